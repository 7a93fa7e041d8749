"""Does RL teach more than SFT's demonstrations did? One env's table over seeds: held-out and
out-of-distribution success after SFT and after SFT + RL, paired on the same tasks, with the
two controls and what RL changed in behaviour.

    .venv/bin/python benchmarks/learning.py --env calculator      # configs/learning/<env>.yaml
    .venv/bin/python benchmarks/learning.py --env search --seeds 0 1 2 --jobs 2
    .venv/bin/python benchmarks/learning.py --env calculator --model smollm2   # a real model

`--model smollm2` runs configs/smollm2_calculator.yaml (SmolLM2-135M-Instruct, fetched once with
`tiller models fetch smollm2-135m-instruct`): one run at a time by default (each wants both
cores and ~7 GB) and no no-SFT control unless --cold-seeds names seeds (as shipped the model
writes no tool call, issue 23, so RL alone has nothing to reinforce).

Per seed S it runs, each a `tiller train` subprocess into OUT/seed<S>/<run>:

- main: SFT on the config's correct but limited demonstrations, then RL;
- random (--random-seeds, default all): RL from main's SFT checkpoint with
  rl.reward_control=random (the verifier's rewards shuffled across each step's episodes: same
  mean, no link to behaviour);
- cold (--cold-seeds, default the first): RL with no SFT, from main's built model
  (OUT/seed<S>/main/base_model), or from the config's model.path where it names one.

Every run evaluates its starting model and its RL model on the config's eval.sets, the seed
picking the tasks, so every comparison is paired on the same tasks (`tiller compare`: paired
bootstrap 95% CI, exact sign test over tasks). `--jobs` runs go at once, each with
cores/jobs torch threads. A run whose summary.json exists is reused when its config.yaml
matches what this invocation would run (logging aside; otherwise the benchmark stops, naming
the sections that differ), so an interrupted benchmark resumes; a folder without summary.json
is an attempt that did not finish and is deleted and rerun. CPU-minutes are each process's
own user + system time (os.wait4); a run made by hand (no cpu.json) shows "-".
Writes OUT/table.md (printed), OUT/table.json and OUT/examples.md (seed 0's held-out tasks
that SFT failed and RL solved, both conversations). The table splits each evaluation by whether
the episode called a tool (from the main run's traces.sqlite): a gain made by answering
without the tool shows there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiller.config import Config, load_config  # noqa: E402
from tiller.controller import EvalNames  # noqa: E402
from tiller.observe.compare import compare, load_outcomes  # noqa: E402
from tiller.observe.compare import format_diff as fmt_diff  # noqa: E402
from tiller.observe.compare import format_success as fmt  # noqa: E402
from tiller.observe.traces import connect, read_episode  # noqa: E402
from tiller.runtime import thread_env  # noqa: E402

ENVS = ("calculator", "search", "sql")
# --model: the config each names and its default --jobs; smollm2 is a calculator config only
MODELS = {"tiny": None, "smollm2": ROOT / "configs" / "smollm2_calculator.yaml"}
# A tiny model and budget: the pipeline in seconds (tests/test_benchmarks_learning.py).
QUICK = ["model.build.hidden_size=64", "model.build.vocab_size=600",
         "model.build.corpus_tasks=60", "sft.tasks=64", "sft.epochs=1", "sft.batch_size=32",
         "rl.steps=2", "rl.tasks_per_step=4", "rl.group_size=4", "eval.tasks=8",
         "sampling.max_new_tokens=24"]
QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.report=false"]
# what RL changed beyond success: summary key -> label (per held-out episode)
BEHAVIOUR = {"tool_calls_per_episode": "tool calls", "tool_errors_per_episode": "tool errors",
             "turns_mean": "turns", "parse_failures_per_episode": "parse failures",
             "response_tokens_mean": "response tokens"}
GOAL_GAIN = 0.15
# what each run's role fixes: a --set of these would make the runs something else
RESERVED = ("seed", "model.path", "model.build", "sft.enabled", "rl.reward_control",
            "rl.steps", "eval.enabled", "eval.sets", "observe.traces.enabled")
CHILDREN: set[int] = set()  # the pids of the runs going now (killed when one fails)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True, choices=ENVS)
    p.add_argument("--config", type=Path, help="default configs/learning/<env>.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--random-seeds", type=int, nargs="*",
                   help="seeds that get the random-reward control (default: every seed)")
    p.add_argument("--cold-seeds", type=int, nargs="*",
                   help="seeds that get the no-SFT control (default: the first seed)")
    p.add_argument("--model", choices=list(MODELS), default="tiny",
                   help="tiny: the env's configs/learning/<env>.yaml (a model built from "
                        "scratch); smollm2: configs/smollm2_calculator.yaml (calculator only)")
    p.add_argument("--jobs", type=int,
                   help="runs at once (default 2; 1 with --model smollm2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (repeatable)")
    p.add_argument("--run-timeout", type=float, default=3600.0,
                   help="seconds one run may take before the benchmark stops")
    p.add_argument("--quick", action="store_true", help="a tiny model: seconds, learns nothing")
    p.add_argument("--out", type=Path, help="default runs/learning/<env>")
    args = p.parse_args(argv)
    real = args.model != "tiny"
    if real and args.env != "calculator":
        p.error(f"--model {args.model}: its config is for --env calculator only")
    if real and args.quick:
        p.error(f"--quick builds a tiny model: not with --model {args.model}")
    args.config = args.config or MODELS[args.model] or (
        ROOT / "configs" / "learning" / f"{args.env}.yaml")
    args.out = args.out or ROOT / "runs" / "learning" / (
        f"{args.env}-{args.model}" if real else args.env)
    args.jobs = (1 if real else 2) if args.jobs is None else args.jobs
    args.random_seeds = args.seeds if args.random_seeds is None else args.random_seeds
    if args.cold_seeds is None:
        args.cold_seeds = [] if real else args.seeds[:1]
    if not {*args.random_seeds, *args.cold_seeds} <= set(args.seeds):
        p.error("--random-seeds and --cold-seeds must be among --seeds")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds: each seed once (got {args.seeds})")
    ours = [s for s in args.set if s.split("=")[0].startswith(RESERVED)]
    if ours:
        p.error(f"--set {ours[0]}: the benchmark sets {', '.join(RESERVED)} itself")
    return args


def overrides(args: argparse.Namespace, seed: int, kind: str) -> list[str]:
    main = args.out / f"seed{seed}" / "main"
    common = [*(QUICK if args.quick else []), f"seed={seed}", *QUIET, *args.set]
    if kind == "main":
        return common
    pretrained = load_config(args.config).model.path
    start = (main / "checkpoints/sft" if kind == "random" else
             main / "base_model" if pretrained is None else pretrained)
    extra = ["rl.reward_control=random"] if kind == "random" else []
    return [*common, f"model.path={json.dumps(str(start))}", "model.build=null",
            "sft.enabled=false", *extra]


def stale_fields(out: Path, cfg: Config) -> list[str]:
    """The config sections in which the run in `out` differs from `cfg` (logging aside)."""
    done = load_config(out / "config.yaml").model_dump()
    want = cfg.model_dump()
    return [k for k in want if k != "logging" and done.get(k) != want[k]]


def run_one(args: argparse.Namespace, seed: int, kind: str) -> dict:
    """One `tiller train` subprocess, or the finished run already in its folder when that
    was made with the same config: its summary with `cpu_s` and `wall_s` added."""
    out = args.out / f"seed{seed}" / kind
    stats, ours = out / "cpu.json", overrides(args, seed, kind)
    if (out / "summary.json").is_file():
        stale = stale_fields(out, load_config(args.config, ours))
        if stale:
            raise RuntimeError(f"seed {seed} {kind}: {out} holds a run made with another "
                               f"config (sections {', '.join(stale)} differ): delete it or "
                               "pick another --out")
        summary = json.loads((out / "summary.json").read_text())
        measured = (json.loads(stats.read_text()) if stats.is_file() else  # made by hand
                    {"cpu_s": None, "wall_s": summary["timings"]["total_s"]})
        return {**summary, **measured}
    if out.exists():  # an attempt that did not finish: its metrics and traces would mix in
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tiller", "train", str(args.config), *ours, "-o", str(out)]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    env = {**os.environ, **thread_env(threads)}  # what runtime.threads: auto takes
    log = out.with_suffix(".log")
    t0 = time.perf_counter()
    timed_out = threading.Event()

    def kill() -> None:  # os.kill, not Popen.kill: that polls, and would reap the child
        timed_out.set()
        os.kill(proc.pid, signal.SIGKILL)  # the pid stays ours until wait4 reaps it

    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        CHILDREN.add(proc.pid)
        timer = threading.Timer(args.run_timeout, kill)
        timer.start()
        try:  # wait4, not wait: the child's own CPU time (RUSAGE_CHILDREN sums all of them)
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            CHILDREN.discard(proc.pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if timed_out.is_set():
        raise RuntimeError(f"seed {seed} {kind}: still running after --run-timeout "
                           f"{args.run_timeout:.0f} s; killed (log: {log})")
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-5:])
        raise RuntimeError(f"seed {seed} {kind}: tiller train exited {proc.returncode} "
                           f"(log: {log}):\n{tail}")
    cpu_s = usage.ru_utime + usage.ru_stime
    result = {"cpu_s": cpu_s, "wall_s": time.perf_counter() - t0, "threads": threads}
    stats.write_text(json.dumps(result))
    print(f"seed {seed} {kind}: {result['wall_s']:.0f} s wall", file=sys.stderr, flush=True)
    return {**json.loads((out / "summary.json").read_text()), **result}


def run_all(args: argparse.Namespace) -> dict[int, dict[str, dict]]:
    """Every seed's main run, and its controls once it is done, `--jobs` at a time. The first
    failure cancels what has not started and kills what is running, then is raised."""
    results: dict[int, dict[str, dict]] = {s: {} for s in args.seeds}
    pool = ThreadPoolExecutor(args.jobs)
    try:
        running: dict[Future, tuple[int, str]] = {
            pool.submit(run_one, args, s, "main"): (s, "main") for s in args.seeds}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                seed, kind = running.pop(fut)
                results[seed][kind] = fut.result()
                if kind == "main":
                    controls = [c for c, seeds in (("random", args.random_seeds),
                                                   ("cold", args.cold_seeds)) if seed in seeds]
                    running.update({pool.submit(run_one, args, seed, c): (seed, c)
                                    for c in controls})
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for pid in list(CHILDREN):
            os.kill(pid, signal.SIGKILL)
        raise
    pool.shutdown()
    return results


def eval_sets(summary: dict) -> list[str]:
    return [k.removesuffix("_after_sft") for k in summary if k.endswith("_after_sft")]


def behaviour(result: dict) -> dict[str, float]:
    r = dict(result)
    r["parse_failures_per_episode"] = r["tool_parse_failures"] / r["samples"]
    return {k: r[k] for k in BEHAVIOUR}


def tool_use(run: Path, name: str, label: str, seed: int) -> dict[str, float | None]:
    """Set `name`'s evaluation at `label` in run folder `run`, split by whether each episode
    called a tool (its tool-call count in traces.sqlite, its success in eval/<label>.jsonl):
    the episodes and successes on each side. `seed`: the run's, the eval seed of an episode
    whose tag names none."""
    _, rows = load_outcomes(f"{run}:{label}")
    success = {(r["task_id"], r["seed"], r["sample"]): r["success"]
               for r in rows if r["set"] == name}
    con = connect(run / "traces.sqlite")
    try:
        episodes = con.execute("SELECT task_id, sample_index, tag, tool_calls FROM episodes "
                               "WHERE phase = ?", (EvalNames(label, name).phase,)).fetchall()
    finally:
        con.close()
    if len(episodes) != len(success):
        raise RuntimeError(f"{run}: {len(episodes)} traced episodes of set {name} at {label} "
                           f"for {len(success)} outcomes: were traces sampled or off?")
    sides: dict[bool, list[bool]] = {True: [], False: []}
    for task, sample, tag, calls in episodes:
        last = json.loads(tag)[-1]  # with several eval seeds the tag ends in seed<S>
        eval_seed = int(last[4:]) if str(last).startswith("seed") else seed
        sides[calls > 0].append(success[(task, eval_seed, sample)])
    rate = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"with_tool": len(sides[True]), "success_with_tool": rate(sides[True]),
            "without_tool": len(sides[False]), "success_without_tool": rate(sides[False]),
            "correct_without_tool": sum(sides[False])}


def seed_rows(args: argparse.Namespace, seed: int, runs: dict[str, dict]) -> list[dict]:
    """One row per eval set: SFT, RL, the paired test, and the controls on the same tasks."""
    folder = args.out / f"seed{seed}"
    _, sft_rows = load_outcomes(f"{folder / 'main'}:sft")
    _, rl_rows = load_outcomes(f"{folder / 'main'}:rl")
    main = runs["main"]
    rows = []
    for name in eval_sets(main):
        sft, rl = main[f"{name}_after_sft"], main[f"{name}_after_rl"]
        row = {"seed": seed, "set": name, "sft": sft, "rl": rl,
               "rl_vs_sft": compare(sft_rows, rl_rows, name, seed),
               "behaviour": {"sft": behaviour(sft), "rl": behaviour(rl)},
               "tool_use": {x: tool_use(folder / "main", name, x, seed) for x in ("sft", "rl")},
               "cpu_min": None if main["cpu_s"] is None else main["cpu_s"] / 60,
               "wall_min": main["wall_s"] / 60}
        if "random" in runs:
            _, rand_rows = load_outcomes(f"{folder / 'random'}:rl")
            rand = runs["random"][f"{name}_after_rl"]
            row["random"] = rand
            row["random_vs_sft"] = compare(sft_rows, rand_rows, name, seed)
            row["random_within_sft_ci"] = sft["ci_low"] <= rand["success"] <= sft["ci_high"]
            row["rl_vs_random"] = compare(rand_rows, rl_rows, name, seed)
        if "cold" in runs:
            _, cold_rows = load_outcomes(f"{folder / 'cold'}:rl")
            row["cold"] = runs["cold"][f"{name}_after_rl"]
            row["rl_vs_cold"] = compare(cold_rows, rl_rows, name, seed)
        rows.append(row)
    return rows


def tables(args: argparse.Namespace, rows: list[dict]) -> str:
    config = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    lines = [f"`{config}`, seeds {' '.join(map(str, args.seeds))}; success [95% bootstrap CI "
             "over tasks], RL - SFT paired on the same tasks [paired bootstrap 95% CI], "
             "sign-test p", "",
             "| seed | set | tasks | SFT | SFT + RL | RL - SFT | random reward | random - SFT "
             "| within SFT CI | RL - random | no SFT (RL only) | RL - no SFT "
             "| CPU-min (whole main run) | wall-min (whole main run) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rand = ((fmt(r["random"]), fmt_diff(r["random_vs_sft"]),
                 "yes" if r["random_within_sft_ci"] else "**no**", fmt_diff(r["rl_vs_random"]))
                if "random" in r else ("-",) * 4)
        cold = (fmt(r["cold"]), fmt_diff(r["rl_vs_cold"])) if "cold" in r else ("-", "-")
        lines.append(f"| {r['seed']} | {r['set']} | {r['sft']['tasks']} | {fmt(r['sft'])} | "
                     f"{fmt(r['rl'])} | {fmt_diff(r['rl_vs_sft'])} | {' | '.join(rand)} | "
                     f"{' | '.join(cold)} | "
                     f"{'-' if r['cpu_min'] is None else format(r['cpu_min'], '.1f')} | "
                     f"{r['wall_min']:.1f} |")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    lines += ["", "| set | mean SFT | mean SFT + RL | mean gain | seeds with p < 0.05 "
              f"| gain >= {GOAL_GAIN:.2f} |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["set"] for r in rows):
        rs = [r for r in rows if r["set"] == name]
        gain = mean([r["rl_vs_sft"]["diff"] for r in rs])
        sig = sum(r["rl_vs_sft"]["p_value"] < 0.05 and r["rl_vs_sft"]["diff"] > 0 for r in rs)
        lines.append(f"| {name} | {mean([r['sft']['success'] for r in rs]):.3f} | "
                     f"{mean([r['rl']['success'] for r in rs]):.3f} | {gain:+.3f} | "
                     f"{sig} of {len(rs)} | {'yes' if gain >= GOAL_GAIN else 'no'} |")
    first = [r for r in rows if r["set"] == rows[0]["set"]]
    lines += ["", f"Behaviour on {first[0]['set']} per episode, mean over seeds (SFT -> SFT + RL):",
              "", "| " + " | ".join(BEHAVIOUR.values()) + " |",
              "|" + "---|" * len(BEHAVIOUR)]
    lines.append("| " + " | ".join(
        f"{mean([r['behaviour']['sft'][k] for r in first]):.2f} -> "
        f"{mean([r['behaviour']['rl'][k] for r in first]):.2f}" for k in BEHAVIOUR) + " |")
    rate = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines += ["", "Tool use per set (SFT -> SFT + RL): episodes that called a tool and their "
              "success, episodes that did not and how many of them were correct:", "",
              "| seed | set | with a tool call | success with | without | correct without |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["tool_use"]["sft"], r["tool_use"]["rl"]
        lines.append(f"| {r['seed']} | {r['set']} | {a['with_tool']} -> {b['with_tool']} | "
                     f"{rate(a['success_with_tool'])} -> {rate(b['success_with_tool'])} | "
                     f"{a['without_tool']} -> {b['without_tool']} | "
                     f"{a['correct_without_tool']} -> {b['correct_without_tool']} |")
    return "\n".join(lines)


def conversation(episode: dict) -> str:
    """The episode's turns as text: each message, each tool call as name(arguments)."""
    out = []
    for m in episode["messages"]:
        if m["role"] == "system":
            continue
        calls = [f"{c['function']['name']}({json.dumps(c['function']['arguments'])})"
                 for c in m.get("tool_calls") or []]
        out.append(" ".join(x for x in [f"[{m['role']}]", m.get("content") or "", *calls] if x))
    return "\n".join(out)


def examples(args: argparse.Namespace, seed: int, n: int = 3) -> str:
    """Up to `n` held-out tasks that seed's SFT model failed and its RL model solved, with
    both episodes' conversations from the run's traces."""
    main = args.out / f"seed{seed}" / "main"
    name = eval_sets(json.loads((main / "summary.json").read_text()))[0]
    (_, before), (_, after) = (load_outcomes(f"{main}:{x}") for x in ("sft", "rl"))
    failed = {r["task_id"] for r in before if r["set"] == name and not r["success"]}
    solved = [r["task_id"] for r in after if r["set"] == name and r["success"]]
    picks = [t for t in dict.fromkeys(solved) if t in failed][:n]
    con = connect(main / "traces.sqlite")
    parts = [f"Seed {seed}, set {name}: {len(picks)} of the tasks SFT failed and RL solved."]
    for task in picks:
        parts.append(f"\n### Task {task}\n")
        for phase, want in (("eval_sft", 0.0), ("eval_rl", 1.0)):
            row = con.execute("SELECT id FROM episodes WHERE phase = ? AND task_id = ? "
                              "ORDER BY reward = ? DESC, id LIMIT 1",
                              (phase, task, want)).fetchone()
            if row is None:
                raise RuntimeError(f"{main}/traces.sqlite holds no {phase} episode of task "
                                   f"{task}: was observe.traces off?")
            ep = read_episode(con, row[0])
            parts.append(f"{'After SFT' if phase == 'eval_sft' else 'After SFT + RL'} "
                         f"(reward {ep['reward']:g}):\n\n```text\n{conversation(ep)}\n```\n")
    con.close()
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = run_all(args)
    rows = [r for s in args.seeds for r in seed_rows(args, s, runs[s])]
    table = tables(args, rows)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "table.json").write_text(json.dumps(rows, indent=2))
    (args.out / "examples.md").write_text(examples(args, args.seeds[0]) + "\n")


if __name__ == "__main__":
    main()
