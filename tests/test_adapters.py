"""Adapters: reasoning-gym datasets with strict answer extraction, and a Gymnasium-style text
game (guess the number) played through the real agent loop."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import random
import string
from pathlib import Path

import pytest
from helpers import RL_MOVES, TINY_ENV_RUN, TextActor, check_short_run

from tiller.config import ConfigError, load_config
from tiller.controller import train
from tiller.engine.api import Generation
from tiller.envs import ENVS, adapters
from tiller.envs.actions import ParsedTurn
from tiller.envs.adapters import GuessNumberEnv, GuessNumberGame, reasoning_gym_env
from tiller.models import train_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.collect import collect_expert
from tiller.rollout.trajectory import Status, is_success

CALCULATOR = Path(__file__).parents[1] / "configs" / "calculator.yaml"
LIMITS = EpisodeLimits(max_turns=10, max_episode_tokens=1 << 16)
TOK = train_tokenizer([], 0)


class RandomActor:
    """Random printable text, numbers, tagged junk and tool calls."""

    async def act(self, prompt_ids, messages, seed, session_id=None):
        rng = random.Random(seed)
        junk = "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 40)))
        return _generation(rng.choice([
            junk, str(rng.randint(-50, 3000)), f"<answer>{junk}</answer>",
            '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>']))


def _generation(text: str) -> Generation:
    ids = TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
    return Generation(ids, [0.0] * len(ids), "stop", version=0)


def _run(env_cls, tasks, actor):
    async def run():
        return await asyncio.gather(*(run_episode(env_cls(), t, actor, TOK, seed=i,
                                                  limits=LIMITS) for i, t in enumerate(tasks)))
    return asyncio.run(run())


# ---- reasoning-gym -------------------------------------------------------------------------

needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                              reason="reasoning-gym is not installed: tiller[reasoning]")


@needs_rg
@pytest.mark.parametrize("dataset", ["basic_arithmetic", "spell_backward"])
def test_reasoning_gym_expert_and_random(dataset):
    env_cls = ENVS[f"reasoning_gym/{dataset}"]
    tasks = env_cls.make_tasks("heldout", 50, seed=0, difficulty=2)
    experts = collect_expert(env_cls, tasks, TOK, guess=0.0, limits=LIMITS, seed=0)
    assert sum(map(is_success, experts)) / len(experts) >= 0.95
    randoms = _run(env_cls, tasks, RandomActor())
    assert sum(map(is_success, randoms)) / len(randoms) <= 0.05


@needs_rg
def test_reasoning_gym_splits_are_disjoint_and_seeded():
    env_cls = ENVS["reasoning_gym/chain_sum"]
    train_tasks = env_cls.make_tasks("train", 200, seed=1, difficulty=3)
    heldout_tasks = env_cls.make_tasks("heldout", 50, seed=1, difficulty=3)
    assert not {t.prompt for t in train_tasks} & {t.prompt for t in heldout_tasks}
    assert [t.id for t in env_cls.make_tasks("train", 5, 1, 3)] == [t.id for t in train_tasks[:5]]


@needs_rg
def test_reasoning_gym_scoring_is_strict():
    import reasoning_gym as rg

    env_cls = ENVS["reasoning_gym/basic_arithmetic"]
    task = env_cls.make_tasks("train", 1, seed=0)[0]
    dataset = rg.create_dataset("basic_arithmetic", seed=0, size=1)
    buried = f"I believe that the final answer is {task.answer}"
    assert 0.0 < dataset.score_answer(buried, task.metadata["entry"]) < 1.0  # rg's partial credit

    def score(text):
        async def run():
            env = env_cls()
            await env.reset(task, 0)
            return await env.verify(ParsedTurn(text))
        return asyncio.run(run())

    assert score(f"Thinking... <answer>{task.answer}</answer>").value == 1.0
    assert score(buried).value == 0.0  # no tags: no answer
    assert score(f"<answer>{buried}</answer>").value == 0.0  # partial credit does not count
    assert score(f"<answer>{buried}</answer>").checks["score"] > 0.0  # but is in the breakdown
    assert score(f"<answer>{task.answer}</answer> (or {task.answer}0)").value == 0.0
    assert score(f"<answer>1</answer><answer>{task.answer}</answer>").value == 0.0


@needs_rg
def test_reasoning_gym_scorer_crash_is_an_env_error_not_a_zero(monkeypatch, caplog):
    env_cls = ENVS["reasoning_gym/basic_arithmetic"]
    task = env_cls.make_tasks("train", 1, seed=0)[0]

    def broken_scorer(answer, entry):
        raise KeyError("metadata")

    monkeypatch.setattr(adapters, "_scorer", lambda dataset: broken_scorer)
    with caplog.at_level(logging.WARNING, logger="tiller.envs.adapters"):
        (traj,) = collect_expert(env_cls, [task], TOK, guess=0.0, limits=LIMITS, seed=0)
    error = "basic_arithmetic scorer: KeyError: 'metadata'"
    assert traj.reward.env_error and traj.reward.error == error
    assert traj.reward.checks == {"format_ok": 1.0, "score": 0.0} and not is_success(traj)
    assert traj.status is Status.ENV_ERROR and traj.env_errors == 1  # dropped, not trained
    assert [r.getMessage() for r in caplog.records] == [f"env_error on task {task.id}: {error}"]
    # no answer in the format: the scorer is not asked, and the policy is simply wrong
    (traj,) = _run(env_cls, [task], TextActor(TOK, ["I think 3"]))
    assert traj.reward.value == 0.0 and not traj.reward.env_error
    assert traj.status is Status.COMPLETED


@needs_rg
def test_reasoning_gym_env_factory_takes_a_config():
    default = ENVS["reasoning_gym/leg_counting"]
    try:
        env_cls = reasoning_gym_env("leg_counting", min_animals=1, max_animals=1)
        assert ENVS["reasoning_gym/leg_counting"] is env_cls
        tasks = env_cls.make_tasks("train", 10, seed=0)
        assert all(t.metadata["entry"]["metadata"]["num_animals"] == 1 for t in tasks)
    finally:
        ENVS["reasoning_gym/leg_counting"] = default


@needs_rg
def test_reasoning_gym_too_small_a_space_fails_fast_with_one_line():
    default = ENVS["reasoning_gym/leg_counting"]
    try:  # one animal: about 500 distinct questions
        env_cls = reasoning_gym_env("leg_counting", min_animals=1, max_animals=1)
        assert len({t.id for t in env_cls.make_tasks("heldout", 100, seed=0)}) == 100
        with pytest.raises(ConfigError, match=r"^only 103 distinct heldout tasks exist \(7630 "
                                              r"draws found no more\), 500 requested"):
            env_cls.make_tasks("heldout", 500, seed=0)  # 500,000 draws before
    finally:
        ENVS["reasoning_gym/leg_counting"] = default


# ---- Gymnasium-style text env ---------------------------------------------------------------


def test_guess_number_game_follows_the_gymnasium_api():
    gymnasium = pytest.importorskip("gymnasium")
    game = GuessNumberGame(size=40)
    assert isinstance(game, gymnasium.Env)
    obs, info = game.reset(seed=3)
    low, high = map(int, info["instance"].split(":")[0].split("-"))
    assert f"from {low} to {high}" in obs and high - low + 1 == 40
    assert game.step("no idea")[:4] == ("Reply with just a whole number.", 0.0, False, False)
    assert game.step(str(low - 1))[0] == "Higher."
    assert game.step(str(game.secret))[1:3] == (1.0, True)
    assert game.reset(seed=3) == (obs, info)  # seeded


def test_guess_number_expert_wins_and_random_loses():
    tasks = GuessNumberEnv.make_tasks("heldout", 50, seed=0, difficulty=3)
    assert not {t.id for t in tasks} & {t.id for t in GuessNumberEnv.make_tasks("train", 200, 0, 3)}
    experts = collect_expert(GuessNumberEnv, tasks, TOK, guess=0.0, limits=LIMITS, seed=0)
    assert sum(map(is_success, experts)) / len(experts) >= 0.95
    assert all(t.reward.checks["terminated"] == 1.0 and t.reward.turn_rewards is None
               for t in experts)  # the return only: turn credit would count it twice
    randoms = _run(GuessNumberEnv, tasks, RandomActor())
    assert sum(map(is_success, randoms)) / len(randoms) <= 0.05


def test_gym_text_env_turns_tool_calls_into_an_error_message():
    task = GuessNumberEnv.make_tasks("train", 1, seed=0, difficulty=1)[0]

    class ToolCallThenExpert:
        async def act(self, prompt_ids, messages, seed, session_id=None):
            if len(messages) == 2:  # the system message and the opening observation
                text = '<tool_call>\n{"name": "guess", "arguments": {}}\n</tool_call>'
            else:  # the expert, on the game minus the tool call and its error
                text = GuessNumberEnv.expert_turn(task, messages[:2] + messages[4:],
                                                  random.Random(seed))
            return _generation(text)

    traj = _run(GuessNumberEnv, [task], ToolCallThenExpert())[0]
    assert traj.messages[3]["content"].startswith("error: this environment has no tools")
    assert is_success(traj)


class StrictGame(GuessNumberGame):
    """A game that rejects a non-number with ValueError, as many Gymnasium envs do."""

    def step(self, action: str):
        int(action)  # ValueError on "seven"
        return super().step(action)


class StrictGuessEnv(GuessNumberEnv):
    make_env = staticmethod(lambda difficulty: StrictGame(size=10 * 2**difficulty))


def test_gym_env_rejecting_an_action_is_the_policys_fault_not_an_env_error():
    task = StrictGuessEnv.make_tasks("train", 1, seed=0, difficulty=1)[0]

    class WordThenExpert:
        async def act(self, prompt_ids, messages, seed, session_id=None):
            if len(messages) == 2:
                return _generation("seven")
            return _generation(StrictGuessEnv.expert_turn(task, messages[:2] + messages[4:],
                                                          random.Random(seed)))

    traj = _run(StrictGuessEnv, [task], WordThenExpert())[0]
    assert traj.status is not Status.ENV_ERROR and not traj.reward.env_error
    assert traj.messages[3]["content"].startswith("error: invalid action: ValueError")
    assert traj.reward.checks["invalid_actions"] == 1.0 and is_success(traj)


@pytest.mark.slow
def test_guess_number_short_training_run(tmp_path):
    cfg = load_config(CALCULATOR, [
        *TINY_ENV_RUN, "env.name=guess_number", "env.max_turns=8", "model.build.vocab_size=400",
        "sampling.max_new_tokens=8", "logging.report=true",  # the report of a user's run too
        *RL_MOVES, f"output_dir={tmp_path}"])
    summary = train(cfg)
    check_short_run(cfg, summary, TextActor)
