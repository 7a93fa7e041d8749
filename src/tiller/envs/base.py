"""The environment interface: tasks, an async reset/step/close episode, and a verifier.

An environment owns the task state and its tools; it never sees tokens or models. The agent
loop hands it each parsed assistant turn (`Action`) and appends the messages it returns.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tiller.envs.actions import ParsedTurn
from tiller.envs.verifiers import Reward
from tiller.tools.registry import Tool, ToolCall, ToolOutcome, ToolRegistry, ToolResult

if TYPE_CHECKING:
    from tiller.config import Config


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    answer: Any
    split: str
    system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one assistant turn."""

    messages: list[dict[str, Any]]
    done: bool
    tool_results: list[ToolResult] = field(default_factory=list)


class Env(ABC):
    """One episode at a time: `reset`, then `step` until done, then `close`."""

    name: ClassVar[str]
    requires: ClassVar[dict[str, str]] = {}
    """Optional packages the env imports -> the pip extra that installs each (checked at
    start-up, so a missing one is one line, not a traceback minutes in)."""
    has_expert: ClassVar[bool] = True
    """Whether `expert_turn` is a scripted expert (SFT demonstrations, the tool gate's probe)."""

    @classmethod
    def configure(cls, cfg: Config) -> type[Env]:
        """The env class a run uses, given its config: this one, or a subclass holding what
        the config names (the dataset env's rows). Runs once at start-up, before any work."""
        return cls

    @classmethod
    def start(cls, run_dir: Path) -> None:
        """Start what the episodes need outside tiller (e.g. an env server), once per run,
        after `configure` and before any work; one that is not usable is a ConfigError. The
        run calls `stop` when it ends, also when it fails or is interrupted."""
        return None

    @classmethod
    def stop(cls) -> None:
        """Stop what `start` started; safe to call twice, or when it started nothing."""
        return None

    @classmethod
    def tokenizer_corpus(cls, tasks: list[Task], tokenizer: Any) -> list[str] | None:
        """Text a built model's tokenizer trains on (`model.build`), rendered with the
        bootstrap `tokenizer`; None: the scripted expert's episodes on `tasks`."""
        return None

    eval_splits: ClassVar[tuple[str, ...]] = ("heldout",)
    """The splits `make_tasks` takes that `eval.sets` may name: heldout, plus any
    out-of-distribution split of held-out instances the env offers (e.g. unseen templates)."""

    splits: ClassVar[tuple[str, ...]] = ("train", "heldout")
    """The splits `make_tasks` serves. An env without "heldout" (a small task set that is all
    for training) runs without held-out evaluation, said in the log and in summary.json."""
    has_difficulty: ClassVar[bool] = True
    """False when `make_tasks` ignores `difficulty` (the same tasks at every level), so a
    difficulty curriculum has nothing to adapt and is refused (`check_curriculum`)."""
    repeats_tasks: ClassVar[bool] = False
    """True when `make_tasks` draws with replacement from a small set, so a list may hold one
    task twice; each draw is its own group (and seed), and `task_space` does not cap `n`."""

    @abstractmethod
    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        """Start an episode; returns the opening messages (system and user)."""

    @abstractmethod
    async def step(self, action: ParsedTurn) -> StepResult: ...

    async def close(self) -> None:
        return None

    @abstractmethod
    def tool_schemas(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    async def verify(self, final: ParsedTurn | None) -> Reward:
        """Score the episode from its final answer (None if there was none, e.g. truncated)
        and the env's final state. Async, since checks may run code in a sandbox."""

    @staticmethod
    @abstractmethod
    def make_tasks(split: str, n: int, seed: int, difficulty: int) -> list[Task]:
        """`n` tasks of `split` (one of `splits`); distinct unless `repeats_tasks`, and the
        splits never overlap."""

    @staticmethod
    def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int | None:
        """How many distinct tasks of `split` exist at `difficulty` (counted, or the expected
        share of a space too big to list); None when unknown. A run checks every task count
        it will ask `make_tasks` for against it before any work."""
        return None

    @staticmethod
    @abstractmethod
    def expert_turn(
        task: Task, messages: list[dict[str, Any]], rng: random.Random, guess_prob: float
    ) -> str:
        """The scripted expert's next assistant turn, as text (SFT demonstrations)."""


class ToolEnv(Env):
    """An environment whose actions are tool calls and whose episode ends on a plain answer.

    A turn with tool calls (or malformed ones) gets one tool message per call, in order; a
    turn without any ends the episode. Subclasses give the tools and the verifier.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        wrap: Callable[[ToolRegistry], Callable[[ToolCall], Awaitable[ToolResult]]] | None = None,
    ):
        self.registry = ToolRegistry(tools)
        # By default tools are called directly; `wrap` puts this episode's registry behind the
        # run's tool stack (faults, executor, record/replay: `tiller.tools.stack.ToolStack`).
        self.invoke = wrap(self.registry) if wrap else self.registry.invoke
        self.task: Task | None = None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.registry.schemas()

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        self.task = task
        system = [{"role": "system", "content": task.system}] if task.system else []
        return [*system, {"role": "user", "content": task.prompt}]

    async def step(self, action: ParsedTurn) -> StepResult:
        if not action.tool_calls and not action.parse_errors:
            return StepResult(messages=[], done=True)
        results = [await self.invoke(call) for call in action.tool_calls]
        messages = [{"role": "tool", "content": f"error: {err}"} for err in action.parse_errors]
        for r in results:
            text = r.content if r.outcome is ToolOutcome.OK else f"error: {r.content}"
            messages.append({"role": "tool", "name": r.call.name, "content": text})
        return StepResult(messages=messages, done=False, tool_results=results)


ENVS: dict[str, type[Env]] = {}


def register_env(cls: type[Env]) -> type[Env]:
    ENVS[cls.name] = cls
    return cls
