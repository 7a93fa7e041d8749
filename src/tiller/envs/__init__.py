"""Environments, registered by name (`env.name` in the config)."""

from . import calculator  # noqa: F401  (registers itself)
from .base import ENVS, Env, StepResult, Task, ToolEnv, register_env

__all__ = ["ENVS", "Env", "StepResult", "Task", "ToolEnv", "register_env"]
