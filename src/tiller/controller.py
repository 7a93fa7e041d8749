"""The controller: the schedule of a run (gate -> SFT -> eval -> RL -> eval).

It owns nothing inside the boxes: `Run` wires them, the env makes tasks, the agent loop turns
(env, engine) into trajectories, the buffer groups and filters them, `train.shaping` turns them
into a batch, the trainer updates the weights and the engine gets each new version. During RL
the rollout manager (`rollout.manager`) samples under rl.mode: sync, one_step_off or async,
a `Learner` shapes and trains each batch and a step recorder (`observe.steps`) records it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiller.algorithms.kl import kl_beta_at
from tiller.checkpoints import Checkpoint, check_run_folder, checkpoint_due
from tiller.config import Config, JudgeConfig
from tiller.errors import ConfigError, RunError
from tiller.files import hold_run_dir, write_file
from tiller.observe.evaluation import (
    outcome_rows,
    success_by_difficulty,
    success_summary,
    write_outcomes,
)
from tiller.observe.health import JudgeHackingTrend
from tiller.observe.metrics import progress
from tiller.observe.steps import StepRecorder
from tiller.preflight import check_evaluable, check_report, heldout_disabled, rl_task_reserve
from tiller.resume import restore_rl, save_rl, say_resumed, start_resume
from tiller.rollout.collect import rollout_metrics
from tiller.rollout.curriculum import Curriculum, make_curriculum
from tiller.rollout.manager import RolloutManager
from tiller.rollout.protocol import Rollouts, Taken
from tiller.rollout.ray_rollouts import RayRollouts, RayWorkers
from tiller.rollout.resume import resumed_tasks
from tiller.rollout.trajectory import Status, Trajectory, is_success
from tiller.run import Run
from tiller.tools.executor import ToolReliabilityError
from tiller.tools.stack import merged_stats
from tiller.train.batch import Batch
from tiller.train.process_state import pause
from tiller.train.reward_control import RewardControl
from tiller.train.sft import train_sft
from tiller.train.shaping import KeyStepFn, judged, rl_batch, train_reward
from tiller.train.trainer import PolicyTrainer

log = logging.getLogger(__name__)


def gate(run: Run) -> dict[str, float]:
    """The tool reliability gate: the expert's (valid) calls on a few train tasks must succeed
    at least `gate.threshold` of the time, per tool, or training does not start."""
    gate, replay = run.cfg.env.tools.gate, run.cfg.env.tools.replay
    if not gate.enabled or (replay is not None and replay.mode == "replay"):
        return {}  # replaying: the live tools are not used at all
    if not run.env_cls.has_expert:  # the probe is the expert's calls
        log.info("tool gate skipped: env %s has no scripted expert to probe the tools with",
                 run.cfg.env.name)
        return {}
    run.expert(run.tasks("train", gate.probe_tasks, 4), guess=0.0, tag="gate")
    report = run.tools.probe_report()
    run.tools.stats(reset=True)
    try:
        report.check(gate.override)
    except ToolReliabilityError as e:
        raise ConfigError(f"{e} (set env.tools.gate.override=true to train anyway)") from e
    rates = {f"gate_ok_rate/{name}": rate for name, rate in report.rates().items()}
    run.log("gate", rates)
    return rates


def sft(run: Run) -> dict[str, Any]:
    cfg, t0 = run.cfg.sft, time.perf_counter()
    if run.cfg.data.sft is not None:  # the user's conversations: every one is kept
        demos = run.sft_demos()
    else:
        demos = run.expert(run.tasks("train", cfg.tasks, 2, cfg.difficulty),
                           cfg.imperfect_fraction, "sft")
        run.log("sft_demos", run.tools.stats(reset=True))
        demos = [d for d in demos if d.status is Status.COMPLETED]
    total = cfg.epochs * -(-len(demos) // cfg.batch_size)
    with progress(run.cfg.logging.progress, "SFT", total) as advance:

        def on_step(step: int, m: dict[str, float]) -> None:
            run.log("sft", m, step)
            advance(f"loss={m['sft_loss']:.3f}")

        steps = train_sft(run.trainer, demos, cfg, run.tokenizer.pad_token_id, run.cfg.seed,
                          on_step)
    run.push_weights()
    run.timings["sft_s"] = time.perf_counter() - t0
    out: dict[str, Any] = {"demonstrations": len(demos), "steps": steps}
    if run.cfg.data.sft is None:  # conversations carry no reward
        out["expert_success"] = float(np.mean([is_success(d) for d in demos]))
    return out


@dataclass(frozen=True)
class EvalNames:
    """How one evaluation is named: the set `name` at `label` (sft, rl, checkpoint, a
    benchmark's step). The heldout set keeps the names evaluations have always had (so its
    episodes' tags, and with them their sampling seeds, and its metric names stay); any other
    set adds its name to each."""

    label: str
    name: str = "heldout"

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.label,) if self.name == "heldout" else (self.label, self.name)

    @property
    def tag(self) -> tuple[str, ...]:
        """The episodes' tag: their record/replay keys and sampling seeds derive from it."""
        return ("eval", *self.parts)

    @property
    def phase(self) -> str:
        """The metrics' and traces' phase."""
        return "_".join(("eval", *self.parts))


def evaluate(run: Run, tasks: list, label: str, name: str = "heldout",
             difficulty: int | None = None) -> dict[str, float]:
    """Success on one eval set: eval.samples_per_task samples per task under each of eval.seeds,
    pass@1 (= `success`) and, with eval.pass_k > 1, unbiased pass@k, each with a 95%
    bootstrap CI over tasks (the seeds pooled; `success/seed<S>` per seed when there are
    several). Every episode's outcome goes to <run>/eval/<label>.jsonl for `tiller compare`."""
    ev, t0, names = run.cfg.eval, time.perf_counter(), EvalNames(label, name)
    seeds = ev.seeds or [run.cfg.seed]
    trajs, rows, per_seed, done = [], [], {}, []
    total = len(seeds) * len(tasks) * ev.samples_per_task
    with progress(run.cfg.logging.progress, f"eval ({', '.join(names.parts)})",
                  total) as advance:

        def tick(t: Trajectory) -> None:
            done.append(is_success(t))
            advance(f"success={sum(done) / len(done):.2f}")

        for seed in seeds:
            # with several seeds each names its episodes (their envs' record/replay keys)
            got = run.episodes(tasks, ev.samples_per_task, run.sampling(ev.temperature),
                               names.tag if len(seeds) == 1 else (*names.tag, f"seed{seed}"),
                               tick, seed=seed)
            per_seed[f"success/seed{seed}"] = success_summary(got)["success"]
            rows += outcome_rows(got, name, seed, difficulty or run.cfg.env.difficulty)
            trajs += got
    write_outcomes(run.dir / "eval" / f"{label}.jsonl", name, rows, root=run.dir)
    if run.traces is not None:  # every eval episode is kept, under its set's phase
        split = {t.id: t.split for t in tasks}
        for t in trajs:
            run.traces.put_episode(t, names.phase, split[t.task_id], run.trainer.version)
    summary = success_summary(trajs, seed=run.cfg.seed, k=ev.pass_k)
    if len(seeds) > 1:
        summary.update(per_seed, seeds=len(seeds))
    summary.update(success_by_difficulty(tasks, trajs, seed=run.cfg.seed))
    summary["time_s"] = time.perf_counter() - t0
    summary.update(rollout_metrics(trajs))
    summary.update(run.tools.stats(reset=True))
    run.log(names.phase, summary)
    run.timings[f"{names.phase}_s"] = summary["time_s"]
    return summary


def evaluate_sets(run: Run, label: str) -> dict[str, dict[str, float]]:
    """`evaluate` on every set of eval.sets (default: heldout alone), by set name."""
    out = {}
    for s in run.cfg.eval.resolved_sets(run.cfg.env.difficulty):
        tasks = run.env_cls.make_tasks(s.split, s.tasks, run.cfg.seed, s.difficulty)
        out[s.name] = evaluate(run, tasks, label, s.name, s.difficulty)
    return out


def rl(run: Run, after_step: Callable[[int], None] | None = None,
       summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """`rl.steps` steps of: take a batch from the rollout manager (sampled under `rl.mode`,
    of the tasks `rl.curriculum` draws or `run.rl_tasks()`), shape it, train on it, push the
    weights, record the step. `after_step(s)` runs once step s's weights are pushed, before
    the next step's groups start in sync (benchmarks evaluate there). A resumable
    checkpoint (with `summary`, the run's so far) is written where `checkpoint_due`."""
    cfg, alg = run.cfg.rl, run.cfg.rl.algorithm
    learner, record, rollouts, idle, start, curriculum = rl_parts(run)
    in_flight = "abort" if run.cfg.rollout.partial == "abort_resume" else "continue"
    with record.running(rollouts, f"RL ({alg.preset or alg.advantage}, {cfg.mode})",
                        cfg.steps, run.cfg.logging.progress):
        for step in range(start, cfg.steps):
            record.begin(step)
            taken = record.taken(rollouts.next_batch(step))
            if idle.trainable(step, taken):
                batch, shaping = learner.shape(taken, step)
                record.trained(batch, shaping, learner.train(batch, step))
                record.pushed(run.push_weights(in_flight))
            record.end(rollouts)
            if after_step is not None:
                after_step(step + 1)
            record.log()
            if checkpoint_due(run.cfg, step + 1):
                save_rl(run, learner, rollouts, record, step + 1, summary or {}, idle.count,
                        curriculum)
            rollouts.weights_live(step + 1, run.trainer.version)
    done = record.finish(rollouts, cfg.mode)
    run.timings["rl_s"] = done["wall_s"]
    return done


def rl_parts(run: Run) -> tuple[Learner, StepRecorder, Rollouts, IdleSteps, int,
                                Curriculum | None]:
    """RL's learner, step recorder, rollouts and idle-step count, the step it starts at (0,
    or a resumed run's checkpoint's, its state put back once everything built drew its
    random numbers) and the curriculum (None when rl.curriculum is off)."""
    learner = Learner(run.cfg, run.trainer, run.tokenizer, run.key_steps)
    curriculum = make_curriculum(run.cfg, run.env_cls, rl_task_reserve(run.cfg))
    record = step_recorder(run, curriculum)
    start = (restore_rl(run.resume, learner, record, curriculum) if run.resume is not None
             else 0)
    rollouts = rl_rollouts(run, learner.reward, curriculum)
    idle = IdleSteps(run.cfg.rl.max_idle_steps, rollouts,
                     run.resume.state["idle_steps"] if run.resume is not None else 0)
    return learner, record, rollouts, idle, start, curriculum


class Learner:
    """The trainer's side of an RL step: the optimizer, the reference model (only while the
    KL term is on), the critic, the reward control, and the shaping of a batch into tensors."""

    def __init__(self, cfg: Config, trainer: PolicyTrainer, tokenizer: Any,
                 key_steps: KeyStepFn | None):
        self.cfg, self.alg = cfg, cfg.rl.algorithm
        self.trainer, self.tokenizer, self.key_steps = trainer, tokenizer, key_steps
        rl_cfg, kl = cfg.rl, self.alg.kl
        trainer.set_optimizer(rl_cfg.lr, rl_cfg.weight_decay, rl_cfg.adam_betas, rl_cfg.adam_eps)
        # kl.beta = 0 (or switched off from the start): no reference model exists or runs;
        # the reference is the policy now, at RL start (after SFT): a copy, or under
        # model.lora the policy with a frozen copy of its adapter (no copy of the base); on
        # trainer ranks every rank makes its own (`PolicyTrainer.reference`)
        self.ref = trainer.reference() if kl_beta_at(0, kl.beta, kl.off_after) else None
        # the critic starts from the policy's plain weights (the merged ones under LoRA: frozen
        # there, the critic's own copy trains all of its tensors)
        self.critic = (trainer.new_critic(self.alg.critic) if self.alg.critic is not None
                       else None)
        self.control = RewardControl(rl_cfg.reward_control, rl_cfg.reward_control_value,
                                     cfg.seed)

    def drop_reference(self) -> None:
        """The KL term is off for good: the reference model (or adapter) is freed."""
        if self.ref is not None:
            self.ref = None
            self.trainer.drop_reference()

    def reward(self, t: Trajectory, value: float | None = None) -> float:
        """The reward trained on: the verifier's plus the gated judge term (the rollout
        manager's), or with `value` the reward control's in the verifier's place."""
        return train_reward(t, self.alg, self.cfg.l_max, self.cfg.l_cache,
                            judge_weight(self.cfg), value)

    def shape(self, taken: Taken, step: int) -> tuple[Batch, dict[str, float]]:
        """The batch's tensors (rewards, advantages, masks, weights) and the shaping's
        metrics. The reward control replaces only the value trained on: the metrics keep the
        real one."""
        kept = taken.trajectories
        real = [t.reward for t in kept]
        values = self.control.apply(real, step)
        batch, stats = rl_batch(kept, torch.tensor(taken.group_index),
                                [self.reward(t, v) for t, v in zip(kept, values, strict=True)],
                                self.tokenizer.pad_token_id, self.alg,
                                self.cfg.rl.env_error_weight, self.key_steps, self.tokenizer)
        return batch, {**self.control.metrics(real, values), **stats}

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        """One optimizer step on `batch`; its metrics. First the test hook's "train" phase
        (tests/test_resume.py: a kill inside a train step)."""
        pause("train")
        if kl_beta_at(step, self.alg.kl.beta, self.alg.kl.off_after) == 0:
            self.drop_reference()  # the schedule switched the KL off: free the copy
        return self.trainer.rl_step(batch, self.cfg.rl, self.cfg.l_max, self.ref, self.critic,
                                    step)


class IdleSteps:
    """Steps in a row with nothing to train. A step whose every group was flat (equal
    rewards: no signal) is skipped with a warning, which is not a failure, until more than
    rl.max_idle_steps come in a row; a step left with nothing otherwise (every episode
    dropped or filtered) fails the run. `count`: the idle steps in a row so far (a resumed
    run's checkpoint's)."""

    def __init__(self, limit: int, rollouts: Rollouts, count: int = 0):
        self.limit, self.rollouts, self.count = limit, rollouts, count

    def trainable(self, step: int, taken: Taken) -> bool:
        if taken.trajectories:
            self.count = 0
            return True
        self.count += 1
        if not taken.stats.get("groups_dropped") or self.count > self.limit:
            raise RunError(f"rl step {step + 1}: nothing to train ({self.count} step(s) in a "
                           f"row): every episode was dropped or filtered (ledger: "
                           f"{dict(self.rollouts.ledger)}; rl.max_idle_steps={self.limit})")
        log.warning("rl step %d: every group had equal rewards; nothing to train, skipped "
                    "(%d in a row)", step + 1, self.count)
        return False


def step_recorder(run: Run, curriculum: Curriculum | None) -> StepRecorder:
    """The recorder of RL's steps, over the run's metrics, traces and counters."""
    others = [run.gateway.stats] if run.gateway is not None else []  # agent.program's calls
    if curriculum is not None:  # before the next step's draws (sync: exact)
        others.append(curriculum.metrics)
    judge = run.cfg.rl.judge
    hacking = (JudgeHackingTrend(judge.window, judge.margin) if isinstance(judge, JudgeConfig)
               else None)
    def tools() -> dict[str, float]:
        """The run's tool counters (evaluation's episodes, and RL's with cluster.backend
        local), with ray plus the rollout workers' (RL's episodes): reset every step."""
        own = run.tools.stats(reset=True)
        if not isinstance(run.engine, RayWorkers):
            return own
        return merged_stats([own, *run.engine.tool_stats()])

    return StepRecorder(run.log, run.traces, run.trainer,
                        tools=tools, engine=run.engine.stats,
                        others=others, judge_weight=judge_weight(run.cfg), hacking=hacking)


def judge_weight(cfg: Config) -> float:
    """rl.judge.weight, 0 without a judge."""
    return cfg.rl.judge.weight if isinstance(cfg.rl.judge, JudgeConfig) else 0.0


def rl_rollouts(run: Run, reward: Callable[[Trajectory], float],
                curriculum: Curriculum | None) -> RolloutManager:
    """RL's rollout manager: the curriculum's tasks (or `run.rl_tasks()`), each episode's
    reward the manager's `reward` (plus rl.judge.fn's score when there is one); with
    cluster.backend ray its episodes run in the rollout workers."""
    manager = RayRollouts if run.cfg.cluster.backend == "ray" else RolloutManager
    tasks = curriculum if curriculum is not None else run.rl_tasks()
    if run.resume is not None:  # the open groups' tasks, then where the checkpoint left off
        tasks = resumed_tasks(tasks, run.resume.state["manager"],
                              restored=curriculum is not None)
    return manager(
        run.cfg, run.engine, run.sampling(run.cfg.sampling.temperature), tasks,
        episode_fn=run.episode_fn, make_env=run.make_env, tokenizer=run.tokenizer,
        limits=run.limits, reward=reward,
        version=run.trainer.version,
        judge=(lambda task, t: judged(run.judge, task, t)) if run.judge else None,
        on_group=curriculum.record if curriculum is not None else None,
        resume=run.resume.state["manager"] if run.resume is not None else None)


def before_rl(run: Run, summary: dict[str, Any], no_eval: str | None) -> None:
    """The tool gate, SFT and the evaluation after it, into `summary`."""
    cfg = run.cfg
    if no_eval:  # said once, here and in the summary: never a silent zero
        log.warning("held-out evaluation is off: %s", no_eval)
        summary.update(heldout="disabled", eval_disabled=no_eval)
    summary["tool_gate"] = gate(run)
    if cfg.sft.enabled:
        summary["sft"] = sft(run)
        summary["sft"]["checkpoint"] = str(run.save("sft"))
    if not no_eval:
        for name, result in evaluate_sets(run, "sft").items():
            summary[f"{name}_after_sft"] = result


def train(cfg: Config, output_dir: str | Path | None = None,
          resume: str | Path | None = None) -> dict[str, Any]:
    """The whole pipeline; returns (and writes) the run summary. With `resume` (a run
    folder) the run goes on from the folder's newest complete checkpoint, in that folder.
    The run folder is locked for the run's life, its summary and report included
    (`files.hold_run_dir`; a resumed run's before its checks, a fresh run's by `Run` once the
    run's own checks passed, before the folder is made): a second process in it is refused in
    one line."""
    t0 = time.perf_counter()
    check_report(cfg)  # before any work
    if resume is None:
        return _train(cfg, output_dir, None, t0)
    check_run_folder(Path(resume))  # a run folder: the lock file is made in no other
    with hold_run_dir(resume):
        return _train(cfg, resume, start_resume(cfg, Path(resume)), t0)


def _train(cfg: Config, run_dir: str | Path | None,
           resumed: tuple[Checkpoint, list[str]] | None, t0: float) -> dict[str, Any]:
    """`train` in `run_dir` (a fresh run's: None for runs/<name>-<time>), a resume's lock held
    and its checkpoint and safe config changes (`start_resume`) given."""
    ckpt, changes = resumed or (None, [])
    run = Run(cfg, run_dir, resume=ckpt, hold=ckpt is None)
    with run.held:  # a fresh run's lock, given up once its summary and report are written
        return _pipeline(cfg, run, ckpt, changes, t0)


def _pipeline(cfg: Config, run: Run, ckpt: Checkpoint | None, changes: list[str],
              t0: float) -> dict[str, Any]:
    """`_train`'s run from its start (or its checkpoint) to its summary and report."""
    if ckpt is not None:
        say_resumed(ckpt, changes, run.dir)
    summary: dict[str, Any] = {"run_dir": str(run.dir), "seed": cfg.seed,
                               "runtime": run.runtime}
    try:
        no_eval = heldout_disabled(cfg, run.env_cls)
        if ckpt is None:
            before_rl(run, summary, no_eval)
        else:  # the gate, SFT and its evaluation were done before the checkpoint
            summary.update({k: v for k, v in ckpt.state["summary"].items() if k not in summary},
                           resumed_from=ckpt.path.name)
            # each resume of the run, in order (a checkpoint's summary holds the ones before)
            summary["resumes"] = [*summary.get("resumes", []), {
                "from": ckpt.path.name, "step": ckpt.step, "config_changes": changes}]
        if cfg.rl.steps > 0:
            summary["rl"] = rl(run, summary=summary)
            if not no_eval:
                for name, result in evaluate_sets(run, "rl").items():
                    summary[f"{name}_after_rl"] = result
        summary["checkpoint"] = str(run.save())
    except BaseException:
        run.close()
        if cfg.logging.report:  # what happened up to the error is worth a picture too
            log.error("report of the failed run: %s", report_uri(run.dir))
        raise
    try:
        run.close()
    finally:  # a close that fails (the trace writer's last rows) still leaves the run's result
        run.timings["total_s"] = time.perf_counter() - t0
        summary["timings"] = run.timings
        write_file(run.dir / "summary.json", json.dumps(summary, indent=2), root=run.dir)
    if cfg.logging.report:
        summary["report"] = report_uri(run.dir)
    return summary


def report_uri(run_dir: Path) -> str:
    """Write the run's report.html and return its file:// address (or, when writing it fails,
    say so: the run's own result stands either way)."""
    from tiller.observe.report import write_report

    try:
        return write_report(run_dir).resolve().as_uri()
    except Exception as e:  # the report is a view of the run: its failure is logged, not raised
        log.error("writing %s/report.html failed: %s: %s", run_dir, type(e).__name__, e)
        return f"(not written: {type(e).__name__}: {e})"


def evaluate_checkpoint(cfg: Config, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Success of the model at `model.path` on every eval set, by set name."""
    check_evaluable(cfg)
    run = Run(cfg, output_dir)
    try:
        sets = evaluate_sets(run, "checkpoint")
    finally:
        run.close()
    summary = {"run_dir": str(run.dir), "model": cfg.model.path, "runtime": run.runtime,
               **sets}
    write_file(run.dir / "summary.json", json.dumps(summary, indent=2), root=run.dir)
    return summary
