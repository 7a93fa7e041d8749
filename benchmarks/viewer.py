"""The viewer benchmark: how fast `tiller view` answers on a run of --episodes episodes.

A run folder is synthesized through the real writers (TrajectoryBuilder trajectories, the
TraceWriter with each step's trainer arrays and ledger, MetricsLogger rows), in groups of
--group-size samples of --tasks-per-step tasks per RL step. Then `tiller view` is started as a
subprocess and each request below is timed over HTTP on 127.0.0.1: the first (cold) answer and
the median of --repeats more.

    PYTHONPATH=src .venv/bin/python benchmarks/viewer.py --browser          # 10,000 episodes
    PYTHONPATH=src .venv/bin/python benchmarks/viewer.py --episodes 500     # smoke run

What "opens in a second" needs is the page load: `/`, `/api/run` and the first page of
`/api/episodes`, which the browser asks for in that order.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import torch

from tiller.envs.verifiers import Reward
from tiller.observe.metrics import MetricsLogger
from tiller.observe.traces import TraceWriter
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder
from tiller.tools.registry import ToolCall, ToolOutcome, ToolResult
from tiller.train.batch import Batch
from tiller.train.trainer import RLStepTensors

ROOT = Path(__file__).resolve().parents[1]
# the synthetic run's mix: (status, share); a completed episode is rewarded half the time
STATUSES = ((Status.COMPLETED, 0.7), (Status.TRUNCATED, 0.18), (Status.ENV_ERROR, 0.08),
            (Status.ABORTED, 0.04))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=10_000)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="run folder (default: a temp dir)")
    p.add_argument("--browser", action="store_true",
                   help="also time the page in headless /usr/bin/chromium (Playwright)")
    return p.parse_args(argv)


def episode(rng: random.Random, task: int, sample: int, step: int, seed: int) -> Trajectory:
    """One synthetic episode: a prompt, 1-4 tool-calling turns with observations, a status,
    a reward with its checks, and a tool result per turn (some failing)."""
    b = TrajectoryBuilder(f"task-{task:05d}", sample)
    b.append_prompt([rng.randrange(600) for _ in range(rng.randint(40, 80))])
    messages = [{"role": "system", "content": "You can call calculate(a, op, b)."},
                {"role": "user", "content": f"Task {task}: how many marbles are left?"}]
    turns, errors = rng.randint(1, 4), 0
    for turn in range(turns):
        n = rng.randint(10, 60)
        b.append_generated([rng.randrange(600) for _ in range(n)],
                           [-rng.expovariate(2.0) for _ in range(n)], step)
        ok = rng.random() > 0.15
        errors += not ok
        call = ToolCall("calculate", {"a": rng.randint(1, 99), "op": "*", "b": rng.randint(1, 9)})
        b.tool_results.append((turn, ToolResult(
            call, ToolOutcome.OK if ok else ToolOutcome.TOOL_ERROR,
            str(rng.randint(1, 999)) if ok else "error: bad operand", rng.random() / 100)))
        messages += [{"role": "assistant", "content": f"step {turn}: calling the tool"},
                     {"role": "tool", "content": b.tool_results[-1][1].content}]
        if turn < turns - 1:
            b.append_observation([rng.randrange(600) for _ in range(rng.randint(5, 15))])
    status = rng.choices([s for s, _ in STATUSES], [w for _, w in STATUSES])[0]
    solved = status is Status.COMPLETED and rng.random() < 0.5
    reward = Reward(float(solved), {"format": 1.0, "answer": float(solved)},
                    env_error=status is Status.ENV_ERROR)
    traj = b.finish(reward, status, messages=messages, tool_calls=turns, tool_errors=errors)
    # the seed and the tag name it in the traces (collect.run_one sets them in a real run)
    return replace(traj, seed=seed, tag=("rl", step - 1))


def synthesize(run_dir: Path, episodes: int, group_size: int = 8, tasks_per_step: int = 16,
               seed: int = 0) -> dict[str, float]:
    """Write `run_dir`'s traces.sqlite and metrics.jsonl for `episodes` RL episodes; returns
    what was written and how long it took."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    writer = TraceWriter(run_dir / "traces.sqlite", queue_size=100_000)
    logger = MetricsLogger(run_dir, tensorboard=False)
    per_step = group_size * tasks_per_step
    written, step = 0, 0
    while written < episodes:
        step += 1
        batch = [episode(rng, (step - 1) * tasks_per_step + i // group_size, i % group_size,
                         step, seed * 10**9 + written + i)
                 for i in range(min(per_step, episodes - written))]
        for t in batch:
            writer.put_episode(t, "rl", "train", step, step)
        rows = Batch.collate(batch, pad_token_id=0)  # one row per episode (none is split)
        mask = rows.loss_mask
        # the trainer's logprobs: the rollout's plus float noise, one token in 200 far off
        noise = torch.tensor([[rng.gauss(0, 1e-6) if rng.random() > 0.005 else 0.5
                               for _ in range(mask.shape[1])] for _ in range(len(batch))])
        logp = (rows.rollout_logprobs + noise) * mask
        adv = (rows.rewards - 0.5)[:, None] * mask
        writer.put_training(step, batch, rows, RLStepTensors(logp, adv))
        writer.put_ledger(step, step, {"started": written + len(batch),
                                       "trained": written + len(batch)})
        written += len(batch)
        logger.log("rl", step, {
            "reward_mean": sum(t.reward.value for t in batch) / len(batch),
            "success_rate": sum(t.reward.value >= 1 for t in batch) / len(batch),
            "tool_errors_per_episode": sum(t.tool_errors for t in batch) / len(batch),
            "env_error_rate": sum(t.status is Status.ENV_ERROR for t in batch) / len(batch)},
            phase_step=step)
    stats = writer.close()
    logger.close()
    return {"episodes": stats["traces/written"], "trained": stats["traces/trained"],
            "steps": step, "seconds": time.perf_counter() - t0,
            "db_mb": (run_dir / "traces.sqlite").stat().st_size / 2**20}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_viewer(run_dir: Path, timeout_s: float = 240.0) -> Iterator[str]:
    """`tiller view run_dir` as a subprocess on a free port; yields its base URL once
    /api/run answers (within timeout_s, or RuntimeError with the server's output)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "tiller", "view", str(run_dir), "--port",
                             str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tiller view exited ({proc.returncode}): "
                                   f"{proc.stdout.read()}")
            try:
                r = httpx.get(f"{url}/api/run", timeout=5)
            except httpx.TransportError:  # not listening yet
                r = None
            if r is not None:
                if r.status_code != 200:
                    raise RuntimeError(f"tiller view: /api/run answered {r.status_code}: "
                                       f"{r.text[:500]}")
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"tiller view did not answer on {url} within {timeout_s}s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def time_requests(url: str, paths: Sequence[str], repeats: int) -> list[dict[str, float]]:
    """Each path's first answer and the median of `repeats` more, in milliseconds."""
    rows = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for path in paths:
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                r = client.get(path)
                times.append((time.perf_counter() - t) * 1000)
                r.raise_for_status()
            rows.append({"path": path, "first_ms": times[0],
                         "median_ms": statistics.median(times[1:]), "bytes": len(r.content)})
    return rows


def time_in_browser(url: str) -> list[dict[str, float]]:
    """Opening the viewer in headless Debian Chromium until its episode table holds the first
    page, twice: with an empty cache (the browser already running, as a user's is: it has
    shown about:blank), then again (cache warm). Each: `wall_ms` from Playwright's goto to
    the rows (with its IPC), `page_ms` the page's own clock just after (performance.now(),
    from the navigation's start: an upper bound, read by one more IPC) and `dom_ms` its
    DOMContentLoaded. The browser is launched as the tests launch it (tests/browser.py:
    /usr/bin/chromium, never a downloaded browser)."""
    spec = importlib.util.spec_from_file_location("tiller_test_browser",
                                                  ROOT / "tests" / "browser.py")
    browser = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(browser)
    times = []
    with tempfile.TemporaryDirectory() as profile, browser.chromium_page(Path(profile)) as page:
        page.goto("about:blank")
        for _ in range(2):
            t = time.perf_counter()
            page.goto(f"{url}/")
            page.wait_for_selector("main[data-view=episodes] #episodes tbody tr",
                                   timeout=30_000)
            wall = (time.perf_counter() - t) * 1000
            page_ms, dom_ms = page.evaluate(
                "[performance.now(), performance.getEntriesByType('navigation')[0]"
                ".domContentLoadedEventEnd]")
            times.append({"wall_ms": wall, "page_ms": page_ms, "dom_ms": dom_ms})
            page.goto("about:blank")
    return times


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="tiller-viewer-bench-"))
    made = synthesize(work, args.episodes, args.group_size, args.tasks_per_step, args.seed)
    print(f"== synthesized {work}: {made['episodes']:.0f} episodes ({made['trained']:.0f} "
          f"trained) over {made['steps']} steps, {made['db_mb']:.1f} MiB, "
          f"{made['seconds']:.1f}s")
    with serve_viewer(work) as url:
        last = httpx.get(f"{url}/api/episodes", params={"order": "id", "desc": "true",
                                                        "limit": 1}).json()["episodes"][0]["id"]
        paths = ["/", "/static/viewer.js", "/api/run", "/api/episodes?limit=50",
                 "/api/episodes?status=env_error&limit=50",
                 "/api/episodes?reward_max=0&tool_errors_min=1&tokens_min=100&limit=50",
                 "/api/episodes?q=task-00042&limit=50",
                 f"/api/episodes?offset={max(args.episodes - 50, 0)}&limit=50",
                 "/api/episodes?order=reward&desc=true&limit=50",
                 f"/api/episodes/{last}", f"/api/episodes/{last}/group", "/api/curves"]
        rows = time_requests(url, paths, args.repeats)
        browser_ms = time_in_browser(url) if args.browser else None
    print("== requests (ms over HTTP on 127.0.0.1)")
    print(f"{'path':<72} {'first':>8} {'median':>8} {'bytes':>9}")
    for r in rows:
        print(f"{r['path']:<72} {r['first_ms']:>8.1f} {r['median_ms']:>8.1f} {r['bytes']:>9}")
    page_load = sum(r["first_ms"] for r in rows if r["path"] in
                    ("/", "/static/viewer.js", "/api/run", "/api/episodes?limit=50"))
    print(f"== page load (/, viewer.js, /api/run, first page; first answers): {page_load:.0f} ms")
    if browser_ms is not None:
        print("== headless Chromium, page open to the first 50 rows in the DOM (ms): wall "
              "(goto to rows) / page clock (navigation start to rows) / DOMContentLoaded")
        for label, b in zip(("empty cache", "again"), browser_ms, strict=True):
            print(f"{label:<12} {b['wall_ms']:>8.0f} {b['page_ms']:>8.0f} {b['dom_ms']:>8.0f}")
    (work / "viewer_bench.json").write_text(json.dumps({
        "synthesized": made, "requests": rows, "page_load_ms": page_load,
        "browser_ms": browser_ms}, indent=2))


if __name__ == "__main__":
    main()
