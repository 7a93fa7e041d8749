"""The Trajectory: one finished episode, exactly as the policy saw and produced it.

Token ids are the source of truth: `token_ids` is the prompt, then each generated turn as the
engine returned it, then each observation as tokenized by the loop, concatenated. `loss_mask`
is 1 exactly on generated tokens and `logprobs` holds the engine's log-probability there.
A `TrajectoryBuilder` keeps these (and the turn spans and versions) aligned by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tiller.envs.verifiers import Reward
from tiller.tools.registry import ToolResult


class Status(str, Enum):
    COMPLETED = "completed"  # the policy gave a final answer
    TRUNCATED = "truncated"  # turn limit, token budget or context hit first
    ABORTED = "aborted"  # the engine or the loop failed
    ENV_ERROR = "env_error"  # a tool or the environment failed: not the policy's fault


@dataclass(frozen=True)
class Trajectory:
    task_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int
    turn_spans: tuple[tuple[int, int], ...]  # [start, end) of each generated turn
    versions: tuple[int, ...]  # weight version that generated each turn (its oldest)
    messages: tuple[dict[str, Any], ...]
    reward: Reward
    status: Status
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    parse_errors: int = 0
    tool_outputs_truncated: int = 0  # tool messages cut by agent.memory: truncate_tool_output
    timings: Mapping[str, float] = field(default_factory=dict)
    # "error": why the episode was aborted or is an env error; "close_error": env.close failed
    info: Mapping[str, str] = field(default_factory=dict)
    # the weight version that sampled each token, aligned with token_ids (-1 where not
    # generated): a turn that spans a weight update (partial rollouts) keeps both versions
    token_versions: tuple[int, ...] = ()
    # tokens the engine generated that the trajectory does not keep (cut at the episode's
    # token budget): with num_generated, every token the engine sampled for it
    discarded_tokens: int = 0
    # the episode's seed (set by `collect.run_one`, which derives it): with the run's seed it
    # names the episode, e.g. in traces.sqlite
    seed: int | None = None
    # (turn, result) of every tool call, in the order the env ran them (traces.sqlite)
    tool_results: tuple[tuple[int, ToolResult], ...] = ()
    # An episode whose context was replaced mid-way (the template re-rendered the history, or a
    # black-box agent rewrote it) is several exact sequences, concatenated in the fields above:
    # each index here starts a new one, whose own prompt is re-encoded context (mask 0). The
    # trainer gives each sequence its own row and forward pass, and all of them the episode's
    # advantage. `split_reasons` says why each split happened.
    segment_starts: tuple[int, ...] = ()
    split_reasons: tuple[str, ...] = ()
    # which draw of its task this episode's group is, among the tasks collected together
    # (0 = the first; a task listed again gets 1, 2...): groups are keyed by (task_id, draw),
    # so a small task set drawn with replacement never merges two draws into one group
    draw: int = 0
    # the tag its seed was derived under (set by `collect.run_one`): ("rl", unit) or ("rl",
    # unit, round) in RL, ("eval", label, ...) in an evaluation. Draws are counted per tag, so
    # across a run (tag, task_id, draw) names the group it was sampled in (traces.sqlite)
    tag: tuple[str | int, ...] = ()

    def segments(self) -> list[tuple[int, int]]:
        """[start, end) of each exact sequence in `token_ids` (one span when never split)."""
        bounds = [0, *self.segment_starts, len(self.token_ids)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)


class TrajectoryBuilder:
    """Builds a `Trajectory` as an episode runs: the prompt first, then generated turns and
    observations in order, then `finish`. Each append extends ids, loss mask and logprobs
    together, so they cannot drift apart:

        append_prompt(ids)                          mask 0, logprob 0, counted in prompt_len
        append_generated(ids, logprobs, version)    mask 1, the engine's logprobs, a turn span
        append_observation(ids)                     mask 0, logprob 0
        start_segment(ids, reason)                  a new exact sequence with context ids
    """

    def __init__(self, task_id: str, sample_index: int = 0):
        self.task_id, self.sample_index = task_id, sample_index
        self.prompt_len = 0
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._spans: list[tuple[int, int]] = []
        self._versions: list[int] = []
        self._token_versions: list[int] = []
        self.discarded_tokens = 0
        self.tool_results: list[tuple[int, ToolResult]] = []  # (turn, result), in call order
        self._segment_starts: list[int] = []
        self._split_reasons: list[str] = []

    def __len__(self) -> int:
        """Tokens in the current sequence: the context the next turn is generated after (the
        episode token budget bounds it, as it bounds the model's context)."""
        return len(self._ids) - (self._segment_starts[-1] if self._segment_starts else 0)

    @property
    def token_ids(self) -> list[int]:
        """A copy of the current sequence's ids: the prompt of the next turn."""
        return self._ids[self._segment_starts[-1] if self._segment_starts else 0:]

    def _extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float],
                versions: Sequence[int] | None = None) -> None:
        self._ids += ids
        self._mask += [mask] * len(ids)
        self._logprobs += logprobs
        self._token_versions += [-1] * len(ids) if versions is None else versions

    def append_prompt(self, ids: Sequence[int]) -> None:
        if len(self._ids) != self.prompt_len:
            raise ValueError("append_prompt after a turn or observation: the prompt comes first")
        self._extend(ids, 0, [0.0] * len(ids))
        self.prompt_len = len(self._ids)

    def append_generated(self, ids: Sequence[int], logprobs: Sequence[float],
                         version: int | Sequence[int]) -> None:
        """`version`: the weight version that sampled each id, or one for the whole turn.
        The turn's version (`Trajectory.versions`) is its oldest."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a generated turn needs one logprob per id: got {len(ids)} ids "
                             f"and {len(logprobs)} logprobs")
        per_token = [version] * len(ids) if isinstance(version, int) else list(version)
        if len(per_token) != len(ids):
            raise ValueError(f"a generated turn needs one version per id: got {len(ids)} ids "
                             f"and {len(per_token)} versions")
        self._spans.append((len(self._ids), len(self._ids) + len(ids)))
        self._versions.append(min(per_token) if per_token else
                              version if isinstance(version, int) else -1)
        self._extend(ids, 1, logprobs, per_token)

    def append_observation(self, ids: Sequence[int]) -> None:
        self._extend(ids, 0, [0.0] * len(ids))

    def start_segment(self, prompt_ids: Sequence[int], reason: str) -> None:
        """End the current exact sequence and start one whose context is `prompt_ids` (mask
        0): the next turns are generated after these ids, not after the stream so far. Tokens
        already appended stay as they were sampled, and are trained in their own row."""
        if not self._spans:
            raise ValueError("start_segment before any generated turn: there is nothing to "
                             "split off (use append_prompt for the first context)")
        if not prompt_ids:
            raise ValueError("start_segment needs the new sequence's context ids")
        self._segment_starts.append(len(self._ids))
        self._split_reasons.append(reason)
        self._extend(prompt_ids, 0, [0.0] * len(prompt_ids))

    def finish(
        self,
        reward: Reward,
        status: Status,
        *,
        messages: Sequence[dict[str, Any]] = (),
        tool_calls: int = 0,
        tool_errors: int = 0,
        env_errors: int = 0,
        parse_errors: int = 0,
        tool_outputs_truncated: int = 0,
        timings: Mapping[str, float] | None = None,
        info: Mapping[str, str] | None = None,
    ) -> Trajectory:
        return Trajectory(
            task_id=self.task_id,
            sample_index=self.sample_index,
            token_ids=tuple(self._ids),
            loss_mask=tuple(self._mask),
            logprobs=tuple(self._logprobs),
            prompt_len=self.prompt_len,
            turn_spans=tuple(self._spans),
            versions=tuple(self._versions),
            messages=tuple(messages),
            reward=reward,
            status=status,
            tool_calls=tool_calls,
            tool_errors=tool_errors,
            env_errors=env_errors,
            parse_errors=parse_errors,
            tool_outputs_truncated=tool_outputs_truncated,
            timings=dict(timings or {}),
            info=dict(info or {}),
            token_versions=tuple(self._token_versions),
            discarded_tokens=self.discarded_tokens,
            tool_results=tuple(self.tool_results),
            segment_starts=tuple(self._segment_starts),
            split_reasons=tuple(self._split_reasons),
        )


def is_success(t: Trajectory) -> bool:
    """The episode succeeded: full reward (value >= 1) and no environment error."""
    return t.reward.value >= 1.0 and not t.reward.env_error
