"""From kept trajectories to the RL batch: the reward RL trains on (the verifier's value plus
DAPO's soft overlong penalty), env_error rows at their weight, overlong masking and the
key-step hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiller.config import AlgorithmConfig
from tiller.errors import import_dotted
from tiller.rollout.trajectory import Status, Trajectory
from tiller.train.algorithms.advantages import overlong_penalty
from tiller.train.algorithms.credit import apply_key_steps
from tiller.train.batch import Batch

KeyStepFn = Callable[[Trajectory, Any], Sequence[float]]


def load_key_steps(path: str | None) -> KeyStepFn | None:
    """The key-step mask hook `package.module:function` (fn(trajectory, tokenizer) -> one 0/1
    per token of trajectory.token_ids), or None when unset."""
    return None if path is None else import_dotted(path, "rl.algorithm.credit.key_steps")


def train_reward(t: Trajectory, alg: AlgorithmConfig, l_max: int, l_cache: int) -> float:
    """The verifier's value, plus DAPO's soft overlong penalty (0 up to l_max - l_cache
    generated tokens, down to -1 at l_max) when `overlong.mode` is soft."""
    if alg.overlong.mode != "soft":
        return t.reward.value
    length = torch.tensor(float(t.num_generated))
    return t.reward.value + float(overlong_penalty(length, l_max, l_cache))


def rl_batch(kept: Sequence[Trajectory], group_index: torch.Tensor, rewards: Sequence[float],
             pad_token_id: int, alg: AlgorithmConfig, env_error_weight: float,
             key_steps: KeyStepFn | None = None, tokenizer: Any = None
             ) -> tuple[Batch, dict[str, float]]:
    """The training batch: env_error trajectories (kept only when env_error_weight > 0) with
    their loss weighted once by it, truncated episodes masked out of the loss under
    `overlong: mask` (they keep their place in the group statistics), and the key-step hook's
    narrowing."""
    batch = Batch.collate(kept, pad_token_id, rewards, group_index)
    episode = batch.episode_index  # rows -> trajectories (a split episode has several rows)
    stats: dict[str, float] = {}
    hit = torch.tensor([t.status is Status.ENV_ERROR for t in kept])
    if hit.any():  # a per-row loss weight: masks, advantages and normalizers never see it
        batch.loss_weight[hit[episode]] = env_error_weight
        stats["env_error_trained"] = float(hit.sum())
    if alg.overlong.mode == "mask":
        cut = torch.tensor([t.status is Status.TRUNCATED for t in kept])
        batch.loss_mask[cut[episode]] = 0.0
        stats["overlong_masked"] = float(cut.sum())
    if key_steps is not None:
        row = 0
        for t in kept:
            key = torch.as_tensor(key_steps(t, tokenizer), dtype=torch.float)
            for start, end in t.segments():
                n = end - start
                batch.loss_mask[row, :n] = apply_key_steps(batch.loss_mask[row, :n],
                                                           key[start:end])
                row += 1
    split = [t for t in kept if t.segment_starts]
    if split:
        stats["split_episodes"] = float(len(split))
        stats["segments_per_episode"] = len(batch.input_ids) / len(kept)
    return batch, stats
