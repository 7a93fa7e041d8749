"""Batches: trajectories right-padded into tensors, and the partition of a batch into
optimizer steps and micro-batches (the policy's log-probabilities on them: `train.logprobs`).
SFT and RL share the same alignment and the same mask.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from tiller.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (the loss's m)
    rollout_logprobs: torch.Tensor  # [B, T] float, the engine's logprob on generated tokens
    rewards: torch.Tensor  # [B] float, each trajectory's outcome reward (after shaping)
    group_index: torch.Tensor  # [B] long, the group (task instance) of each row
    turn_spans: tuple[tuple[tuple[int, int], ...], ...] = ()  # each row's generated turns
    turn_rewards: torch.Tensor | None = None  # [B, K] per-turn rewards (without the outcome)
    # [B] float, each row's weight on its per-token loss (rl.env_error_weight); default 1.
    # A weight, not a mask: advantages, masks and the aggregation's normalizers ignore it.
    loss_weight: torch.Tensor | None = None
    # [B] long, the weight version that sampled each row (its oldest turn's); -1 = unknown.
    # The trainer's staleness metrics: trainer version at train start minus this.
    sample_version: torch.Tensor | None = None
    # [B] long, the trajectory (episode) each row is a sequence of: rows of one split episode
    # share its advantage, computed once per episode (`Trajectory.segments`)
    episode_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.episode_index is None:
            self.episode_index = torch.arange(len(self.input_ids))
        if self.loss_weight is None:
            self.loss_weight = torch.ones(len(self.input_ids))
        if self.sample_version is None:
            self.sample_version = torch.full((len(self.input_ids),), -1, dtype=torch.long)

    @classmethod
    def collate(
        cls,
        trajectories: Sequence[Trajectory],
        pad_token_id: int,
        rewards: Sequence[float] | None = None,
        group_index: Sequence[int] | torch.Tensor | None = None,
    ) -> Batch:
        """Right-pad trajectories into tensors, one row per exact sequence (`segments()`: one
        per trajectory unless its episode was split; `episode_index` maps rows back).
        `rewards` default to each `reward.value`, `group_index` to one group per draw of a
        task (`Trajectory.draw`, so a repeated task id is a group of its own); both are given
        per trajectory and repeated on its rows. `turn_rewards` is set when any verifier gave
        per-turn rewards (turn-level credit), padded with 0 to the longest episode's turns;
        `sample_version` is each trajectory's oldest turn version (-1 when it has no turn)."""
        rows = [(i, start, end) for i, t in enumerate(trajectories)
                for start, end in t.segments()]
        width = max(end - start for _, start, end in rows)
        n = len(rows)
        ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width))
        lp = torch.zeros((n, width))
        for r, (i, start, end) in enumerate(rows):
            t, k = trajectories[i], end - start
            ids[r, :k] = torch.tensor(t.token_ids[start:end])
            attn[r, :k] = 1
            mask[r, :k] = torch.tensor(t.loss_mask[start:end], dtype=torch.float)
            lp[r, :k] = torch.tensor(t.logprobs[start:end])
        episode = torch.tensor([i for i, _, _ in rows], dtype=torch.long)
        if rewards is None:
            rewards = [t.reward.value for t in trajectories]
        if group_index is None:  # one group per draw: a repeated task id is a new group
            ids_of: dict[tuple[str, int], int] = {}
            group_index = [ids_of.setdefault((t.task_id, t.draw), len(ids_of))
                           for t in trajectories]
        turn_rewards = None
        if any(t.reward.turn_rewards is not None for t in trajectories):
            if n > len(trajectories):
                raise ValueError("per-turn rewards (turn-level credit) over episodes split into "
                                 "several sequences are not supported")
            turn_rewards = torch.zeros((n, max(t.num_turns for t in trajectories)))
            for i, t in enumerate(trajectories):
                given = (t.reward.turn_rewards or ())[: t.num_turns]
                turn_rewards[i, : len(given)] = torch.tensor(given, dtype=torch.float)
        versions = torch.tensor([min(t.versions, default=-1) for t in trajectories])
        spans = tuple(tuple((a - start, b - start) for a, b in trajectories[i].turn_spans
                            if start <= a < end) for i, start, end in rows)
        return cls(ids, attn, mask, lp,
                   torch.as_tensor(rewards, dtype=torch.float)[episode],
                   torch.as_tensor(group_index, dtype=torch.long)[episode],
                   spans, turn_rewards, sample_version=versions[episode],
                   episode_index=episode)

    def rows(self, index: torch.Tensor) -> Batch:
        """A sub-batch for one gradient pass, trimmed to its own longest row (the turn
        structure stays behind: advantages are computed on the whole batch first)."""
        width = int(self.attention_mask[index].sum(-1).max())
        return Batch(self.input_ids[index, :width], self.attention_mask[index, :width],
                     self.loss_mask[index, :width], self.rollout_logprobs[index, :width],
                     self.rewards[index], self.group_index[index],
                     loss_weight=self.loss_weight[index],
                     sample_version=self.sample_version[index],
                     episode_index=self.episode_index[index])

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor on `device` (the model's, for a forward pass)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return Batch(**moved)


def micro_batches(lengths: torch.Tensor, size: int, max_tokens: int | None = None,
                  packed: bool = False) -> list[torch.Tensor]:
    """Row indices in chunks of at most `size` rows, grouped by length so little compute goes
    to padding; with `max_tokens`, a chunk also closes before its tokens would exceed it
    (packed: the sum of its lengths; padded: rows x its longest, as the rows come shortest
    first); a row longer than `max_tokens` runs alone.

    Losses are normalized by whole-batch counts, so how rows are chunked never changes the
    gradient.
    """
    order = torch.argsort(lengths, stable=True)
    if max_tokens is None:
        return [order[i : i + size] for i in range(0, len(order), size)]
    out: list[list[int]] = [[]]
    used = 0
    for row in order.tolist():
        n = int(lengths[row])
        cost = used + n if packed else n * (len(out[-1]) + 1)
        if out[-1] and (len(out[-1]) == size or cost > max_tokens):
            out.append([])
            cost = n
        out[-1].append(row)
        used = cost
    return [torch.tensor(rows, dtype=torch.long) for rows in out if rows]


def minibatches(
    batch: Batch, mini_batches: int, micro_batch_size: int, l_max: int = 0,
    max_tokens: int | None = None, packed: bool = False,
) -> list[tuple[torch.Tensor, list[torch.Tensor], dict[str, float]]]:
    """The rows of each optimizer step (strided, so each step sees every group), their
    micro-batches (`micro_batches`, by rows and optionally a token budget), and the step's
    normalizers for the aggregation: every micro-batch divides by
    its optimizer batch's totals, so accumulation equals one big batch in every mode. The
    policy and the critic walk the same partition. A batch with fewer rows than `mini_batches`
    (filtering and dropped episodes shrink it) gets one step per row: never an empty step (an
    optimizer step and a weight version with no data). The trainer logs the steps taken."""
    n = len(batch.input_ids)
    if mini_batches > n:
        log.warning("this step's batch has %d rows, fewer than rl.mini_batches=%d: one "
                    "optimizer step per row", n, mini_batches)
        mini_batches = n
    out = []
    for i in range(mini_batches):
        mini = torch.arange(n)[i::mini_batches]
        lengths = batch.attention_mask[mini].sum(-1)
        micros = [mini[idx] for idx in micro_batches(lengths, micro_batch_size, max_tokens,
                                                     packed)]
        mask = batch.loss_mask[mini]
        # the empty-row rule: a row with no loss token is not a sequence of the seq-mean modes
        totals = {"total_tokens": float(mask.sum()), "total_seqs": int((mask.sum(-1) > 0).sum()),
                  "l_max": l_max}
        out.append((mini, micros, totals))
    return out
