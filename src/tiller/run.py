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
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiller.checkpoints import (
    ADAPTER_DIR,
    Checkpoint,
    check_steps_free,
    load_weights,
    model_fingerprint,
)
from tiller.config import Config, ModelJudgeConfig, dump_config
from tiller.engine.api import SamplingParams
from tiller.engine.factory import make_engine
from tiller.engine.weight_sync import ShardedSync, WeightSync
from tiller.envs import Env, Task, ToolEnv
from tiller.errors import ConfigError
from tiller.files import hold_run_dir, refuse_links, replacing, write_file
from tiller.gateway.program import ProgramEpisode
from tiller.models import (
    build_env_model,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_model_path,
)
from tiller.observe.metrics import MetricsLogger
from tiller.observe.traces import TraceWriter
from tiller.preflight import check_model, check_run, check_tools, rl_train_tasks
from tiller.resume import cut_run_dir
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits
from tiller.rollout.chat import stop_token_ids
from tiller.rollout.cluster import RayCluster, check_cluster, rank_threads
from tiller.rollout.collect import check_aborted, collect, collect_expert
from tiller.rollout.memory import MemoryPolicy
from tiller.rollout.ray_http import ray_engine
from tiller.rollout.trajectory import Trajectory
from tiller.runtime import set_up_threads
from tiller.tools.sandbox import set_unsafe_fallback
from tiller.tools.stack import ToolStack
from tiller.train.conversations import conversation_demos
from tiller.train.distributed import Leader, Leading, TrainerOptions
from tiller.train.judges import ModelJudge
from tiller.train.lora import Lora, LoraTrainer
from tiller.train.ranks import start_ranks
from tiller.train.trainer import PolicyTrainer

log = logging.getLogger(__name__)


def compute_streams(cfg: Config) -> int:
    """A run's torch compute streams that run at once: the embedded engine's worker, a judge
    model's worker (it scores episodes while others are generated), and the trainer when it
    trains while episodes are sampled (rl.mode one_step_off or async; in sync it waits for
    them). At least 1 (the trainer of an HTTP-engine run)."""
    rollout = (int(cfg.engine.backend == "embedded")
               + int(isinstance(cfg.rl.judge, ModelJudgeConfig)))
    overlaps = cfg.rl.mode != "sync" and cfg.rl.steps > 0
    return max(1, rollout + int(overlaps))


def run_dir_path(cfg: Config, output_dir: str | Path | None) -> Path:
    """The run folder's path: `output_dir`, output_dir or runs/<name>-<time>."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(output_dir or cfg.output_dir or Path("runs") / f"{cfg.name}-{stamp}")


def make_run_dir(cfg: Config, output_dir: str | Path | None) -> Path:
    """The run folder (`run_dir_path`), made, holding the config."""
    out = run_dir_path(cfg, output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "config.yaml", dump_config(cfg), root=out)
    return out


# what a run writes in its folder as it goes: a fresh run refuses a folder holding any
RECORD = ("metrics.jsonl", "traces.sqlite", "summary.json")


def check_new_run_dir(cfg: Config, run_dir: Path) -> None:
    """A run that is not resumed refuses, in one line, a folder holding another run's record
    (its metrics, traces or summary: the new run would append to them, e.g. a run killed before
    its first checkpoint started again in its folder) or, with checkpoint.every > 0, its step
    folders (a later --resume would take theirs)."""
    refuse_links(*(run_dir / name for name in RECORD))  # a link's own one line
    held = [name for name in RECORD if (run_dir / name).exists()]
    if held:
        raise ConfigError(f"run folder {run_dir} already holds a run's {', '.join(held)}: "
                          f"resume that run with `tiller train --resume {run_dir}`, or start "
                          "a new one in another folder (-o)")
    if cfg.checkpoint.every:
        check_steps_free(run_dir, 0, "another run's checkpoints: resume that run with --resume")


def closes(stack: ExitStack, what: str, close: Callable[[], Any]) -> None:
    """Register `close` on `stack`. A failure of it is logged, then raised with the error
    already on its way (the run's, or an earlier close's) as its context, as a `finally`
    block raises: when several fail each is in the log, and the last one raised carries the
    others."""

    def exit_(exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            close()
        except BaseException as e:
            log.error("closing the run's %s failed: %s: %s", what, type(e).__name__, e)
            if e.__context__ is None and e is not exc:
                e.__context__ = exc
            raise
        return False  # the error on its way, if any, goes on

    stack.push(exit_)


class Run:
    """Everything one run needs, built from a validated `Config` once `preflight.check_run`
    passed (hooks named in the config are imported there, so a bad one fails before any
    work). Each part that needs closing is registered as it is opened; `close` closes them in
    reverse order, each even when one before it failed, as does a start that fails."""

    gateway: Any = None  # agent.program's gateway, started once the models are built
    traces: TraceWriter | None = None  # traces.sqlite's writer (observe.traces)
    lora: Lora | None = None  # model.lora: the adapters, the policy and its merged copy
    # model.path's fingerprint (`checkpoints.model_fingerprint`) as loaded, for checkpoints
    base: str | None = None

    def __init__(self, cfg: Config, output_dir: str | Path | None = None,
                 resume: Checkpoint | None = None, hold: bool = False):
        """With `resume` (a checkpoint of this run folder) the policy starts from its weights
        and version, and the engine gets them (checked) before any episode. With `hold` (a
        fresh run of `controller.train`, which holds a resumed run's lock itself) the run
        folder is locked (`files.hold_run_dir`) once the run's checks passed, before it is
        made, until the run closes, and one holding another run's record is refused
        (`check_new_run_dir`)."""
        self.cfg, self.resume = cfg, resume
        checked = check_run(cfg)
        check_cluster(cfg)  # Ray installed, its address answers, CPUs for every actor
        self.env_cls, self.sft_conversations = checked.env_cls, checked.sft_conversations
        self.episode_fn, self.key_steps = checked.episode_fn, checked.key_steps
        self.judge = checked.judge  # rl.judge.model loads with the models
        held = ExitStack()  # the run folder's lock (`hold`)
        with ExitStack() as stack:  # nothing of a run that did not start outlives it
            stack.push(held)
            if hold:
                output_dir = run_dir_path(cfg, output_dir)
                held.enter_context(hold_run_dir(output_dir))
                check_new_run_dir(cfg, output_dir)
            self.dir = make_run_dir(cfg, output_dir)
            random.seed(cfg.seed)
            np.random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            self.limits = EpisodeLimits(
                cfg.env.max_turns, cfg.env.max_episode_tokens, MemoryPolicy(
                    cfg.agent.memory, tool_output_tokens=cfg.agent.tool_output_tokens or 128,
                    reserve_tokens=cfg.sampling.max_new_tokens),
                chat_format=cfg.model.chat_format, history=cfg.agent.history)
            self.timings: dict[str, float] = {}
            self._open(stack, checked.program)
            self._closing = stack.pop_all()
        # the lock outlives `close`: its holder (`controller.train`) gives it up once the
        # run's summary is written (`held` in `_closing` is left empty)
        self.held = held.pop_all()

    def _open(self, stack: ExitStack, program: Callable[..., Any] | None) -> None:
        """The tool stack, the models and trainer, the metrics logger, the trace writer, the
        engine and the gateway, in this order, each registered on `stack` as it opens (a
        resume's cut of the run folder comes just before the sinks open, once everything
        before them started and passed its checks): what
        makes episodes (the engine, the gateway's calls into it) closes before the sinks they
        are written to (traces, metrics)."""
        cfg = self.cfg
        if cfg.cluster.backend == "ray":  # stopped last, after every actor
            self.cluster = RayCluster(cfg, self.dir).start()
            closes(stack, "Ray cluster", self.cluster.close)
        # Before any work: a bad replay path stops the run here, and the sandbox policy holds
        # from the first env on (a code env without bwrap refuses unless it is allowed).
        self.tools = ToolStack(cfg.env.tools, self.dir)
        closes(stack, "tool stack", self.tools.close)
        set_unsafe_fallback(cfg.env.tools.sandbox.allow_unsafe_fallback)
        closes(stack, "sandbox policy", lambda: set_unsafe_fallback(False))  # ends with the run
        check_tools(self.env_cls, self.tools)
        # an env server (openenv), checked before any work; stopped before the tools' servers
        closes(stack, "env server", self.env_cls.stop)
        self.env_cls.start(self.dir)
        self._build_models()
        if isinstance(self.trainer, Leading):
            closes(stack, "trainer ranks", self.trainer.close)
        if self.resume is not None:  # every check passed (the model's too): cut, then append
            cut_run_dir(self.dir, self.resume)
        self.logger = MetricsLogger(self.dir, cfg.logging.tensorboard, cfg.logging.wandb,
                                    cfg.logging.wandb_project, cfg.model_dump())
        closes(stack, "metrics logger", self.logger.close)
        t = cfg.observe.traces
        if t.enabled:  # e.g. an older tiller's traces.sqlite in this folder fails here
            traces = self.traces = TraceWriter(self.dir / "traces.sqlite", t.sample_rate,
                                               t.max_mb, cfg.seed, t.queue_size,
                                               t.close_timeout_s)
            # drained before the logger closes, so its final counts are logged
            closes(stack, "trace writer", lambda: self.log("traces", traces.close()))
        self._start_engine(stack)
        if program is not None:
            from tiller.gateway.server import Gateway  # FastAPI and uvicorn: the serve extra

            self.gateway = Gateway().start()
            closes(stack, "agent gateway", self.gateway.close)
            self.episode_fn = ProgramEpisode(self.gateway, program, cfg.agent.program_timeout_s,
                                             cfg.agent.reward)

    def _build_models(self) -> None:
        """The model and tokenizer, the judge's model and the trainer."""
        cfg = self.cfg
        t0 = time.perf_counter()
        device = resolve_device(cfg.model.device)
        path = Path(cfg.model.path) if cfg.model.path is not None else build_env_model(
            self.env_cls, self.dir / "base_model", cfg.model.build, seed=cfg.seed,
            difficulty=cfg.env.difficulty, max_turns=cfg.env.max_turns,
            tools=[t.schema for t in self.tools.extra], root=self.dir)
        if cfg.model.path is not None and cfg.checkpoint.every:  # before it is read
            self.base = model_fingerprint(resolve_model_path(path))
        self.tokenizer = load_tokenizer(path)
        # fp32 master weights for the optimizer whatever model.dtype is (see PolicyTrainer); the
        # engine's copy (and the reference model) are in model.dtype
        dtype = getattr(torch, cfg.model.dtype)
        self.model = load_model(path, torch.float32).to(device)
        if cfg.model.lora is not None:  # the trainer steps the adapters; self.model is merged
            self.lora = Lora(self.model, cfg.model.lora)
            self.model = self.lora.merged
        if self.resume is not None and self.lora is not None:
            self.lora.load(self.resume.path / ADAPTER_DIR)
        elif self.resume is not None:
            load_weights(self.model, self.resume)
        # before the engine, the trainer or any episode computes: they share these threads
        self.runtime = set_up_threads(cfg.runtime.threads, streams=compute_streams(cfg),
                                      params=sum(p.numel() for p in self.model.parameters()))
        write_file(self.dir / "runtime.json", json.dumps(self.runtime, indent=2), root=self.dir)
        check_model(cfg, self.tokenizer, self.model, self.limits)
        if isinstance(cfg.rl.judge, ModelJudgeConfig):
            self.judge = ModelJudge(cfg.rl.judge.model, cfg.rl.judge.prompt, device=device)
        self.timings["build_s"] = time.perf_counter() - t0
        s = cfg.sampling
        truncated = s.logprobs == "sampled"  # the trainer recomputes what the engine reports
        options = TrainerOptions(temperature=s.temperature or 1.0, compute_dtype=dtype,
                                 top_k=s.top_k if truncated else 0,
                                 top_p=s.top_p if truncated else 1.0, dropout=cfg.model.dropout,
                                 train=cfg.train)
        # train.world_size > 1: the ranks shard a copy; self.model gets its weights each step
        self.trainer = (start_ranks(self.model, cfg.train.world_size, options,
                                    cfg.cluster.backend, cfg.train.rank_timeout_s,
                                    remote=cfg.cluster.address is not None, lora=self.lora,
                                    actor_threads=rank_threads(cfg))
                        if cfg.train.world_size > 1 else
                        LoraTrainer(self.lora, **vars(options)) if self.lora is not None else
                        PolicyTrainer(self.model, **vars(options)))
        if self.resume is not None:  # and the copy weight sync pushes (ranks: the gathered one)
            self.trainer.version = self.trainer.publisher.version = self.resume.state[
                "trainer_version"]

    def _start_engine(self, stack: ExitStack) -> None:
        """The engine, registered on `stack`, and its first weights checked."""
        cfg = self.cfg
        # the servers of engine.backend http or vllm get the trainer's weights (version 0); with
        # Ray the rollout workers' embedded engines are copies of them, or the workers generate
        # on those servers (managed ones each in a Ray actor)
        self.engine = (ray_engine(cfg, self.model, self.tokenizer, self.env_cls,
                                  self.episode_fn, self.limits, self.dir,
                                  self.trainer.weight_update)
                       if cfg.cluster.backend == "ray" else
                       make_engine(cfg, self.model, self.tokenizer.pad_token_id,
                                   run_dir=self.dir, initial=self.trainer.weight_update,
                                   tokenizer=self.tokenizer))
        closes(stack, "engine", self.engine.close)
        dtype = getattr(torch, cfg.model.dtype)
        self.weight_sync = (ShardedSync(self.trainer, self.engine, cfg.weight_sync, dtype)
                            if cfg.weight_sync.shards == "per_rank" else
                            WeightSync(self.trainer.publisher, self.engine, cfg.weight_sync,
                                       dtype))
        # the engine's first weights (a copy, or the servers' start-up push) are checked like
        # every later sync's
        self.weight_sync.check_parity(self.trainer.version)
        if self.resume is not None:  # every engine gets the checkpoint's weights and version
            self.push_weights()

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
        """The train tasks RL samples (`preflight.rl_train_tasks`)."""
        return rl_train_tasks(self.cfg, self.env_cls)

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
        self.full_weights()
        with replacing(out, root=self.dir) as new:
            self.model.save_pretrained(new, safe_serialization=True)  # merged under LoRA
            self.tokenizer.save_pretrained(new)
            if self.lora is not None:
                self.lora.save(new / ADAPTER_DIR)
        return out

    def full_weights(self) -> None:
        """`model` at the trainer's version: with per-rank weight sync the ranks' shards are
        gathered into it now (no step did)."""
        if isinstance(self.trainer, Leader):
            self.trainer.gathered()

    def close(self) -> None:
        """Close every part the run opened, in reverse order: the gateway, the engine, the
        trace writer (its last counts logged), the metrics logger, the sandbox policy, the
        tool stack. Nothing makes episodes once the sinks close. Each closes even when one
        before it failed; each failure is logged and raised (`closes`)."""
        self._closing.close()
