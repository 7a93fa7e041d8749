"""The controller: the synchronous schedule of a run (build -> SFT -> GRPO -> eval).

It wires the boxes together and owns nothing inside them: the env makes tasks and steps,
the agent loop turns (env, engine) into trajectories, the buffer groups them, the algorithm
registries give advantages and losses, the trainer updates the weights and the engine gets each
new version through a `WeightUpdate`.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from tiller.buffer import DataBuffer
from tiller.config import BuildConfig, Config, ConfigError, require_package
from tiller.envs import ENVS, Env, Task, ToolEnv
from tiller.models import build_tiny_model, load_model, load_tokenizer, train_tokenizer
from tiller.observe.evaluation import is_success, success_summary
from tiller.observe.metrics import MetricsLogger, check_backends, progress
from tiller.rollout.agent_loop import (
    EngineActor,
    EpisodeLimits,
    ExpertActor,
    derive_seed,
    load_episode_fn,
    run_episode,
)
from tiller.rollout.engine import EmbeddedEngine, SamplingParams
from tiller.rollout.trajectory import Status, Trajectory
from tiller.tools.executor import ToolReliabilityError
from tiller.tools.stack import ToolStack
from tiller.train.algorithms.advantages import overlong_penalty
from tiller.train.algorithms.credit import apply_key_steps
from tiller.train.algorithms.kl import kl_beta_at
from tiller.train.batch import Batch
from tiller.train.critic import Critic
from tiller.train.trainer import Trainer


def resolve_env(name: str) -> type[Env]:
    if name not in ENVS:
        raise ConfigError(f"config field env.name: unknown env {name!r}; "
                          f"choose one of: {', '.join(sorted(ENVS))}")
    for module, extra in ENVS[name].requires.items():
        require_package(module, extra, f"env.name={name}")
    return ENVS[name]


KeyStepFn = Callable[[Trajectory, Any], Sequence[float]]


def load_key_steps(path: str | None) -> KeyStepFn | None:
    """The key-step mask hook `package.module:function` (fn(trajectory, tokenizer) -> one 0/1
    per token of trajectory.token_ids), or None when unset."""
    if path is None:
        return None
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"config field rl.algorithm.credit.key_steps: got {path!r}; "
                          f"cannot import it: {e}") from e
    if not callable(fn):
        raise ConfigError(f"config field rl.algorithm.credit.key_steps: got {path!r}; "
                          "expected a callable")
    return fn


def check_algorithm(cfg: Config) -> None:
    """What the config cannot check by itself (registry names and the ignored-knob rule are
    validated when it loads) is checked before any work starts: the key-step hook imports."""
    load_key_steps(cfg.rl.algorithm.credit.key_steps)


def rl_task_count(cfg: Config) -> int:
    """Train tasks RL draws: dynamic sampling may take up to max_rounds times a plain run's."""
    alg = cfg.rl.algorithm
    rounds = alg.dynamic_sampling.max_rounds if alg.dynamic_sampling.enabled else 1
    return max(cfg.rl.steps * cfg.rl.tasks_per_step * (rounds or 1), 1)


def check_task_counts(cfg: Config, env_cls: type[Env]) -> None:
    """Every task list the run will draw fits the env's task space, checked before any work:
    drawing more distinct tasks than exist would otherwise fail only after the model build."""
    d = cfg.env.difficulty
    wants = [("eval.tasks", "heldout", cfg.eval.tasks)]
    if cfg.model.build is not None:
        wants.append(("model.build.corpus_tasks", "train", cfg.model.build.corpus_tasks))
    if cfg.sft.enabled:
        wants.append(("sft.tasks", "train", cfg.sft.tasks))
    if cfg.rl.steps > 0:
        wants.append(("rl.steps × rl.tasks_per_step", "train", rl_task_count(cfg)))
    for field, split, n in wants:
        space = env_cls.task_space(split, d)
        if space is not None and n > space:
            raise ConfigError(f"config field {field}: got {n}; env {env_cls.name} has only "
                              f"{space} {split} tasks at env.difficulty={d}: ask for at most "
                              f"{space} or pick an env.difficulty with more")


class Run:
    """Everything one run needs, built from a validated `Config`."""

    def __init__(self, cfg: Config, output_dir: str | Path | None = None):
        self.cfg = cfg
        self.env_cls = resolve_env(cfg.env.name)
        check_algorithm(cfg)
        check_backends(cfg.logging.tensorboard, cfg.logging.wandb)
        check_task_counts(cfg, self.env_cls)
        self.episode_fn = load_episode_fn(cfg.agent.loop)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.dir = Path(output_dir or cfg.output_dir or Path("runs") / f"{cfg.name}-{stamp}")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.limits = EpisodeLimits(cfg.env.max_turns, cfg.env.max_episode_tokens)
        self.timings: dict[str, float] = {}

        t = time.perf_counter()
        model_path = self._model_path()
        self.tokenizer = load_tokenizer(model_path)
        dtype = getattr(torch, cfg.model.dtype)
        self.model = load_model(model_path, dtype)
        self.timings["build_s"] = time.perf_counter() - t
        self.trainer = Trainer(self.model, temperature=cfg.sampling.temperature or 1.0)
        # The engine holds its own copy of the weights and only learns new ones by update.
        self.engine = EmbeddedEngine(
            copy.deepcopy(self.model), self.tokenizer.pad_token_id, cfg.max_batch_size
        )
        self.logger = MetricsLogger(self.dir, cfg.logging.tensorboard, cfg.logging.wandb,
                                    cfg.logging.wandb_project, cfg.model_dump())
        self.params = self._sampling(cfg.sampling.temperature)
        self.tools = ToolStack(cfg.env.tools, self.dir)

    # ---- model ---------------------------------------------------------------------------

    def _model_path(self) -> Path:
        cfg = self.cfg
        if cfg.model.path is not None:
            return Path(cfg.model.path)
        assert cfg.model.build is not None
        return build_env_model(self.env_cls, self.dir / "base_model", cfg.model.build,
                               seed=cfg.seed, difficulty=cfg.env.difficulty,
                               max_turns=cfg.env.max_turns)

    def _sampling(self, temperature: float) -> SamplingParams:
        s = self.cfg.sampling
        return SamplingParams(temperature=temperature, top_p=s.top_p, top_k=s.top_k,
                              max_new_tokens=s.max_new_tokens,
                              stop_token_ids=(self.tokenizer.eos_token_id,))

    def push_weights(self) -> None:
        self.engine.update_weights(self.trainer.weight_update())

    # ---- rollouts ------------------------------------------------------------------------

    def make_env(self, *key: Any) -> Env:
        """A fresh env for one episode, its tools behind the run's tool stack; `key` names the
        episode for record/replay and fault draws."""
        if not issubclass(self.env_cls, ToolEnv):
            return self.env_cls()
        return self.env_cls(wrap=self.tools.wrapper("/".join(map(str, key))))

    def _expert_episodes(self, tasks: Sequence[Task], guess: float, tag: str = "sft"
                         ) -> list[Trajectory]:
        return collect_expert(self.env_cls, tasks, self.tokenizer, guess=guess,
                              limits=self.limits, seed=self.cfg.seed, episode_fn=self.episode_fn,
                              make_env=lambda i: self.make_env(tag, i))

    def gate(self) -> dict[str, float]:
        """The tool reliability gate: the expert's (valid) calls on a few train tasks must
        succeed at least `gate.threshold` of the time, per tool, or training does not start."""
        gate = self.cfg.env.tools.gate
        replay = self.cfg.env.tools.replay
        if not gate.enabled or (replay is not None and replay.mode == "replay"):
            return {}  # replaying: the live tools are not used at all
        tasks = self.env_cls.make_tasks("train", gate.probe_tasks, self.cfg.seed + 4,
                                        self.cfg.env.difficulty)
        self._expert_episodes(tasks, guess=0.0, tag="gate")
        report = self.tools.probe_report()
        self.tools.stats(reset=True)
        try:
            report.check(gate.override)
        except ToolReliabilityError as e:
            raise ConfigError(f"{e} (set env.tools.gate.override=true to train anyway)") from e
        rates = {f"gate_ok_rate/{name}": rate for name, rate in report.rates().items()}
        self.logger.log("gate", 0, rates)
        return rates

    async def _episodes(self, tasks: Sequence[Task], samples: int, params: SamplingParams,
                        tag: Any, on_done: Callable[[Trajectory], None] | None = None
                        ) -> list[Trajectory]:
        actor = EngineActor(self.engine, params)

        async def one(task: Task, k: int) -> Trajectory:
            traj = await self.episode_fn(self.make_env(*tag, task.id, k), task, actor,
                                         self.tokenizer,
                                         seed=derive_seed(self.cfg.seed, tag, task.id, k),
                                         sample_index=k, limits=self.limits)
            if on_done is not None:
                on_done(traj)
            return traj

        return list(await asyncio.gather(*(one(t, k) for t in tasks for k in range(samples))))

    # ---- phases --------------------------------------------------------------------------

    def sft(self) -> dict[str, Any]:
        cfg = self.cfg.sft
        t0 = time.perf_counter()
        tasks = self.env_cls.make_tasks("train", cfg.tasks, self.cfg.seed + 2,
                                        self.cfg.env.difficulty)
        demos = self._expert_episodes(tasks, cfg.imperfect_fraction)
        self.logger.log("sft_demos", 0, self.tools.stats(reset=True))
        demos = [d for d in demos if d.status is Status.COMPLETED]
        steps = cfg.epochs * math.ceil(len(demos) / cfg.batch_size)
        self.trainer.set_optimizer(cfg.lr)
        def lr_factor(s: int) -> float:
            warm = min(1.0, (s + 1) / max(cfg.warmup_steps, 1))
            if cfg.lr_schedule == "constant":
                return warm
            return warm * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))

        schedule = torch.optim.lr_scheduler.LambdaLR(self.trainer.optimizer, lr_factor)
        gen = torch.Generator().manual_seed(self.cfg.seed)
        pad = self.tokenizer.pad_token_id
        with progress(self.cfg.logging.progress) as bars:
            bar = bars.add_task("SFT", total=steps, info="")
            step = 0
            for _ in range(cfg.epochs):
                order = torch.randperm(len(demos), generator=gen).tolist()
                for i in range(0, len(order), cfg.batch_size):
                    batch = Batch.collate([demos[j] for j in order[i : i + cfg.batch_size]], pad)
                    m = self.trainer.sft_step(batch, cfg.micro_batch_size)
                    m["lr"] = schedule.get_last_lr()[0]
                    schedule.step()
                    step += 1
                    self.logger.log("sft", step, m)
                    bars.update(bar, advance=1, info=f"loss={m['sft_loss']:.3f}")
        self.push_weights()
        self.timings["sft_s"] = time.perf_counter() - t0
        return {"demonstrations": len(demos), "steps": steps,
                "expert_success": float(np.mean([is_success(d) for d in demos]))}

    def evaluate(self, tasks: Sequence[Task], label: str) -> dict[str, float]:
        """Held-out success: eval.samples_per_task samples per task, pass@1 (= `success`) and,
        with eval.pass_k > 1, unbiased pass@k, each with a 95% bootstrap CI over tasks."""
        ev = self.cfg.eval
        t0 = time.perf_counter()
        params = self._sampling(ev.temperature)
        with progress(self.cfg.logging.progress) as bars:
            bar = bars.add_task(f"eval ({label})", total=len(tasks) * ev.samples_per_task,
                                info="")
            done: list[bool] = []

            def tick(t: Trajectory) -> None:
                done.append(is_success(t))
                bars.update(bar, advance=1, info=f"success={sum(done) / len(done):.2f}")

            trajs = asyncio.run(self._episodes(tasks, ev.samples_per_task, params,
                                               ("eval", label), tick))
        summary = success_summary(trajs, seed=self.cfg.seed, k=ev.pass_k)
        summary["time_s"] = time.perf_counter() - t0
        summary.update(rollout_metrics(trajs))
        summary.update(self.tools.stats(reset=True))
        self.logger.log(f"eval_{label}", self.trainer.version, summary)
        self.timings[f"eval_{label}_s"] = summary["time_s"]
        return summary

    def train_reward(self, t: Trajectory) -> float:
        """The reward RL trains on: the verifier's value, plus DAPO's soft overlong penalty
        (0 up to l_max - l_cache generated tokens, down to -1 at l_max) when it is on."""
        if self.cfg.rl.algorithm.overlong.mode != "soft":
            return t.reward.value
        length = torch.tensor(float(t.num_generated))
        return t.reward.value + float(overlong_penalty(length, self.cfg.l_max, self.cfg.l_cache))

    def _sample_groups(self, step: int, tasks: Iterator[Task], buffer: DataBuffer
                       ) -> tuple[list[Trajectory], dict[str, float]]:
        """Roll out this step's groups into the buffer.

        With dynamic sampling, groups whose training rewards are all equal are filtered out
        (ledger: `filtered/zero_variance`) and the missing number of groups is sampled again,
        until `tasks_per_step` groups have signal or `max_rounds` rounds ran; then the step
        trains on what there is. Without it, such groups stay in the batch (A = 0) and are only
        counted. Returns every trajectory sampled, for the rollout metrics, and the counts.
        """
        cfg = self.cfg.rl
        ds = cfg.algorithm.dynamic_sampling
        sampled: list[Trajectory] = []
        groups = flat = rounds = 0
        for r in range((ds.max_rounds or 1) if ds.enabled else 1):
            batch_tasks = list(itertools.islice(tasks, cfg.tasks_per_step - len(buffer.groups)))
            if not batch_tasks:
                break
            tag = ("rl", step) if r == 0 else ("rl", step, r)
            trajs = asyncio.run(self._episodes(batch_tasks, cfg.group_size, self.params, tag))
            sampled += trajs
            rounds += 1
            before = len(buffer.groups)
            buffer.add(trajs)
            groups += len(buffer.groups) - before
            zero = buffer.zero_variance_groups(self.train_reward)  # earlier ones were dropped
            flat += len(zero)
            if ds.enabled:
                buffer.drop_groups(zero, "zero_variance")
        stats = {"zero_variance_group_frac": flat / max(groups, 1),
                 "groups_kept": float(len(buffer.groups)),
                 "rollout_tokens": float(sum(t.num_generated for t in sampled))}
        if ds.enabled:
            stats.update(sampling_rounds=float(rounds), groups_dropped=float(flat))
        return sampled, stats

    def _rl_batch(self, kept: list[Trajectory], group_index: torch.Tensor,
                  key_steps: KeyStepFn | None) -> tuple[Batch, dict[str, float]]:
        """The training batch: shaped rewards, and the loss mask scaled for env_error
        trajectories (`rl.env_error_weight`, when they are kept), narrowed by overlong masking
        (truncated episodes leave the loss but keep their place in the group statistics) and
        by the key-step hook."""
        alg = self.cfg.rl.algorithm
        batch = Batch.collate(kept, self.tokenizer.pad_token_id,
                              [self.train_reward(t) for t in kept], group_index)
        stats: dict[str, float] = {}
        hit = torch.tensor([t.status is Status.ENV_ERROR for t in kept])
        if hit.any():  # kept only when rl.env_error_weight > 0
            batch.loss_mask[hit] *= self.cfg.rl.env_error_weight
            stats["env_error_trained"] = float(hit.sum())
        if alg.overlong.mode == "mask":
            cut = torch.tensor([t.status is Status.TRUNCATED for t in kept])
            batch.loss_mask[cut] = 0.0
            stats["overlong_masked"] = float(cut.sum())
        if key_steps is not None:
            for i, t in enumerate(kept):
                n = len(t.token_ids)
                key = torch.as_tensor(key_steps(t, self.tokenizer), dtype=torch.float)
                batch.loss_mask[i, :n] = apply_key_steps(batch.loss_mask[i, :n], key)
        return batch, stats

    def rl(self) -> None:
        cfg = self.cfg.rl
        alg = cfg.algorithm
        t0 = time.perf_counter()
        self.trainer.set_optimizer(cfg.lr, cfg.weight_decay)
        tasks = iter(self.env_cls.make_tasks("train", rl_task_count(self.cfg), self.cfg.seed + 3,
                                             self.cfg.env.difficulty))
        # kl.beta = 0 (or switched off from the start): no reference model exists or runs
        self.ref_model = (copy.deepcopy(self.model).eval()
                          if kl_beta_at(0, alg.kl.beta, alg.kl.off_after) > 0 else None)
        self.critic = Critic(self.model, alg.critic) if alg.critic is not None else None
        key_steps = load_key_steps(alg.credit.key_steps)
        buffer = DataBuffer(keep_env_errors=cfg.env_error_weight > 0)
        with progress(self.cfg.logging.progress) as bars:
            bar = bars.add_task(f"RL ({alg.preset or alg.advantage})", total=cfg.steps, info="")
            for step in range(cfg.steps):
                ts = time.perf_counter()
                if kl_beta_at(step, alg.kl.beta, alg.kl.off_after) == 0:
                    self.ref_model = None  # the schedule switched the KL off: free the copy
                sampled, m = self._sample_groups(step, tasks, buffer)
                t_roll = time.perf_counter() - ts
                kept, group_index = buffer.take_batch()
                if kept:
                    batch, mask_stats = self._rl_batch(kept, group_index, key_steps)
                    m.update(mask_stats)
                    m.update(self.trainer.rl_step(batch, cfg, self.cfg.l_max, self.ref_model,
                                                  self.critic, step))
                    self.push_weights()
                m.update(rollout_metrics(sampled))
                m.update(self.tools.stats(reset=True))
                m.update(rollout_s=t_roll, step_s=time.perf_counter() - ts,
                         version=self.trainer.version, skipped=float(not kept))
                m.update({f"ledger/{k}": v for k, v in buffer.ledger.items()})
                self.logger.log("rl", step + 1, m)
                bars.update(bar, advance=1, info=(
                    f"reward={m['reward_mean']:.2f} success={m['success_rate']:.2f} "
                    f"zero_var={m['zero_variance_group_frac']:.2f}"))
        self.timings["rl_s"] = time.perf_counter() - t0

    def close(self) -> None:
        self.logger.close()
        self.tools.close()

    def save(self, name: str = "final") -> Path:
        out = self.dir / "checkpoints" / name
        self.model.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        return out


def collect_expert(env_cls: type[Env], tasks: Sequence[Task], tokenizer: Any, *, guess: float,
                   limits: EpisodeLimits, seed: int, episode_fn: Any = run_episode,
                   make_env: Callable[[int], Env] | None = None) -> list[Trajectory]:
    """The scripted expert's episodes on `tasks`, through the same loop the policy uses;
    `make_env(i)` builds episode i's env (default: the env class with plain tools)."""
    make_env = make_env or (lambda i: env_cls())

    async def one(i: int, task: Task) -> Trajectory:
        actor = ExpertActor(env_cls, task, tokenizer, guess)
        return await episode_fn(make_env(i), task, actor, tokenizer,
                                seed=derive_seed(seed, "expert", i), limits=limits)

    async def run_all() -> list[Trajectory]:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    return asyncio.run(run_all())


def build_env_model(env_cls: type[Env], out: Path, build: BuildConfig, *, seed: int,
                    difficulty: int, max_turns: int) -> Path:
    """A tiny model whose tokenizer learned from the env's expert episodes.

    The episodes are rendered through the real loop with a byte-level tokenizer (the BPE
    alphabet with no merges yet); a share of them guess, so answers without tools are covered.
    """
    bootstrap = train_tokenizer([], 0)
    tasks = env_cls.make_tasks("train", build.corpus_tasks, seed + 1, difficulty)
    trajs = collect_expert(env_cls, tasks, bootstrap, guess=0.3,
                           limits=EpisodeLimits(max_turns, 1 << 16), seed=seed)
    corpus = [bootstrap.decode(t.token_ids) for t in trajs]
    return build_tiny_model(out, corpus, vocab_size=build.vocab_size,
                            hidden_size=build.hidden_size, num_layers=build.num_layers,
                            num_heads=build.num_heads, seed=seed)


def rollout_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    n = max(len(trajs), 1)
    statuses = [t.status.value for t in trajs]
    return {
        "reward_mean": sum(t.reward.value for t in trajs) / n,
        "success_rate": sum(is_success(t) for t in trajs) / n,
        "response_tokens_mean": sum(t.num_generated for t in trajs) / n,
        "episode_tokens_mean": sum(len(t.token_ids) for t in trajs) / n,
        "turns_mean": sum(t.num_turns for t in trajs) / n,
        "tool_calls_per_episode": sum(t.tool_calls for t in trajs) / n,
        "tool_errors_per_episode": sum(t.tool_errors for t in trajs) / n,
        "tool_parse_failures": float(sum(t.parse_errors for t in trajs)),
        "env_error_rate": statuses.count("env_error") / n,
        "truncated_rate": statuses.count("truncated") / n,
    }


def train(cfg: Config, output_dir: str | Path | None = None) -> dict[str, Any]:
    """The whole pipeline; returns (and writes) the run summary."""
    t0 = time.perf_counter()
    run = Run(cfg, output_dir)
    env = cfg.env
    heldout = run.env_cls.make_tasks("heldout", cfg.eval.tasks, cfg.seed, env.difficulty)
    summary: dict[str, Any] = {"run_dir": str(run.dir), "seed": cfg.seed}
    summary["tool_gate"] = run.gate()
    if cfg.sft.enabled:
        summary["sft"] = run.sft()
        summary["sft"]["checkpoint"] = str(run.save("sft"))
    summary["heldout_after_sft"] = run.evaluate(heldout, "sft")
    if cfg.rl.steps > 0:
        run.rl()
        summary["heldout_after_rl"] = run.evaluate(heldout, "rl")
    summary["checkpoint"] = str(run.save())
    run.timings["total_s"] = time.perf_counter() - t0
    summary["timings"] = run.timings
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run.close()
    return summary


def evaluate_checkpoint(cfg: Config, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Held-out success of the model at `model.path`."""
    run = Run(cfg, output_dir)
    heldout = run.env_cls.make_tasks("heldout", cfg.eval.tasks, cfg.seed, cfg.env.difficulty)
    summary = {"run_dir": str(run.dir), "heldout": run.evaluate(heldout, "checkpoint")}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run.close()
    return summary
