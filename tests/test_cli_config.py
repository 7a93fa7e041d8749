"""`tiller config show CONFIG [key=value ...]`, run in-process: the resolved config with every
default, as YAML that loads back to the same Config."""

from pathlib import Path

import yaml
from helpers import cli

from tiller.config import Config, load_config
from tiller.run import Run

CONFIG = str(Path(__file__).parent.parent / "configs" / "calculator.yaml")


def show(*args: str) -> tuple[int, str]:
    return cli("config", "show", *args)


def test_config_show_prints_the_resolved_config_with_defaults():
    code, out = show(CONFIG, "rl.steps=3", "rl.algorithm.preset=dapo", "rl.mode=async")
    assert code == 0, out
    shown = yaml.safe_load(out)
    cfg = load_config(CONFIG, ["rl.steps=3", "rl.algorithm.preset=dapo", "rl.mode=async"])
    assert Config.model_validate(shown) == cfg
    assert shown["rl"]["steps"] == 3 and shown["rl"]["mode"] == "async"
    # defaults the file does not write, and what the preset resolved to (the file names
    # policy_loss, so the clip range is the loss's own, not dapo's 0.28)
    assert shown["weight_sync"]["parity_tol"] == 0.05 and shown["rl"]["max_staleness"] is None
    alg = shown["rl"]["algorithm"]
    assert (alg["eps_high"], alg["dynamic_sampling"]["max_rounds"], alg["overlong"]["mode"],
            alg["off_policy"]) == (0.2, 3, "soft", "mis")
    assert "max_batch_size" in shown["engine"] and "urls" not in shown["engine"]


def test_config_show_keeps_the_api_key_out():
    code, out = show(CONFIG, "engine.backend=http", "engine.urls=[http://127.0.0.1:1]",
                     "engine.api_key=a-secret-key-of-20-chars")
    assert code == 0, out
    assert yaml.safe_load(out)["engine"]["api_key"] == "**********"
    assert "a-secret-key" not in out


def test_config_show_errors_are_one_line():
    code, out = show(CONFIG, "engine.backend=http", "engine.urls=[http://127.0.0.1:1]",
                     "engine.cache_bytes=0")
    assert code == 2
    assert out.strip().splitlines() == [
        "error: config field engine.cache_bytes: got 0; it only applies with engine.backend: "
        "embedded (engine.backend is http): leave it out, or drop it with engine.cache_bytes=null"]


def test_config_show_prints_the_config_yaml_a_run_writes(calc_sft_dir, tmp_path):
    """One dump (config.dump_config) for both, byte for byte."""
    overrides = [f"model.path={calc_sft_dir}", "model.build=null", "rl.mode=async",
                 "rl.algorithm.preset=dapo", "eval.sets=[{name: a}, {name: b, tasks: 5}]",
                 "logging.tensorboard=false"]
    code, shown = show(CONFIG, *overrides)
    assert code == 0, shown
    run = Run(load_config(CONFIG, overrides), tmp_path)
    run.close()
    assert (tmp_path / "config.yaml").read_text() == shown
    assert "max_staleness: null" in shown and "- name: b\n    split: heldout\n    tasks: 5" in shown
