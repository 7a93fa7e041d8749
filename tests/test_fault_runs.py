"""Training runs under injected tool faults, and a recorded run replayed with dead tools."""

import json

import pytest
from helpers import TINY_RUN, numbers

from tiller.config import load_config
from tiller.controller import train

FAULTS = [
    "env.tools.faults={timeout_prob: 0.1, crash_prob: 0.05, hang_s: 2.0, seed: 3}",
    "env.tools.executor={default: {timeout_s: 0.3, retries: 0}}",
    "env.tools.gate.override=true",  # these tools fail 15% of the time on purpose
]


def rows(run_dir, phase=None):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if phase is None or r["phase"] == phase]


@pytest.mark.parametrize("config, tool, extra", [
    ("configs/calculator.yaml", "calculate", []),
    ("configs/search.yaml", "search", ["sft.tasks=64", "env.difficulty=2"]),
])
def test_training_completes_under_timeouts_and_crashes(tmp_path, config, tool, extra):
    summary = train(load_config(config, [*TINY_RUN, *extra, *FAULTS]), tmp_path)
    assert summary["heldout_after_rl"]["tasks"] == 16
    rl = rows(tmp_path, "rl")
    calls = sum(r.get(f"tool_calls/{tool}", 0) for r in rl)
    errors = sum(r.get(f"env_error_rate/{tool}", 0) * r.get(f"tool_calls/{tool}", 0) for r in rl)
    gate = rows(tmp_path, "gate")[0][f"gate_ok_rate/{tool}"]
    assert gate < 1.0  # the gate saw the faults (and was overridden)
    if calls:  # the tiny policy may not call tools at all; the evals and the gate always do
        assert errors > 0
    dropped = rl[-1].get("ledger/dropped/env_error", 0)
    env_eps = sum(r["env_error_rate"] * 16 for r in rl)  # 4 tasks x 4 samples per step
    assert dropped == pytest.approx(env_eps)  # every env_error episode left the loss


def test_gate_refuses_unreliable_tools(tmp_path):
    cfg = load_config("configs/calculator.yaml",
                      [*TINY_RUN, "env.tools.faults={crash_prob: 0.2, seed: 1}"])
    from tiller.config import ConfigError

    with pytest.raises(ConfigError, match=r"calculate succeeded \d+/\d+ .*override=true"):
        train(cfg, tmp_path)


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
