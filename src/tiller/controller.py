"""The controller: the schedule of a run (gate -> SFT -> eval -> RL -> eval).

It owns nothing inside the boxes: `Run` wires them, the env makes tasks, the agent loop turns
(env, engine) into trajectories, the buffer groups and filters them, `train.shaping` turns them
into a batch, the trainer updates the weights and the engine gets each new version. During RL
the rollout manager (`rollout.manager`) samples under rl.mode: sync, one_step_off or async.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiller.config import Config
from tiller.errors import ConfigError, RunError, require_package
from tiller.files import write_file
from tiller.observe.evaluation import (
    outcome_rows,
    success_by_difficulty,
    success_summary,
    write_outcomes,
)
from tiller.observe.health import EnvErrorTrend, JudgeHackingTrend
from tiller.observe.metrics import progress
from tiller.rollout.collect import rollout_metrics
from tiller.rollout.curriculum import make_curriculum
from tiller.rollout.manager import RolloutManager
from tiller.rollout.protocol import Rollouts
from tiller.rollout.trajectory import Status, Trajectory, is_success
from tiller.run import Run, get_env, heldout_disabled, rl_task_reserve
from tiller.tools.executor import ToolReliabilityError
from tiller.train.algorithms.kl import kl_beta_at
from tiller.train.critic import Critic
from tiller.train.reward_control import RewardControl
from tiller.train.sft import train_sft
from tiller.train.shaping import judge_metrics, judged, rl_batch, train_reward

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


def evaluate(run: Run, tasks: list, label: str, name: str = "heldout",
             difficulty: int | None = None) -> dict[str, float]:
    """Success on one eval set: eval.samples_per_task samples per task under each of eval.seeds,
    pass@1 (= `success`) and, with eval.pass_k > 1, unbiased pass@k, each with a 95%
    bootstrap CI over tasks (the seeds pooled; `success/seed<S>` per seed when there are
    several). Every episode's outcome goes to <run>/eval/<label>.jsonl for `tiller compare`."""
    ev, t0 = run.cfg.eval, time.perf_counter()
    seeds = ev.seeds or [run.cfg.seed]
    # the heldout set keeps the tag (so the sampling seeds) evaluations have always had
    tag = ("eval", label) if name == "heldout" else ("eval", label, name)
    where = label if name == "heldout" else f"{label}, {name}"
    trajs, rows, per_seed, done = [], [], {}, []
    total = len(seeds) * len(tasks) * ev.samples_per_task
    with progress(run.cfg.logging.progress, f"eval ({where})", total) as advance:

        def tick(t: Trajectory) -> None:
            done.append(is_success(t))
            advance(f"success={sum(done) / len(done):.2f}")

        for seed in seeds:
            # with several seeds each names its episodes (their envs' record/replay keys)
            got = run.episodes(tasks, ev.samples_per_task, run.sampling(ev.temperature),
                               tag if len(seeds) == 1 else (*tag, f"seed{seed}"), tick,
                               seed=seed)
            per_seed[f"success/seed{seed}"] = success_summary(got)["success"]
            rows += outcome_rows(got, name, seed, difficulty or run.cfg.env.difficulty)
            trajs += got
    write_outcomes(run.dir / "eval" / f"{label}.jsonl", name, rows)
    phase = f"eval_{label}" if name == "heldout" else f"eval_{label}_{name}"
    if run.traces is not None:  # every eval episode is kept, under its set's phase
        split = {t.id: t.split for t in tasks}
        for t in trajs:
            run.traces.put_episode(t, phase, split[t.task_id], run.trainer.version)
    summary = success_summary(trajs, seed=run.cfg.seed, k=ev.pass_k)
    if len(seeds) > 1:
        summary.update(per_seed, seeds=len(seeds))
    summary.update(success_by_difficulty(tasks, trajs, seed=run.cfg.seed))
    summary["time_s"] = time.perf_counter() - t0
    summary.update(rollout_metrics(trajs))
    summary.update(run.tools.stats(reset=True))
    run.log(phase, summary)
    run.timings[f"{phase}_s"] = summary["time_s"]
    return summary


def evaluate_sets(run: Run, label: str) -> dict[str, dict[str, float]]:
    """`evaluate` on every set of eval.sets (default: heldout alone), by set name."""
    out = {}
    for s in run.cfg.eval.resolved_sets(run.cfg.env.difficulty):
        tasks = run.env_cls.make_tasks(s.split, s.tasks, run.cfg.seed, s.difficulty)
        out[s.name] = evaluate(run, tasks, label, s.name, s.difficulty)
    return out


def rl(run: Run, after_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """`rl.steps` steps of: take a batch from the rollout manager, train on it, push the
    weights. The manager samples under `rl.mode` (sync, one_step_off or async), the tasks
    `rl.curriculum` draws (or `run.rl_tasks()`). `after_step(s)` runs once step s's weights
    are pushed, before the next step's groups start in sync (benchmarks evaluate there)."""
    cfg, alg = run.cfg.rl, run.cfg.rl.algorithm
    run.trainer.set_optimizer(cfg.lr, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps)
    # kl.beta = 0 (or switched off from the start): no reference model exists or runs
    ref = (copy.deepcopy(run.model).to(run.dtype).eval()
           if kl_beta_at(0, alg.kl.beta, alg.kl.off_after) else None)
    critic = (Critic(run.model, alg.critic, run.cfg.model.dropout)
              if alg.critic is not None else None)
    trend = EnvErrorTrend()
    hacking = JudgeHackingTrend(cfg.judge.window, cfg.judge.margin)
    # the manager's reward is the verifier's (plus the gated judge term); the batch's may be
    # the control's (`v`)
    reward = lambda t, v=None: train_reward(t, alg, run.cfg.l_max, run.cfg.l_cache,  # noqa: E731
                                            cfg.judge.weight, v)
    control = RewardControl(cfg.reward_control, cfg.reward_control_value, run.cfg.seed)
    curriculum = make_curriculum(run.cfg, run.env_cls, rl_task_reserve(run.cfg))
    in_flight = "abort" if run.cfg.rollout.partial == "abort_resume" else "continue"
    engine_busy0 = run.engine.stats().get("busy_s")
    t0 = time.perf_counter()
    rollouts = RolloutManager(
        run.cfg, run.engine, run.sampling(run.cfg.sampling.temperature),
        curriculum if curriculum is not None else run.rl_tasks(), episode_fn=run.episode_fn,
        make_env=run.make_env, tokenizer=run.tokenizer, limits=run.limits, reward=reward,
        version=run.trainer.version,
        judge=(lambda task, t: judged(run.judge, task, t)) if run.judge else None,
        on_group=curriculum.record if curriculum is not None else None)
    idle, trainer_s, staleness = 0, 0.0, Counter()
    rl_step = 1  # the step RL is in (1-based): where what is left at the end is traced
    try:
        with progress(run.cfg.logging.progress, f"RL ({alg.preset or alg.advantage}, "
                      f"{cfg.mode})", cfg.steps) as advance:
            for step in range(cfg.steps):
                rl_step = step + 1
                ts = time.perf_counter()
                if kl_beta_at(step, alg.kl.beta, alg.kl.off_after) == 0:
                    ref = None  # the schedule switched the KL off: free the copy
                taken = rollouts.next_batch(step)
                kept = taken.trajectories
                # the episodes that ended since the last step; in async, when none did (the
                # producer stops at the end of the run), the batch's own
                m = {**taken.stats, **rollout_metrics(taken.ended or kept),
                     **trend.update(taken.ended, run.trainer.version),
                     "rollout_tokens": float(sum(t.num_generated for t in taken.ended)),
                     "rollout_s": time.perf_counter() - ts}  # the wait for the batch
                if run.traces is not None:
                    for t in taken.ended:
                        run.traces.put_episode(t, "rl", "train", run.trainer.version, step + 1)
                judge = judge_metrics(taken.ended, cfg.judge.weight)
                if judge:
                    m.update(judge, **hacking.update(judge["judge/mean"], m["success_rate"]))
                idle = 0 if kept else idle + 1
                if not kept and (not m.get("groups_dropped") or idle > cfg.max_idle_steps):
                    raise RunError(f"rl step {step + 1}: nothing to train ({idle} step(s) in a "
                                   f"row): every episode was dropped or filtered (ledger: "
                                   f"{dict(rollouts.ledger)}; rl.max_idle_steps="
                                   f"{cfg.max_idle_steps})")
                if not kept:  # every group was flat: no signal this step, which is not a failure
                    log.warning("rl step %d: every group had equal rewards; nothing to train, "
                                "skipped (%d in a row)", step + 1, idle)
                else:
                    tt = time.perf_counter()
                    stale = [run.trainer.version - min(t.versions) for t in kept]
                    staleness.update(stale)
                    m.update(staleness_metrics(stale))
                    # the control replaces only the value trained on (m keeps the real one)
                    real = [t.reward for t in kept]
                    values = control.apply(real, step)
                    m.update(control.metrics(real, values))
                    batch, stats = rl_batch(kept, torch.tensor(taken.group_index),
                                            [reward(t, v) for t, v in
                                             zip(kept, values, strict=True)],
                                            run.tokenizer.pad_token_id, alg,
                                            cfg.env_error_weight, run.key_steps, run.tokenizer)
                    m.update(stats, **run.trainer.rl_step(batch, cfg, run.cfg.l_max, ref,
                                                          critic, step))
                    m["train_s"] = time.perf_counter() - tt
                    if run.traces is not None:
                        run.traces.put_training(step + 1, kept, batch, run.trainer.last_rl)
                    ts_sync = time.perf_counter()
                    m.update(run.push_weights(in_flight))  # sync/*: bytes, kind, parity
                    m["sync_s"] = time.perf_counter() - ts_sync
                    trainer_s += time.perf_counter() - tt
                m.update(run.tools.stats(reset=True), step_s=time.perf_counter() - ts,
                         version=run.trainer.version, skipped=float(not kept),
                         trainer_busy_frac=trainer_s / (time.perf_counter() - t0))
                # counters as of this step, before the next groups may start (in sync they
                # start only now, so these are exact per step)
                ledger = {k: v for k, v in rollouts.stats().items() if k.startswith("ledger/")}
                m.update(ledger)
                if run.traces is not None:
                    run.traces.put_ledger(step + 1, run.trainer.version,
                                          {k.removeprefix("ledger/"): v for k, v in ledger.items()})
                    m.update(run.traces.stats())
                m.update({f"engine/{k}": v for k, v in run.engine.stats().items()})
                if run.gateway is not None:  # agent.program: calls, splits, rejections so far
                    m.update(run.gateway.stats())
                if curriculum is not None:  # before the next step's draws (sync: exact)
                    m.update(curriculum.metrics())
                if after_step is not None:
                    after_step(step + 1)
                rollouts.weights_live(step + 1, run.trainer.version)
                run.log("rl", m, step + 1)
                advance(f"reward={m['reward_mean']:.2f} success={m['success_rate']:.2f} "
                        f"zero_var={m['zero_variance_group_frac']:.2f}")
        t_end = time.perf_counter()
    except BaseException:
        try:  # the error that stopped RL is the one to report, not a failing wind-down's;
            # the final ledger (what the wind-down counted) is logged all the same
            run.log("rl_summary", ledger_row(wind_down(run, rollouts, rl_step)))
        except Exception as e:
            log.error("rl: winding down the rollouts after the error below failed too: %s: %s",
                      type(e).__name__, e)
        raise
    ledger = wind_down(run, rollouts, rl_step)
    # the wall time includes winding down the episodes still running: their cost is real
    wall = run.timings["rl_s"] = time.perf_counter() - t0
    produced = rollouts.stats()
    summary = {"mode": cfg.mode, "ledger": dict(ledger),
               "env_error_rate_by_version": trend.by_version(), "wall_s": wall,
               "wind_down_s": wall - (t_end - t0),
               "groups_ahead_max": produced["groups_ahead_max"],
               "trainer_busy_frac": trainer_s / wall,
               "rollout_train_ratio": produced["rollout_busy_s"] / max(trainer_s, 1e-9),
               "samples_per_s": ledger["trained"] / wall}
    if engine_busy0 is not None:
        summary["engine_busy_frac"] = (run.engine.stats()["busy_s"] - engine_busy0) / wall
    if staleness:
        summary["staleness_mean"] = (sum(s * n for s, n in staleness.items())
                                     / sum(staleness.values()))
        summary["staleness_max"] = max(staleness)
    unaccounted = ledger_unaccounted(ledger)
    if unaccounted:  # a bug in the accounting itself: say so loudly, keep the run's results
        log.error("rl: %d started trajectories are not in the ledger (%s)", unaccounted,
                  dict(ledger))
        summary["ledger_unaccounted"] = unaccounted
    run.log("rl_summary", {**{k: v for k, v in summary.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)},
                           **ledger_row(ledger)})
    return summary


def wind_down(run: Run, rollouts: Rollouts, rl_step: int) -> Counter[str]:
    """Close the rollouts and trace what the end of RL left, under `rl_step` (the step RL
    ended in): the episodes that ended after the last batch was taken, and `at_end` on those
    it left untrained (the ledger's dropped/in_flight_at_end, dropped/unused_at_end). Returns
    the final ledger; its dropped/cancelled_at_end are the episodes cancelled while running,
    which have no trajectory to trace."""
    ledger = rollouts.close()
    left = rollouts.leftovers()
    if run.traces is not None:
        for t in left.ended:
            run.traces.put_episode(t, "rl", "train", run.trainer.version, rl_step)
        if left.at_end:
            run.traces.put_at_end(rl_step, left.at_end)
    if left.at_end or ledger["dropped/cancelled_at_end"]:
        log.warning("rl: the end of RL left %d finished episodes untrained (traced with "
                    "at_end = 1) and cancelled %d running ones (ledger: %s)", len(left.at_end),
                    ledger["dropped/cancelled_at_end"],
                    {k: v for k, v in ledger.items() if k.endswith("_at_end")})
    return ledger


def ledger_row(ledger: Counter[str]) -> dict[str, float]:
    """The ledger as metrics (`ledger/<bucket>`)."""
    return {f"ledger/{k}": float(v) for k, v in ledger.items()}


def staleness_metrics(stale: list[int]) -> dict[str, float]:
    """The batch's staleness (trainer version - oldest sampling version, per trajectory): mean,
    max and the histogram as `staleness/<s>` = share of trajectories."""
    out = {"staleness_mean": sum(stale) / len(stale), "staleness_max": float(max(stale))}
    for s, n in sorted(Counter(stale).items()):
        out[f"staleness/{s}"] = n / len(stale)
    return out


def ledger_unaccounted(ledger: Counter[str]) -> int:
    """Started trajectories that did not end trained, filtered or dropped (0 unless a bug)."""
    ended = sum(n for k, n in ledger.items()
                if k == "trained" or k.startswith(("filtered/", "dropped/")))
    return ledger["started"] - ended


def train(cfg: Config, output_dir: str | Path | None = None) -> dict[str, Any]:
    """The whole pipeline; returns (and writes) the run summary."""
    t0 = time.perf_counter()
    if cfg.logging.report:  # before any work: a report that cannot be written is one line now
        require_package("matplotlib", "report", "logging.report=true",
                        instead="set logging.report=false")
    run = Run(cfg, output_dir)
    summary: dict[str, Any] = {"run_dir": str(run.dir), "seed": cfg.seed,
                               "runtime": run.runtime}
    try:
        no_eval = heldout_disabled(cfg, run.env_cls)
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
        if cfg.rl.steps > 0:
            summary["rl"] = rl(run)
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
        write_file(run.dir / "summary.json", json.dumps(summary, indent=2))
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
    no_eval = heldout_disabled(cfg, get_env(cfg.env.name).configure(cfg))
    if no_eval:
        raise ConfigError(f"tiller eval has nothing to evaluate: {no_eval}")
    run = Run(cfg, output_dir)
    try:
        sets = evaluate_sets(run, "checkpoint")
    finally:
        run.close()
    summary = {"run_dir": str(run.dir), "model": cfg.model.path, "runtime": run.runtime,
               **sets}
    write_file(run.dir / "summary.json", json.dumps(summary, indent=2))
    return summary
