"""Paired comparison of two evaluations on the same tasks (`tiller compare RUN_A RUN_B`).

Two success rates with overlapping 95% intervals do not say "no difference", and two that do
not overlap are a weaker test than the data allow: both runs answered the same tasks, so the
per-task differences are what varies. This module pairs the two evaluations' per-episode
outcomes (eval/<label>.jsonl, written by every evaluation) on task id and reports:

- each run's success rate (per task: mean over its samples and seeds; then over tasks),
- the difference B - A with a paired-bootstrap 95% CI (tasks resampled, both runs together),
- an exact two-sided sign test over tasks: tasks where B did better vs tasks where A did
  better (ties dropped), against Binomial(n, 1/2). With one sample per task this is exactly
  McNemar's exact test on the discordant pairs.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from tiller.errors import ConfigError

# an evaluation label when the run folder holds several: the last stage of the schedule first
LABEL_ORDER = ("checkpoint", "rl", "sft")


def parse_spec(spec: str) -> tuple[Path, str | None]:
    """"RUN_DIR" or "RUN_DIR:LABEL" (e.g. runs/x:sft) -> (folder, label or None)."""
    folder, sep, label = spec.rpartition(":")
    if sep and label and "/" not in label and Path(folder).is_dir():
        return Path(folder), label
    return Path(spec), None


def load_outcomes(spec: str) -> tuple[str, list[dict]]:
    """The rows of one evaluation of a run folder: `spec` names the folder and optionally the
    label (default: the last stage evaluated, `LABEL_ORDER`). Returns (name, rows)."""
    folder, label = parse_spec(spec)
    evals = folder / "eval"
    if not folder.is_dir():
        raise ConfigError(f"run folder {str(folder)!r} does not exist")
    found = sorted(p.stem for p in evals.glob("*.jsonl")) if evals.is_dir() else []
    if not found:
        raise ConfigError(f"run folder {str(folder)!r} has no evaluations (eval/*.jsonl): "
                          "evaluate it with `tiller eval RUN_DIR` first")
    if label is None:
        label = next((x for x in LABEL_ORDER if x in found), None)
        if label is None:
            raise ConfigError(f"run folder {str(folder)!r} holds evaluations {found}: name one "
                              f"as {folder}:LABEL")
    if label not in found:
        raise ConfigError(f"run folder {str(folder)!r} has no evaluation {label!r}; it has: "
                          f"{', '.join(found)}")
    path = evals / f"{label}.jsonl"
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{i}: not JSON: {e}") from e
        if not isinstance(row, dict) or not {"task_id", "set", "success"} <= row.keys():
            raise ConfigError(f"{path}:{i}: not an outcome row (an object with task_id, set "
                              f"and success): {line[:80]}")
        rows.append(row)
    return f"{folder}:{label}", rows


def per_task(rows: list[dict], set_name: str) -> dict[str, float]:
    """Success per task of one set: the mean over its samples and seeds."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["set"] == set_name:
            by_task[r["task_id"]].append(float(r["success"]))
    return {task: float(np.mean(v)) for task, v in by_task.items()}


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided p-value of `wins` vs `losses` under Binomial(wins + losses, 1/2)
    (McNemar's exact test when they are the discordant pairs)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap_ci(diff: np.ndarray, n_boot: int = 10000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean per-task difference, tasks resampled with both runs'
    outcomes on each kept together (the pairing)."""
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(n_boot, diff.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def compare(rows_a: list[dict], rows_b: list[dict], set_name: str = "heldout",
            seed: int = 0) -> dict[str, float]:
    """B vs A on `set_name`, paired on task id. Refuses (ConfigError) when either has no such
    set or the two were evaluated on different task lists."""
    a, b = per_task(rows_a, set_name), per_task(rows_b, set_name)
    for which, got, rows in (("A", a, rows_a), ("B", b, rows_b)):
        if not got:
            sets = sorted({r["set"] for r in rows})
            raise ConfigError(f"run {which} has no eval set {set_name!r} (it has: "
                              f"{', '.join(sets)}); pick one with --set")
    if a.keys() != b.keys():
        shared = len(a.keys() & b.keys())
        raise ConfigError(f"the runs were evaluated on different task lists for set "
                          f"{set_name!r}: {len(a)} and {len(b)} tasks, {shared} shared; a paired "
                          "comparison needs the same tasks (same env, seed, difficulty and "
                          "eval set)")
    tasks = sorted(a)
    xa, xb = np.array([a[t] for t in tasks]), np.array([b[t] for t in tasks])
    diff = xb - xa
    lo, hi = paired_bootstrap_ci(diff, seed=seed)
    wins, losses = int((diff > 0).sum()), int((diff < 0).sum())
    return {"tasks": len(tasks), "success_a": float(xa.mean()), "success_b": float(xb.mean()),
            "diff": float(diff.mean()), "diff_ci_low": lo, "diff_ci_high": hi,
            "b_better": wins, "a_better": losses, "p_value": sign_test(wins, losses)}


def format_success(s: dict) -> str:
    """An evaluation summary's success with its CI: "0.410 [0.352, 0.473]"."""
    return f"{s['success']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"


def format_diff(c: dict) -> str:
    """A `compare` result: "+0.043 [-0.008, +0.094], p=0.14" (B - A, paired CI, p-value)."""
    return (f"{c['diff']:+.3f} [{c['diff_ci_low']:+.3f}, {c['diff_ci_high']:+.3f}], "
            f"p={c['p_value']:.2g}")
