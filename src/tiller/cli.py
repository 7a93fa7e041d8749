"""The command line: `tiller train CONFIG [key=value ...]` and `tiller eval CONFIG ...`.

Errors a user can fix (bad config, missing model, unknown env or algorithm) print one line
and exit with status 2, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .config import ConfigError, load_config
from .models import ModelLoadError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Reinforcement learning for tool-using LLM agents.")
console = Console()

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file")]
Overrides = Annotated[list[str] | None, typer.Argument(help="overrides: section.key=value")]
OutputDir = Annotated[Path | None, typer.Option("--output-dir", "-o", help="run folder")]


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _print_summary(summary: dict) -> None:
    table = Table(title="held-out success")
    for col in ("phase", "success", "95% CI", "tasks"):
        table.add_column(col)
    for key, row in summary.items():
        if key.startswith("heldout"):
            table.add_row(key.removeprefix("heldout_").removeprefix("heldout") or "model",
                          f"{row['success']:.3f}", f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}]",
                          str(row["tasks"]))
    console.print(table)
    console.print(f"run folder: {summary['run_dir']}")


@app.command()
def train(config: ConfigArg, overrides: Overrides = None, output_dir: OutputDir = None) -> None:
    """Build or load the model, then SFT, GRPO and held-out evaluation, as the config says."""
    from .controller import train as run_train

    try:
        cfg = load_config(config, overrides or [])
        summary = run_train(cfg, output_dir)
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    _print_summary(summary)


@app.command("eval")
def evaluate(config: ConfigArg, overrides: Overrides = None, output_dir: OutputDir = None) -> None:
    """Held-out success of the model at model.path (e.g. a run's checkpoints/final)."""
    from .controller import evaluate_checkpoint

    try:
        cfg = load_config(config, overrides or [])
        summary = evaluate_checkpoint(cfg, output_dir)
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    _print_summary(summary)


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())
