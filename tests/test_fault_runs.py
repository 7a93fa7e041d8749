"""Training runs under injected tool faults, and a recorded run replayed with dead tools."""

import json

import pytest
from helpers import TINY_RUN, numbers

from tiller.config import load_config
from tiller.controller import train
from tiller.rollout.agent_loop import ExpertActor, run_episode

FAULTS = [
    "env.tools.faults={timeout_prob: 0.1, crash_prob: 0.05, hang_s: 2.0, seed: 3}",
    "env.tools.executor={default: {timeout_s: 0.3, retries: 0}}",
    "env.tools.gate.override=true",  # these tools fail 15% of the time on purpose
]


def rows(run_dir, phase=None):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if phase is None or r["phase"] == phase]


@pytest.mark.slow
@pytest.mark.parametrize("config, tool, extra", [
    ("configs/calculator.yaml", "calculate", []),
    ("configs/search.yaml", "search", ["sft.tasks=64", "env.difficulty=2"]),
])
def test_training_completes_under_timeouts_and_crashes(tmp_path, config, tool, extra):
    summary = train(load_config(config, [*TINY_RUN, *extra, *FAULTS]), tmp_path)
    assert summary["heldout_after_rl"]["tasks"] == 16
    rl = rows(tmp_path, "rl")
    # Every phase that logs tool figures: the SFT demos are the expert's, so they always call
    # (the tiny policy itself may not call tools at all).
    logged = [r for r in rows(tmp_path) if f"tool_calls/{tool}" in r]
    assert {r["phase"] for r in logged} >= {"sft_demos", "rl"}
    calls = sum(r[f"tool_calls/{tool}"] for r in logged)
    errors = sum(r[f"env_error_rate/{tool}"] * r[f"tool_calls/{tool}"] for r in logged)
    gate = rows(tmp_path, "gate")[0][f"gate_ok_rate/{tool}"]
    assert gate < 1.0  # the gate saw the faults (and was overridden)
    assert calls >= 30 and errors > 0  # the faults reached the training run's own calls
    dropped = rl[-1].get("ledger/dropped/env_error", 0)
    env_eps = sum(r["env_error_rate"] * 16 for r in rl)  # 4 tasks x 4 samples per step
    assert dropped == pytest.approx(env_eps)  # every env_error episode left the loss


def test_gate_refuses_unreliable_tools(tmp_path):
    cfg = load_config("configs/calculator.yaml",
                      [*TINY_RUN, "env.tools.faults={crash_prob: 0.2, seed: 1}"])
    from tiller.config import ConfigError

    with pytest.raises(ConfigError, match=r"calculate succeeded \d+/\d+ .*override=true"):
        train(cfg, tmp_path)


@pytest.mark.slow
def test_recorded_run_replays_with_dead_tools(tmp_path):
    db = tmp_path / "tools.sqlite"
    record = [*TINY_RUN, f"env.tools.replay={{path: {db}, mode: record}}",
              "env.tools.faults={garbage_prob: 0.2, seed: 5}", "env.tools.gate.enabled=false"]
    replay = [*TINY_RUN, f"env.tools.replay={{path: {db}, mode: replay}}",
              "env.tools.faults={crash_prob: 1.0}"]  # a live call would crash
    train(load_config("configs/calculator.yaml", record), tmp_path / "rec")
    train(load_config("configs/calculator.yaml", replay), tmp_path / "rep")

    def seen(d):
        # the executor's per-tool counters (`name/tool`) count live calls only, and a replay
        # makes none (nor runs the gate); everything the episodes saw must match
        return [r for r in numbers(d, ("/calculate",)) if r["phase"] != "gate"]

    rec, rep = rows(tmp_path / "rec"), rows(tmp_path / "rep")
    assert sum(r.get("tool_calls/calculate", 0) for r in rec) > 0  # the SFT demos' calls
    assert sum(r.get("tool_calls/calculate", 0) for r in rep) == 0  # no live call at all
    assert seen(tmp_path / "rec") == seen(tmp_path / "rep")


async def expert_loop(env, task, actor, tokenizer, **kwargs):
    """An `agent.loop` that plays the scripted expert instead of the policy, so every episode
    of a tiny run makes the same, valid tool calls."""
    return await run_episode(env, task, ExpertActor(type(env), task, tokenizer), tokenizer,
                             **kwargs)


def test_run_level_concurrency_limit_and_cache_span_the_episodes(tmp_path):
    """env.tools.executor limits and the cache act on the whole run, not per episode: 8 tasks
    x 4 samples of the expert, at most one call at a time, and each distinct call runs once
    (the other three samples' identical calls are cache hits)."""
    cfg = load_config("configs/calculator.yaml", [
        *TINY_RUN, "sft.enabled=false", "rl.steps=0", "eval.tasks=8", "eval.samples_per_task=4",
        "agent.loop=test_fault_runs:expert_loop", "env.tools.gate.enabled=false",
        "env.tools.executor={max_concurrency: 1, "
        "tools: {calculate: {cache: true, cache_scope: run}}}"])  # calculate is stateless
    train(cfg, tmp_path)
    ev = rows(tmp_path, "eval_sft")[0]
    calls, hits = ev["tool_calls/calculate"], ev["tool_cache_hits/calculate"]
    assert calls >= 32 and calls % 4 == 0  # every episode called; the samples alike
    assert hits >= calls * 3 / 4  # 3 of each 4 identical calls (more if two tasks share one)
    assert ev["tool_peak_concurrency/calculate"] == 1
    assert ev["tool_calls_per_episode"] == calls / 32
