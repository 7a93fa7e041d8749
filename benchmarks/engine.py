"""The engine benchmark: tiller's embedded engine against Hugging Face `generate`, side by side.

Sections (`--sections`, all by default); every ratio is between two sides measured in this same
process, A and B alternating in each repeat (A first in even repeats, B first in odd ones):

  single  one turn of N calculator prompts (chat template, tool schemas), temperature 1:
          generated tokens/s of tiller's engine, of `model.generate` (one batched, left-padded
          call, do_sample, same max_new_tokens; only real tokens up to and including the first
          stop token are counted) and of transformers' ContinuousBatchingManager
          (one started manager, logprobs on), on the demo model and on a ~25M-parameter Qwen3
          with random weights.
  multi   N concurrent episodes of the calculator env and of an 8-turn env (`FixedTurnsEnv`,
          below), through the real agent loop (`collect` / `run_episode`), driven (A) by
          tiller's engine and (B) by `HFWaveActor`: every waiting turn batched into one
          `generate` call per wave, each turn re-prefilling its whole conversation.
  serve   `tiller serve` as a subprocess on a free 127.0.0.1 port, driven by the official
          `openai` client (AsyncOpenAI chat completions) at C concurrent clients for a bounded
          number of requests: requests/s, p50 and p99 latency. Skipped, saying why, when the
          serve extra or the command is missing.
  e2e     the demo's RL phase (configs/calculator.yaml, `rl.steps` steps from the SFT
          checkpoint, no SFT, no eval): episodes/s, generated tokens/s, seconds per RL step.
  lookup  one KV prefix lookup (`PrefixCache.lookup`, run on the engine's worker thread for
          every new request) of a prompt of L tokens whose every 16-token block is stored
          (another session's entry of the same L tokens: a GRPO sibling's next turn), for each
          L of --lookup-tokens, against the lookup before issue 19 (`QuadraticLookup`, below:
          it compared the whole prefix again at every block hit). Milliseconds, median of
          --repeats; no model is loaded for this section.

Multi-turn columns:
  prefill / non-gen   tokens run through the model as prompt, over the non-generated tokens
                      (prompt and observations, `loss_mask == 0`) of the finished trajectories.
                      A: `engine.stats()["prefill_tokens"]`; B: the real prompt tokens of every
                      row of every wave. The floor is a little above 1: the last generated
                      token of a turn is first run through the model with the next turn.
  finished rows       the share of decoded row-steps spent on rows that had already finished.
                      A: from `stats()` (`engine_counts`: decoded row-steps that produced
                      no token of a live request, over all decoded row-steps);
                      B: (rows x steps of each `generate` call - tokens it really generated)
                      over rows x steps.
  wall / ideal        wall time over a modelled ideal engine's:
                          ideal = P * c_prefill + G * c_step(B) / B
                      P: non-generated tokens of the finished trajectories, each prefilled once;
                      G: generated tokens, decoded B rows at a time (B = the number of episodes,
                      i.e. the batch never shrinks); c_prefill: seconds per token of one bare
                      prefill forward of B rows of the median prompt length; c_step(B): seconds
                      of one bare decode forward of B rows on a cache as long as the mean
                      position of the generated tokens in their trajectories. Both are measured in
                      this run with plain `model(...)` calls on a DynamicCache (logits of the
                      last position only); tools, the agent loop and sampling count as overhead.

Sizes are flags; `--quick` is a seconds-long smoke run (tiny sizes, used by the tests).
Results go to `<--work>/<--label>.json` as well as the printed tables.

    # the full benchmark (1 torch thread; the lead runs it on a quiet machine)
    .venv/bin/python benchmarks/engine.py --label after
    # smoke run
    .venv/bin/python benchmarks/engine.py --quick

Before/after (end to end on the old engine): the script only uses tiller APIs that existed at
e8a2ede (the old wave engine), and falls back where newer ones are missing (no `stats()`: those
columns show "-"). Run this same file against the old code with PYTHONPATH, then compare:

    git worktree add /tmp/tiller-before e8a2ede
    PYTHONPATH=/tmp/tiller-before/src .venv/bin/python benchmarks/engine.py \\
        --sections e2e,single,multi --label before \\
        --config /tmp/tiller-before/configs/calculator.yaml
    PYTHONPATH=src .venv/bin/python benchmarks/engine.py --sections e2e,single,multi \\
        --label after --compare runs/bench_engine/before.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import importlib.util
import inspect
import itertools
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    PreTrainedModel,
    Qwen3Config,
)

import tiller
from tiller.config import load_config
from tiller.engine.api import Generation, SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.kv_cache import PrefixCache
from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Env, StepResult, Task
from tiller.envs.calculator import CalculatorEnv
from tiller.envs.verifiers import Reward
from tiller.models import load_model, load_tokenizer
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits, run_episode
from tiller.rollout.chat import ChatFormat, stop_token_ids
from tiller.rollout.collect import collect

DEMO_SFT = "runs/seeds/seed0/checkpoints/sft"  # what `benchmarks/demo_seeds.py` leaves behind
# a quick SFT of the demo's build config on tool-using demonstrations only, so that episodes
# call the tool (40 SFT steps; the demo itself runs 400)
BUILD_SFT = ["sft.tasks=640", "sft.epochs=4", "sft.imperfect_fraction=0.0"]
QUICK_BUILD = ["model.build.hidden_size=64", "model.build.vocab_size=600",
               "model.build.corpus_tasks=60", "sft.tasks=32", "sft.epochs=1"]
SECTIONS = ("single", "multi", "serve", "e2e", "lookup")
QUICK_SIZES = {"repeats": 1, "prompts": "4", "episodes": "4", "group_size": 2,
               "max_new_tokens": 8, "big": "64,2,4", "clients": "2", "requests": "4",
               "rl_steps": 1, "lookup_tokens": "256,1024"}
QUICK_RL = ["rl.tasks_per_step=2", "rl.group_size=2", "sampling.max_new_tokens=8"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--model", help=f"demo model (default: {DEMO_SFT} when it exists, else one "
                   "built and SFT-ed under --work)")
    p.add_argument("--config", default="configs/calculator.yaml")
    p.add_argument("--work", default="runs/bench_engine", help="cache and results folder")
    p.add_argument("--label", default="now", help="names the results file <work>/<label>.json")
    p.add_argument("--compare", help="a results JSON of an earlier run: print ratios to it")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the issue's baseline "
                   "figures use 1)")
    p.add_argument("--repeats", type=int, default=3, help="A/B repeats, order alternating")
    p.add_argument("--prompts", default="32,128", help="single turn: prompt counts")
    p.add_argument("--episodes", default="32,128", help="multi turn: concurrent episodes")
    p.add_argument("--group-size", type=int, default=8, help="multi turn: episodes per task, "
                   "as in the demo's RL (they share a prompt)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=128, help="engine rows decoded at once")
    p.add_argument("--big", default="512,8,8", help="the ~25M Qwen3: hidden,layers,heads")
    p.add_argument("--no-cb", action="store_true", help="skip the ContinuousBatchingManager")
    p.add_argument("--cb-attn", default="sdpa", help="attn_implementation for the CB manager "
                   "(sdpa or eager, which it runs as paged|eager)")
    p.add_argument("--cb-page-size", type=int, default=16, help="CB manager KV page (tokens)")
    p.add_argument("--clients", default="16,64", help="serve: concurrent openai clients")
    p.add_argument("--requests", default="128,256", help="serve: requests per client count")
    p.add_argument("--request-timeout", type=float, default=120.0, help="serve: per request, s")
    p.add_argument("--serve-timeout", type=float, default=600.0,
                   help="serve: start-up and each load run, s")
    p.add_argument("--rl-steps", type=int, default=3, help="e2e: RL steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="e2e: extra config override (repeatable)")
    p.add_argument("--lookup-tokens", default="2048,8192,32768",
                   help="lookup: prompt lengths (tokens)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a seconds-long smoke run")
    args = p.parse_args(argv)
    if args.quick:  # every size small, except those given on the command line
        for name, value in QUICK_SIZES.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
        args.set = [*QUICK_RL, *args.set]
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- models and prompts -------------------------------------------------------------------


def demo_model(args: argparse.Namespace) -> Path:
    """--model, else the demo's SFT checkpoint, else one built (and cached) under --work."""
    if args.model:
        return Path(args.model)
    if not args.quick and (Path(DEMO_SFT) / "config.json").is_file():
        return Path(DEMO_SFT)
    from tiller.controller import sft
    from tiller.run import Run

    out = Path(args.work) / ("model_quick" if args.quick else "model")
    path = out / "checkpoints" / "sft"
    if (path / "config.json").is_file():
        return path
    print(f"building the demo model and a quick SFT in {out} (cached for later runs)",
          file=sys.stderr)
    cfg = load_config(args.config, [*(QUICK_BUILD if args.quick else BUILD_SFT),
                                    "logging.progress=false", "logging.tensorboard=false"])
    run = Run(cfg, out)
    try:
        sft(run)
        return run.save("sft")
    finally:
        run.close()


def big_model(tokenizer: Any, hidden: int, layers: int, heads: int) -> PreTrainedModel:
    """A Qwen3 shaped like the demo's (MLP 3x, half as many KV heads) with the demo tokenizer;
    512/8/8 is 25.7M parameters. Random weights: its turns run to max_new_tokens."""
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def millions(model: PreTrainedModel) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"


def calc_messages(n: int, seed: int) -> list[list[dict]]:
    """The opening messages of n calculator tasks (what `CalculatorEnv.reset` returns)."""
    return [[{"role": "system", "content": t.system}, {"role": "user", "content": t.prompt}]
            for t in CalculatorEnv.make_tasks("train", n, seed, 2)]


def calc_prompts(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    """The first prompts of n calculator episodes, exactly as the agent loop renders them."""
    chat = ChatFormat(tokenizer, CalculatorEnv().tool_schemas())
    return [chat.prompt_ids(m) for m in calc_messages(n, seed)]


def params_for(tokenizer: Any, model: PreTrainedModel, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                          stop_token_ids=stop_token_ids(tokenizer, model.generation_config))


def make_engine(model: PreTrainedModel, tokenizer: Any, args: argparse.Namespace
                ) -> EmbeddedEngine:
    # its own copy, as in a run: the engine may change the model it is given
    return EmbeddedEngine(copy.deepcopy(model).eval(), tokenizer.pad_token_id,
                          max_batch_size=args.max_batch)


def close_engine(engine: EmbeddedEngine) -> None:
    if hasattr(engine, "close"):  # the old (e8a2ede) engine has no worker thread to stop
        engine.close()


def flush(engine: EmbeddedEngine) -> None:
    """Between repeats: the same prompts again must not hit the previous repeat's KV."""
    if hasattr(engine, "flush_cache"):
        engine.flush_cache()


def stats(engine: EmbeddedEngine) -> dict[str, float]:
    return dict(engine.stats()) if hasattr(engine, "stats") else {}


def stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def engine_counts(delta: dict[str, float]) -> dict[str, float]:
    """The multi-turn counters from a `stats()` difference. Each request's first token comes
    from its prefill, every later one from a decode row-step, so the decoded row-steps that
    produced nothing for a live request are decoded_row_steps - (generated_tokens - requests).
    Empty for an engine without `stats()` (the old one)."""
    if not delta:
        return {}
    live = delta["generated_tokens"] - delta["requests"]
    return {"prefill_tokens": delta["prefill_tokens"], "cached_tokens": delta["cached_tokens"],
            "decode_row_steps": delta["decoded_row_steps"],
            "finished_row_steps": delta["decoded_row_steps"] - live,
            "busy_s": delta["busy_s"]}


def count_real(tokens: Sequence[int], stop: Sequence[int]) -> int:
    """Generated tokens up to and including the first stop token (padding after it is not)."""
    for i, t in enumerate(tokens):
        if t in stop:
            return i + 1
    return len(tokens)


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompts: Sequence[Sequence[int]],
                params: SamplingParams, pad: int, seed: int) -> tuple[list[list[int]], int]:
    """One batched `generate` call; returns each row's real tokens and the steps it ran."""
    ids, mask = left_pad(prompts, pad)
    torch.manual_seed(seed)  # generate samples from the global generator
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=params.temperature > 0,
        # top_k=0 explicitly: None would fall back to transformers' default top-k of 50, a
        # different (shorter-tailed) distribution than the engine samples
        temperature=params.temperature or None, top_k=params.top_k,
        top_p=params.top_p, max_new_tokens=params.max_new_tokens,
        eos_token_id=list(params.stop_token_ids), pad_token_id=pad)
    new = out[:, ids.size(1):].tolist()
    stop = params.stop_token_ids
    return [row[:count_real(row, stop)] for row in new], len(new[0]) if new else 0


# ---- single turn --------------------------------------------------------------------------


def run_engine_single(engine: EmbeddedEngine, prompts: list[list[int]],
                      params: SamplingParams, seed: int) -> int:
    async def all_() -> list[Generation]:
        return list(await asyncio.gather(*(engine.generate(p, params, seed * 100_003 + i)
                                           for i, p in enumerate(prompts))))

    return sum(len(g.token_ids) for g in asyncio.run(all_()))


class CBManager:
    """transformers' ContinuousBatchingManager, started once and fed each run's prompts, as an
    engine would use it (`generate_batch` builds and tears one down per call, and its teardown
    runs `gc.collect()` twice: ~1.4 s a call here). Logprobs on, as tiller returns them; sized
    for `most` requests of up to `longest` prompt tokens, all prefilled in one step."""

    def __init__(self, model: PreTrainedModel, params: SamplingParams, pad: int, most: int,
                 longest: int, args: argparse.Namespace):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page, self.params = args.cb_page_size, params
        pages = most * -(-(longest + params.max_new_tokens) // page)
        # no block sharing: a run's prompts are all prefilled in one step, so they could not
        # share pages anyway, and a repeat must not reuse the pages of the one before
        cb = ContinuousBatchingConfig(
            return_logprobs=True, seed=0, page_size=page, num_blocks=pages + most + 16,
            allow_block_sharing=False,
            max_batch_tokens=most * (longest + 1),
            max_requests_per_batch=min(args.max_batch, most))
        gen = GenerationConfig(do_sample=True, temperature=params.temperature, top_k=0,
                               top_p=1.0, max_new_tokens=params.max_new_tokens,
                               eos_token_id=list(params.stop_token_ids), pad_token_id=pad)
        self.manager = model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=cb)
        self.manager.start()

    def run(self, prompts: list[list[int]], timeout: float = 600.0) -> int:
        ids = set(self.manager.add_requests(prompts, max_new_tokens=self.params.max_new_tokens))
        tokens, deadline = 0, time.monotonic() + timeout
        while ids:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ContinuousBatchingManager: {len(ids)} of {len(prompts)} "
                                   f"requests unanswered after {timeout:.0f} s")
            out = self.manager.get_result(timeout=1)
            if out is None:
                if not self.manager.is_running():
                    raise RuntimeError("ContinuousBatchingManager's generation thread died "
                                       "(its log says why)")
                continue
            if out.request_id in ids and out.is_finished():
                if out.error:
                    raise RuntimeError(f"ContinuousBatchingManager: {out.error}")
                ids.discard(out.request_id)
                tokens += count_real(out.generated_tokens, self.params.stop_token_ids)
        return tokens

    def close(self) -> None:
        self.manager.stop(block=True, timeout=60)
        self.manager.destroy()


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t0


def single_turn(args: argparse.Namespace, name: str, model: PreTrainedModel, tokenizer: Any
                ) -> list[dict[str, Any]]:
    """Tokens/s of tiller's engine, HF generate and (unless --no-cb) the CB manager on the
    same prompts; the three run in rotating order in each repeat."""
    params = params_for(tokenizer, model, args.max_new_tokens)
    pad = tokenizer.pad_token_id
    engine = make_engine(model, tokenizer, args)
    every = {n: calc_prompts(tokenizer, n) for n in ints(args.prompts)}
    cb = None
    if not args.no_cb:  # its own copy: the manager switches the model's attention
        cb_model = copy.deepcopy(model).eval()
        cb_model.set_attn_implementation(args.cb_attn)
        cb = CBManager(cb_model, params, pad, max(every),
                       max(len(p) for ps in every.values() for p in ps), args)
    rows = []
    try:
        for n, prompts in every.items():
            sides: dict[str, Callable[[int], int]] = {
                "tiller": lambda s, pr=prompts: run_engine_single(engine, pr, params, s),
                "hf": lambda s, pr=prompts: sum(map(len, hf_generate(model, pr, params, pad,
                                                                      s)[0])),
            }
            if cb is not None:  # one manager seed: its requests have no seeds of their own
                sides["cb"] = lambda s, pr=prompts: cb.run(pr)
            for fn in sides.values():  # warm-up: first-call costs are not the steady state
                fn(10**6)
            tokens = dict.fromkeys(sides, 0)
            secs = dict.fromkeys(sides, 0.0)
            names = list(sides)
            for r in range(args.repeats):
                for side in names[r % len(names):] + names[:r % len(names)]:
                    flush(engine)
                    got, s = timed(lambda fn=sides[side], r=r: fn(r))
                    tokens[side] += got
                    secs[side] += s
            tps = {k: tokens[k] / secs[k] for k in sides}
            rows.append({"model": name, "prompts": n,
                         "prompt_tokens_mean": sum(map(len, prompts)) / n,
                         **{f"{k}_tokens_per_s": v for k, v in tps.items()},
                         **{f"{k}_tokens": tokens[k] for k in sides},
                         "tiller_vs_hf": tps["tiller"] / tps["hf"],
                         "cb_vs_hf": tps["cb"] / tps["hf"] if "cb" in tps else None})
            print(f"single {name} x{n}: tiller {tps['tiller']:.0f} tok/s, hf {tps['hf']:.0f}"
                  + (f", cb {tps['cb']:.0f}" if "cb" in tps else ""), file=sys.stderr)
    finally:
        close_engine(engine)
        if cb is not None:
            cb.close()
    return rows


# ---- multi turn ---------------------------------------------------------------------------


class FixedTurnsEnv(CalculatorEnv):
    """A calculator task that goes on for exactly `turns` assistant turns, whatever they say:
    each turn gets a tool-like observation (~20 tokens with the template's wrapping) and the
    episode ends after the last one. A long multi-turn workload for any model."""

    turns = 8

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.step_no = 0

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        self.rng = random.Random(seed)
        self.step_no = 0
        return await super().reset(task, seed)

    async def step(self, action: ParsedTurn) -> StepResult:
        self.step_no += 1
        if self.step_no >= self.turns:
            return StepResult(messages=[], done=True)
        value = self.rng.randrange(10**7, 10**8)  # one token per digit with the demo tokenizer
        return StepResult(messages=[{"role": "tool", "name": "calculate",
                                     "content": f"{value} (step {self.step_no})"}], done=False)

    async def verify(self, final: ParsedTurn | None) -> Reward:
        return Reward(float(final is not None))


@dataclass
class _Wait:
    prompt_ids: list[int]
    future: asyncio.Future


class HFWaveActor:
    """The agent loop's actor over plain HF `generate`: every turn waiting when a wave starts
    goes into one left-padded `generate` call (at most `max_batch` rows); turns that become
    ready during a wave wait for the next. Each turn re-prefills its whole conversation.
    Logprobs are returned as zeros (the loop needs one per token; computing them would only
    slow this baseline down)."""

    def __init__(self, model: PreTrainedModel, params: SamplingParams, pad: int, max_batch: int,
                 seed: int):
        self.model, self.params, self.pad, self.max_batch = model, params, pad, max_batch
        self.seed = seed
        self.pending: list[_Wait] = []
        self.waves: list[int] = []
        self.prefill_tokens = self.row_steps = self.real_steps = 0
        self._worker: asyncio.Task | None = None

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int,
                  session_id: str | None = None) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self.pending.append(_Wait(list(prompt_ids), future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    async def _settle(self) -> None:
        """Let every episode whose tool call just finished queue its turn (generously: until
        the queue stops growing for 2 ms), so that waves are as full as they can be."""
        while True:
            n = len(self.pending)
            await asyncio.sleep(0.002)
            if len(self.pending) == n:
                return

    async def _serve(self) -> None:
        while self.pending:
            await self._settle()
            batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch:]
            batch = [w for w in batch if not w.future.cancelled()]
            if not batch:
                continue
            self.waves.append(len(batch))
            try:
                outs = await asyncio.to_thread(self._generate, [w.prompt_ids for w in batch])
            except Exception as e:  # every waiting episode sees the failure (it aborts, counted)
                for w in batch:
                    if not w.future.cancelled():
                        w.future.set_exception(e)
                continue
            for w, gen in zip(batch, outs, strict=True):
                if not w.future.cancelled():
                    w.future.set_result(gen)

    def _generate(self, prompts: list[list[int]]) -> list[Generation]:
        room = min(self.model.config.max_position_embeddings - len(p) for p in prompts)
        params = self.params
        if room < params.max_new_tokens:  # the engine clips each row's budget the same way
            params = SamplingParams(params.temperature, params.top_p, params.top_k,
                                    max(1, room), params.stop_token_ids)
        rows, steps = hf_generate(self.model, prompts, params, self.pad,
                                  self.seed + len(self.waves))
        self.prefill_tokens += sum(map(len, prompts))
        self.row_steps += steps * len(prompts)
        self.real_steps += sum(map(len, rows))
        stop = params.stop_token_ids
        return [Generation(r, [0.0] * len(r), "stop" if r and r[-1] in stop else "length", 0)
                for r in rows]


@torch.inference_mode()
def bare_costs(model: PreTrainedModel, prompts: list[list[int]], batch: int, context: int,
               steps: int = 8) -> tuple[float, float]:
    """(seconds per prefill token, seconds per decode step of `batch` rows): plain forwards on a
    DynamicCache with logits of the last position only. Prefill: `batch` rows of the median
    prompt length; decode: `batch` rows on a cache of `context` tokens (the generated tokens'
    mean position: decode attention grows with it). The best of two tries (noise only ever
    adds time)."""
    rows = [prompts[i % len(prompts)] for i in range(batch)]

    def tile(length: int) -> torch.Tensor:  # every row cut or repeated to `length` tokens
        return torch.tensor([(r * (length // len(r) + 1))[:length] for r in rows])

    short, long = tile(int(statistics.median(map(len, rows)))), tile(max(1, context))
    # transformers 5 renames past_key_values to cache (the engine makes the same check)
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    best_prefill = best_step = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        model(input_ids=short, use_cache=True, logits_to_keep=1, **{arg: DynamicCache()})
        best_prefill = min(best_prefill, (time.perf_counter() - t0) / short.numel())
        cache = DynamicCache()
        out = model(input_ids=long, use_cache=True, logits_to_keep=1, **{arg: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, use_cache=True, logits_to_keep=1, **{arg: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        best_step = min(best_step, (time.perf_counter() - t0) / steps)
    return best_prefill, best_step


def run_episodes(actor: Any, env_cls: type[Env], tasks: list[Task], samples: int,
                 tokenizer: Any, limits: EpisodeLimits, seed: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    trajs = asyncio.run(collect(tasks, samples, actor, episode_fn=run_episode,
                                make_env=lambda *key: env_cls(), tokenizer=tokenizer,
                                limits=limits, seed=seed, tag=("bench",)))
    return trajs, time.perf_counter() - t0


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def multi_turn(args: argparse.Namespace, model: PreTrainedModel, tokenizer: Any
               ) -> list[dict[str, Any]]:
    params = params_for(tokenizer, model, args.max_new_tokens)
    envs = {"calculator": (CalculatorEnv, EpisodeLimits(6, 512)),
            f"fixed-{FixedTurnsEnv.turns}-turns": (FixedTurnsEnv, EpisodeLimits(8, 1024))}
    engine = make_engine(model, tokenizer, args)
    rows = []
    try:
        for (env_name, (env_cls, limits)), n in itertools.product(envs.items(),
                                                                   ints(args.episodes)):
            group = max(1, min(args.group_size, n))
            tasks = CalculatorEnv.make_tasks("train", -(-n // group), 7, 2)
            acc = {side: Counter() for side in "AB"}
            waves: list[int] = []
            run_episodes(EngineActor(engine, params), env_cls, tasks[:1], 1, tokenizer, limits,
                         10**6)  # warm-up
            for r in range(args.repeats):
                for side in ("AB" if r % 2 == 0 else "BA"):
                    if side == "A":
                        flush(engine)
                        before = stats(engine)
                        trajs, wall = run_episodes(EngineActor(engine, params), env_cls, tasks,
                                                   group, tokenizer, limits, r)
                        acc["A"].update(engine_counts(stats_delta(before, stats(engine))))
                    else:
                        actor = HFWaveActor(model, params, tokenizer.pad_token_id,
                                            args.max_batch, r)
                        trajs, wall = run_episodes(actor, env_cls, tasks, group, tokenizer,
                                                   limits, r)
                        acc["B"].update(prefill_tokens=actor.prefill_tokens,
                                        decode_row_steps=actor.row_steps,
                                        finished_row_steps=actor.row_steps - actor.real_steps)
                        waves += actor.waves if r == 0 else []
                    gen = sum(t.num_generated for t in trajs)
                    nongen = sum(len(t.token_ids) for t in trajs) - gen
                    acc[side].update(wall=wall, generated=gen, nongen=nongen,
                                     episodes=len(trajs), turns=sum(t.num_turns for t in trajs),
                                     aborted=sum(t.status.value == "aborted" for t in trajs),
                                     positions=sum(i for t in trajs
                                                   for i, m in enumerate(t.loss_mask) if m))
            both = acc["A"] + acc["B"]
            context = round(both["positions"] / max(both["generated"], 1))
            c_prefill, c_step = bare_costs(model, calc_prompts(tokenizer, n), n, context)
            row: dict[str, Any] = {"env": env_name, "episodes": n, "model": millions(model),
                                   "waves_b": waves, "c_prefill_token_s": c_prefill,
                                   "c_decode_step_s": c_step, "decode_context": context}
            for side, a in acc.items():
                ideal = a["nongen"] * c_prefill + a["generated"] * c_step / n
                row[f"{side}_tokens_per_s"] = a["generated"] / a["wall"]
                row[f"{side}_turns_mean"] = a["turns"] / a["episodes"]
                row[f"{side}_aborted"] = a["aborted"]
                row[f"{side}_wall_vs_ideal"] = a["wall"] / ideal
                row[f"{side}_prefill_vs_nongen"] = ratio(a.get("prefill_tokens"), a["nongen"])
                row[f"{side}_finished_row_share"] = ratio(a.get("finished_row_steps"),
                                                          a.get("decode_row_steps"))
            row["A_vs_B"] = row["A_tokens_per_s"] / row["B_tokens_per_s"]
            row["A_stats"] = dict(acc["A"])
            rows.append(row)
            print(f"multi {env_name} x{n}: A {row['A_tokens_per_s']:.0f} tok/s, "
                  f"B {row['B_tokens_per_s']:.0f} tok/s, waves {waves}", file=sys.stderr)
    finally:
        close_engine(engine)
    return rows


# ---- server under load --------------------------------------------------------------------


def serve_missing() -> str | None:
    """Why the serve section cannot run here, or None."""
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"missing {', '.join(missing)}: pip install 'tiller[serve]' for the server, "
                "openai (in tiller[dev]) for the client")
    probe = subprocess.run([sys.executable, "-m", "tiller", "serve", "--help"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"`tiller serve` is not available in this tiller ({tiller.__file__})"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tiller serve exited with {proc.returncode} before /health "
                               f"answered; its log: {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.5)
    raise TimeoutError(f"tiller serve did not answer {url}/health within {timeout:.0f} s; "
                       f"its log: {log}")


async def load(base: str, messages: list[list[dict]], tools: list[dict], clients: int,
               requests: int, max_tokens: int, timeout: float, total: float) -> dict[str, Any]:
    """`requests` chat completions from `clients` concurrent workers; failures are counted by
    type (and the first one kept), never retried."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=timeout,
                                max_retries=0)
    model = (await client.models.list()).data[0].id
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    first_error: list[str] = []
    tokens = 0
    counter = itertools.count()

    async def worker() -> None:
        nonlocal tokens
        while (i := next(counter)) < requests:
            t0 = time.perf_counter()
            try:
                r = await client.chat.completions.create(
                    model=model, messages=messages[i % len(messages)], tools=tools,
                    max_tokens=max_tokens, temperature=1.0)
            except openai.OpenAIError as e:
                errors[type(e).__name__] += 1
                first_error[:] = first_error or [f"{type(e).__name__}: {e}"[:300]]
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens if r.usage else 0

    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), total)
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

    return {"clients": clients, "requests": requests, "ok": len(lat), "errors": dict(errors),
            "first_error": first_error[0] if first_error else None, "wall_s": wall,
            "requests_per_s": len(lat) / wall, "tokens_per_s": tokens / wall,
            "p50_s": pct(0.50), "p99_s": pct(0.99)}


def serve_load(args: argparse.Namespace, model_path: Path) -> list[dict]:
    why = serve_missing()
    if why is not None:
        print(f"SKIPPED serve section: {why}", file=sys.stderr)
        return [{"skipped": why}]
    port, work = free_port(), Path(args.work)
    log = work / f"serve-{args.label}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "tiller", "serve", str(model_path), "--port", str(port),
           "--host", "127.0.0.1"]
    messages = calc_messages(max(ints(args.requests)), 11)
    tools = [{"type": "function", "function": s} if "function" not in s else s
             for s in CalculatorEnv().tool_schemas()]
    rows = []
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, proc, args.serve_timeout, log)
            for clients, requests in zip(ints(args.clients), itertools.cycle(ints(args.requests))):
                row = asyncio.run(load(base, messages, tools, clients, requests,
                                       args.max_new_tokens, args.request_timeout,
                                       args.serve_timeout))
                rows.append(row)
                print(f"serve x{clients}: {row['requests_per_s']:.1f} req/s, "
                      f"{row['ok']}/{requests} ok, errors {row['errors']}", file=sys.stderr)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
    return rows


# ---- end to end ---------------------------------------------------------------------------


def end_to_end(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    """The demo's RL phase alone (no gate, SFT or eval) from the SFT checkpoint."""
    from tiller.controller import rl
    from tiller.run import Run

    overrides = [*args.set, f"model.path={model_path}", "model.build=null",
                 "sft.enabled=false", f"rl.steps={args.rl_steps}", "logging.progress=false",
                 "logging.tensorboard=false"]
    run = Run(load_config(args.config, overrides),
              Path(args.work) / f"e2e-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.perf_counter()
    try:
        episodes = rl(run)["ledger"]["started"]  # every episode the RL phase rolled out
    finally:
        run.close()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["phase"] == "rl"]
    rollout_s = sum(r["rollout_s"] for r in rows)
    return {"steps": len(rows), "episodes": episodes, "wall_s": wall,
            "episodes_per_s": episodes / wall,
            "tokens_per_s": sum(r["rollout_tokens"] for r in rows) / wall,
            "s_per_step": wall / max(len(rows), 1), "rollout_s_per_step": rollout_s / len(rows),
            "trainer_busy_frac": 1 - rollout_s / sum(r["step_s"] for r in rows),
            "run_dir": str(run.dir)}


# ---- tables -------------------------------------------------------------------------------


# ---- prefix lookup ------------------------------------------------------------------------


class QuadraticLookup:
    """The block index of `PrefixCache` before issue 19, the lookup section's baseline: a hash
    chained over whole blocks maps to the newest entry holding that prefix, and each block hit
    is verified by comparing the whole prefix again, O(L^2 / block) per lookup."""

    def __init__(self, block_size: int = 16):
        self.block_size = block_size
        self.entries: list[tuple[int, ...]] = []
        self.blocks: dict[int, int] = {}  # hash of tokens[: k * block_size] -> entry index

    def hashes(self, tokens: tuple[int, ...]) -> list[int]:
        h, out, b = 0, [], self.block_size
        for k in range(len(tokens) // b):
            h = hash((h, tokens[k * b:(k + 1) * b]))
            out.append(h)
        return out

    def put(self, tokens: list[int]) -> None:
        self.entries.append(tuple(tokens))
        for h in self.hashes(self.entries[-1]):
            self.blocks[h] = len(self.entries) - 1

    def lookup(self, tokens: list[int]) -> int:
        toks, best = tuple(tokens), 0
        for k, h in enumerate(self.hashes(toks[:-1]), start=1):
            entry = self.blocks.get(h)
            if entry is None:
                break
            n = k * self.block_size
            if n > best and self.entries[entry][:n] == toks[:n]:
                best = n
        return min(best, len(toks) - 1)


def prefix_lookup(args: argparse.Namespace) -> list[dict]:
    """Per prompt length: the old and the new lookup of the same prompt, A/B alternating."""
    rows = []
    for length in ints(args.lookup_tokens):
        rng = random.Random(length)
        stored = [rng.randrange(32000) for _ in range(length)]
        prompt = stored + [rng.randrange(32000) for _ in range(16)]  # the next turn's tokens
        cache = PrefixCache(1 << 40)
        kv = torch.zeros(1, 1, length, 1)
        cache.put(stored, [(kv, kv)], "sibling")
        old = QuadraticLookup()
        old.put(stored)
        sides = {"old": functools.partial(old.lookup, prompt),
                 "new": lambda c=cache, p=prompt: c.lookup(p, "another session")[0]}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for rep in range(args.repeats):
            for side in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                found, seconds = timed(sides[side])
                assert found == length, (side, found, length)  # both find every block
                times[side].append(seconds)
        old_ms, new_ms = (1e3 * statistics.median(times[s]) for s in ("old", "new"))
        rows.append({"tokens": length, "old_ms": old_ms, "new_ms": new_ms,
                     "old_vs_new": old_ms / new_ms})
    return rows


def fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def md(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def tables(res: dict[str, Any]) -> str:
    out = [f"tiller at {res['tiller']} ({res['commit']}), {res['threads']} torch thread(s), "
           f"{res['repeats']} repeat(s), label {res['label']!r}"]
    if "single" in res:
        out.append("\n### Single turn (generated tokens/s)\n")
        out.append(md(["model", "prompts", "prompt tok", "tiller", "HF generate", "tiller / HF",
                       "CB manager", "CB / HF"],
                      [[r["model"], str(r["prompts"]), fmt(r["prompt_tokens_mean"], ".0f"),
                        fmt(r["tiller_tokens_per_s"], ".0f"), fmt(r["hf_tokens_per_s"], ".0f"),
                        fmt(r["tiller_vs_hf"], ".2f", "x"),
                        fmt(r.get("cb_tokens_per_s"), ".0f"), fmt(r["cb_vs_hf"], ".2f", "x")]
                       for r in res["single"]]))
        out.append("\ngoal (issue 8): tiller / HF >= 1.1x on the demo model, >= 1.0x on ~25M")
    if "multi" in res:
        out.append("\n### Multi-turn (A: tiller engine, B: HF generate per wave)\n")
        out.append(md(["env", "episodes", "turns/ep", "A tok/s", "B tok/s", "A / B",
                       "A prefill / non-gen", "B prefill / non-gen", "A finished rows",
                       "B finished rows", "A wall / ideal", "B wall / ideal", "aborted A/B"],
                      [[r["env"], str(r["episodes"]), fmt(r["A_turns_mean"], ".1f"),
                        fmt(r["A_tokens_per_s"], ".0f"), fmt(r["B_tokens_per_s"], ".0f"),
                        fmt(r["A_vs_B"], ".2f", "x"), fmt(r["A_prefill_vs_nongen"]),
                        fmt(r["B_prefill_vs_nongen"]), fmt(r["A_finished_row_share"], ".1%"),
                        fmt(r["B_finished_row_share"], ".1%"), fmt(r["A_wall_vs_ideal"]),
                        fmt(r["B_wall_vs_ideal"]), f"{r['A_aborted']}/{r['B_aborted']}"]
                       for r in res["multi"]]))
        out.append("\ngoals (issue 8): A / B >= 3x, A prefill / non-gen <= 1.05, A finished "
                   "rows <= 5%, A wall / ideal <= 1.2")
        out.append("B's waves (first repeat): "
                   + "; ".join(f"{r['env']} x{r['episodes']}: {r['waves_b']}"
                               for r in res["multi"]))
    if "serve" in res:
        out.append("\n### Server under load (openai client, chat completions)\n")
        if res["serve"] and "skipped" in res["serve"][0]:
            out.append(f"skipped: {res['serve'][0]['skipped']}")
        else:
            out.append(md(["clients", "requests", "ok", "req/s", "tok/s", "p50 s", "p99 s",
                           "errors"],
                          [[str(r["clients"]), str(r["requests"]), str(r["ok"]),
                            fmt(r["requests_per_s"], ".1f"), fmt(r["tokens_per_s"], ".0f"),
                            fmt(r["p50_s"], ".2f"), fmt(r["p99_s"], ".2f"),
                            json.dumps(r["errors"]) if r["errors"] else "0"]
                           for r in res["serve"]]))
    if "e2e" in res:
        e = res["e2e"]
        out.append("\n### End to end (demo RL phase)\n")
        out.append(md(["steps", "episodes", "episodes/s", "gen tok/s", "s / step",
                       "rollout s / step", "trainer busy"],
                      [[str(e["steps"]), str(e["episodes"]), fmt(e["episodes_per_s"]),
                        fmt(e["tokens_per_s"], ".0f"), fmt(e["s_per_step"]),
                        fmt(e["rollout_s_per_step"]), fmt(e["trainer_busy_frac"], ".0%")]]))
    if "lookup" in res:
        out.append("\n### Prefix lookup (ms per lookup, every block of the prompt stored)\n")
        out.append(md(["prompt tokens", "before (quadratic)", "now (trie)", "before / now"],
                      [[str(r["tokens"]), fmt(r["old_ms"], ".3f"), fmt(r["new_ms"], ".3f"),
                        fmt(r["old_vs_new"], ".0f", "x")] for r in res["lookup"]]))
        out.append("\ngoal (issue 19): a 32k-token lookup under 5 ms")
    return "\n".join(out)


def compare(res: dict[str, Any], old: dict[str, Any]) -> str:
    """This run against an earlier results file (e.g. the old engine): ratios now / then."""
    out = [f"\n### {res['label']!r} vs {old['label']!r} ({old['commit']})\n"]
    rows = []
    if "e2e" in res and "e2e" in old:
        for key in ("episodes_per_s", "tokens_per_s"):
            rows.append([f"e2e {key}", fmt(old["e2e"][key]), fmt(res["e2e"][key]),
                         fmt(res["e2e"][key] / old["e2e"][key], ".2f", "x")])
        for key in ("s_per_step", "rollout_s_per_step"):
            rows.append([f"e2e {key} (speed-up)", fmt(old["e2e"][key]), fmt(res["e2e"][key]),
                         fmt(old["e2e"][key] / res["e2e"][key], ".2f", "x")])
    for key, metric in (("single", "tiller_tokens_per_s"), ("multi", "A_tokens_per_s")):
        then = {(r.get("model", r.get("env")), r.get("prompts", r.get("episodes"))): r
                for r in old.get(key, [])}
        for r in res.get(key, []):
            k = (r.get("model", r.get("env")), r.get("prompts", r.get("episodes")))
            if k in then:
                rows.append([f"{key} {k[0]} x{k[1]} tok/s", fmt(then[k][metric], ".0f"),
                             fmt(r[metric], ".0f"), fmt(r[metric] / then[k][metric], ".2f", "x")])
    out.append(md(["metric", old["label"], res["label"], "ratio"], rows))
    return "\n".join(out)


def git_commit() -> str:
    """The commit of the tiller that is imported (this file may run against an older one)."""
    try:
        r = subprocess.run(["git", "-C", str(Path(tiller.__file__).parent), "rev-parse",
                            "--short", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    return r.stdout.strip() or "unknown (not a git checkout)"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # what runtime.threads: auto takes in the runs made here and the `tiller serve` started
    # here (an environment variable, so an older checkout under PYTHONPATH reads it too)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = model = tokenizer = None
    if set(args.sections) - {"lookup"}:  # the lookup section needs no model
        path = demo_model(args)
        tokenizer = load_tokenizer(path)
        model = load_model(path).eval()
    res: dict[str, Any] = {"label": args.label, "tiller": str(Path(tiller.__file__).parent),
                           "commit": git_commit(), "threads": args.threads,
                           "repeats": args.repeats, "model_path": str(path),
                           "argv": sys.argv[1:] if argv is None else list(argv)}
    sections: dict[str, Callable[[], Any]] = {
        "single": lambda: [*single_turn(args, f"demo {millions(model)}", model, tokenizer),
                           *single_turn(args, f"qwen3 {millions(big)} random", big, tokenizer)],
        "multi": lambda: multi_turn(args, model, tokenizer),
        "serve": lambda: serve_load(args, path),
        "e2e": lambda: end_to_end(args, path),
        "lookup": lambda: prefix_lookup(args)}
    big = big_model(tokenizer, *ints(args.big)) if "single" in args.sections else None
    res["section_s"] = {}
    for name in (s for s in SECTIONS if s in args.sections):
        ts = time.perf_counter()
        res[name] = sections[name]()
        res["section_s"][name] = time.perf_counter() - ts
        print(f"{name}: {res['section_s'][name]:.0f} s", file=sys.stderr)
    res["total_s"] = time.perf_counter() - t0
    text = tables(res)
    if args.compare:
        text += "\n" + compare(res, json.loads(Path(args.compare).read_text()))
    out = work / f"{args.label}.json"
    out.write_text(json.dumps(res, indent=2))
    print(text)
    print(f"\nresults: {out}, total {res['total_s']:.0f} s")
    return res


if __name__ == "__main__":
    main()
