"""The SFT cold start: cross-entropy on the expert's assistant tokens (the mask RL uses), with
linear warmup and a cosine or constant learning rate."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from tiller.config import SFTConfig
from tiller.errors import RunError
from tiller.rollout.trajectory import Trajectory
from tiller.train.batch import Batch
from tiller.train.trainer import PolicyTrainer


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """min(1, (s + 1) / warmup), times 0.5 (1 + cos(pi s / total)) for `cosine`."""
    warm = min(1.0, (step + 1) / max(warmup, 1))
    if schedule == "constant":
        return warm
    return warm * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


def train_sft(trainer: PolicyTrainer, demos: Sequence[Trajectory], cfg: SFTConfig,
              pad_token_id: int, seed: int,
              on_step: Callable[[int, dict[str, float]], None]) -> int:
    """`cfg.epochs` shuffled passes over `demos` in batches of `cfg.batch_size`; `on_step(step,
    metrics)` after each optimizer step. Returns the number of steps."""
    if not demos:
        raise RunError("sft: no expert demonstration completed, so there is nothing to train on "
                       "(is env.max_turns or env.max_episode_tokens too small for the expert?); "
                       "set sft.enabled=false to start RL from the base model")
    steps = cfg.epochs * math.ceil(len(demos) / cfg.batch_size)
    trainer.set_optimizer(cfg.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        trainer.optimizer, lambda s: lr_factor(s, steps, cfg.warmup_steps, cfg.lr_schedule))
    gen = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(len(demos), generator=gen).tolist()
        for i in range(0, len(order), cfg.batch_size):
            batch = Batch.collate([demos[j] for j in order[i : i + cfg.batch_size]], pad_token_id)
            metrics = trainer.sft_step(batch, cfg.micro_batch_size)
            metrics["lr"] = schedule.get_last_lr()[0]
            schedule.step()
            step += 1
            on_step(step, metrics)
    return steps
