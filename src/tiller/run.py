"""A run's wiring: the run folder, the model and tokenizer, the engine (its own copy of the
weights, updated only through `WeightUpdate`s), the trainer, the tool stack and the metrics.
The schedule that uses them is `tiller.controller`."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from tiller.config import Config
from tiller.engine.api import SamplingParams
from tiller.engine.factory import make_engine
from tiller.engine.weight_sync import WeightSync
from tiller.envs import Env, Task, ToolEnv
from tiller.envs.dataset import DatasetEnv, read_conversations
from tiller.errors import ConfigError
from tiller.files import replacing, write_file
from tiller.gateway.program import ProgramEpisode, load_program
from tiller.models import (
    build_env_model,
    dropout_rates,
    load_model,
    load_tokenizer,
    resolve_device,
)
from tiller.observe.metrics import MetricsLogger, check_backends
from tiller.observe.traces import TraceWriter
from tiller.plugins import check_env_tools, env_label, load_env_class
from tiller.rollout.agent_loop import (
    EngineActor,
    EpisodeLimits,
    check_rollout_setup,
    load_episode_fn,
)
from tiller.rollout.chat import stop_token_ids
from tiller.rollout.collect import check_aborted, collect, collect_expert
from tiller.rollout.curriculum import check_curriculum
from tiller.rollout.memory import MemoryPolicy
from tiller.rollout.trajectory import Trajectory
from tiller.runtime import set_up_threads
from tiller.tools.sandbox import set_unsafe_fallback
from tiller.tools.stack import ToolStack
from tiller.train.conversations import conversation_demos
from tiller.train.judges import ModelJudge, check_judge_model
from tiller.train.shaping import load_judge, load_key_steps
from tiller.train.trainer import Trainer

log = logging.getLogger(__name__)


def get_env(name: str) -> type[Env]:
    """The env class of `env.name`: registered, an installed entry point or a dotted path
    (`tiller.plugins`)."""
    return load_env_class(name)


def check_env_data(cfg: Config, env_cls: type[Env]) -> None:
    """data.* and rewards go to the dataset env, or to a plug-in env that subclasses it (the
    config cannot tell before the plug-in is imported)."""
    given = cfg.data.train is not None or bool(cfg.rewards)
    if given and not issubclass(env_cls, DatasetEnv):
        raise ConfigError(f"config field data.train: env {cfg.env.name} is not the dataset env "
                          "or a subclass of it (tiller.envs.dataset.DatasetEnv), so it cannot "
                          "take data.* or rewards; its own verifier scores its episodes")


def heldout_disabled(cfg: Config, env_cls: type[Env]) -> str | None:
    """Why the run has no held-out evaluation (eval.enabled false, or an env without a
    heldout split: not in `Env.splits`, or a `task_space` of 0), or None when it has one."""
    if not cfg.eval.enabled:
        return "eval.enabled is false"
    if "heldout" not in env_cls.splits:
        return f"env {env_label(env_cls)} has no heldout split (splits: {env_cls.splits})"
    if env_cls.task_space("heldout", cfg.env.difficulty) == 0:
        return (f"env {env_label(env_cls)} has no heldout tasks at "
                f"env.difficulty={cfg.env.difficulty}")
    return None


def rl_task_count(cfg: Config) -> int:
    """Train tasks RL draws: dynamic sampling may take up to max_rounds times a plain run's."""
    alg = cfg.rl.algorithm
    rounds = (alg.dynamic_sampling.max_rounds or 1) if alg.dynamic_sampling.enabled else 1
    return max(cfg.rl.steps * cfg.rl.tasks_per_step * rounds, 1)


def rl_task_reserve(cfg: Config) -> int:
    """Train tasks RL may draw: `rl_task_count`, twice that in async (the reserve)."""
    return rl_task_count(cfg) * (2 if cfg.rl.mode == "async" else 1)


def check_task_counts(cfg: Config, env_cls: type[Env]) -> None:
    """Every task list the run will draw fits the env's task space, checked before any work:
    drawing more distinct tasks than exist would otherwise fail only after the model build."""
    d = cfg.env.difficulty
    no_eval = heldout_disabled(cfg, env_cls)
    wants = [("eval.tasks", "heldout", cfg.eval.tasks)] if cfg.eval.sets is None else []
    for s in cfg.eval.resolved_sets(d) if cfg.eval.sets is not None else []:
        if s.split not in env_cls.eval_splits:
            raise ConfigError(f"config field eval.sets ({s.name}).split: got {s.split!r}; env "
                              f"{env_cls.name} offers: {', '.join(env_cls.eval_splits)}")
        space = env_cls.task_space(s.split, s.difficulty)
        if space is not None and s.tasks > space:
            raise ConfigError(f"config field eval.sets ({s.name}).tasks: got {s.tasks}; env "
                              f"{env_cls.name} has only {space} {s.split} tasks at "
                              f"difficulty {s.difficulty}")
    if no_eval:
        wants = []
    if cfg.model.build is not None:
        wants.append(("model.build.corpus_tasks", "train", cfg.model.build.corpus_tasks))
    wants = [(*w, "env.difficulty", d) for w in wants]
    if cfg.sft.enabled and cfg.data.sft is None:
        sft_d = cfg.sft.difficulty or d
        wants.append(("sft.tasks", "train", cfg.sft.tasks,
                      "sft.difficulty" if cfg.sft.difficulty else "env.difficulty", sft_d))
    if cfg.rl.steps > 0:
        wants.append(("rl.steps × rl.tasks_per_step", "train", rl_task_count(cfg),
                      "env.difficulty", d))
    for field, split, n, d_field, diff in wants:
        space = None if env_cls.repeats_tasks else env_cls.task_space(split, diff)
        if space is not None and n > space:
            raise ConfigError(f"config field {field}: got {n}; env {env_label(env_cls)} has only "
                              f"{space} {split} tasks at {d_field}={diff}: ask for at most "
                              f"{space} or pick an {d_field} with more")
    check_curriculum(cfg, env_cls, rl_task_reserve(cfg))


def check_sft_source(cfg: Config, env_cls: type[Env]) -> None:
    """SFT needs demonstrations: the env's scripted expert or the conversations of data.sft."""
    if cfg.sft.enabled and cfg.data.sft is None and not env_cls.has_expert:
        raise ConfigError(f"config field sft.enabled: env {cfg.env.name} has no scripted "
                          "expert to demonstrate; give SFT conversations in data.sft (a "
                          "messages JSONL), or set sft.enabled=false")


def compute_streams(cfg: Config) -> int:
    """A run's torch compute streams that run at once: the embedded engine's worker, a judge
    model's worker (it scores episodes while others are generated), and the trainer when it
    trains while episodes are sampled (rl.mode one_step_off or async; in sync it waits for
    them). At least 1 (the trainer of an HTTP-engine run)."""
    rollout = int(cfg.engine.backend == "embedded") + int(cfg.rl.judge.model is not None)
    overlaps = cfg.rl.mode != "sync" and cfg.rl.steps > 0
    return max(1, rollout + int(overlaps))


def warn_blind_correction(cfg: Config) -> None:
    """One warning when RL trains with top-k / top-p truncation, untruncated logprobs and an
    off-policy correction: the behaviour logprob it divides by is not the probability the
    token was drawn with (lower by the log of the kept mass), so its weights stay near 1 on
    off-policy data."""
    s, alg = cfg.sampling, cfg.rl.algorithm
    if cfg.rl.steps and s.truncates and s.logprobs == "untruncated" and alg.off_policy != "none":
        log.warning("sampling.logprobs is untruncated with top_k %d / top_p %g: off_policy %s "
                    "cannot see the truncation (its behaviour logprob is not the one tokens "
                    "were drawn with); use sampling.logprobs: sampled where the engine reports "
                    "it (tiller's engines do)", s.top_k, s.top_p, alg.off_policy)


class Run:
    """Everything one run needs, built from a validated `Config`. Hooks named in the config
    (agent loop or program, key steps) are imported first, so a bad one fails before any work."""

    gateway: Any = None  # agent.program's gateway, started once the models are built
    traces: TraceWriter | None = None  # traces.sqlite's writer (observe.traces)

    def __init__(self, cfg: Config, output_dir: str | Path | None = None):
        self.cfg = cfg
        env_cls = get_env(cfg.env.name)
        check_env_data(cfg, env_cls)
        self.env_cls = env_cls.configure(cfg)  # a dataset env reads its rows
        check_sft_source(cfg, self.env_cls)
        # every row checked now, before any work
        self.sft_conversations = read_conversations(cfg.data) if cfg.data.sft else []
        check_backends(cfg.logging.tensorboard, cfg.logging.wandb)
        check_task_counts(cfg, self.env_cls)
        warn_blind_correction(cfg)
        self.episode_fn = load_episode_fn(cfg.agent.loop)
        program = load_program(cfg.agent.program) if cfg.agent.program else None
        self.key_steps = load_key_steps(cfg.rl.algorithm.credit.key_steps)
        self.judge = load_judge(cfg.rl.judge.fn)  # rl.judge.model loads with the models
        if cfg.rl.judge.model is not None:
            check_judge_model(cfg.rl.judge.model)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.dir = Path(output_dir or cfg.output_dir or Path("runs") / f"{cfg.name}-{stamp}")
        self.dir.mkdir(parents=True, exist_ok=True)
        write_file(self.dir / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.limits = EpisodeLimits(cfg.env.max_turns, cfg.env.max_episode_tokens, MemoryPolicy(
            cfg.agent.memory, tool_output_tokens=cfg.agent.tool_output_tokens or 128,
            reserve_tokens=cfg.sampling.max_new_tokens),
            chat_format=cfg.model.chat_format, history=cfg.agent.history)
        self.timings: dict[str, float] = {}
        # Before any work: a bad replay path stops the run here, and the sandbox policy holds
        # from the first env on (a code env without bwrap refuses unless it is allowed).
        self.tools = ToolStack(cfg.env.tools, self.dir)
        set_unsafe_fallback(cfg.env.tools.sandbox.allow_unsafe_fallback)
        try:
            check_env_tools(self.env_cls, self.tools.functions)
            check_env_tools(self.env_cls, self.tools.mcp_tools, "env.tools.mcp")
            self.env_cls.start(self.dir)  # an env server (openenv), checked before any work
            self._build_models()
        except BaseException:  # nothing of a run that did not start outlives it
            self.env_cls.stop()
            self.tools.close()
            set_unsafe_fallback(False)
            raise
        t = cfg.observe.traces
        try:  # e.g. an older tiller's traces.sqlite in this folder: what started is closed
            self.traces = TraceWriter(self.dir / "traces.sqlite", t.sample_rate, t.max_mb,
                                      cfg.seed, t.queue_size, t.close_timeout_s
                                      ) if t.enabled else None
        except BaseException:
            self.close()
            raise
        if program is not None:
            from tiller.gateway.server import Gateway  # FastAPI and uvicorn: the serve extra

            try:
                self.gateway = Gateway().start()
            except BaseException:
                self.close()
                raise
            self.episode_fn = ProgramEpisode(self.gateway, program, cfg.agent.program_timeout_s,
                                             cfg.agent.reward)

    def _build_models(self) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.device = resolve_device(cfg.model.device)
        path = Path(cfg.model.path) if cfg.model.path is not None else build_env_model(
            self.env_cls, self.dir / "base_model", cfg.model.build, seed=cfg.seed,
            difficulty=cfg.env.difficulty, max_turns=cfg.env.max_turns,
            tools=[t.schema for t in self.tools.extra])
        self.tokenizer = load_tokenizer(path)
        # fp32 master weights for the optimizer whatever model.dtype is (see Trainer); the
        # engine's copy (and the reference model) are in model.dtype
        self.dtype = getattr(torch, cfg.model.dtype)
        self.model = load_model(path, torch.float32).to(self.device)
        # before the engine, the trainer or any episode computes: they share these threads
        self.runtime = set_up_threads(cfg.runtime.threads, streams=compute_streams(cfg),
                                      params=sum(p.numel() for p in self.model.parameters()))
        write_file(self.dir / "runtime.json", json.dumps(self.runtime, indent=2))
        check_rollout_setup(self.tokenizer, self.model.config, self.limits)
        if cfg.rl.judge.model is not None:
            self.judge = ModelJudge(cfg.rl.judge.model, cfg.rl.judge.prompt, device=self.device)
        self.timings["build_s"] = time.perf_counter() - t0
        if cfg.model.dropout == "keep" and not dropout_rates(self.model):
            raise ConfigError("config field model.dropout: got 'keep'; this model has no "
                              "dropout (no dropout module or attention_dropout above 0), so "
                              "there is nothing to keep: remove it")
        s = cfg.sampling
        truncated = s.logprobs == "sampled"  # the trainer recomputes what the engine reports
        self.trainer = Trainer(self.model, temperature=s.temperature or 1.0,
                               compute_dtype=self.dtype, top_k=s.top_k if truncated else 0,
                               top_p=s.top_p if truncated else 1.0, dropout=cfg.model.dropout)
        # the servers of engine.backend http get the trainer's weights (version 0)
        self.engine = make_engine(cfg, self.model, self.tokenizer.pad_token_id,
                                  weights_dir=self.dir / "weights",
                                  initial=self.trainer.weight_update)
        try:
            self.weight_sync = WeightSync(self.trainer, self.engine, cfg.weight_sync,
                                          self.dtype)
            # the engine's first weights (a copy, or the servers' start-up push) are checked
            # like every later sync's
            self.weight_sync.check_parity(self.trainer.version)
            self.logger = MetricsLogger(self.dir, cfg.logging.tensorboard, cfg.logging.wandb,
                                        cfg.logging.wandb_project, cfg.model_dump())
        except BaseException:
            self.engine.close()
            raise

    def log(self, phase: str, metrics: dict[str, Any], phase_step: int | None = None) -> None:
        """Metrics at the global step: the trainer's weight version (optimizer steps so far),
        monotonic across SFT, RL and evals."""
        self.logger.log(phase, self.trainer.version, metrics, phase_step)

    def sampling(self, temperature: float) -> SamplingParams:
        s = self.cfg.sampling
        return SamplingParams(temperature=temperature, top_p=s.top_p, top_k=s.top_k,
                              max_new_tokens=s.max_new_tokens, logprobs=s.logprobs,
                              stop_token_ids=stop_token_ids(self.tokenizer,
                                                            self.model.generation_config,
                                                            self.cfg.model.chat_format))

    def push_weights(self, in_flight: str = "continue") -> dict[str, float]:
        """Sync the trainer's weights to the engine (checked: checksums, echoed version,
        parity); the sync/* metrics to log."""
        return self.weight_sync.push(in_flight)

    def make_env(self, *key: Any) -> Env:
        """A fresh env for one episode, its tools behind the run's tool stack; `key` names the
        episode for record/replay and fault draws."""
        if not issubclass(self.env_cls, ToolEnv):
            return self.env_cls()
        return self.env_cls(wrap=self.tools.wrapper("/".join(map(str, key))))

    def tasks(self, split: str, n: int, seed_offset: int,
              difficulty: int | None = None) -> list[Task]:
        return self.env_cls.make_tasks(split, n, self.cfg.seed + seed_offset,
                                       difficulty or self.cfg.env.difficulty)

    def rl_tasks(self) -> Iterator[Task]:
        """The train tasks RL samples: the same `rl_task_count` tasks in every mode; async
        goes on with a reserve as large, drawn only if needed (groups filtered as stale give
        their place to new ones)."""
        n = rl_task_count(self.cfg)
        yield from self.tasks("train", n, 3)
        if self.cfg.rl.mode == "async":
            yield from self.tasks("train", n, 5)  # 4 is the tool gate's

    def episodes(self, tasks: Sequence[Task], samples: int, params: SamplingParams, tag: tuple,
                 on_done: Callable[[Trajectory], None] | None = None,
                 seed: int | None = None) -> list[Trajectory]:
        """The policy's episodes, `samples` per task, sampled under `seed` (default the run's);
        fails the run when more than `rl.max_aborted_frac` of them aborted (a broken engine
        cannot teach anything)."""
        trajs = asyncio.run(collect(
            tasks, samples, EngineActor(self.engine, params), episode_fn=self.episode_fn,
            make_env=self.make_env, tokenizer=self.tokenizer, limits=self.limits,
            seed=self.cfg.seed if seed is None else seed, tag=tag, on_done=on_done))
        check_aborted(trajs, self.cfg.rl.max_aborted_frac, "/".join(map(str, tag)))
        return trajs

    def sft_demos(self) -> list[Trajectory]:
        """The conversations of data.sft as demonstrations (train.conversations)."""
        schemas = self.make_env("sft", "schemas").tool_schemas()  # the dataset env's: none
        return conversation_demos(self.sft_conversations, self.tokenizer, self.cfg.data,
                                  self.cfg.env.max_episode_tokens, schemas,
                                  self.cfg.model.chat_format)

    def expert(self, tasks: Sequence[Task], guess: float, tag: str) -> list[Trajectory]:
        return collect_expert(self.env_cls, tasks, self.tokenizer, guess=guess,
                              limits=self.limits, seed=self.cfg.seed, episode_fn=self.episode_fn,
                              make_env=lambda i: self.make_env(tag, i))

    def save(self, name: str = "final") -> Path:
        out = self.dir / "checkpoints" / name
        with replacing(out) as new:
            self.model.save_pretrained(new, safe_serialization=True)
            self.tokenizer.save_pretrained(new)
        return out

    def close(self) -> None:
        try:  # each closes even when the one before it failed
            self.engine.close()
        finally:
            try:  # drained before the logger closes, so its final counts are logged
                if self.traces is not None:
                    self.log("traces", self.traces.close())
            finally:
                try:
                    self.logger.close()
                finally:
                    try:
                        try:  # the env's server, then the tools' (MCP) servers
                            self.env_cls.stop()
                        finally:
                            self.tools.close()
                    finally:
                        set_unsafe_fallback(False)  # the run's sandbox policy ends with it
                        if self.gateway is not None:
                            self.gateway.close()
