"""Plug-ins from outside tiller (envs, tools, loops, hooks by dotted path or entry point), small
task sets that repeat instances, held-out evaluation switched off, and the exposed optimizer
and advantage knobs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import QUIET, TINY_RUN, cli, saved_model, tiny_rl

from tiller.config import AlgorithmConfig, load_config
from tiller.controller import evaluate_checkpoint, train
from tiller.envs import ENVS
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError
from tiller.observe.evaluation import success_summary
from tiller.plugins import check_env_tools, load_env_class
from tiller.preflight import heldout_disabled
from tiller.rollout.agent_loop import EngineActor
from tiller.rollout.collect import collect, draws
from tiller.rollout.manager import RolloutManager
from tiller.rollout.trajectory import Status, Trajectory
from tiller.run import Run
from tiller.tools.registry import ToolRegistry, load_tools
from tiller.train.batch import Batch
from tiller.train.trainer import compute_advantages

ROOT = Path(__file__).parents[1]
PKG = ROOT / "examples" / "plugin_pkg"
CONFIG = "configs/calculator.yaml"
PAIR_SUM = "tiller_example_plugin.envs:PairSumEnv"


@pytest.fixture()
def plugin_path(monkeypatch):
    """The example package importable, as PYTHONPATH=examples/plugin_pkg makes it."""
    monkeypatch.syspath_prepend(str(PKG))


def one_line_error(match: str, fn, *args):
    with pytest.raises(ConfigError) as e:
        fn(*args)
    message = str(e.value)
    assert "\n" not in message, message
    assert match in message, message
    return message


# ---------------------------------------------------------------- tiller train, from outside


@pytest.mark.slow
@pytest.mark.integration
def test_tiller_train_with_a_dotted_path_env_from_a_package_outside_tiller(tmp_path):
    """The acceptance run: the real CLI in a fresh process, the env (and an extra tool) named
    by dotted path from examples/plugin_pkg, nothing of it imported by tiller."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(PKG)])}
    proc = subprocess.run(
        [sys.executable, "-m", "tiller", "train", str(PKG / "pair_sum.yaml"), "-o", str(tmp_path),
         "env.tools=[tiller_example_plugin.tools:multiply]", "model.build.corpus_tasks=40",
         "sft.tasks=64", "sft.epochs=1", "rl.steps=2", "rl.tasks_per_step=4",
         "rl.group_size=4", *QUIET],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "held-out evaluation disabled: env pair_sum has no heldout split" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["heldout"] == "disabled" and "heldout_after_rl" not in summary
    assert summary["tool_gate"] == {"gate_ok_rate/add": 1.0}
    assert summary["rl"]["ledger"]["started"] == summary["rl"]["ledger"]["trained"] == 2 * 4 * 4
    assert (tmp_path / "checkpoints" / "final" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [3, 4]  # after 2 SFT steps
    assert not [r for r in rows if r["phase"].startswith("eval")]
    saved = load_config(tmp_path / "config.yaml")
    assert saved.env.name == PAIR_SUM
    assert saved.env.tools.functions == ["tiller_example_plugin.tools:multiply"]


def test_config_tools_join_the_env_tools_behind_the_run_stack(plugin_path, calc_model_dir,
                                                              tmp_path):
    cfg = load_config(CONFIG, [*saved_model(calc_model_dir), f"env.name={PAIR_SUM}",
                               "eval.enabled=false",
                               "env.tools=[tiller_example_plugin.tools:multiply]"])
    run = Run(cfg, tmp_path)
    try:
        env = run.make_env("test", "pair-1-2", 0)
        assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "multiply"]
        multiply = env.tool_schemas()[1]["function"]
        assert multiply["return"] == {"type": "integer", "description": "The product a * b."}
        from tiller.envs.actions import ParsedTurn
        from tiller.tools.registry import ToolCall

        step = asyncio.run(env.step(ParsedTurn(content="", tool_calls=[
            ToolCall("multiply", {"a": 6, "b": 7})])))
        assert step.messages == [{"role": "tool", "name": "multiply", "content": "42"}]
        # the call went through the run's executor: it is counted like the env's own tools
        assert run.tools.stats(reset=False)["tool_calls/multiply"] == 1.0
    finally:
        run.close()


def test_a_yaml_list_is_short_for_tools_functions():
    listed = load_config(CONFIG, ["model.path=x", "model.build=null", "env.tools=[a.b:c]"])
    full = load_config(CONFIG, ["model.path=x", "model.build=null",
                                "env.tools={functions: [a.b:c]}"])
    assert listed.env.tools == full.env.tools and listed.env.tools.functions == ["a.b:c"]


# ---------------------------------------------------------------- bad plug-in paths


@pytest.mark.parametrize("name, match", [
    ("no_such_env", "config field env.name: unknown env 'no_such_env'; choose one of: "),
    ("nosuchpkg.envs:Env", "config field env.name: got 'nosuchpkg.envs:Env'; cannot import "
                           "it: ModuleNotFoundError: No module named 'nosuchpkg'"),
    ("tiller_example_plugin.envs:Missing", "cannot import it: AttributeError: module "
                                           "'tiller_example_plugin.envs' has no attribute"),
    ("tiller_example_plugin.tools:multiply", "got 'tiller_example_plugin.tools:multiply'; it "
                                             "is an object of type function, not a subclass "
                                             "of tiller.envs.Env"),
    ("tiller_example_plugin.envs:Task", "it is a class Task, not a subclass of tiller.envs.Env"),
    ("tiller.envs.base:ToolEnv", "ToolEnv leaves abstract methods of Env unimplemented: "
                                 "expert_turn, make_tasks, verify"),
    (":Env", "got ':Env'; expected a dotted path package.module:name"),
    ("tiller_example_plugin.envs.PairSumEnv", None),  # the dotted form with a dot works too
])
def test_every_bad_env_path_is_one_line(plugin_path, name, match):
    if match is None:
        assert load_env_class(name).name == "pair_sum"
        return
    one_line_error(match, load_env_class, name)


def test_a_plugin_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_syntax.py").write_text("class Env(:\n    pass\n")
    (tmp_path / "raises_on_import.py").write_text(
        "raise RuntimeError('first line\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    one_line_error("got 'broken_syntax:Env'; cannot import it: SyntaxError: ",
                   load_env_class, "broken_syntax:Env")
    one_line_error("cannot import it: RuntimeError: first line second line",
                   load_env_class, "raises_on_import:Env")


def undocumented(x: int) -> int:
    return x


@pytest.mark.parametrize("paths, match", [
    (["nosuch.mod:f"], "config field env.tools.functions: got 'nosuch.mod:f'; cannot import it: "
                       "ModuleNotFoundError"),
    (["tiller_example_plugin.envs:SYSTEM"], "got 'tiller_example_plugin.envs:SYSTEM'; expected "
                                            "a callable"),
    (["test_plugins:undocumented"], "got 'test_plugins:undocumented'; cannot make a tool of "
                                    "it: DocstringParsingException: "),
    (["tiller_example_plugin.tools:multiply", "tiller_example_plugin.tools:multiply"],
     "a tool named 'multiply' is listed twice"),
])
def test_every_bad_tool_path_is_one_line(plugin_path, paths, match):
    one_line_error(match, load_tools, paths)


def test_tools_an_env_cannot_take_are_one_line(plugin_path):
    pair_sum = load_env_class(PAIR_SUM)
    one_line_error("config field env.tools.functions: tool name(s) add are already tools of env "
                   "pair_sum; rename yours", check_env_tools, pair_sum,
                   load_tools(["tiller_example_plugin.tools:add"]))
    one_line_error("config field env.tools.functions: env guess_number is not a ToolEnv",
                   check_env_tools, ENVS["guess_number"],
                   load_tools(["tiller_example_plugin.tools:multiply"]))


@pytest.mark.parametrize("override, field", [
    ("env.name=nosuchpkg:Env", "env.name"),
    ("env.tools=[nosuchpkg:tool]", "env.tools.functions"),
    ("agent.loop=nosuchpkg:loop", "agent.loop"),
    ("rl.algorithm.credit.key_steps=nosuchpkg:mask", "rl.algorithm.credit.key_steps"),
])
def test_bad_plugin_paths_stop_the_cli_with_one_line_before_any_work(tmp_path, override,
                                                                     field):
    """Envs, tools, loops and key-step hooks fail alike: exit 2, one line naming the field,
    before the model is built (the run folder holds at most its config)."""
    code, printed = cli("train", CONFIG, *TINY_RUN, override, "-o", tmp_path / "run")
    assert code == 2 and len(printed.strip().splitlines()) == 1, printed
    out = " ".join(printed.split())  # rich wraps long lines at the terminal width
    assert out.startswith(f"error: config field {field}: got 'nosuchpkg:") and (
        "cannot import it: ModuleNotFoundError: No module named 'nosuchpkg'" in out), out
    assert not (tmp_path / "run" / "base_model").exists()


# ---------------------------------------------------------------- entry points


def write_distribution(root: Path, name: str, entry_points: str) -> None:
    """An installed distribution as pip leaves one: a .dist-info folder on sys.path."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[tiller.envs]\n{entry_points}\n")


def test_installed_packages_register_envs_under_the_tiller_envs_entry_point(
        plugin_path, tmp_path, monkeypatch):
    write_distribution(tmp_path / "a", "pair_sum_dist",
                       f"pair_sum_installed = {PAIR_SUM}\nbroken_env = nosuchpkg.envs:Env\n"
                       f"twice = {PAIR_SUM}")
    write_distribution(tmp_path / "b", "other_dist", "twice = tiller_example_plugin.envs:Other")
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    assert load_env_class("pair_sum_installed").__module__ == "tiller_example_plugin.envs"
    one_line_error("config field env.name: got 'broken_env'; its entry point "
                   "'nosuchpkg.envs:Env' (group 'tiller.envs') cannot be loaded: "
                   "ModuleNotFoundError", load_env_class, "broken_env")
    one_line_error("got 'twice'; 2 installed packages register an env of that name",
                   load_env_class, "twice")
    message = one_line_error("unknown env 'nope'", load_env_class, "nope")
    assert "pair_sum_installed" in message and "calculator" in message


@pytest.mark.slow
@pytest.mark.integration
def test_the_example_package_installs_with_its_entry_point(tmp_path, monkeypatch):
    """pip installs examples/plugin_pkg (offline, into a folder): env.name=pair_sum finds it."""
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(target),
                          str(PKG)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    monkeypatch.syspath_prepend(str(target))
    for name in [m for m in sys.modules if m.startswith("tiller_example_plugin")]:
        monkeypatch.delitem(sys.modules, name)  # imported from examples/ by other tests
    cls = load_env_class("pair_sum")
    assert cls.name == "pair_sum"
    assert Path(sys.modules[cls.__module__].__file__).is_relative_to(target)  # the installed one


# ---------------------------------------------------------------- repeated task instances


def test_draws_count_each_task_ids_repeats():
    tasks = ENVS["calculator"].make_tasks("train", 2, 0, 2)
    a, b = tasks
    assert draws([a, b, a, a, b]) == [0, 0, 1, 2, 1]


def made(task_id: str, draw: int, reward: float) -> Trajectory:
    return Trajectory(task_id=task_id, sample_index=0, token_ids=(1, 2, 3), loss_mask=(0, 1, 1),
                      logprobs=(0.0, -1.0, -1.0), prompt_len=1, turn_spans=((1, 3),),
                      versions=(0,), messages=(), reward=Reward(reward),
                      status=Status.COMPLETED, draw=draw)


def test_a_repeated_task_is_its_own_group_with_its_own_advantages():
    # task A drawn twice (rewards 1, 0 then 0, 0), task B once (1, 1)
    trajs = [made("A", 0, 1.0), made("A", 0, 0.0), made("B", 0, 1.0), made("B", 0, 1.0),
             made("A", 1, 0.0), made("A", 1, 0.0)]
    batch = Batch.collate(trajs, 0)
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    adv, _ = compute_advantages(batch, AlgorithmConfig(advantage="grpo"))
    # group A#0: mean 0.5, std (Bessel) sqrt(0.5) -> +-0.5 / (0.70710678 + 1e-6); the others
    # are flat. Merged into one group A would be [1, 0, 0, 0]: mean 0.25, a different answer.
    a0 = 0.5 / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(adv[:, -1], torch.tensor([a0, -a0, 0.0, 0.0, 0.0, 0.0]))


def test_evaluation_counts_a_repeated_task_as_two_units():
    trajs = [made("A", 0, 1.0), made("A", 0, 1.0), made("A", 1, 0.0), made("A", 1, 0.0)]
    s = success_summary(trajs, k=2)
    assert (s["tasks"], s["samples"], s["success"], s["pass@2"]) == (2, 4, 0.5, 0.5)


def test_collect_gives_each_draw_of_a_task_its_own_seeds(calc_sft_dir, tmp_path):
    run = Run(load_config(CONFIG, saved_model(calc_sft_dir)), tmp_path)
    try:
        a, b = run.tasks("train", 2, 0)
        trajs = asyncio.run(collect(
            [a, b, a], 3, EngineActor(run.engine, run.sampling(1.0)), episode_fn=run.episode_fn,
            make_env=run.make_env, tokenizer=run.tokenizer, limits=run.limits, seed=0,
            tag=("t",)))
    finally:
        run.close()
    assert [(t.task_id, t.draw) for t in trajs] == [(a.id, 0)] * 3 + [(b.id, 0)] * 3 + [
        (a.id, 1)] * 3
    first, again = trajs[:3], trajs[6:]
    assert [t.token_ids for t in first] != [t.token_ids for t in again]  # new samples
    assert Batch.collate(trajs, 0).group_index.tolist() == [0] * 3 + [1] * 3 + [2] * 3


def test_the_rollout_manager_keeps_repeated_tasks_in_separate_groups(calc_sft_dir, tmp_path):
    cfg = load_config(CONFIG, [*saved_model(calc_sft_dir), "sft.enabled=false", "rl.steps=1",
                               "rl.tasks_per_step=3", "rl.group_size=2"])
    run = Run(cfg, tmp_path)
    a, b = run.tasks("train", 2, 0)
    manager = RolloutManager(cfg, run.engine, run.sampling(1.0), iter([a, a, b]),
                             episode_fn=run.episode_fn, make_env=run.make_env,
                             tokenizer=run.tokenizer, limits=run.limits,
                             reward=lambda t: t.reward.value, version=run.trainer.version)
    try:
        taken = manager.next_batch(0)
    finally:
        manager.close()
        run.close()
    assert [(t.task_id, t.draw) for t in taken.trajectories] == [
        (a.id, 0), (a.id, 0), (a.id, 1), (a.id, 1), (b.id, 0), (b.id, 0)]
    assert taken.group_index == [0, 0, 1, 1, 2, 2]
    rows = taken.trajectories
    assert {rows[0].token_ids, rows[1].token_ids} != {rows[2].token_ids, rows[3].token_ids}


# ---------------------------------------------------------------- held-out evaluation off


def test_eval_disabled_skips_heldout_and_says_so(calc_sft_dir, tmp_path, caplog):
    cfg = load_config(CONFIG, tiny_rl(
        calc_sft_dir, "rl.group_size=2", "eval.enabled=false",
        # no task count is checked against a split the run does not draw from
        "eval.tasks=100000000"))
    with caplog.at_level("WARNING"):
        summary = train(cfg, tmp_path)
    assert "held-out evaluation is off: eval.enabled is false" in caplog.text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["heldout"] == "disabled" == summary["heldout"]
    assert saved["eval_disabled"] == "eval.enabled is false"
    assert "heldout_after_sft" not in saved and "heldout_after_rl" not in saved
    phases = {json.loads(line)["phase"]
              for line in (tmp_path / "metrics.jsonl").read_text().splitlines()}
    assert "rl" in phases and not {p for p in phases if p.startswith("eval")}
    one_line_error("tiller eval has nothing to evaluate: eval.enabled is false",
                   evaluate_checkpoint, cfg, tmp_path / "eval")


def test_heldout_is_off_by_config_by_splits_or_by_an_empty_heldout_space(plugin_path):
    calculator = ENVS["calculator"]

    class NoHeldoutTasks(calculator):
        task_space = staticmethod(lambda split, difficulty, heldout_fraction=0.2:
                                  0 if split == "heldout" else 100)

    cfg = load_config(CONFIG, ["model.path=x", "model.build=null"])
    assert heldout_disabled(cfg, calculator) is None
    assert heldout_disabled(cfg, load_env_class(PAIR_SUM)) == (
        "env pair_sum has no heldout split (splits: ('train',))")
    assert heldout_disabled(cfg, NoHeldoutTasks) == (
        "env calculator has no heldout tasks at env.difficulty=2")
    cfg.eval.enabled = False
    assert heldout_disabled(cfg, calculator) == "eval.enabled is false"


# ---------------------------------------------------------------- optimizer and advantage knobs


def test_optimizer_and_advantage_knobs_default_to_todays_values():
    cfg = load_config(CONFIG, ["model.path=x", "model.build=null"])
    assert (cfg.rl.adam_betas, cfg.rl.adam_eps) == ((0.9, 0.99), 1e-8)
    assert cfg.rl.algorithm.advantage_eps == 1e-6  # grpo divides by its std
    assert AlgorithmConfig(advantage="rloo").advantage_eps is None  # rloo has none


def test_optimizer_knobs_reach_adamw(calc_sft_dir, tmp_path):
    from tiller.controller import rl

    cfg = load_config(CONFIG, [*saved_model(calc_sft_dir), "sft.enabled=false", "rl.steps=1",
                               "rl.tasks_per_step=1", "rl.group_size=2",
                               "rl.adam_betas=[0.8, 0.95]", "rl.adam_eps=1e-5"])
    run = Run(cfg, tmp_path)
    try:
        rl(run)
        group = run.trainer.optimizer.param_groups[0]
    finally:
        run.close()
    assert (group["betas"], group["eps"]) == ((0.8, 0.95), 1e-5)


def test_advantage_eps_is_the_estimators_denominator_eps():
    batch = Batch.collate([made("A", 0, 1.0), made("A", 0, 0.0)], 0)
    adv, _ = compute_advantages(batch, AlgorithmConfig(advantage="grpo", advantage_eps=0.5))
    expected = 0.5 / (0.5 ** 0.5 + 0.5)
    torch.testing.assert_close(adv[:, -1], torch.tensor([expected, -expected]))


@pytest.mark.parametrize("override, match", [
    ("rl.adam_betas=[0.9, 1.0]", "config field rl.adam_betas: got [0.9, 1.0]; Value error, "
                                 "expected two floats in [0, 1)"),
    ("rl.adam_betas=[0.9]", "config field rl.adam_betas"),
    ("rl.adam_eps=0", "config field rl.adam_eps: got 0;"),
    ("rl.algorithm.advantage_eps=-1", "config field rl.algorithm.advantage_eps: got -1;"),
])
def test_bad_knob_values_are_one_line(override, match):
    one_line_error(match, load_config, CONFIG, ["model.path=x", "model.build=null", override])


def test_advantage_eps_for_an_estimator_without_one_is_an_error():
    one_line_error("config field rl.algorithm.advantage_eps: got 0.1; the algorithm ignores "
                   "it: used only by estimators that divide by a std",
                   load_config, CONFIG, ["model.path=x", "model.build=null",
                                         "rl.algorithm.advantage=rloo",
                                         "rl.algorithm.advantage_eps=0.1"])


def test_registry_extend_refuses_to_replace_a_tool(plugin_path):
    from tiller_example_plugin.tools import add

    registry = ToolRegistry([add])
    with pytest.raises(ValueError, match="tool 'add' is already registered"):
        registry.extend([add])
