"""The code env: disjoint seeded splits, an expert that passes the hidden tests, a random policy
that does not, tool errors the model sees, a strict verifier, and a short training run."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from helpers import RL_MOVES, TINY_ENV_RUN, TextActor, check_short_run

from tiller.config import load_config
from tiller.controller import train
from tiller.envs import ENVS
from tiller.envs.actions import ParsedTurn
from tiller.envs.code import CodeEnv, make_tasks
from tiller.models import train_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.collect import collect_expert
from tiller.rollout.trajectory import is_success
from tiller.tools import launch
from tiller.tools.registry import ToolCall

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
CONFIG = Path(__file__).parents[1] / "configs" / "code.yaml"
LIMITS = EpisodeLimits(max_turns=4, max_episode_tokens=1 << 16)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([], 0)  # byte-level: any text round-trips


def RandomCode(tok, turns=None):
    return TextActor(tok, turns, tools=("run_python",), make_args=lambda rng, j: {"code": j})


def _episodes(tasks, actor_for, tok):
    async def run():
        return await asyncio.gather(*(run_episode(CodeEnv(), t, actor_for(t), tok, seed=i,
                                                  limits=LIMITS) for i, t in enumerate(tasks)))
    return asyncio.run(run())


def test_splits_are_disjoint_and_seeded():
    train_ids = {t.id for t in make_tasks("train", 300, seed=1, difficulty=3)}
    heldout_ids = {t.id for t in make_tasks("heldout", 100, seed=1, difficulty=3)}
    assert len(train_ids) == 300 and len(heldout_ids) == 100 and not train_ids & heldout_ids
    again = make_tasks("train", 5, seed=1, difficulty=3)
    assert [t.id for t in again] == [t.id for t in make_tasks("train", 5, 1, 3)]
    assert all(len(t.metadata["tests"]) == 8 for t in again)


@pytest.mark.slow
def test_expert_passes_hidden_tests(tok):
    tasks = make_tasks("heldout", 50, seed=0, difficulty=3)
    trajs = collect_expert(ENVS["code"], tasks, tok, guess=0.0, limits=LIMITS, seed=0)
    success = sum(map(is_success, trajs)) / len(trajs)
    assert success >= 0.95, [t.reward for t in trajs if not is_success(t)][:3]
    assert all(t.tool_calls == 1 and t.tool_errors == 0 for t in trajs)


def test_random_policy_scores_near_zero(tok):
    tasks = make_tasks("heldout", 50, seed=0, difficulty=2)
    trajs = _episodes(tasks, lambda t: RandomCode(tok), tok)
    assert sum(map(is_success, trajs)) / len(trajs) <= 0.05
    assert sum(t.tool_errors for t in trajs) > 0 and not any(t.reward.env_error for t in trajs)


def test_bad_tool_calls_reach_the_model_as_errors(tok):
    task = make_tasks("train", 1, seed=0)[0]
    turns = ['<tool_call>\n{"name": "run_python", "arguments": {"source": "1"}}\n</tool_call>',
             '<tool_call>\n{"name": "exec", "arguments": {"code": "1"}}\n</tool_call>',
             '<tool_call>\n{"name": "run_python", arguments: }\n</tool_call>',
             f"```python\n{task.answer}```"]
    (traj,) = _episodes([task], lambda t: RandomCode(tok, turns), tok)
    errors = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(errors) == 3 and all(e.startswith("error:") for e in errors)
    assert "invalid arguments" in errors[0] and "unknown tool" in errors[1]
    assert traj.tool_errors == 2 and traj.parse_errors == 1 and traj.env_errors == 0
    assert is_success(traj)  # the errors cost nothing but turns


def _verify(task, content, env=None):
    async def run():
        e = env or CodeEnv()
        await e.reset(task, 0)
        return await e.verify(ParsedTurn(content) if content is not None else None)
    return asyncio.run(run())


def test_verifier_is_strict():
    task = make_tasks("train", 1, seed=3, difficulty=2)[0]
    assert _verify(task, f"```python\n{task.answer}```").value == 1.0
    assert _verify(task, task.answer).checks["format_ok"] == 0.0  # no code block
    two = f"```python\n{task.answer}```\nor\n```python\n{task.answer}```"
    assert _verify(task, two).value == 0.0
    assert _verify(task, "```python\ndef solve(x):\n    return None\n```").value == 0.0
    assert _verify(task, None).value == 0.0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_run_python_tool_and_sandbox_failure(monkeypatch):
    env = CodeEnv()
    task = make_tasks("train", 1, seed=0)[0]

    async def call(code):
        await env.reset(task, 0)
        return await env.registry.invoke(ToolCall("run_python", {"code": code}))

    r = asyncio.run(call("print(6 * 7)"))
    assert r.outcome.value == "ok" and r.content == "[ok]\n42"

    # a real bwrap failure: the python it binds into the sandbox does not exist
    missing = "/nonexistent-python-dir"
    monkeypatch.setattr(launch, "_python_binds", lambda: [(missing, missing)])
    failed = asyncio.run(call("print(1)"))
    assert failed.outcome.value == "env_error" and "bwrap" in failed.content
    reward = _verify(task, f"```python\n{task.answer}```", env)
    assert reward.env_error and reward.value == 0.0


@pytest.mark.slow
def test_short_training_run(tmp_path):
    cfg = load_config(CONFIG, [*TINY_ENV_RUN, *RL_MOVES, f"output_dir={tmp_path}"])
    summary = train(cfg)
    assert summary["sft"]["expert_success"] >= 0.5  # 30% of demos are imperfect on purpose
    check_short_run(cfg, summary, RandomCode)
