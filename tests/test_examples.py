"""examples/grpo_minimal.py runs end to end on tiny settings: SFT learns, the engine's
logprobs are the trainer's (TITO), and every GRPO step reports its figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "grpo_minimal.py"


@pytest.mark.slow
def test_grpo_minimal_runs_on_tiny_settings(tmp_path):
    spec = importlib.util.spec_from_file_location("grpo_minimal", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses resolve annotations through it
    spec.loader.exec_module(example)
    args = example.Args(out=str(tmp_path), hidden_size=64, sft_tasks=64, sft_steps=20,
                        sft_batch_size=16, steps=2, tasks_per_step=4, group_size=4,
                        eval_tasks=8)
    history = example.main(args)
    assert len(history["sft_loss"]) == 20
    assert history["sft_loss"][-1] < 0.65 * history["sft_loss"][0]  # 6.8 -> 3.9 measured
    assert len(history["reward"]) == len(history["clip_frac"]) == 2
    # each step's reward mean is a share of 16 episodes with 0/1 rewards
    assert all(float(r * 16).is_integer() and 0 <= r <= 1 for r in history["reward"])
    assert max(history["logp_mismatch"]) < 1e-4  # TITO: engine and trainer agree in fp32
    assert len(history["success_before"]) == len(history["success_after"]) == 1
