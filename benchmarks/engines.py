"""The engine backends side by side, with HF `generate` as the baseline measured in the same run.

Backends (`--backends`): `hf` (plain `model.generate`: one left-padded batched call for single
turn, `HFWaveActor` of benchmarks/engine.py for multi-turn), `embedded` (EmbeddedEngine in this
process), `serve` (the embedded engine in a managed `tiller serve` subprocess, driven through
HttpEngine) and `vllm` (a managed vLLM CPU server from .venv-vllm, driven through VllmEngine).
Models (`--models`): `demo` (a Qwen3 like the demo's: hidden 128, 2 layers, 4 heads, head_dim
32), `25m` (hidden 512, 8 layers, 8 heads, head_dim 64; both random weights built by
`tiller.models.build_tiny_model`), `135m` (SmolLM2-135M-Instruct from `tiller models fetch`).

Per cell (model x backend), fp32, temperature 1:
  single   generated tokens/s of --prompts calculator prompts (chat template with tool schemas),
           all submitted at once, --max-new-tokens each.
  multi    generated tokens/s of --episodes concurrent episodes of `FixedTurnsEnv`
           (benchmarks/engine.py) with --turns assistant turns each, every turn's prompt the
           previous context plus a tool result, through the real agent loop (`collect`).
  client   for the HTTP backends, tiller's own client work: every generate call of the
           multi-turn run replayed one at a time through a new engine of the same class on a
           null server that answers the run's median answer at once (`client_seconds`: body
           building and JSON, httpx, the thread hops, the answer's decoding and checks, plus
           the loopback round trip: an estimate, not a bound, docs/engines.md says why).
           "client ms/req" is the median per call; "client share" the sum over the run's
           calls over the multi-turn run's wall time (the client work runs on the engine's
           one event-loop thread).
  vs hf    the cell's tokens/s over HF's on the same model in this run.
Weight sync (`--sync`, needs vllm in the backends): a full push into the vLLM server
(`VllmEngine.update_weights`, benchmarks/vllm_sync.py's `push_times`) from a folder on disk and
through a /dev/shm segment (`engine.weight_transfer: shm`), alternating on the same server,
against `save_pretrained` of the same model to local disk; medians of --repeats, per model,
and the medians of each part of a push (`vllm_sync.CallTimes`: the checks and write, and each
HTTP call of the push by path).
RL step (`--rl-steps N`): `tiller train` of configs/calculator.yaml (heads 4: head_dim 32) with a
short SFT and N RL steps per backend; the per-step rollout/train/sync seconds from metrics.jsonl.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engines.py \\
        --models demo,25m,135m --backends hf,embedded,serve,vllm --sync --rl-steps 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import select
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as bench  # noqa: E402 - benchmarks/engine.py: the shared single/multi-turn pieces
import vllm_sync  # noqa: E402 - benchmarks/vllm_sync.py: the timed weight push

from tiller.config import VllmEngineConfig, load_config  # noqa: E402
from tiller.controller import train  # noqa: E402
from tiller.engine.api import Generation  # noqa: E402
from tiller.engine.embedded import EmbeddedEngine  # noqa: E402
from tiller.engine.factory import connect  # noqa: E402
from tiller.engine.http import HttpEngine  # noqa: E402
from tiller.engine.servers import ManagedServers, tiller_serve_specs  # noqa: E402
from tiller.engine.updates import WeightUpdate  # noqa: E402
from tiller.engine.vllm import VllmEngine, connect_vllm  # noqa: E402
from tiller.models import build_tiny_model, models_dir  # noqa: E402
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits  # noqa: E402
from tiller.rollout.chat import end_of_turn_token  # noqa: E402

BUILT = {"demo": (128, 2, 4), "25m": (512, 8, 8)}  # hidden, layers, heads
FETCHED = "smollm2-135m-instruct"  # in models_dir(): $TILLER_MODELS_DIR, else ~/.cache
BACKENDS = ("hf", "embedded", "serve", "vllm")
RL_SHORT = ["sft.tasks=128", "sft.epochs=1", "eval.tasks=8",
            "rl.tasks_per_step=4", "rl.group_size=4", "logging.progress=false",
            "logging.report=false", "runtime.threads=1"]
RL_BACKENDS = {"embedded": ["engine.backend=embedded"],
               "serve": ["engine.backend=http", "engine.servers=1"],
               "vllm": ["engine.backend=vllm"]}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,25m,135m")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="weight-sync pushes per model")
    ap.add_argument("--sync", action="store_true", help="time weight sync into vLLM")
    ap.add_argument("--rl-steps", type=int, default=0, help="RL steps of `tiller train` per "
                    "backend on the demo config (0: no RL section)")
    ap.add_argument("--work", default="/tmp/tiller-engines")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    args.models, args.backends = args.models.split(","), args.backends.split(",")
    unknown = set(args.backends) - set(BACKENDS) | set(args.models) - {*BUILT, "135m"}
    if unknown:
        ap.error(f"unknown models/backends: {sorted(unknown)}")
    return args


def model_dir(name: str, work: Path) -> Path:
    if name == "135m":
        return models_dir() / FETCHED
    hidden, layers, heads = BUILT[name]
    path = work / f"model-{name}"
    if not path.exists():
        build_tiny_model(path, vllm_sync.CORPUS, vocab_size=1024, hidden_size=hidden,
                         num_layers=layers, num_heads=heads, max_positions=1024)
    return path


class Recorder:
    """The generate calls of an HttpEngine (their arguments, in order) and the servers' decoded
    answers to them, by wrapping `generate` and `_post` of this one instance."""

    def __init__(self, engine: HttpEngine):
        self.calls: list[tuple[tuple, dict]] = []
        self.answers: list[Any] = []
        post, generate = engine._post, engine.generate

        @functools.wraps(post)
        async def recorded_post(server: Any, path: str, *a: Any, **k: Any) -> Any:
            answer = await post(server, path, *a, **k)
            if path in GENERATE_PATHS:
                self.answers.append(answer)
            return answer

        @functools.wraps(generate)
        async def recorded_generate(*a: Any, **k: Any) -> Any:
            self.calls.append((a, k))
            return await generate(*a, **k)

        engine._post, engine.generate = recorded_post, recorded_generate

    def canned(self) -> bytes:
        """The answer of median length, as JSON: what the null server answers every request."""
        bodies = sorted((json.dumps(a).encode() for a in self.answers), key=len)
        return bodies[len(bodies) // 2]


GENERATE_PATHS = ("/generate", "/v1/completions")  # tiller serve's, vLLM's
# a null server: every POST answered with the canned body of argv[1] at once (asyncio, HTTP/1.1
# keep-alive); it prints its port, and ends with its stdin
NULL_SERVER = r"""
import asyncio, sys
body = open(sys.argv[1], "rb").read()
head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
async def serve(r, w):
    try:
        while True:
            lines = (await r.readuntil(b"\r\n\r\n")).lower().split(b"\r\n")
            size = [int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:")]
            await r.readexactly(size[0] if size else 0)
            w.write(head % len(body) + body)
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        w.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


def client_seconds(engine: HttpEngine, rec: Recorder, work: Path) -> list[float]:
    """Seconds of each generate call of `rec`, replayed one at a time, in order, through a new
    engine of `engine`'s class on a null server that answers `rec.canned()` at once: tiller's
    own client work per request (building and encoding the body, httpx, the thread hops,
    decoding and checking the answer), plus the loopback round trip and the null server's
    answer. An estimate, not a bound: the requests are the real ones, plus loopback and the
    null server (more than the request side's cost), but every answer is the median one
    (vLLM's grow turn by turn with `return_token_ids`: the later turns' answer side is timed
    at less than its size). One warm-up call first, not counted."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "canned.json").write_bytes(rec.canned())
    proc = subprocess.Popen([sys.executable, "-c", NULL_SERVER, str(work / "canned.json")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    null = None
    try:
        if not select.select([proc.stdout], [], [], 30.0)[0]:
            raise RuntimeError("the null server did not print its port within 30 s")
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        kind = {"shapes": {}} if isinstance(engine, VllmEngine) else {}
        null = type(engine)([url], weights_dir=work / "weights", max_retries=0,
                            request_timeout_s=60, **kind)

        async def replay() -> list[float]:
            times = []
            for a, k in rec.calls[:1] + rec.calls:
                t0 = time.perf_counter()
                await null.generate(*a, **k)
                times.append(time.perf_counter() - t0)
            return times[1:]

        return asyncio.run(replay())
    finally:
        if null is not None:
            null.close()
        proc.stdin.close()  # its end
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start(backend: str, model: Any, tok: Any, path: Path, run_dir: Path) -> Any:
    """The engine of `backend` holding `model`'s weights (None for hf)."""
    if backend == "embedded":
        return EmbeddedEngine(model, tok.pad_token_id, max_batch_size=64)
    initial = WeightUpdate.full(model, 0)
    if backend == "serve":
        weights = run_dir / "weights"
        weights.mkdir(parents=True, exist_ok=True)
        managed = ManagedServers(tiller_serve_specs(path, 1, weights_root=weights,
                                                    dtype="float32", threads=1),
                                 log_dir=run_dir / "servers", startup_timeout_s=300)
        return connect(managed.start(), weights_dir=weights, api_key=None,
                       request_timeout_s=600, max_retries=0,
                       vocab_size=model.config.vocab_size,
                       max_context=model.config.max_position_embeddings, initial=initial,
                       dtype="float32", root=run_dir, managed=managed)
    if backend == "vllm":
        # tiller_shm on the server too: --sync times pushes from disk and through shm on it
        cfg = VllmEngineConfig(kv_cache_bytes=512 << 20, startup_timeout_s=600,
                               weight_transfer="shm")
        return connect_vllm(cfg, model, tok, run_dir=run_dir, initial=initial, dtype="float32")
    return None


def single(backend: str, engine: Any, model: Any, tok: Any, args: argparse.Namespace) -> float:
    prompts = bench.calc_prompts(tok, args.prompts)
    params = bench.params_for(tok, model, args.max_new_tokens)
    t0 = time.perf_counter()
    if engine is None:
        rows, _ = bench.hf_generate(model, prompts, params, tok.pad_token_id, 0)
        tokens = sum(map(len, rows))
    else:
        tokens = bench.run_engine_single(engine, prompts, params, 0)
    return tokens / (time.perf_counter() - t0)


class ClosedTurns:
    """An actor whose turns that ran out of --max-new-tokens ("length") are closed with the
    end-of-turn token, as if sampled (logprob 0), so that random-weight models play every turn
    of `FixedTurnsEnv` instead of ending the episode truncated. The closing tokens are counted
    in `added` and left out of the tokens/s."""

    def __init__(self, actor: Any, eot: int):
        self.actor, self.eot, self.added = actor, eot, 0

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int,
                  session_id: str | None = None) -> Generation:
        gen = await self.actor.act(prompt_ids, messages, seed, session_id=session_id)
        if gen.finish_reason != "length":
            return gen
        self.added += 1
        versions = (*gen.versions, gen.versions[-1]) if gen.versions else ()
        return dataclasses.replace(gen, token_ids=[*gen.token_ids, self.eot],
                                   logprobs=[*gen.logprobs, 0.0], finish_reason="stop",
                                   versions=versions)


def multi(engine: Any, model: Any, tok: Any, args: argparse.Namespace
          ) -> tuple[float, float, float]:
    """(generated tokens/s, turns per episode, wall seconds) of the multi-turn episodes."""
    params = bench.params_for(tok, model, args.max_new_tokens)
    bench.FixedTurnsEnv.turns = args.turns
    limits = EpisodeLimits(args.turns, model.config.max_position_embeddings)
    tasks = bench.CalculatorEnv.make_tasks("train", args.episodes, 7, 2)
    inner = (bench.HFWaveActor(model, params, tok.pad_token_id, 64, 0) if engine is None
             else EngineActor(engine, params))
    actor = ClosedTurns(inner, tok.convert_tokens_to_ids(end_of_turn_token(tok)))
    trajs, wall = bench.run_episodes(actor, bench.FixedTurnsEnv, tasks, 1, tok, limits, 0)
    aborted = sum(t.status.value == "aborted" for t in trajs)
    if aborted:
        raise RuntimeError(f"{aborted} of {len(trajs)} episodes aborted")
    return ((sum(t.num_generated for t in trajs) - actor.added) / wall,
            sum(t.num_turns for t in trajs) / len(trajs), wall)


def cell(name: str, backend: str, args: argparse.Namespace, sync: dict) -> dict[str, Any]:
    path = model_dir(name, Path(args.work))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    engine = start(backend, model, tok, path, Path(args.work) / f"run-{name}-{backend}")
    row: dict[str, Any] = {"model": name, "params_m": bench.millions(model), "backend": backend,
                           "start_s": time.perf_counter() - t0}
    try:
        single(backend, engine, model, tok, args)  # warm-up (first allocations), every side
        row["single_tok_s"] = single(backend, engine, model, tok, args)
        rec = Recorder(engine) if isinstance(engine, HttpEngine) else None
        row["multi_tok_s"], row["turns"], wall = multi(engine, model, tok, args)
        row["client_ms"] = row["client_share"] = None
        if rec is not None:
            per = client_seconds(engine, rec, Path(args.work) / f"null-{name}-{backend}")
            row["client_ms"] = 1000 * statistics.median(per)
            row["client_share"] = sum(per) / wall
        if backend == "vllm" and args.sync:
            sync[name] = sync_times(engine, model, Path(args.work) / f"run-{name}-vllm", args)
    finally:
        if engine is not None:
            engine.close()
    print(f"{name} {backend}: {row}", file=sys.stderr)
    return row


def sync_times(engine: Any, model: Any, run_dir: Path, args: argparse.Namespace) -> dict:
    """Median seconds of `save_pretrained` to local disk and of a full push into vLLM from
    disk and through shm (`engine.weight_transfer`), the two alternating, same server."""
    med = statistics.median
    save = [vllm_sync.timed(lambda: model.save_pretrained(run_dir / "hf-save"))
            for _ in range(args.repeats)]
    times: dict[str, tuple[list, list, list]] = {"disk": ([], [], []), "shm": ([], [], [])}
    calls = vllm_sync.CallTimes(engine)
    for i in range(args.repeats):
        for j, transfer in enumerate(times):
            for got, more in zip(times[transfer], vllm_sync.push_times(
                    engine, model, run_dir / "weights", 1 + 2 * i + j, 1, transfer, calls),
                    strict=True):
                got.extend(more)
    out: dict[str, Any] = {"save_s": med(save)}
    for transfer, (push, write, parts) in times.items():
        out |= {f"{transfer}_push_s": med(push), f"{transfer}_write_s": med(write),
                f"{transfer}_parts": {k: med(p.get(k, 0.0) for p in parts)
                                      for k in dict.fromkeys(k for p in parts for k in p)}}
    return out


def rl_steps(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.work) / f"rl-{backend}"
    cfg = load_config("configs/calculator.yaml",
                      [*RL_SHORT, f"rl.steps={args.rl_steps}", *RL_BACKENDS[backend]])
    if out.exists():  # ours; a fresh run refuses a run's record
        shutil.rmtree(out)
    train(cfg, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    mean = lambda k: sum(r.get(k, 0.0) for r in rl) / len(rl)  # noqa: E731
    return {"backend": backend, "steps": len(rl), "rollout_s": mean("rollout_s"),
            "train_s": mean("train_s"), "sync_s": mean("sync_s"), "step_s": mean("step_s")}


def tables(rows: list[dict], sync: dict) -> str:
    hf = {r["model"]: r for r in rows if r["backend"] == "hf"}

    def vs(r: dict, key: str) -> str:
        base = hf.get(r["model"])
        return f"{r[key] / base[key]:.2f}x" if base else "-"

    out = ["| model | backend | start s | single tok/s | vs hf | multi tok/s | vs hf | "
           "turns/ep | client ms/req | client share |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        client = ("- | -" if r["client_share"] is None else
                  f"{r['client_ms']:.2f} | {100 * r['client_share']:.1f}%")
        out.append(f"| {r['model']} ({r['params_m']}) | {r['backend']} | {r['start_s']:.1f} | "
                   f"{r['single_tok_s']:.0f} | {vs(r, 'single_tok_s')} | "
                   f"{r['multi_tok_s']:.0f} | {vs(r, 'multi_tok_s')} | {r['turns']:.1f} | "
                   f"{client} |")
    if sync:
        out += ["", "| model | save_pretrained s | disk push s (write) | shm push s (write) | "
                "disk / save | shm / save | shm / disk |", "|---|---|---|---|---|---|---|"]
        out += [f"| {m} | {s['save_s']:.3f} | {s['disk_push_s']:.3f} ({s['disk_write_s']:.3f}) | "
                f"{s['shm_push_s']:.3f} ({s['shm_write_s']:.3f}) | "
                f"{s['disk_push_s'] / s['save_s']:.2f}x | {s['shm_push_s'] / s['save_s']:.2f}x | "
                f"{s['shm_push_s'] / s['disk_push_s']:.2f}x |" for m, s in sync.items()]
        out += ["", "Parts of a push (medians, s): `_save` (checks and write) and each HTTP call",
                "", "| model | path | parts |", "|---|---|---|"]
        out += [f"| {m} | {t} | " + ", ".join(f"{k} {v:.3f}" for k, v in s[f"{t}_parts"].items())
                + " |" for m, s in sync.items() for t in ("disk", "shm")]
    return "\n".join(out)


def rl_table(rl: list[dict]) -> str:
    out = ["| backend | RL steps | rollout s/step | train s/step | sync s/step | step s |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r['backend']} | {r['steps']} | {r['rollout_s']:.2f} | {r['train_s']:.2f} | "
            f"{r['sync_s']:.2f} | {r['step_s']:.2f} |" for r in rl]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    sync: dict[str, dict] = {}
    rows = [cell(m, b, args, sync) for m in args.models for b in args.backends]
    print(tables(rows, sync), flush=True)  # before the RL section, which takes longest
    rl = [rl_steps(b, args) for b in args.backends if b in RL_BACKENDS] if args.rl_steps else []
    if rl:
        print("\n" + rl_table(rl))
    result = {"rows": rows, "sync": sync, "rl": rl}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
