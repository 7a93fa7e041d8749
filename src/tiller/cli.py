"""The command line: `tiller train CONFIG [key=value ...]`, `tiller eval CONFIG ...` and
`tiller serve MODEL_PATH [options]`.

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
        if not isinstance(row, dict):  # "heldout": "disabled"
            console.print(f"held-out evaluation {row}: {summary.get('eval_disabled')}")
            continue
        phase = key.removeprefix("heldout_").removeprefix("heldout") or "model"
        # pass@1 is `success`; pass@k (eval.pass_k > 1) sits beside it
        metrics = ["success"] + [m for m in row if m.startswith("pass@") and "_ci_" not in m]
        for m in metrics:
            lo, hi = ("ci_low", "ci_high") if m == "success" else (f"{m}_ci_low", f"{m}_ci_high")
            table.add_row(phase, "pass@1" if m == "success" else m, f"{row[m]:.3f}",
                          f"[{row[lo]:.3f}, {row[hi]:.3f}]", str(row["tasks"]),
                          str(row["samples"]))
    if table.row_count:
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


DTYPES = ("float32", "bfloat16", "float16")


@app.command()
def serve(
    model_path: Annotated[Path, typer.Argument(help="a Hugging Face model folder")],
    port: Annotated[int, typer.Option(help="TCP port", min=1, max=65535)] = 30000,
    host: Annotated[str, typer.Option(help="address to bind; other than loopback needs "
                                           "--api-key")] = "127.0.0.1",
    api_key: Annotated[str | None, typer.Option(
        envvar="TILLER_API_KEY", help="bearer token every route but /health requires")] = None,
    weights_root: Annotated[Path | None, typer.Option(
        help="the only folder /update_weights_from_disk may read (off when unset)")] = None,
    dtype: Annotated[str, typer.Option(help=f"one of {', '.join(DTYPES)}")] = "float32",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    max_batch_size: Annotated[int, typer.Option(min=1, help="engine batch rows")] = 128,
    cache_bytes: Annotated[int, typer.Option(min=0, help="engine KV cache budget")] = 1 << 30,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="413 above this")] = 4 << 20,
    max_n: Annotated[int, typer.Option(min=1, help="choices per request")] = 8,
    max_prompt_tokens: Annotated[int | None, typer.Option(
        min=1, help="longest prompt (default: the model's context)")] = None,
    request_timeout_s: Annotated[float, typer.Option(
        min=0.001, help="504 for a generation not done by then")] = 600.0,
) -> None:
    """Serve a model over HTTP: SGLang's /generate and OpenAI-compatible chat and completions."""
    import logging

    from tiller.errors import require_package
    from tiller.serve.guard import is_loopback

    if not is_loopback(host) and not api_key:
        _fail(f"--host {host} is reachable from other machines: pass --api-key (or set "
              "TILLER_API_KEY), or bind 127.0.0.1")
    if dtype not in DTYPES:
        _fail(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if device not in ("auto", "cpu", "cuda"):
        _fail(f"--device {device}: expected auto, cpu or cuda")
    if weights_root is not None and not weights_root.is_dir():
        _fail(f"--weights-root {str(weights_root)!r} is not a folder")
    try:
        uvicorn = require_package("uvicorn", "serve", "tiller serve")
        require_package("fastapi", "serve", "tiller serve")
    except ConfigError as e:
        _fail(str(e))

    import torch

    from tiller.models import load_model, load_tokenizer, resolve_device
    from tiller.rollout.chat import stop_token_ids
    from tiller.rollout.engine import EmbeddedEngine
    from tiller.serve.app import create_app
    from tiller.serve.server import ServeSettings

    try:
        torch_device = resolve_device(device)
        tokenizer = load_tokenizer(model_path)
        model = load_model(model_path, getattr(torch, dtype)).to(torch_device)
        stops = stop_token_ids(tokenizer, model.generation_config)
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    engine = EmbeddedEngine(model, tokenizer.pad_token_id, max_batch_size=max_batch_size,
                            cache_bytes=cache_bytes)
    settings = ServeSettings(
        model_path=str(model_path), stop_token_ids=stops, dtype=dtype, device=str(torch_device),
        api_key=api_key, weights_root=weights_root.resolve() if weights_root else None,
        max_body_bytes=max_body_bytes, max_n=max_n, max_prompt_tokens=max_prompt_tokens,
        request_timeout_s=request_timeout_s)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # keep-alive well above HttpEngine's 2 s idle expiry: a server that closes a pooled
    # connection first makes the client's next request on it fail with ReadError
    uvicorn.run(create_app(engine, tokenizer, settings), host=host, port=port,
                log_level="info", timeout_graceful_shutdown=5, timeout_keep_alive=75)


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())
