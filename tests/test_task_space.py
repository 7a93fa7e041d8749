"""Start-up failures a user fixes in one line: a task count larger than the env's task space,
and a missing optional package (named with the pip extra that installs it). Both stop a run
before any work, and the draws themselves give up fast when the space runs out."""

from __future__ import annotations

import random
import sys

import pytest
from helpers import cli

from tiller.config import ConfigError, load_config
from tiller.envs import ENVS
from tiller.envs.splits import draw_split, split_of, split_size
from tiller.run import Run


def test_draw_split_gives_up_fast_when_the_space_runs_out():
    keys = [f"key{i}" for i in range(50)]
    heldout = sorted(k for k in keys if split_of(k) == "heldout")
    assert split_size(keys, "heldout") == len(heldout) == 9
    assert split_size(1000, "heldout") == 200 and split_size(1000, "train") == 800
    draws = 0

    def draw(rng):
        nonlocal draws
        draws += 1
        return rng.choice(keys)

    assert sorted(draw_split("heldout", 9, random.Random(0), draw, str)) == heldout
    draws = 0
    with pytest.raises(ConfigError) as e:
        draw_split("heldout", 10, random.Random(0), draw, str)
    assert str(e.value).startswith("only 9 distinct heldout tasks exist") and "\n" not in str(e)
    assert draws < 2000  # ~150 draws find all 9, then at most max(1000, 2 * 150) more


@pytest.mark.parametrize("env, difficulty, split", [
    ("calculator", 1, "heldout"), ("code", 1, "heldout"), ("code", 1, "train")])
def test_task_space_is_exact_and_one_more_task_fails_fast(env, difficulty, split):
    env_cls = ENVS[env]
    space = env_cls.task_space(split, difficulty)
    assert space == {"calculator": 1576, "code": {"heldout": 74, "train": 243}[split]}[env]
    assert len({t.id for t in env_cls.make_tasks(split, space, 0, difficulty)}) == space
    with pytest.raises(ConfigError, match=f"only {space} distinct {split} tasks exist"):
        env_cls.make_tasks(split, space + 1, 0, difficulty)


def test_task_spaces_beyond_listing_are_the_hash_share():
    # 89² · (1 + 1988) calculator problems at difficulty 2, 20% of them held out
    assert ENVS["calculator"].task_space("heldout", 2) == int(89**2 * 1989 * 0.2)
    # Σ_k 50^k list pipelines · 4 finals + Σ_k 39^k string pipelines · 3 finals, k = 1..3
    total = 4 * (50 + 50**2 + 50**3) + 3 * (39 + 39**2 + 39**3)
    assert ENVS["code"].task_space("train", 3) == int(total * 0.8) == 554269
    assert ENVS["sql"].task_space("train", 2) == int(2**31 * 0.8)


def _cli(*args):
    """The real CLI's one line, and its exit status 2."""
    code, out = cli(*args)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in out and len(lines) == 1, out
    return lines[0]


def test_cli_refuses_more_tasks_than_exist_before_any_work(tmp_path):
    line = _cli("train", "configs/calculator.yaml", "env.difficulty=1", "eval.tasks=2000",
                "--output-dir", str(tmp_path / "run"))
    assert line == ("error: config field eval.tasks: got 2000; env calculator has only 1576 "
                    "heldout tasks at env.difficulty=1: ask for at most 1576 or pick an "
                    "env.difficulty with more")
    assert not (tmp_path / "run").exists()  # stopped before the run folder and the model


def test_cli_names_the_extra_of_a_missing_env_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bm25s", None)  # `import bm25s` now raises ImportError
    line = _cli("train", "configs/search.yaml", "--output-dir", str(tmp_path / "run"))
    assert line.startswith("error: env.name=search needs the 'bm25s' package")
    assert line.endswith("pip install 'tiller[search]'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("module, overrides, extra", [
    ("bm25s", ["env.name=search"], "search"),
    ("reasoning_gym", ["env.name=reasoning_gym/chain_sum"], "reasoning"),
    ("tensorboard", ["logging.tensorboard=true"], "tensorboard"),
    ("wandb", ["logging.wandb=true", "logging.tensorboard=false"], "wandb"),
])
def test_run_start_up_names_the_extra_of_a_missing_package(tmp_path, monkeypatch, module,
                                                           overrides, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    cfg = load_config("configs/calculator.yaml", overrides)
    with pytest.raises(ConfigError) as e:
        Run(cfg, tmp_path / "run")
    assert f"needs the {module!r} package" in str(e.value)
    assert f"pip install 'tiller[{extra}]'" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # before any work
