"""The command line: `tiller train CONFIG [key=value ...]` and `tiller eval CONFIG ...`.

Errors a user can fix (bad config, missing model, unknown env or algorithm) print one line
and exit with status 2, never a traceback; a run that started but cannot learn (a broken engine,
a step with nothing to train) prints one line naming the cause and exits with status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tiller.config import load_config
from tiller.errors import ConfigError, RunError
from tiller.models import ModelLoadError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Reinforcement learning for tool-using LLM agents.")
console = Console()

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file")]
Overrides = Annotated[list[str] | None, typer.Argument(help="overrides: section.key=value")]
OutputDir = Annotated[Path | None, typer.Option("--output-dir", "-o", help="run folder")]


def _fail(message: str, code: int = 2) -> None:
    # escaped: "pip install 'tiller[search]'" is not rich markup
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _print_summary(summary: dict) -> None:
    table = Table(title="held-out success")
    for col in ("phase", "metric", "value", "95% CI", "tasks", "samples"):
        table.add_column(col)
    for key, row in summary.items():
        if not key.startswith("heldout"):
            continue
        phase = key.removeprefix("heldout_").removeprefix("heldout") or "model"
        # pass@1 is `success`; pass@k (eval.pass_k > 1) sits beside it
        metrics = ["success"] + [m for m in row if m.startswith("pass@") and "_ci_" not in m]
        for m in metrics:
            lo, hi = ("ci_low", "ci_high") if m == "success" else (f"{m}_ci_low", f"{m}_ci_high")
            table.add_row(phase, "pass@1" if m == "success" else m, f"{row[m]:.3f}",
                          f"[{row[lo]:.3f}, {row[hi]:.3f}]", str(row["tasks"]),
                          str(row["samples"]))
    console.print(table)
    console.print(f"run folder: {summary['run_dir']}")


def _run(action: str, config: Path, overrides: list[str] | None, output_dir: Path | None) -> None:
    # the controller imports torch and transformers: only once a command runs, so --help is fast
    from tiller import controller

    try:
        cfg = load_config(config, overrides or [])
        summary = getattr(controller, action)(cfg, output_dir)
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    except RunError as e:  # the run started but cannot learn: one line, exit 1
        _fail(str(e), code=1)
    _print_summary(summary)


@app.command()
def train(config: ConfigArg, overrides: Overrides = None, output_dir: OutputDir = None) -> None:
    """Build or load the model, then SFT, RL and held-out evaluation, as the config says."""
    _run("train", config, overrides, output_dir)


@app.command("eval")
def evaluate(config: ConfigArg, overrides: Overrides = None, output_dir: OutputDir = None) -> None:
    """Held-out success of the model at model.path (e.g. a run's checkpoints/final)."""
    _run("evaluate_checkpoint", config, overrides, output_dir)


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())
