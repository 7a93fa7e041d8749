"""Environments, registered by name (`env.name` in the config)."""

from tiller.envs import adapters, calculator, code, dataset, search, sql  # noqa: F401  (each registers itself)
from tiller.envs.base import ENVS, Env, StepResult, Task, ToolEnv, register_env

__all__ = ["ENVS", "Env", "StepResult", "Task", "ToolEnv", "register_env"]
