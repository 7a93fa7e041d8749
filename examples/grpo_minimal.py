"""GRPO on the calculator env in one file, CleanRL-style: the whole algorithm on tiller's pure
functions (the agent loop, the group-relative advantage, the PPO-clip loss, token-mean
aggregation), with no controller, buffer or config file in between.

    python examples/grpo_minimal.py --steps 20

A tiny Qwen3 is built locally, given a short SFT cold start on the scripted expert, then
trained with GRPO; held-out success is printed before and after RL.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tiller.algorithms import ADVANTAGES, AGGREGATIONS, POLICY_LOSSES
from tiller.config import BuildConfig
from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.updates import WeightUpdate
from tiller.envs import ENVS
from tiller.models import build_env_model, load_model, load_tokenizer
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits, run_episode
from tiller.rollout.chat import stop_token_ids
from tiller.rollout.collect import collect, collect_expert
from tiller.rollout.trajectory import is_success
from tiller.train.batch import Batch
from tiller.train.logprobs import token_logprobs


@dataclass
class Args:
    out: str = "runs/grpo_minimal"
    """where the built model goes"""
    seed: int = 0
    """seeds the model, the tasks and every episode"""
    hidden_size: int = 128
    """width of the tiny Qwen3 (2 layers, heads of 16 dims)"""
    sft_tasks: int = 3200
    """expert demonstrations for the cold start; half answer without the tool (and are wrong)"""
    sft_steps: int = 400
    """SFT optimizer steps"""
    sft_batch_size: int = 64
    """demonstrations per SFT step"""
    steps: int = 25
    """GRPO steps"""
    tasks_per_step: int = 16
    """groups per GRPO step"""
    group_size: int = 8
    """samples per task: the group the advantage is relative to"""
    lr: float = 3e-4
    """GRPO learning rate (AdamW)"""
    ppo_epochs: int = 2
    """passes over each rollout batch; from the second on, the ratio moves and clipping acts"""
    mini_batches: int = 2
    """optimizer steps per pass"""
    clip_eps: float = 0.2
    """PPO clip range: rho is clipped to [1 - eps, 1 + eps]"""
    eval_tasks: int = 256
    """held-out tasks, evaluated before and after RL"""


def rollout(env_cls, engine, tok, tasks, samples, seed, tag, limits) -> list:
    params = SamplingParams(temperature=1.0, max_new_tokens=48,
                            stop_token_ids=stop_token_ids(tok, engine.model.generation_config))
    return asyncio.run(collect(tasks, samples, EngineActor(engine, params),
                               episode_fn=run_episode, make_env=lambda *_: env_cls(),
                               tokenizer=tok, limits=limits, seed=seed, tag=tag))


def main(args: Args) -> dict[str, list[float]]:
    torch.manual_seed(args.seed)
    env_cls = ENVS["calculator"]
    limits = EpisodeLimits(max_turns=6, max_episode_tokens=512)
    build = BuildConfig(vocab_size=1024, hidden_size=args.hidden_size, num_layers=2,
                        num_heads=args.hidden_size // 16)
    path = build_env_model(env_cls, Path(args.out) / "base", build, seed=args.seed,
                           difficulty=2, max_turns=limits.max_turns)
    tok, policy = load_tokenizer(path), load_model(path)

    # SFT cold start: cross-entropy on the expert's assistant tokens (loss_mask = 1)
    tasks = env_cls.make_tasks("train", args.sft_tasks, args.seed + 2, 2)
    demos = collect_expert(env_cls, tasks, tok, guess=0.5, limits=limits, seed=args.seed)
    history: dict[str, list[float]] = {"sft_loss": [], "reward": [], "clip_frac": [],
                                       "logp_mismatch": []}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    n = args.sft_batch_size
    for step in range(args.sft_steps):
        batch = Batch.collate([demos[(step * n + i) % len(demos)] for i in range(n)],
                              tok.pad_token_id)
        logp, _ = token_logprobs(policy, batch)
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        warmup.step()
        history["sft_loss"].append(float(loss.detach()))

    # the engine samples with its own copy of the weights; it learns new ones only by update
    engine = EmbeddedEngine(copy.deepcopy(policy), tok.pad_token_id, max_batch_size=128)
    heldout = env_cls.make_tasks("heldout", args.eval_tasks, args.seed, 2)

    def success(tag: str) -> float:
        trajs = rollout(env_cls, engine, tok, heldout, 1, args.seed, (tag,), limits)
        return sum(map(is_success, trajs)) / len(trajs)

    history["success_before"] = [success("eval-before")]
    print(f"SFT loss {history['sft_loss'][0]:.2f} -> {history['sft_loss'][-1]:.3f}; "
          f"held-out success after SFT: {history['success_before'][0]:.3f}")

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99))
    train_tasks = env_cls.make_tasks("train", args.steps * args.tasks_per_step, args.seed + 3, 2)
    for step in range(args.steps):
        tasks = train_tasks[step * args.tasks_per_step : (step + 1) * args.tasks_per_step]
        trajs = rollout(env_cls, engine, tok, tasks, args.group_size, args.seed, ("rl", step),
                        limits)
        batch = Batch.collate(trajs, tok.pad_token_id)  # groups: one per draw of a task
        mask = batch.loss_mask  # (B, T): 1 on generated tokens, 0 on prompt and tool output

        # A_i = (r_i - mean(r_group)) / (std(r_group) + eps), shared by every token of episode i
        adv = ADVANTAGES["grpo"](batch.rewards, batch.group_index, 1e-6)[:, None] * mask
        with torch.no_grad():
            logp_old, _ = token_logprobs(policy, batch)  # the policy that sampled the batch
        mismatch = ((logp_old - batch.rollout_logprobs).abs() * mask).max()

        clipped = 0.0
        for _ in range(args.ppo_epochs):
            for rows in torch.randperm(len(trajs)).chunk(args.mini_batches):
                mb = batch.rows(rows)
                width = mb.input_ids.size(1)
                logp, _ = token_logprobs(policy, mb)
                loss_tok, stats = POLICY_LOSSES["ppo_clip"](
                    logp, logp_old[rows, :width], adv[rows, :width], mb.loss_mask,
                    eps_low=args.clip_eps, eps_high=args.clip_eps)
                # token-mean: sum of m * L over the mini-batch / its number of generated tokens
                loss = AGGREGATIONS["token-mean"](loss_tok, mb.loss_mask,
                                                  total_tokens=float(mb.loss_mask.sum()),
                                                  total_seqs=len(rows), l_max=0)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                clipped += float(stats["clipped"].sum())

        engine.update_weights(WeightUpdate.full(policy, step + 1))
        history["reward"].append(float(batch.rewards.mean()))
        history["clip_frac"].append(clipped / (args.ppo_epochs * float(mask.sum())))
        history["logp_mismatch"].append(float(mismatch))
        print(f"step {step + 1:3d}  reward {history['reward'][-1]:.3f}  "
              f"clip_frac {history['clip_frac'][-1]:.4f}  mismatch {mismatch:.1e}")

    history["success_after"] = [success("eval-after")]
    print(f"held-out success after GRPO: {history['success_after'][0]:.3f}")
    return history


def parse_args() -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return Args(**vars(p.parse_args()))


if __name__ == "__main__":
    main(parse_args())
