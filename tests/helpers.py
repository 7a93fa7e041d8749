"""Helpers shared by the tests: tiny-run overrides and an actor that plays scripted or random
turns through the real agent loop."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import sqlite3
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tiller.config import Config
from tiller.engine.api import Generation
from tiller.models import load_tokenizer
from tiller.plugins import load_env_class
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.collect import collect_expert
from tiller.rollout.trajectory import is_success


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the module look themselves up there
    spec.loader.exec_module(module)
    return module


def dead_pid() -> int:
    """The pid of a process that has exited (reaped)."""
    child = subprocess.Popen(["true"])
    child.wait(10)
    return child.pid


# Logging that writes only metrics.jsonl and the log: no progress bar, no TensorBoard files.
QUIET = ["logging.progress=false", "logging.tensorboard=false"]
# A whole pipeline (build, SFT, RL, eval) in seconds: for tests that check it runs, not learns.
TINY_RUN = [
    "model.build.hidden_size=64", "model.build.vocab_size=600", "model.build.corpus_tasks=60",
    "sft.tasks=64", "sft.epochs=1", "sft.batch_size=32", "rl.steps=2", "rl.tasks_per_step=4",
    "rl.group_size=4", "eval.tasks=16", "logging.progress=false",
    # report.html costs seconds of matplotlib per run; tests/test_report.py turns it on
    "logging.report=false",
]
# The same for the envs with longer episodes (code, search, sql).
TINY_ENV_RUN = [
    "model.build.hidden_size=64", "model.build.num_layers=1", "model.build.num_heads=2",
    "model.build.vocab_size=500", "model.build.corpus_tasks=40", "sft.tasks=40",
    "sft.epochs=1", "sft.batch_size=8", "rl.steps=2", "rl.tasks_per_step=2",
    "rl.group_size=2", "eval.tasks=8", "sampling.max_new_tokens=64", *QUIET,
    "logging.report=false",
]


def saved_model(path: Path | str) -> list[str]:
    """Overrides that load the model saved at `path` (`calc_model_dir`, `calc_sft_dir`)
    instead of building one, with QUIET logging."""
    return [f"model.path={path}", "model.build=null", *QUIET]


def tiny_rl(path: Path | str, *more: str) -> list[str]:
    """Overrides for a tiny RL run from the model saved at `path` (`calc_sft_dir`, say): no
    SFT, 1 step of 2 tasks x 4 samples, 8 held-out tasks, QUIET logging. `more` comes last,
    and a later key=value wins over an earlier one."""
    return [*saved_model(path), "sft.enabled=false", "rl.steps=1", "rl.tasks_per_step=2",
            "rl.group_size=4", "eval.tasks=8", *more]


# A tiny policy never succeeds, so GRPO's advantages are all 0 and RL would leave the weights
# as they are; an entropy bonus gives every trainable token a gradient, so a short run shows
# whether RL trained on the env's episodes at all.
RL_MOVES = ["rl.algorithm.entropy_coef=0.01"]


# Which episodes share an engine batch depends on thread timing, which moves the engine's
# logprobs by float noise (~1e-8): the samples do not change, these diagnostics may (the
# mismatch, raw and by staleness, and the off-policy weight computed from it).
NOISE = ("time", "logp_mismatch_", "importance_weight_", "mismatch_", "staleness_weighted_",
         "is_weight_",
         # how requests meet in the engine's batches, and shares of wall time, follow thread
         # timing too (the tokens sampled do not)
         "engine/decode_steps", "engine/decoded_row_steps", "engine/max_rows",
         "engine/prefill_calls", "trainer_busy_frac", "rollout_train_ratio", "samples_per_s",
         "engine_busy_frac", "episodes_running", "groups_ready",
         # the trace writer's counts as of a step follow its thread (what it wrote so far)
         "traces/")


def rl_rows(run_dir: Path) -> list[dict]:
    """The RL steps' rows of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def numbers(run_dir: Path, skip_suffixes: tuple[str, ...] = ()) -> list[dict]:
    """Every metric a run logged, except wall-clock ones, float-noise diagnostics and keys
    ending in `skip_suffixes`."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in r.items()
             if not k.startswith(NOISE) and not k.endswith(("_s", *skip_suffixes))}
            for r in rows]


class TextActor:
    """Plays `turns` in order or, without them, a random policy: half the time a call to one
    of `tools` (or to an unknown tool) with `make_args(rng, junk)`, else one of `finals` with
    random text in place of `{junk}`."""

    def __init__(self, tok, turns=None, *, tools=(), make_args=None, finals=("{junk}",)):
        self.tok, self.turns, self.tools = tok, turns, tools
        self.make_args = make_args or (lambda rng, junk: {})
        self.finals = finals

    async def act(self, prompt_ids, messages, seed, session_id=None):
        if self.turns is not None:
            text = self.turns[sum(m["role"] == "assistant" for m in messages)]
        else:
            rng = random.Random(seed)
            junk = "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 60)))
            if self.tools and rng.random() < 0.5:
                call = {"name": rng.choice([*self.tools, "nope"]),
                        "arguments": self.make_args(rng, junk)}
                text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            else:
                text = rng.choice(self.finals).replace("{junk}", junk)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return Generation(ids, [0.0] * len(ids), "stop", version=0)


def check_short_run(cfg: Config, summary: dict[str, Any], random_actor: Callable[[Any], Any]
                    ) -> tuple[float, float]:
    """What a tiny run must show besides finishing: on the run's own held-out tasks, with its
    tokenizer and episode limits, the scripted expert succeeds and `random_actor(tokenizer)`
    does not (so env and verifier tell them apart under the run's settings), and the RL steps
    changed the weights. Returns (expert, random) success rates."""
    env_cls = load_env_class(cfg.env.name)  # registered, installed or a dotted path
    tok = load_tokenizer(summary["checkpoint"])
    limits = EpisodeLimits(cfg.env.max_turns, cfg.env.max_episode_tokens)
    tasks = env_cls.make_tasks("heldout", cfg.eval.tasks, cfg.seed, cfg.env.difficulty)
    assert summary["heldout_after_rl"]["tasks"] == len(tasks)
    experts = collect_expert(env_cls, tasks, tok, guess=0.0, limits=limits, seed=cfg.seed)

    async def randoms():
        return await asyncio.gather(*(run_episode(env_cls(), t, random_actor(tok), tok, seed=i,
                                                  limits=limits) for i, t in enumerate(tasks)))
    expert = sum(map(is_success, experts)) / len(tasks)
    rand = sum(map(is_success, asyncio.run(randoms()))) / len(tasks)
    assert expert >= 0.95 and rand <= 0.05, (expert, rand)

    before = load_file(Path(summary["sft"]["checkpoint"]) / "model.safetensors")
    after = load_file(Path(summary["checkpoint"]) / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "RL left the weights"
    return expert, rand


def trained_episodes(db: Path) -> list[dict[str, Any]]:
    """The trained RL episodes of a traces.sqlite, in (trained_step, task_id, sample_index)
    order: their columns, with `advantage` the one value every trained token shares."""
    from tiller.observe.traces import connect, decode

    out = []
    with closing(connect(db)) as con:
        for r in con.execute("SELECT * FROM episodes WHERE phase = 'rl' AND trained_step IS "
                             "NOT NULL ORDER BY trained_step, task_id, sample_index"):
            adv = {a for a, m in zip(decode("advantages", r["advantages"]),
                                     decode("train_mask", r["train_mask"]), strict=True) if m}
            assert len(adv) == 1  # every trained token of an episode shares its advantage
            out.append({**dict(r), "advantage": adv.pop()})
    return out


def traces_of_version(path: Path, version: int) -> Path:
    """A traces.sqlite at `path` whose meta says it was written with schema `version` (as a
    file an older tiller wrote says)."""
    from tiller.observe.traces import TraceWriter

    TraceWriter(path).close()
    with closing(sqlite3.connect(path)) as con, con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
    return path


def cli(*args: str | Path, env: dict[str, str | None] | None = None) -> tuple[int, str]:
    """`tiller ARGS` run in this process (typer's CliRunner): its exit status and what it
    printed, stdout and stderr together, log records included as a user's terminal shows
    them (`fresh_process_logging`). `env` sets environment variables for the call (None
    removes one). An exception the CLI lets escape is raised here: the traceback a user would
    see fails the test."""
    from typer.testing import CliRunner

    from tiller.cli import app

    with fresh_process_logging():
        result = CliRunner().invoke(app, [str(a) for a in args], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@contextmanager
def fresh_process_logging() -> Iterator[None]:
    """Logging as a fresh `tiller` process has it, for the block: no handler on the root
    logger (pytest's are set aside, so a test's caplog sees nothing meanwhile) and its level
    WARNING. A record then reaches what a user sees as it would there: through logging's
    last-resort handler (WARNING and up, the bare message) onto sys.stderr, which CliRunner
    captures, or through the handler a command installs itself (`tiller serve`'s
    basicConfig); those are removed and closed at the end, pytest's put back."""
    import logging

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = saved
        root.setLevel(level)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextmanager
def serve_process(model_dir: Path, *args: str, timeout_s: float = 180.0
                  ) -> Iterator[dict[str, Any]]:
    """`tiller serve MODEL_DIR --port <free> --device cpu ARGS` as a subprocess (without
    TILLER_API_KEY from the environment); yields {"url", "port", "log"} once /health answers
    ("log": its output lines so far). Stopped with SIGINT at exit; its output must then hold
    no traceback."""
    import os
    import signal
    import subprocess
    import threading
    import time

    import httpx

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TILLER_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiller", "serve", str(model_dir), "--port", str(port),
         "--device", "cpu", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, f"tiller serve exited: {''.join(log)[-2000:]}"
            assert time.monotonic() < deadline, f"tiller serve did not answer /health in " \
                                                f"{timeout_s:g} s"
            time.sleep(0.5)
        yield {"url": url, "port": port, "log": log}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=10)
    assert "Traceback" not in "".join(log), "".join(log)[-3000:]


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def processes_with(marker: str) -> list[int]:
    """Running (not zombie) processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() \
                    and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:  # exited meanwhile
            pass
    return found


def scripted_generation(tokenizer: Any, policy: Any, text: str) -> Generation:
    """`text` as one ended turn, stamped with the policy's engine version as if sampled (so RL
    trains on it): the scripted half of the test loops (mcp_loop.py, openenv_loop.py)."""
    from tiller.rollout.chat import end_of_turn_token

    ids = tokenizer.encode(text, add_special_tokens=False)
    ids.append(tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer)))
    version = getattr(getattr(policy, "engine", None), "version", 0)
    return Generation(ids, [0.0] * len(ids), "stop", version=version,
                      versions=(version,) * len(ids))


def env_below(var: str, folder: Path) -> list[int]:
    """This user's processes whose environment sets `var` to a path below `folder` (it is
    inherited: a process and every process it spawned, whatever their command lines)."""
    prefix = f"{var}={folder}{os.sep}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(v.startswith(prefix) for v in
                                            (entry / "environ").read_bytes().split(b"\0")):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return found
