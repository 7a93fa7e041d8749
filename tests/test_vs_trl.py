"""benchmarks/vs_trl.py: both sides get the same long prompts, and `--quick` runs both to a
table. The run needs TRL (the `bench` extra, not installed in CI): it is skipped without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiller.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sides_prefill_the_same_prompts_of_the_asked_length(vs_trl, calc_model_dir):
    tokenizer = load_tokenizer(calc_model_dir)
    vs_trl.size_preamble(tokenizer, 800)
    tasks = vs_trl.PaddedCalculatorEnv.make_tasks("train", 6, 3, 2)
    assert all(t.system.startswith("# Calculator manual") for t in tasks)
    lengths = vs_trl.check_prompts(tokenizer, tasks)
    assert min(lengths) >= 780 and max(lengths) < 900  # a manual example is under 80 tokens
    # TRL calls the tool as a plain function: tiller's result, and tiller's text on an error
    tool = vs_trl.trl_tool()
    assert tool("2 * 21") == "42"
    assert tool("2 ^ 3") == "error: expected one operation 'a op b' with op in + - *, got '2 ^ 3'"


CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 * 21"}}\n</tool_call>'


def assert_trl_reads_hermes_calls(vs_trl, tokenizer):
    """TRL gets a parser for a template it does not know by its text, and reads with it the
    tool call tiller's parser reads."""
    assert vs_trl.set_response_template(tokenizer) == "TRL's qwen3 (Hermes tool calls in ChatML)"
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    parsed = tokenizer.parse_response(CALL + "<|im_end|>", prefix=prefix)
    assert parsed["tool_calls"] == [{"type": "function", "function": {
        "name": "calculate", "arguments": {"expression": "2 * 21"}}}]


def test_trl_parses_the_demo_templates_tool_calls(vs_trl, calc_model_dir):
    assert_trl_reads_hermes_calls(vs_trl, load_tokenizer(calc_model_dir))


@pytest.mark.slow
def test_smollm2_prompts_are_identical_and_its_calls_parsed(vs_trl, smollm2_dir):
    """SmolLM2-135M-Instruct's own template (ChatML, tool schemas in the system turn): the
    same ids on both sides at ~800 tokens, and TRL reads its Hermes calls."""
    tokenizer = load_tokenizer(smollm2_dir)
    assert vs_trl.size_preamble(tokenizer, 800) == 8  # its tokens per example: more than the demo's
    lengths = vs_trl.check_prompts(tokenizer, vs_trl.PaddedCalculatorEnv.make_tasks(
        "train", 8, 3, 2))
    assert min(lengths) >= 800 and max(lengths) < 950
    assert_trl_reads_hermes_calls(vs_trl, tokenizer)


@pytest.mark.slow
@pytest.mark.integration
def test_quick_runs_both_sides_to_a_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "identical ids on both sides" in proc.stdout
    assert "| TRL / tiller |" in proc.stdout
    result = json.loads((tmp_path / "results.json").read_text())
    for side in ("tiller", "trl"):
        assert len(result["steps"][side]) == 1  # quick: 1 round of 2 steps, 1 is warm-up
        m = result["medians"][side]
        assert m["step_s"] > m["rollout_s"] > 0 and m["train_s"] > 0
        # quick: 2 tasks x 2 samples, at most 12 new tokens in each of at most 3 turns
        assert 4 <= m["tokens"] <= 4 * 12 * 3 and 1 <= m["turns"] <= 3
