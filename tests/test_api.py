"""The Python API: `tiller.train(config_or_path, **overrides)` and `tiller.Trainer(...)`, over
the same config models as the CLI; `import tiller` stays free of torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import tiller
from tiller.api import build_config, dotted_name
from tiller.errors import ConfigError

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "dataset"
TINY = {"build": {"vocab_size": 400, "hidden_size": 64, "num_layers": 1, "num_heads": 2,
                  "corpus_tasks": 10}}


@pytest.mark.integration
def test_import_tiller_is_fast_and_imports_no_torch():
    code = "import sys, tiller; assert callable(tiller.Trainer.__init__); " \
           "print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src")}, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


def test_overrides_are_nested_dicts_validated_like_the_cli():
    cfg = build_config(ROOT / "configs" / "calculator.yaml",
                       {"rl": {"steps": 3, "algorithm": {"preset": "dapo"}}, "seed": 7})
    assert (cfg.rl.steps, cfg.seed, cfg.rl.algorithm.preset) == (3, 7, "dapo")
    assert cfg.rl.group_size == 8  # the rest of the section is the file's
    with pytest.raises(ConfigError, match=r"^config field rl.steps: got -1;"):
        build_config(ROOT / "configs" / "calculator.yaml", {"rl": {"steps": -1}})
    with pytest.raises(ConfigError, match=r"^config field rl.stepz: "):
        tiller.train(ROOT / "configs" / "calculator.yaml", rl={"stepz": 1})


def test_trainer_names_importable_callables_and_holds_the_others(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import arith

    local = lambda prompts, completions, **kw: [0.0 for _ in completions]  # noqa: E731
    t = tiller.Trainer(model=TINY, data=str(EXAMPLE / "train.jsonl"), tools=[arith.add],
                       reward=[arith.correct, {"function": local, "weight": 0.5, "gate": True},
                               "exact_match"], rl={"steps": 1}, sft={"enabled": False})
    cfg = t.config
    assert cfg.env.name == "dataset" and cfg.data.tools == ["arith:add"]
    assert [r.function for r in cfg.rewards[:1]] == ["arith:correct"]
    assert cfg.rewards[1].function.startswith("<in-process>:") and cfg.rewards[1].gate
    assert cfg.rewards[2].verifier == "exact_match"
    assert dotted_name(local).startswith("<in-process>:test_trainer_names")
    with pytest.raises(ConfigError, match="expected a function, a verifier name"):
        tiller.Trainer(model=TINY, data="x.jsonl", reward=3)


@pytest.mark.slow
@pytest.mark.integration
def test_trainer_trains_on_a_parquet_file_with_an_in_process_reward(tmp_path):
    rows = [{"prompt": f"What is {a} + 1?", "answer": a + 1} for a in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    sft = tmp_path / "sft.jsonl"  # so that the tiny model learns to end its turn
    sft.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": r["prompt"]},
        {"role": "assistant", "content": str(r["answer"])}]}) + "\n" for r in rows))
    seen = []

    def reward(prompts, completions, answer, **kwargs):
        seen.append((prompts[0], completions[0], answer[0]))
        return [float(completions[0].strip() == str(answer[0]))]

    summary = tiller.Trainer(
        model=TINY, data={"train": str(tmp_path / "train.parquet"), "sft": str(sft)},
        reward=reward, output_dir=tmp_path / "run",
        env={"max_turns": 1, "max_episode_tokens": 64}, sampling={"max_new_tokens": 6},
        sft={"epochs": 8, "batch_size": 4, "warmup_steps": 2},
        rl={"steps": 1, "tasks_per_step": 4, "group_size": 2},
        logging={"progress": False, "tensorboard": False}).train()
    assert "rl" in summary and summary["heldout"] == "disabled"  # no data.eval
    assert summary["eval_disabled"] == "env dataset has no heldout tasks at env.difficulty=2"
    assert not any(k.startswith("heldout_after") for k in summary)
    prompts = {r["prompt"]: r["answer"] for r in rows}
    # only episodes that end with an answer reach the reward; after SFT most do
    assert seen and all(prompts[p] == a and isinstance(c, str) for p, c, a in seen)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    name = saved["rewards"][0]["function"]
    assert name.startswith("<in-process>:")
    # the saved config names a callable that only this process holds: the CLI says so
    code = ("from tiller.errors import import_dotted, ConfigError\n"
            f"try: import_dotted({name!r}, 'rewards[0].function')\n"
            "except ConfigError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src")}, check=True, timeout=60)
    assert out.stdout.startswith("config field rewards[0].function: got '<in-process>:")
    assert "replay from the CLI needs an importable" in out.stdout


@pytest.mark.slow
def test_tiller_train_runs_the_readme_example(tmp_path, monkeypatch):
    """docs/datasets.md's command, through the API with two overrides that keep it short."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    summary = tiller.train(EXAMPLE / "config.yaml", output_dir=tmp_path / "run",
                           rl={"steps": 1}, sft={"epochs": 1})
    assert summary["sft"]["demonstrations"] == 25
    assert summary["heldout_after_rl"]["tasks"] == 8
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 1 and {"check/correct", "check/brief", "check/numeric_match"} <= set(rl[0])


def test_trainer_tools_join_another_envs_own_tools():
    from tiller.api import Trainer

    t = Trainer(model={"build": {}}, env="calculator", tools=["tiller_tools_mod:lookup"])
    assert t.config.env.tools.functions == ["tiller_tools_mod:lookup"]
    assert t.config.data.tools == []
    d = Trainer(model={"build": {}}, data="rows.jsonl", tools=["tiller_tools_mod:lookup"],
                reward="exact_match")
    assert d.config.data.tools == ["tiller_tools_mod:lookup"] and d.config.env.tools.functions == []
