"""Evaluation figures: success rates and pass@k with bootstrap confidence intervals.

Every figure carries its 95% interval and the number of tasks and samples behind it; the
interval resamples tasks (not samples), since tasks are the unit that varies between runs.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiller.algorithms.passk import pass_at_k
from tiller.files import write_file
from tiller.rollout.trajectory import Trajectory, is_success


def bootstrap_ci(
    per_task: Sequence[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `per_task` values."""
    x = np.asarray(per_task, dtype=float)
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def success_summary(
    trajectories: Sequence[Trajectory], seed: int = 0, k: int = 1
) -> dict[str, float]:
    """Mean success = pass@1 (c / n per task, averaged over tasks) with its 95% bootstrap CI,
    and with k > 1 the unbiased pass@k (`pass_at_k`, n >= k samples per task) with its own CI
    under `pass@k`, `pass@k_ci_low`, `pass@k_ci_high`. pass@1 rising while pass@k falls is the
    sign of entropy collapse."""
    by_task: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t in trajectories:  # a task drawn twice is two units (its own n samples each)
        by_task[(t.task_id, t.draw)].append(float(is_success(t)))
    per_task = [float(np.mean(v)) for v in by_task.values()]
    lo, hi = bootstrap_ci(per_task, seed=seed)
    summary = {
        "success": float(np.mean(per_task)) if per_task else float("nan"),
        "ci_low": lo,
        "ci_high": hi,
        "tasks": len(per_task),
        "samples": len(trajectories),
    }
    if k > 1:
        at_k = [pass_at_k(len(v), int(sum(v)), k) for v in by_task.values()]
        lo_k, hi_k = bootstrap_ci(at_k, seed=seed)
        summary.update({f"pass@{k}": float(np.mean(at_k)) if at_k else float("nan"),
                        f"pass@{k}_ci_low": lo_k, f"pass@{k}_ci_high": hi_k})
    return summary


def outcome_rows(trajectories: Sequence[Trajectory], set_name: str, seed: int,
                 difficulty: int) -> list[dict]:
    """One row per episode, what `tiller compare` pairs on: the set, task id, sampling seed,
    sample index, success, the verifier's reward, the status and the set's difficulty."""
    return [{"set": set_name, "task_id": t.task_id, "seed": seed, "sample": t.sample_index,
             "success": is_success(t), "reward": t.reward.value, "status": t.status.value,
             "difficulty": difficulty} for t in trajectories]


def write_outcomes(path: Path, set_name: str, rows: Sequence[dict]) -> None:
    """Put `rows` as the outcomes of `set_name` in the JSONL file at `path`, keeping the rows
    of its other sets (one file per evaluation label holds all its sets). A link there is
    not this run's file: it is neither read nor written through, but replaced."""
    kept = []
    if path.is_file() and not path.is_symlink():
        kept = [r for r in map(json.loads, path.read_text().splitlines())
                if r["set"] != set_name]
    write_file(path, "".join(json.dumps(r) + "\n" for r in [*kept, *rows]))


def success_by_difficulty(tasks: Sequence[Any], trajectories: Sequence[Trajectory],
                          seed: int = 0) -> dict[str, float]:
    """pass@1 of the tasks at each `Task.metadata["difficulty"]` level, with its 95% CI and
    task count, as flat `difficulty/<d>/{success,ci_low,ci_high,tasks}` (a metrics row holds
    scalars only); empty when the tasks carry no difficulty."""
    level = {t.id: t.metadata["difficulty"] for t in tasks if "difficulty" in t.metadata}
    by_level: dict[Any, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        if t.task_id in level:
            by_level[level[t.task_id]].append(t)
    out: dict[str, float] = {}
    for d, trajs in sorted(by_level.items()):
        s = success_summary(trajs, seed=seed)
        out.update({f"difficulty/{d}/{k}": s[k] for k in ("success", "ci_low", "ci_high",
                                                           "tasks")})
    return out
