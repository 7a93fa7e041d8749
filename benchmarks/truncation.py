"""The trainer's logprobs under top-k / top-p: the chunked function against the whole-row method.

`new` is `train/truncation.py` (the kept set from topk of growing k, chunks of rows, only per-row
numbers saved for the backward pass); `old` is the method it replaced, written out below: the
sampler's `kept_set` on every [rows, V] row (a sort of each), then the masked logsumexps of the
logprob and the entropy with plain autograd. Both compute logp_K(y) and H_K of every row from a
float32 log softmax [rows, V], then backward of their sum, with one torch thread.

Each measurement runs in a fresh process, after a warm-up call on 8 rows:
  seconds   wall time of forward + backward (median of --repeats);
  peak MiB  the peak resident set over one forward + backward (VmHWM, reset through
            /proc/self/clear_refs once the inputs exist) less the resident set before it, in a
            second fresh process started with MALLOC_MMAP_THRESHOLD_=65536, so that glibc
            returns every freed tensor to the system and the peak is that of the tensors alive
            at once. It includes the [rows, V] float32 gradient both methods must
            return (the `grad MiB` column).
Logits: N(0, 1) * --scale per entry (default 5: at top_p 0.9 over 49,152 tokens a row keeps a
median of 35, a peaked distribution; smaller scales are flatter and keep more); `kept` is the
median kept-set size over the first 64 rows. Tokens are uniform (mostly outside the kept set,
as stale samples can be).

    PYTHONPATH=src .venv/bin/python benchmarks/truncation.py                  # ~2 minutes
    PYTHONPATH=src .venv/bin/python benchmarks/truncation.py --rows 1024 4096
    PYTHONPATH=src .venv/bin/python benchmarks/truncation.py --quick          # smoke run

`--json PATH` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tiller.engine.sampling import kept_set, truncated_logprobs
from tiller.train.truncation import kept_cut, kept_mask, truncated_token_logprobs

SETTINGS = {"top_p 0.9": (0, 0.9), "top_k 50": (50, 1.0)}


def old_method(logp: torch.Tensor, ids: torch.Tensor, top_k: int, top_p: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-row method (the trainer's before the chunked function)."""
    rows = ids.numel()
    keep = kept_set(logp.detach().exp(), torch.full((rows,), top_k),
                    torch.full((rows,), top_p), max_top_k=top_k, any_top_p=top_p < 1)
    logq = logp - torch.logsumexp(logp.masked_fill(~keep, float("-inf")), -1, keepdim=True)
    ent = -torch.where(keep, logq.exp() * logq, torch.zeros_like(logq)).sum(-1)
    return truncated_logprobs(logp, ids, keep), ent


def new_method(logp: torch.Tensor, ids: torch.Tensor, top_k: int, top_p: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    out, ent = truncated_token_logprobs(logp, ids, top_k, top_p, True)
    assert ent is not None
    return out, ent


METHODS = {"old": old_method, "new": new_method}


def inputs(rows: int, vocab: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 log softmax [rows, vocab] as a leaf, uniform tokens [rows]), seeded."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(rows, vocab, generator=g) * scale, -1)
    return logp.requires_grad_(), torch.randint(0, vocab, (rows,), generator=g)


def resident_kib() -> dict[str, int]:
    """This process's resident set now (VmRSS) and at its peak (VmHWM), in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if line.startswith("Vm"))
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def one(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this process (`--one`): seconds, or the peak resident-set growth."""
    torch.set_num_threads(1)
    fn, (top_k, top_p) = METHODS[spec["method"]], SETTINGS[spec["setting"]]

    def step(logp: torch.Tensor, ids: torch.Tensor) -> float:
        out, ent = fn(logp, ids, top_k, top_p)
        (out.sum() + ent.sum()).backward()
        return float(out.detach().double().sum() + ent.detach().double().sum())

    step(*inputs(8, spec["vocab"], spec["scale"]))  # warm-up: lazy initialisation
    if spec["measure"] == "memory":
        logp, ids = inputs(spec["rows"], spec["vocab"], spec["scale"])
        Path("/proc/self/clear_refs").write_text("5")  # peak := now (Linux >= 4.0)
        before = resident_kib()["VmRSS"]
        step(logp, ids)
        return {"peak_mib": (resident_kib()["VmHWM"] - before) / 1024}
    logp, ids = inputs(spec["rows"], spec["vocab"], spec["scale"])
    times, total = [], 0.0
    for _ in range(spec["repeats"]):
        logp.grad = None
        t0 = time.perf_counter()
        total = step(logp, ids)
        times.append(time.perf_counter() - t0)
    p = logp.detach()[:64].exp()
    kept = kept_mask(p, *kept_cut(p, top_k, top_p)).sum(-1)
    return {"seconds": statistics.median(times), "checksum": total,
            "kept": int(kept.median())}


def spawn(spec: dict[str, Any]) -> dict[str, Any]:
    """`one(spec)` in a fresh process (memory: with glibc's mmap threshold at 64 KiB)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if spec["measure"] == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """A row per (rows, setting, method), with its ratios against `old` of the same case."""
    out = []
    for rows in args.rows:
        for setting in SETTINGS:
            case = {"rows": rows, "vocab": args.vocab, "setting": setting,
                    "scale": args.scale, "repeats": args.repeats}
            got = {m: {**case, "method": m,
                       **spawn({**case, "method": m, "measure": "seconds"}),
                       **spawn({**case, "method": m, "measure": "memory"})} for m in METHODS}
            for r in got.values():
                r["grad_mib"] = rows * args.vocab * 4 / 2**20
                r["time_vs_old"] = r["seconds"] / got["old"]["seconds"]
                r["memory_vs_old"] = r["peak_mib"] / got["old"]["peak_mib"]
            out += got.values()
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| rows x vocab | truncation | kept (median) | method | fwd+bwd s | peak MiB "
             "| grad MiB | time vs old | memory vs old |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} x {r['vocab']} | {r['setting']} | {r['kept']} "
                     f"| {r['method']} | {r['seconds']:.2f} | {r['peak_mib']:.0f} "
                     f"| {r['grad_mib']:.0f} | {r['time_vs_old']:.2f}x "
                     f"| {r['memory_vs_old']:.2f}x |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1024], help="rows (positions)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size")
    p.add_argument("--scale", type=float, default=5.0, help="logits' standard deviation")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats (median)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a seconds-long smoke run")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.vocab = [128], 2000
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]] | None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return None
    t0 = time.perf_counter()
    rows = measure(args)
    print(table(rows))
    print(f"({time.perf_counter() - t0:.0f} s; torch {torch.__version__}, 1 thread)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
