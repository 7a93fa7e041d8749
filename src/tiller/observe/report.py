"""The run report: one self-contained HTML file, `RUN_DIR/report.html`, with every plot a PNG
embedded as base64 (nothing is fetched when it opens), built from `metrics.jsonl` and, when
the run finished, `summary.json` (docs/viewer.md says how to read each plot).

Each section is one function from the run's records to HTML. A section whose data the run does
not have (staleness in a sync run, difficulty in an env whose tasks carry none, a run that
stopped before RL) says so in one line instead of drawing an empty plot.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiller.errors import RunFolderError, require_package
from tiller.files import write_file

# the section titles, in order (the report's <h2>s; tests check they are all there)
SECTIONS = ("Held-out success", "RL learning curve", "Success by difficulty",
            "Tool calls and tool errors", "env_error rate", "Logprob mismatch", "Staleness",
            "Rollout and training time", "Ledger")
PHASE_LABELS = {"eval_sft": "after SFT", "eval_rl": "after RL", "eval_checkpoint": "checkpoint"}


@dataclass
class RunRecords:
    """What a run folder holds for the report: metrics.jsonl's records by phase, summary.json
    (None while the run is going or when it stopped with an error) and the config."""

    dir: Path
    phases: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def rl(self) -> list[dict[str, Any]]:
        return self.phases.get("rl", [])

    def evals(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, last record) of each held-out evaluation, in run order."""
        return [(PHASE_LABELS.get(p, p.removeprefix("eval_")), rows[-1])
                for p, rows in self.phases.items() if p.startswith("eval_")]


def load_run(run_dir: str | Path) -> RunRecords:
    """Read a run folder (also one a training is still writing); a missing folder or
    metrics.jsonl, or a malformed line, is one RunFolderError naming the file (and the line)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise RunFolderError(f"{run_dir} is not a run folder: it has no metrics.jsonl")
    records = RunRecords(run_dir)
    # a line without its newline is being written by a running training: not read yet
    lines = metrics.read_text().split("\n")[:-1]
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            phase = row["phase"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RunFolderError(f"{metrics}:{n}: not a metrics record ({type(e).__name__}: "
                                 f"{e}): {line[:80]!r}") from e
        records.phases.setdefault(phase, []).append(row)
    for name, attr, parse in (("summary.json", "summary", json.loads),
                              ("config.yaml", "config", yaml.safe_load)):
        path = run_dir / name
        if path.is_file():
            try:
                setattr(records, attr, parse(path.read_text()))
            except (json.JSONDecodeError, yaml.YAMLError) as e:
                raise RunFolderError(f"{path}: cannot be parsed: {e}") from e
    return records


# ---------------------------------------------------------------------- plotting helpers


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def _figure(ncols: int = 1) -> tuple[Any, Any]:
    # Figure, not pyplot: no global state, no GUI backend (the Agg canvas is the default)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * ncols, 3.4))
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, axes


def _column(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    """`key` of every row, NaN where a row lacks it (a skipped step has no train metrics)."""
    return [float(r[key]) if isinstance(r.get(key), (int, float)) else math.nan for r in rows]


def _has(rows: Sequence[dict[str, Any]], key: str) -> bool:
    return any(not math.isnan(v) for v in _column(rows, key))


def _curves(rows: Sequence[dict[str, Any]], keys: Sequence[str], ylabel: str,
            log_y: bool = False) -> str:
    """One line per key over the RL steps (keys the run never logged are left out)."""
    fig, (ax,) = _figure()
    steps = _column(rows, "phase_step")
    for key in keys:
        if _has(rows, key):
            ax.plot(steps, _column(rows, key), marker="o", markersize=3, label=key)
    values = [v for k in keys for v in _column(rows, k) if not math.isnan(v)]
    if log_y and values and min(values) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _png(fig)


# control characters (newlines too) and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _text(value: Any) -> str:
    """`value` as HTML text: markup escaped, and every control character shown as its
    backslash escape (a newline as \\n), so a config or metric string from the run folder
    never puts a raw line of its own into the file."""
    return _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode(),
                        html.escape(str(value)))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else _text(v)

    head = "".join(f"<th>{_text(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _note(text: str) -> str:
    return f'<p class="note">{_text(text)}</p>'


def _no_rl(run: RunRecords) -> str | None:
    return None if run.rl else _note("No RL step was logged (rl.steps=0, or the run stopped "
                                     "before its first step).")


# ---------------------------------------------------------------------- the sections


def heldout_section(run: RunRecords) -> str:
    evals = run.evals()
    if not evals:
        return _note("No held-out evaluation was logged.")
    fig, (ax,) = _figure()
    labels = [label for label, _ in evals]
    success = [r["success"] for _, r in evals]
    err = [[r["success"] - r["ci_low"] for _, r in evals],
           [r["ci_high"] - r["success"] for _, r in evals]]
    ax.bar(labels, success, yerr=err, capsize=6, color="#4c78a8")
    for i, s in enumerate(success):
        ax.annotate(f"{s:.3f}", (i, s), textcoords="offset points", xytext=(12, 4), fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("pass@1 (95% bootstrap CI over tasks)")
    rows = []
    for label, r in evals:
        extra = "; ".join(f"{k} {r[k]:.3f} [{r[k + '_ci_low']:.3f}, {r[k + '_ci_high']:.3f}]"
                          for k in r if k.startswith("pass@") and "_ci_" not in k)
        rows.append((label, r["success"], f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
                     r["tasks"], r["samples"], extra or "-"))
    return _png(fig) + _table(("phase", "pass@1", "95% CI", "tasks", "samples", "pass@k"), rows)


def learning_curve_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    fig, (ax, ax_len) = _figure(2)
    steps = _column(run.rl, "phase_step")
    for key in ("reward_mean", "success_rate"):
        ax.plot(steps, _column(run.rl, key), marker="o", markersize=3, label=f"{key} (train)")
    # held-out success before and after RL at the ends of the curve, with their intervals
    for label, r in run.evals():
        x = {"after SFT": 0, "after RL": steps[-1]}.get(label)
        if x is not None:
            ax.errorbar([x], [r["success"]], yerr=[[r["success"] - r["ci_low"]],
                                                  [r["ci_high"] - r["success"]]],
                        fmt="s", capsize=5, label=f"held-out {label}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / success")
    ax.legend(fontsize=8)
    for key in ("response_tokens_mean", "episode_tokens_mean"):
        ax_len.plot(steps, _column(run.rl, key), marker="o", markersize=3, label=key)
    ax_len.set_xlabel("RL step")
    ax_len.set_ylabel("tokens per episode")
    ax_len.legend(fontsize=8)
    return _png(fig)


def _levels(record: dict[str, Any]) -> set[int]:
    return {int(k.split("/")[1]) for k in record
            if k.startswith("difficulty/") and k.endswith("/success")}


def difficulty_section(run: RunRecords) -> str:
    evals = [(label, r) for label, r in run.evals() if _levels(r)]
    levels = sorted(set().union(*(_levels(r) for _, r in evals)))
    if not levels:
        return _note("The held-out tasks carry no per-task difficulty "
                     "(Task.metadata['difficulty']), so success is not split by it.")
    fig, (ax,) = _figure()
    width = 0.8 / len(evals)
    for i, (label, r) in enumerate(evals):
        xs = [d + (i - (len(evals) - 1) / 2) * width for d in levels]
        s = [r.get(f"difficulty/{d}/success", math.nan) for d in levels]
        lo = [v - r.get(f"difficulty/{d}/ci_low", v) for d, v in zip(levels, s, strict=True)]
        hi = [r.get(f"difficulty/{d}/ci_high", v) - v for d, v in zip(levels, s, strict=True)]
        ax.bar(xs, s, width=width, yerr=[lo, hi], capsize=4, label=label)
    ax.set_xticks(levels)
    ax.set_xlabel("task difficulty")
    ax.set_ylabel("held-out pass@1 (95% CI)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    tasks = [(d, *(r.get(f"difficulty/{d}/tasks", "-") for _, r in evals)) for d in levels]
    return _png(fig) + _table(("difficulty", *(f"tasks ({label})" for label, _ in evals)),
                              tasks)


def tools_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    return _curves(run.rl, ("tool_calls_per_episode", "tool_errors_per_episode"),
                   "per episode") + _curves(run.rl, ("tool_parse_failures",),
                                            "unparsable tool calls per step")


def env_error_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    fig, (ax,) = _figure()
    steps, rate = _column(run.rl, "phase_step"), _column(run.rl, "env_error_rate")
    ax.plot(steps, rate, marker="o", markersize=3, label="env_error_rate")
    rising = [(s, r) for s, r, flag in zip(steps, rate, _column(run.rl, "env_error_rising"),
                                               strict=True) if flag == 1]
    if rising:
        ax.scatter([s for s, _ in rising], [r for _, r in rising], color="red", marker="x",
                   s=60, label="env_error_rising")
    ax.set_xlabel("RL step")
    ax.set_ylabel("share of episodes")
    ax.legend(fontsize=8)
    return _png(fig)


def mismatch_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    if not _has(run.rl, "logp_mismatch_mean"):
        return _note("No step trained, so no logprob mismatch was measured.")
    return _curves(run.rl, ("logp_mismatch_mean", "logp_mismatch_max"),
                   "|logp rollout - logp trainer|", log_y=True)


def _mode(run: RunRecords) -> str:
    return ((run.summary or {}).get("rl", {}).get("mode")
            or run.config.get("rl", {}).get("mode", "sync"))


def staleness_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    if _mode(run) == "sync":
        return _note("A sync run (rl.mode=sync): every batch is trained by the weights that "
                     "sampled it, so staleness is 0 throughout.")
    fig, (ax, ax_hist) = _figure(2)
    steps = _column(run.rl, "phase_step")
    for key in ("staleness_mean", "staleness_max"):
        ax.plot(steps, _column(run.rl, key), marker="o", markersize=3, label=key)
    ax.set_xlabel("RL step")
    ax.set_ylabel("weight versions behind")
    ax.legend(fontsize=8)
    hist: dict[int, float] = {}
    for r in run.rl:
        for k, v in r.items():
            if k.startswith("staleness/"):
                hist[int(k.split("/")[1])] = hist.get(int(k.split("/")[1]), 0.0) + v
    total = sum(hist.values()) or 1.0
    ax_hist.bar(list(hist), [v / total for v in hist.values()], color="#f58518")
    ax_hist.set_xticks(sorted(hist))
    ax_hist.set_xlabel("staleness (versions)")
    ax_hist.set_ylabel("share of trained trajectories")
    return _png(fig)


def timing_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    fig, (ax, ax_frac) = _figure(2)
    steps = _column(run.rl, "phase_step")
    bottom = [0.0] * len(steps)
    for key in ("rollout_s", "train_s", "sync_s"):
        values = [0.0 if math.isnan(v) else v for v in _column(run.rl, key)]
        ax.bar(steps, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("RL step")
    ax.set_ylabel("seconds (stacked)")
    ax.legend(fontsize=8)
    for key in ("trainer_busy_frac",):
        ax_frac.plot(steps, _column(run.rl, key), marker="o", markersize=3, label=key)
    ax_frac.set_ylim(0, 1.05)
    ax_frac.set_xlabel("RL step")
    ax_frac.set_ylabel("share of RL wall time so far")
    ax_frac.legend(fontsize=8)
    rl = (run.summary or {}).get("rl", {})
    keys = ("rollout_train_ratio", "trainer_busy_frac", "engine_busy_frac", "samples_per_s",
            "wall_s", "wind_down_s")
    rows = [(k, rl[k]) for k in keys if k in rl]
    return _png(fig) + (_table(("whole RL phase", "value"), rows) if rows else _note(
        "summary.json has no RL totals (the run did not finish)."))


def ledger_section(run: RunRecords) -> str:
    if (missing := _no_rl(run)) is not None:
        return missing
    final = (run.summary or {}).get("rl", {}).get("ledger") or {
        k.removeprefix("ledger/"): v for k, v in run.rl[-1].items() if k.startswith("ledger/")}
    counts = sorted(k for k in final if not k.startswith("tokens/"))
    fig, (ax,) = _figure()
    steps = _column(run.rl, "phase_step")
    for key in counts:
        ax.plot(steps, _column(run.rl, f"ledger/{key}"), marker="o", markersize=3, label=key)
    ax.set_xlabel("RL step")
    ax.set_ylabel("trajectories so far")
    ax.legend(fontsize=8)
    unaccounted = (run.summary or {}).get("rl", {}).get("ledger_unaccounted")
    note = (_note(f"{unaccounted} started trajectories are not in the ledger: an accounting "
                  f"bug.") if unaccounted else "")
    return _png(fig) + _table(("ledger (end of RL)", "count"),
                              [(k, final[k]) for k in sorted(final)]) + note


RENDERERS: tuple[Callable[[RunRecords], str], ...] = (
    heldout_section, learning_curve_section, difficulty_section, tools_section,
    env_error_section, mismatch_section, staleness_section, timing_section, ledger_section)

_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;
color:#222}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:.2em .6em;
text-align:left;font-size:.9em}.note{color:#555;font-style:italic}img{max-width:100%}"""


def render_report(run: RunRecords) -> str:
    """The whole report as one HTML string."""
    require_package("matplotlib", "report", "tiller report")
    cfg = run.config
    facts = [("run folder", str(run.dir)), ("name", cfg.get("name", "-")),
             ("env", cfg.get("env", {}).get("name", "-")), ("rl.mode", _mode(run)),
             ("algorithm", json.dumps(cfg.get("rl", {}).get("algorithm", {}))),
             ("finished", "yes" if run.summary is not None else "no (no summary.json)")]
    facts += [(k, f"{v:.1f} s") for k, v in (run.summary or {}).get("timings", {}).items()]
    body = [f"<h1>tiller run report: {_text(cfg.get('name', run.dir.name))}</h1>",
            _table(("", ""), facts)]
    for title, render in zip(SECTIONS, RENDERERS, strict=True):
        body.append(f'<section><h2>{_text(title)}</h2>{render(run)}</section>')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>tiller report: "
            f"{_text(run.dir.name)}</title><style>{_CSS}</style></head><body>"
            f"{''.join(body)}</body></html>")


def write_report(run_dir: str | Path) -> Path:
    """Write `run_dir/report.html` and return its path."""
    run = load_run(run_dir)
    return write_file(run.dir / "report.html", render_report(run), root=run.dir)
