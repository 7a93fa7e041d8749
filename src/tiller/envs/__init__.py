"""Environments, registered by name (`env.name` in the config)."""

from tiller.envs import (  # noqa: F401  (each registers itself)
    adapters,
    calculator,
    code,
    dataset,
    harbor,
    openenv,
    search,
    sql,
)
from tiller.envs.base import ENVS, Env, StepResult, Task, ToolEnv, register_env

__all__ = ["ENVS", "Env", "StepResult", "Task", "ToolEnv", "register_env"]
