"""benchmarks/engine.py keeps running: its --quick smoke run fills every table (timings are not
asserted, only that each section measured what it says), and its two benchmark-local pieces
(the 8-turn env and the per-wave HF `generate` actor) do what the benchmark relies on."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiller.engine.api import Generation
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.chat import ChatFormat, end_of_turn_token
from tiller.rollout.trajectory import Status

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks/engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_fills_every_table(calc_sft_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/engine.py", "--quick", "--model", str(calc_sft_dir),
         "--work", str(tmp_path), "--label", "smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "smoke.json").read_text())
    # single turn: the demo model and the locally built Qwen3, 4 prompts, every side counted
    assert [(r["model"].split()[0], r["prompts"]) for r in res["single"]] == [("demo", 4),
                                                                             ("qwen3", 4)]
    for r in res["single"]:
        assert 0 < r["tiller_tokens"] <= 4 * 8  # 4 prompts x 8 new tokens at most
        assert 0 < r["hf_tokens"] <= 4 * 8 and 0 < r["cb_tokens"] <= 4 * 8
    # multi-turn: both envs, 4 episodes each, driven by both sides without an abort
    assert [(r["env"], r["episodes"]) for r in res["multi"]] == [("calculator", 4),
                                                                ("fixed-8-turns", 4)]
    for r in res["multi"]:
        assert r["A_aborted"] == r["B_aborted"] == 0
        assert sum(r["waves_b"]) >= 4 and r["c_prefill_token_s"] > 0 and r["c_decode_step_s"] > 0
        assert 0 <= r["B_finished_row_share"] < 1 and r["B_prefill_vs_nongen"] >= 1
        # the engine's side comes from its stats() counters
        assert r["A_prefill_vs_nongen"] > 0 and 0 <= r["A_finished_row_share"] < 1
    # the server: measured, or skipped with the reason printed
    if "skipped" in res["serve"][0]:
        assert f"SKIPPED serve section: {res['serve'][0]['skipped']}" in proc.stderr
    else:
        assert [(r["clients"], r["ok"]) for r in res["serve"]] == [(2, 4)]
    # the RL phase: one step of 2 tasks x 2 samples
    assert res["e2e"]["steps"] == 1 and res["e2e"]["episodes"] == 4
    # the prefix lookup: both algorithms timed at each length (they found the same prefix)
    assert [r["tokens"] for r in res["lookup"]] == [256, 1024]
    assert all(r["old_ms"] > 0 and r["new_ms"] > 0 for r in res["lookup"])
    for title in ("Single turn", "Multi-turn", "Server under load", "End to end",
                  "Prefix lookup"):
        assert f"### {title}" in proc.stdout


def test_the_baseline_lookup_finds_what_the_prefix_cache_finds():
    """The lookup section's baseline (the quadratic lookup before issue 19) agrees with
    `PrefixCache` on prompts sharing 0 to all of their blocks with the stored entry."""
    stored = list(range(100, 260))
    old = bench.QuadraticLookup()
    old.put(stored)
    new = bench.PrefixCache(1 << 30)
    kv = bench.torch.zeros(1, 1, len(stored), 1)
    new.put(stored, [(kv, kv)], "a")
    for keep in (0, 5, 16, 40, 160):
        prompt = stored[:keep] + [7] * 20
        assert old.lookup(prompt) == new.lookup(prompt, "b")[0] == keep // 16 * 16


def test_fixed_turns_env_runs_every_turn(tokenizer):
    """Whatever the turns say, the episode has exactly FixedTurnsEnv.turns of them."""
    env = bench.FixedTurnsEnv()
    task = bench.CalculatorEnv.make_tasks("train", 1, 0, 2)[0]
    eot = tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))

    class Chatty:
        async def act(self, prompt_ids, messages, seed, session_id=None):
            ids = [*tokenizer.encode("The answer is 3.", add_special_tokens=False), eot]
            return Generation(ids, [0.0] * len(ids), "stop", 0)

    traj = asyncio.run(run_episode(env, task, Chatty(), tokenizer, seed=0,
                                   limits=EpisodeLimits(8, 1024)))
    assert traj.status is Status.COMPLETED and traj.num_turns == bench.FixedTurnsEnv.turns == 8
    # each observation is a short tool result: ~20 tokens with the template's wrapping
    spans = traj.turn_spans
    observations = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    assert all(10 <= n <= 30 for n in observations), observations


def test_hf_wave_actor_batches_every_waiting_turn(model, tokenizer):
    """The first turns of 4 episodes go into one `generate` call, and the counters add up."""
    params = bench.params_for(tokenizer, model, 6)
    actor = bench.HFWaveActor(model, params, tokenizer.pad_token_id, max_batch=128, seed=0)
    tasks = bench.CalculatorEnv.make_tasks("train", 2, 0, 2)
    trajs, _ = bench.run_episodes(actor, bench.CalculatorEnv, tasks, 2, tokenizer,
                                  EpisodeLimits(3, 512), seed=0)
    chat = ChatFormat(tokenizer, bench.CalculatorEnv().tool_schemas())
    first = [chat.prompt_ids(m) for m in bench.calc_messages(2, 0)]
    assert actor.waves[0] == 4 and len(trajs) == 4
    assert actor.prefill_tokens >= 2 * sum(map(len, first))  # each prompt, twice per task
    assert actor.real_steps == sum(t.num_generated for t in trajs)
    assert actor.row_steps >= actor.real_steps


@pytest.mark.parametrize(("tokens", "real"), [([5, 7, 2, 0, 0], 3), ([5, 7], 2), ([], 0)])
def test_count_real_stops_at_the_first_stop_token(tokens, real):
    assert bench.count_real(tokens, (2, 9)) == real
