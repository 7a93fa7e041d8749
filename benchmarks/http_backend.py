"""The demo's RL phase through `engine.backend: http` against two `tiller serve` processes,
next to the same phase on the embedded engine, and optionally with one server killed mid-run.

    .venv/bin/python benchmarks/http_backend.py                     # embedded vs http
    .venv/bin/python benchmarks/http_backend.py --kill-at-step 10   # + server 0 killed at step 10

Each run starts from the same SFT checkpoint (`--model`, default the seed-0 demo's) with
`sft.enabled=false`, so the runs differ only in where rollouts are generated. The servers run
the same engine code with the same seeds and receive the trainer's weights after every step,
so a healthy http run samples the same tokens as the embedded one. The table reports held-out
success after RL with its 95% CI, the ledger (every episode trained, filtered or dropped), the
router's retries and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TILLER = str(Path(sys.executable).with_name("tiller"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, weights_root: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([TILLER, "serve", str(model), "--port", str(port),
                             "--weights-root", str(weights_root), "--threads", "1"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"tiller serve on port {port} exited: see {log}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"tiller serve on port {port} did not answer /health within 120 s")


def rl_steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"phase": "rl"' in line)


def train(run_dir: Path, model: Path, steps: int, extra: list[str],
          kill: tuple[subprocess.Popen, int] | None = None) -> float:
    cmd = [TILLER, "train", str(ROOT / "configs/calculator.yaml"), "-o", str(run_dir),
           f"model.path={model}", "model.build=null", "sft.enabled=false", f"rl.steps={steps}",
           "logging.progress=false", *extra]
    if run_dir.exists():  # a fresh run refuses a folder holding a run's record; ours
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=(run_dir.parent / f"{run_dir.name}.log").open("w"),
                            stderr=subprocess.STDOUT)
    while proc.poll() is None:
        if kill is not None and rl_steps_done(run_dir) >= kill[1]:
            kill[0].send_signal(signal.SIGKILL)
            print(f"killed server 0 after RL step {kill[1]}", flush=True)
            kill = None
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: see {run_dir.parent / run_dir.name}.log")
    return time.perf_counter() - t0


def summarize(run_dir: Path, wall: float) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    after = summary["heldout_after_rl"]
    last_rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"phase": "rl"' in line][-1]
    return {"success": after["success"], "ci": [after["ci_low"], after["ci_high"]],
            "ledger": summary["rl"]["ledger"], "retries": last_rl.get("engine/retries", 0),
            "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "runs/seeds/seed0/checkpoints/sft")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--kill-at-step", type=int, default=0, help="0: no killed-server run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/http_backend")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"--model {args.model} is not a checkpoint: run the demo first "
                         "(benchmarks/demo_seeds.py --seeds 0 --out runs/seeds)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"embedded": summarize(args.out / "embedded", train(
        args.out / "embedded", args.model, args.steps, []))}
    variants = [("http", 0)] + ([("http, server 0 killed", args.kill_at_step)]
                                if args.kill_at_step else [])
    for name, kill_at in variants:
        run_dir = args.out / ("http_kill" if kill_at else "http")
        ports = [free_port(), free_port()]
        servers = [start_server(args.model, p, args.out, args.out / f"server{i}.log")
                   for i, p in enumerate(ports)]
        try:
            urls = "[" + ",".join(f"http://127.0.0.1:{p}" for p in ports) + "]"
            wall = train(run_dir, args.model, args.steps,
                         ["engine.backend=http", f"engine.urls={urls}",
                          f"engine.weights_dir={run_dir / 'weights'}"],
                         kill=(servers[0], kill_at) if kill_at else None)
            results[name] = summarize(run_dir, wall)
        finally:
            for s in servers:
                s.kill()
                s.wait(timeout=30)
    print(f"\nRL phase, {args.steps} steps from {args.model}\n")
    print("| engine | held-out success after RL | 95% CI | ledger | retries | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['success']:.3f} | [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | "
              f"{r['ledger']} | {r['retries']:.0f} | {r['wall_s']} |")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
