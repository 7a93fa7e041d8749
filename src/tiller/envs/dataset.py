"""The dataset env (`env.name: dataset`): a user's file of prompts as tasks, scored by the
`rewards:` entries (envs/rewards.py). See docs/datasets.md.

Each row is its own task, with an id made of the file name and the row number, so a prompt the
file holds several times stays several tasks (never one group by accident). A row with tools
(`data.tools` for every row, plus the row's own tools column: dotted paths of typed functions)
is a multi-turn tool episode that ends at the first answer without tool calls; a row without
tools is single-turn: the episode ends at the first answer.

RL draws the train rows in a seeded shuffled order, every row once per pass, pass after pass
(a later pass's task ids get `#<pass>`, so its seeds and record/replay keys are its own).
The held-out evaluation uses the first `eval.tasks` rows of `data.eval`; with no `data.eval`
the run has no held-out split and skips the evaluations.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tiller.envs.actions import ParsedTurn, assistant_message
from tiller.envs.base import StepResult, Task, ToolEnv, register_env
from tiller.envs.rewards import (
    EXTRACTORS,
    VERIFIERS,
    RewardEntry,
    answer_problem,
    call_function,
    combine,
    resolve_entries,
)
from tiller.envs.rows import Row, column, messages_column, read_rows, row_error
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError
from tiller.tools.registry import Tool, load_tools

if TYPE_CHECKING:
    from tiller.config import Config, DataConfig

logger = logging.getLogger(__name__)


_TOOLS: dict[str, Tool] = {}  # dotted path -> its Tool, imported once per process


def resolve_tools(paths: list[str], where: str) -> list[Tool]:
    """Tools by dotted path (`tools.registry.load_tools`, read once per path); a path that
    cannot become a tool is one line naming `where` (a config field or a file's row and
    column)."""
    for p in paths:
        if p not in _TOOLS:
            try:
                [_TOOLS[p]] = load_tools([p], "tools")
            except ConfigError as e:
                raise ConfigError(f"{where}: {str(e).removeprefix('config field tools: ')}") from e
    return [_TOOLS[p] for p in paths]


def row_tools(data: DataConfig, path: str, row: Row) -> list[str]:
    """The dotted tool paths a row gets: `data.tools`, then its own tools column (optional)."""
    n, values = row
    own = values.get(data.tools_column)
    if own is None:
        own = []
    if not isinstance(own, list) or not all(isinstance(p, str) for p in own):
        raise row_error(path, n, data.tools_column, "expected a list of dotted paths of tool "
                        f"functions (package.module:function), got {own!r}"[:200])
    resolve_tools(data.tools, "config field data.tools")
    resolve_tools(own, f"{path} row {n}, column {data.tools_column!r}")
    return list(dict.fromkeys([*data.tools, *own]))


RESERVED = {"prompts", "completions"}  # the reward functions' keywords, not column names


@dataclass(frozen=True)
class DatasetSource:
    """What `configure` read: the tasks of each split, the reward entries, the rows' texts."""

    train: list[Task]
    heldout: list[Task]
    entries: list[RewardEntry]
    sft_conversations: list[tuple[int, list[dict[str, Any]], list[str]]] = field(
        default_factory=list)


def load_tasks(data: DataConfig, path: str, field_name: str, split: str,
               entries: list[RewardEntry], run_tools: bool = False) -> list[Task]:
    """Every row of `path` as a Task, each checked now: the prompt (or messages) column, the
    answer where a library verifier needs one, the metadata columns, the tools. With
    `run_tools` (MCP tools: `env.tools.mcp`) every row is a multi-turn tool episode."""
    tasks = []
    prompt_col = data.messages_column or data.prompt_column
    for row in read_rows(path, field_name):
        n, values = row
        if data.messages_column:
            opening = messages_column(path, row, data.messages_column)
            if not opening or opening[-1]["role"] != "user":
                raise row_error(path, n, data.messages_column, "expected the opening messages "
                                "of an episode, ending with a user message")
            prompt: Any = opening
            text = opening[-1]["content"]
        else:
            text = prompt = column(path, row, data.prompt_column, str, "a string (the prompt)")
        answer = values.get(data.answer_column)
        for e in entries:
            if e.verifier is None:
                continue
            if answer is None:
                raise row_error(path, n, data.answer_column, f"missing; rewards entry "
                                f"{e.name!r} ({e.verifier}) compares the answer with it")
            problem = answer_problem(e.verifier, answer)
            if problem is not None:
                raise row_error(path, n, data.answer_column, problem)
        if data.metadata_columns is None:
            columns = {k: v for k, v in values.items() if k != prompt_col}
        else:
            for name in data.metadata_columns:
                if name not in values:
                    raise row_error(path, n, name, "missing; it is one of data.metadata_columns")
            columns = {k: values[k] for k in [data.answer_column, *data.metadata_columns]
                       if k in values}
        clash = sorted(RESERVED & set(columns))
        if clash:
            raise row_error(path, n, clash[0], "this name is the reward functions' own keyword "
                            "(prompts, completions); rename the column, or leave it out of "
                            "data.metadata_columns")
        tools = row_tools(data, path, row)
        tasks.append(Task(
            id=f"{Path(path).name}:{n}", prompt=text, answer=answer, split=split,
            system=data.system if not data.messages_column else None,
            metadata={"prompt": prompt, "columns": columns, "tools": tools,
                      "conversational": bool(data.messages_column or tools or run_tools),
                      "multi_turn": bool(tools or run_tools)}))
    return tasks


Conversation = tuple[int, list[dict[str, Any]], list[str]]  # (row, messages, tool paths)


def read_conversations(data: DataConfig) -> list[Conversation]:
    """Every row of `data.sft`, checked now: the messages column holds a conversation that
    opens with at least one non-assistant message and ends with an assistant turn."""
    assert data.sft is not None
    out = []
    for row in read_rows(data.sft, "data.sft"):
        messages = messages_column(data.sft, row, data.sft_messages_column)
        roles = [m["role"] for m in messages]
        if "assistant" not in roles or roles[0] == "assistant" or roles[-1] != "assistant":
            raise row_error(data.sft, row[0], data.sft_messages_column, "expected a "
                            "conversation that opens with a system or user message and ends "
                            f"with an assistant turn, got roles {roles}")
        out.append((row[0], messages, row_tools(data, data.sft, row)))
    return out


@register_env
class DatasetEnv(ToolEnv):
    """Rows of `data.train` / `data.eval` as tasks; configured per run (`configure`)."""

    name: ClassVar[str] = "dataset"
    has_expert: ClassVar[bool] = False
    has_difficulty: ClassVar[bool] = False  # rows are rows at every env.difficulty
    source: ClassVar[DatasetSource]

    def __init__(self, wrap: Any = None):
        super().__init__([], wrap=wrap)
        self.wrap = wrap
        self.added: list[dict[str, Any]] = []  # the messages after the prompt

    @classmethod
    def configure(cls, cfg: Config) -> type[DatasetEnv]:
        """A subclass holding this run's rows and rewards, all read and checked now."""
        data = cfg.data
        assert data.train is not None  # Config requires it with env.name dataset
        entries = resolve_entries(cfg.rewards)
        mcp = bool(cfg.env.tools.mcp)  # the servers' tools reach every row's episode
        train = load_tasks(data, data.train, "data.train", "train", entries, mcp)
        heldout = (load_tasks(data, data.eval, "data.eval", "heldout", entries, mcp)
                   if data.eval else [])
        sft = read_conversations(data) if data.sft else []
        source = DatasetSource(train, heldout, entries, sft)
        return type(f"DatasetEnv[{Path(data.train).name}]", (cls,), {"source": source})

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int, difficulty: int = 1,
                   heldout_fraction: float = 0.2) -> list[Task]:  # type: ignore[override]
        """train: `n` tasks in seeded shuffled passes over the rows; heldout: the first `n`
        rows of data.eval (none without it)."""
        if split == "heldout":
            return cls.source.heldout[:n]
        rows, out = cls.source.train, []
        for epoch in range(-(-n // len(rows))):
            order = list(range(len(rows)))
            random.Random(f"dataset/{seed}/{epoch}").shuffle(order)
            for i in order:
                t = rows[i]
                out.append(t if epoch == 0 else Task(
                    id=f"{t.id}#{epoch}", prompt=t.prompt, answer=t.answer, split=t.split,
                    system=t.system, metadata=t.metadata))
        return out[:n]

    @classmethod
    def task_space(cls, split: str, difficulty: int,  # type: ignore[override]
                   heldout_fraction: float = 0.2) -> int | None:
        """The eval rows, 0 without data.eval (then the run has no held-out evaluation);
        train rows are drawn in passes, so any count can be drawn."""
        return len(cls.source.heldout) if split == "heldout" else None

    @classmethod
    def tokenizer_corpus(cls, tasks: list[Task], tokenizer: Any) -> list[str]:
        """Each task's opening rendered with its answer (when it has one), and the SFT
        conversations: the text the policy reads and writes."""
        texts = []
        for t in tasks:
            answer = [] if t.answer is None else [{"role": "assistant", "content": str(t.answer)}]
            schemas = [x.schema for x in resolve_tools(t.metadata["tools"], t.id)]
            texts.append(tokenizer.apply_chat_template([*cls.opening(t), *answer],
                                                       tools=schemas, tokenize=False))
        for _, messages, tools in cls.source.sft_conversations:
            schemas = [x.schema for x in resolve_tools(tools, "data.sft")]
            texts.append(tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False))
        return texts

    @staticmethod
    def opening(task: Task) -> list[dict[str, Any]]:
        prompt = task.metadata["prompt"]
        if isinstance(prompt, list):
            return [dict(m) for m in prompt]
        system = [{"role": "system", "content": task.system}] if task.system else []
        return [*system, {"role": "user", "content": prompt}]

    @staticmethod
    def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                    guess_prob: float) -> str:
        raise ConfigError("env dataset has no scripted expert: give SFT conversations in "
                          "data.sft, or set sft.enabled=false")

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        # this row's tools, behind the run's tool stack like any ToolEnv's
        ToolEnv.__init__(self, resolve_tools(task.metadata["tools"], task.id), wrap=self.wrap)
        self.task, self.added = task, []
        return self.opening(task)

    async def step(self, action: ParsedTurn) -> StepResult:
        assert self.task is not None
        self.added.append(assistant_message(action))
        if not self.task.metadata["multi_turn"]:
            return StepResult(messages=[], done=True)  # single-turn: the first answer is final
        result = await super().step(action)
        self.added.extend(result.messages)
        return result

    async def verify(self, final: ParsedTurn | None) -> Reward:
        """Every entry on the final answer (no final answer: every check 0). A reward
        function that raises is the env's failure (env_error, with the exception), not a 0
        the policy would learn from."""
        assert self.task is not None
        entries = self.source.entries
        if final is None:
            return Reward(0.0, {e.name: 0.0 for e in entries})
        meta = self.task.metadata
        completion: Any = list(self.added) if meta["conversational"] else final.content
        prompt = self.opening(self.task) if meta["conversational"] else meta["prompt"]
        values: list[float | None] = []
        for e in entries:
            if e.verifier is not None:
                got = EXTRACTORS[e.extract](final.content)
                values.append(float(VERIFIERS[e.verifier](got, self.task.answer)))
                continue
            try:
                values.append(await call_function(e, prompt, completion, meta["columns"]))
            except ConfigError:
                raise
            except Exception as ex:  # any bug in the user's function: recorded, never dropped
                error = f"reward function {e.path}: {type(ex).__name__}: {ex}"
                logger.warning("env_error on task %s: %s", self.task.id, error)
                return Reward(0.0, {x.name: 0.0 for x in entries}, env_error=True, error=error)
        return combine(entries, values)
