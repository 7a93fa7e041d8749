"""The config sections of the env sources that talk to servers or read folders: `env.openenv`
(tiller.envs.openenv) and `env.harbor` (tiller.envs.harbor). Kept apart from their envs so
tiller.config imports them without importing the envs (which import tiller.config)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

SYSTEM = ("You are working in a Linux shell. Run commands with the shell tool; its working "
          "directory is the task's workdir. When the task is done, reply without a tool call.")


class OpenEnvConfig(BaseModel):
    """`env.openenv`: where the OpenEnv server is, and how the policy acts on it."""

    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, pattern=r"^https?://", description="a running server's base "
                            "URL, e.g. http://127.0.0.1:8000 (its /ws is the session)")
    command: list[str] | None = Field(
        None, min_length=1, description="argv that starts the server for the run; '{port}' in "
        "it becomes a free port on 127.0.0.1, where tiller then connects")
    start_timeout_s: float = Field(120.0, gt=0, description="how long the command's server "
                                   "may take to answer /health")
    timeout_s: float = Field(30.0, gt=0, description="per answer to a reset or step; a later "
                             "answer is an env_error")
    tool_name: str = Field("step", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$", description="the "
                           "tool the policy acts with; its arguments are the action's fields")
    text_field: str | None = Field(None, description="instead of a tool: the assistant's plain "
                                   "text becomes this (string) field of the action")
    observation_field: str | None = Field(None, description="show only this field of each "
                                          "observation (default: all of them, as JSON)")
    system: str | None = Field(None, description="system prompt of every episode")
    reset_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra fields of "
                                         "every reset request (besides the task's seed)")

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.url is None) == (self.command is None):
            raise ValueError("set exactly one of url (a running server) or command (tiller "
                             "starts it)")
        if self.command is not None and not any("{port}" in a for a in self.command):
            raise ValueError("command must hold '{port}' where the server's port goes (tiller "
                             "picks a free one and connects there)")
        return self


class HarborConfig(BaseModel):
    """`env.harbor`: the task folders and the sandbox they run in."""

    model_config = ConfigDict(extra="forbid")
    tasks: str = Field(description="a folder of Harbor task folders (or one task folder): "
                       "the train tasks")
    eval: str | None = Field(None, description="a folder of held-out Harbor tasks; unset: no "
                             "held-out split, the run skips the held-out evaluations")
    command_timeout_s: float = Field(30.0, gt=0, description="per shell command (wall and "
                                     "CPU seconds); a command past it is killed and the "
                                     "policy sees it timed out. The shell tool's executor "
                                     "timeout, if set, must exceed this + 30 s")
    output_chars: int = Field(4000, ge=100, description="of a command's output shown to the "
                              "policy (its start and end)")
    memory_mb: int = Field(1024, ge=64, description="address space of a command and of the "
                           "tests (RLIMIT_AS)")
    workspace_mb: int = Field(32, ge=1, le=1024, description="size of the workdir carried "
                              "between commands (packed); a command that grows it past this "
                              "is the policy's tool_error, its changes discarded")
    reward_key: str = Field("reward", description="the entry of reward.json trained on (a "
                            "file with one entry needs no key)")
    system: str | None = Field(SYSTEM, description="system prompt of every episode")
