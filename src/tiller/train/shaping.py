"""From kept trajectories to the RL batch: the reward RL trains on (the verifier's value, a
judge's shaping term where the verifier says success, DAPO's soft overlong penalty), env_error
rows at their weight, overlong masking and the key-step hook."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from tiller.algorithms.advantages import overlong_penalty
from tiller.algorithms.credit import apply_key_steps
from tiller.config import AlgorithmConfig
from tiller.envs.base import Task
from tiller.envs.verifiers import JUDGE
from tiller.errors import RunError, import_dotted
from tiller.rollout.trajectory import Status, Trajectory, is_success
from tiller.train.batch import Batch

KeyStepFn = Callable[[Trajectory, Any], Sequence[float]]
JudgeFn = Callable[[Task, Trajectory], float]


def load_key_steps(path: str | None) -> KeyStepFn | None:
    """The key-step mask hook `package.module:function` (fn(trajectory, tokenizer) -> one 0/1
    per token of trajectory.token_ids), or None when unset."""
    return None if path is None else import_dotted(path, "rl.algorithm.credit.key_steps")


def load_judge(path: str | None) -> JudgeFn | None:
    """The judge `package.module:function` (fn(task, trajectory) -> float in [0, 1]), or None
    when rl.judge.fn is unset."""
    return None if path is None else import_dotted(path, "rl.judge.fn")


def judged(judge: JudgeFn, task: Task, t: Trajectory) -> Trajectory:
    """`t` with the judge's score recorded as the check `judge` of its reward (the verifier's
    value is untouched: success is still the verifier's alone). A score outside [0, 1], or not
    a number, stops the run: a judge that pays 1e6 would drown the verifier."""
    score = judge(task, t)
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:
        raise RunError(f"rl.judge.fn returned {score!r} for task {task.id}; expected a float "
                       "in [0, 1]")
    if JUDGE in t.reward.checks:
        raise RunError(f"rl.judge.fn: the verifier of task {task.id} already has a check "
                       f"named {JUDGE!r}")
    return replace(t, reward=replace(t.reward, checks={**t.reward.checks, JUDGE: float(score)}))


def judge_bonus(t: Trajectory, weight: float) -> float:
    """weight * the judge's score where the verifier says success, else 0: the judge ranks
    correct answers against each other and never pays for a wrong one."""
    score = t.reward.checks.get(JUDGE)
    return weight * score if score is not None and is_success(t) else 0.0


def train_reward(t: Trajectory, alg: AlgorithmConfig, l_max: int, l_cache: int,
                 judge_weight: float = 0.0, value: float | None = None) -> float:
    """The verifier's value (or `value` in its place: the reward control's), plus the gated
    judge term (`judge_bonus`), plus DAPO's soft overlong penalty (0 up to l_max - l_cache
    generated tokens, down to -1 at l_max) when `overlong.mode` is soft; the penalty is always
    the trajectory's own length's."""
    base = (t.reward.value if value is None else value) + judge_bonus(t, judge_weight)
    if alg.overlong.mode != "soft":
        return base
    length = torch.tensor(float(t.num_generated))
    return base + float(overlong_penalty(length, l_max, l_cache))


def judge_metrics(trajectories: Sequence[Trajectory], weight: float) -> dict[str, float]:
    """`judge/*` of a step's ended episodes: the judge's mean score (over all of them, wrong
    answers included: what a hacked judge would show), its mean on successes, and the mean
    shaping term actually paid."""
    scores = [(t.reward.checks[JUDGE], is_success(t)) for t in trajectories
              if JUDGE in t.reward.checks]
    if not scores:
        return {}
    won = [s for s, ok in scores if ok]
    return {"judge/mean": sum(s for s, _ in scores) / len(scores),
            "judge/mean_on_success": sum(won) / len(won) if won else math.nan,
            "judge/paid_mean": weight * sum(won) / len(scores)}


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
