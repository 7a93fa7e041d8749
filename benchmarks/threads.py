"""CPU threads on the demo's SFT phase: idle and loaded, each with 1 and 2 torch threads and
with `runtime.threads: auto` (issue 19, "CPU threads"; docs/running.md, "CPU threads").

    .venv/bin/python benchmarks/threads.py            # the demo's SFT: 80 steps, sft.tasks=640
    .venv/bin/python benchmarks/threads.py --quick    # a tiny model, 2 steps (tests/)

One model is built first (the demo's, as `model.build` makes it). Each measurement is then one
`tiller train configs/calculator.yaml sft.tasks=640 rl.steps=0 eval.enabled=false` subprocess
from that model with `runtime.threads` set, its environment stripped of the thread variables
(so auto follows its rule, not an inherited OMP_NUM_THREADS); it is timed by its summary's
`timings.sft_s` (the demonstrations, 80 optimizer steps and the weight push), with its own CPU
seconds (os.wait4) and the torch thread count its runtime.json reports. "idle" runs alone (the
machine as it is: say what else ran); "loaded" runs beside `--busy` processes that spin a
Python loop, started by this benchmark `--settle` seconds before the first loaded measurement
(so the 1-minute load average the auto rule reads has seen them) and stopped after the last.
Ratios are against "before": torch's own default thread count (what every run used before
runtime.threads, measured in a child process here) on the idle machine, and on the same load.
Writes OUT/threads.json and OUT/threads.md (printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiller.config import Config, load_config  # noqa: E402
from tiller.models import build_env_model  # noqa: E402
from tiller.plugins import load_env_class  # noqa: E402
from tiller.runtime import THREAD_VARS, usable_cores  # noqa: E402

CONFIG = ROOT / "configs" / "calculator.yaml"
# the demo's SFT phase alone: 640 demonstrations, 8 epochs of batches of 64 = 80 steps
SFT_PHASE = ["sft.tasks=640", "rl.steps=0", "eval.enabled=false", "logging.progress=false",
             "logging.tensorboard=false", "logging.report=false"]
# a tiny model and 2 SFT steps: proves the benchmark runs end to end, measures nothing
QUICK = ["model.build.hidden_size=64", "model.build.vocab_size=600",
         "model.build.corpus_tasks=60", "sft.tasks=64", "sft.epochs=1", "sft.batch_size=32"]
BUSY = "while True: pass"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 SFT steps")
    p.add_argument("--out", type=Path, help="default runs/bench-threads-<time>")
    p.add_argument("--threads", nargs="+", default=["1", "2", "auto"],
                   help="runtime.threads values measured under each load (torch's default "
                   "count is added when missing: it is the baseline)")
    p.add_argument("--busy", type=int, default=2, help="busy processes beside a loaded run")
    p.add_argument("--settle", type=float, help="seconds the busy processes run before the "
                   "first loaded measurement (default 60; --quick 0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more config overrides (e.g. a smaller model.build)")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds one measurement may take before it is killed")
    args = p.parse_args(argv)
    if args.settle is None:
        args.settle = 0.0 if args.quick else 60.0
    return args


def child_env() -> dict[str, str]:
    """This checkout's tiller, and no thread variable: each run's come from runtime.threads."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return env


def torch_default_threads() -> int:
    """The intra-op threads torch picks by itself in a fresh process: what runs used before."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           env=child_env(), capture_output=True, text=True, timeout=300,
                           check=True)
    return int(probe.stdout.strip())


def build_model(cfg: Config, out: Path) -> Path:
    """The model `model.build` makes for this config (as `tiller train` would), built once."""
    assert cfg.model.build is not None
    return build_env_model(load_env_class(cfg.env.name), out, cfg.model.build, seed=cfg.seed,
                           difficulty=cfg.env.difficulty, max_turns=cfg.env.max_turns)


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[int]]:
    """`n` processes that spin a Python loop, stopped (and reaped) on the way out."""
    procs: list[subprocess.Popen] = []
    try:
        procs += [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def measure(args: argparse.Namespace, model: Path, load: str, setting: str, out: Path
            ) -> dict[str, Any]:
    """One `tiller train` subprocess of the SFT phase at `runtime.threads=setting`."""
    run_dir = out / f"{load}-threads-{setting}"
    cmd = [sys.executable, "-m", "tiller", "train", str(CONFIG), *SFT_PHASE,
           *(QUICK if args.quick else []), *args.set, f"model.path={model}", "model.build=null",
           f"runtime.threads={setting}", "-o", str(run_dir)]
    log = run_dir.with_suffix(".log")
    load_before = os.getloadavg()[0]
    timed_out = threading.Event()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=ROOT)

        def kill() -> None:  # os.kill, not Popen.kill: that polls, and would reap the child
            timed_out.set()
            os.kill(proc.pid, signal.SIGKILL)  # the pid stays ours until wait4 reaps it

        timer = threading.Timer(args.run_timeout, kill)
        timer.start()
        try:  # wait4: the child's own CPU time
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if timed_out.is_set() or proc.returncode != 0:
        why = "killed after --run-timeout" if timed_out.is_set() else f"exit {proc.returncode}"
        tail = "\n".join(log.read_text().splitlines()[-5:])
        raise RuntimeError(f"{load}, runtime.threads={setting}: tiller train {why} "
                           f"(log: {log}):\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    runtime = json.loads((run_dir / "runtime.json").read_text())
    row = {"load": load, "setting": setting, "threads": runtime["threads"],
           "torch_threads": runtime["torch_threads"], "sft_s": summary["timings"]["sft_s"],
           "sft_steps": summary["sft"]["steps"], "cpu_s": usage.ru_utime + usage.ru_stime,
           "load_1min": load_before, "rule": runtime["rule"]}
    print(f"{load}, runtime.threads={setting}: {row['sft_s']:.1f} s SFT "
          f"({row['torch_threads']} torch threads)", file=sys.stderr, flush=True)
    return row


def with_ratios(rows: list[dict[str, Any]], before: str) -> list[dict[str, Any]]:
    """Each row with `vs_idle_before` and `vs_before`: its SFT seconds over the idle run's and
    the same load's run at torch's default count (`before`)."""
    base = {r["load"]: r["sft_s"] for r in rows if r["setting"] == before}
    return [{**r, "vs_idle_before": r["sft_s"] / base["idle"],
             "vs_before": r["sft_s"] / base[r["load"]]} for r in rows]


def table(rows: list[dict[str, Any]], before: str) -> str:
    lines = [f"| load | runtime.threads | torch threads | SFT s | CPU s | load avg at start "
             f"| / idle, {before} (before) | / same load, {before} (before) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['load']} | {r['setting']} | {r['torch_threads']} | "
                     f"{r['sft_s']:.1f} | {r['cpu_s']:.1f} | {r['load_1min']:.2f} | "
                     f"{r['vs_idle_before']:.2f}x | {r['vs_before']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "runs" / f"bench-threads-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    before = str(torch_default_threads())
    settings = list(dict.fromkeys([*args.threads, before]))  # the baseline is always measured
    cfg = load_config(CONFIG, [*SFT_PHASE, *(QUICK if args.quick else []), *args.set])
    model = build_model(cfg, out / "model")
    rows = [measure(args, model, "idle", s, out) for s in settings]
    with busy_processes(args.busy) as pids:
        time.sleep(args.settle)
        rows += [measure(args, model, "loaded", s, out) for s in settings]
    rows = with_ratios(rows, before)
    md = table(rows, before)
    result = {"rows": rows, "before": before, "busy_pids": pids, "busy": args.busy,
              "settle_s": args.settle, "usable_cores": usable_cores(),
              "quick": args.quick, "set": args.set, "wall_s": time.perf_counter() - t0}
    (out / "threads.json").write_text(json.dumps(result, indent=2))
    (out / "threads.md").write_text(md + "\n")
    print(md)
    print(f"\n{out / 'threads.md'}: {result['wall_s']:.0f} s in all; torch's own default here "
          f"is {before} thread(s) (before)")
    return result


if __name__ == "__main__":
    main()
