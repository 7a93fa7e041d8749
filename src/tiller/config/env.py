"""The environment episodes run in, and the agent that acts in it (the loop or a black-box
program, its memory and history)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tiller.config.base import Section
from tiller.envs.source_config import HarborConfig, OpenEnvConfig
from tiller.errors import ConfigError
from tiller.tools.stack import ToolsConfig


class EnvConfig(Section):
    """The environment: where tasks come from and what an episode may do
    (docs/environments.md)."""

    name: str = Field("calculator", description="the env: a registered name (calculator, "
                      "code, search, sql, dataset, ...), an installed plug-in's entry point, or "
                      "a dotted path package.module:Class")
    difficulty: int = Field(2, ge=1, le=10, description="the level train and held-out tasks "
                            "are made at; with a difficulty curriculum, the highest level "
                            "(the target)")
    max_turns: int = Field(6, ge=1, description="assistant turns per episode; an episode not "
                           "done after them is truncated")
    max_episode_tokens: int = Field(
        512, ge=16, description="tokens of one exact sequence (prompt, generated and "
        "observation tokens); generation past it is cut and the episode truncated "
        "(agent.memory drop_oldest starts a new sequence instead); at most the model's "
        "context")
    tools: ToolsConfig = Field(default_factory=ToolsConfig,
                               description="extra tool functions and the stack every call goes "
                               "through: executor, fault injection, record/replay, gate, "
                               "sandbox; MCP servers")
    openenv: OpenEnvConfig | None = Field(None, description="env openenv: the OpenEnv server "
                                          "(url or command) and how the policy acts on it")
    harbor: HarborConfig | None = Field(None, description="env harbor: the folder of Harbor "
                                        "tasks and the sandbox they run in")


DEFAULT_LOOP = "tiller.rollout.agent_loop:run_episode"


class AgentConfig(Section):
    loop: str = Field(DEFAULT_LOOP, description="dotted path of the episode function, "
                      "`async def run_episode(env, task, actor, tokenizer, *, seed, limits, "
                      "sample_index)` (docs/architecture.md)")
    memory: Literal["full", "drop_oldest", "truncate_tool_output"] = Field(
        "full", description="what a long episode keeps in context (docs/environments.md, "
        "'Memory'): full: everything, truncated at env.max_episode_tokens; drop_oldest: when "
        "the next context would leave less than sampling.max_new_tokens of the budget, drop "
        "the oldest exchanges and go on in a new exact sequence; truncate_tool_output: cut "
        "each tool message to agent.tool_output_tokens before the model sees it. A custom "
        "agent.loop gets the policy as limits.memory and honours it only if it applies it; "
        "agent.program allows only full")
    tool_output_tokens: int | None = Field(
        None, ge=1, description="truncate_tool_output only (default 128): tokens kept of each "
        "tool message")
    program: str | None = Field(
        None, description="dotted path of a black-box agent program, `async def main(base_url, "
        "api_key, model, task)`, awaited per episode against tiller's OpenAI-compatible "
        "gateway (docs/gateway.md); replaces agent.loop")
    program_timeout_s: float = Field(
        300.0, gt=0, description="seconds one agent.program episode may run; past it the "
        "episode is aborted")
    reward: Literal["verifier", "program"] = Field(
        "verifier", description="agent.program's reward: the env's verifier on the model's "
        "last turn, or the number (or {'reward': x}) the program returns")
    history: Literal["stream", "template"] = Field(
        "stream", description="what the next turn's prompt holds: stream = the exact sampled "
        "ids plus the new messages (one exact sequence, reasoning kept); template = the chat "
        "template's re-rendering, which starts a new exact segment of the episode wherever it "
        "differs from the stream (docs/formats.md)")

    @model_validator(mode="after")
    def _memory_knobs(self) -> AgentConfig:
        if self.tool_output_tokens is not None and self.memory != "truncate_tool_output":
            raise ConfigError(f"config field agent.tool_output_tokens: got "
                              f"{self.tool_output_tokens}; it is only used with agent.memory: "
                              f"truncate_tool_output (agent.memory is {self.memory})")
        return self

    @model_validator(mode="after")
    def _program_fits(self) -> AgentConfig:
        if self.program is not None and self.loop != DEFAULT_LOOP:
            raise ConfigError(f"config field agent.program: got {self.program!r}; it replaces "
                              f"the agent loop, so agent.loop must stay the default (got "
                              f"{self.loop!r}): set one of them")
        if self.program is not None and self.memory != "full":
            raise ConfigError(f"config field agent.memory: got {self.memory!r}; it is tiller's "
                              "agent loop's memory, and agent.program keeps its own history "
                              "(a rewrite splits the episode): leave it 'full'")
        if self.program is not None and self.history != "stream":
            raise ConfigError(f"config field agent.history: got {self.history!r}; with "
                              "agent.program the gateway assembles the program's calls itself "
                              "(a rewritten history splits the episode): leave it 'stream'")
        if self.program is None and self.reward == "program":
            raise ConfigError("config field agent.reward: got 'program'; it needs an "
                              "agent.program whose return value is the reward")
        return self
