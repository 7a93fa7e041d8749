"""The search env: a deterministic shared corpus, questions split by hash, one search per hop
(no passage answers a multi-hop question alone), an expert at >= 95%, a random policy near 0,
tool errors the model sees, and a short training run."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from helpers import RL_MOVES, TINY_ENV_RUN, TextActor, check_short_run

from tiller.config import load_config
from tiller.controller import train
from tiller.envs import ENVS
from tiller.envs.actions import ParsedTurn
from tiller.envs.search import SearchEnv, make_tasks, search_passages, world
from tiller.models import train_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.collect import collect_expert
from tiller.rollout.trajectory import is_success

pytest.importorskip("bm25s")
CONFIG = Path(__file__).parents[1] / "configs" / "search.yaml"
LIMITS = EpisodeLimits(max_turns=6, max_episode_tokens=1 << 16)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([], 0)


def RandomSearch(tok, turns=None):
    return TextActor(tok, turns, tools=("search",), make_args=lambda rng, j: {"query": j},
                     finals=("{junk}", "The answer is {junk}."))


def test_corpus_is_deterministic_and_shared_by_both_splits():
    assert world().passages == world.__wrapped__().passages  # rebuilt from scratch: the same
    train_tasks = make_tasks("train", 300, seed=1, difficulty=3)
    heldout_tasks = make_tasks("heldout", 100, seed=7, difficulty=3)
    assert not {t.id for t in train_tasks} & {t.id for t in heldout_tasks}
    assert [t.id for t in make_tasks("train", 5, 1, 3)] == [t.id for t in train_tasks[:5]]
    names = {n for t in train_tasks + heldout_tasks for n in t.metadata["chain"]}
    assert all(any(n in p for p in world().passages) for n in names)  # one world for both


@pytest.mark.parametrize("difficulty", [2, 3])
def test_no_single_passage_answers_a_multi_hop_question(difficulty):
    tasks = make_tasks("train", 200, seed=0, difficulty=difficulty)
    assert all(len(t.metadata["relations"]) >= 2 for t in tasks)
    for t in tasks:
        anchor, answer, nodes = t.metadata["anchor"], t.answer, t.metadata["chain"]
        assert answer not in t.prompt
        assert not [p for p in world().passages if anchor in p and answer in p], t.prompt
        for i, a in enumerate(nodes):  # no shortcut past any hop either
            later = nodes[i + 2 :]
            assert not [p for p in world().passages if a in p and any(b in p for b in later)]
        # and searching the question itself does not surface the answer
        assert not any(answer in p for p in search_passages(world(), t.prompt))


def test_expert_needs_one_search_per_hop_and_finds_each_hop():
    tasks = make_tasks("heldout", 50, seed=0, difficulty=3)
    for t in tasks:
        nodes = t.metadata["chain"]
        messages = [{"role": "user", "content": t.prompt}]
        for hop in range(len(nodes) - 1):
            call = json.loads(SearchEnv.expert_turn(t, messages, random.Random(0)).split("\n")[1])
            hits = search_passages(world(), call["arguments"]["query"])
            assert any(nodes[hop] in p and nodes[hop + 1] in p for p in hits), (t.prompt, hits)
            messages.append({"role": "tool", "content": "\n".join(hits)})


def test_expert_scores_at_least_95_percent(tok):
    tasks = make_tasks("heldout", 50, seed=0, difficulty=3)
    trajs = collect_expert(ENVS["search"], tasks, tok, guess=0.0, limits=LIMITS, seed=0)
    assert sum(map(is_success, trajs)) / len(trajs) >= 0.95
    hops = [len(task.metadata["relations"]) for task in tasks]
    assert [t.tool_calls for t in trajs] == hops


def test_random_policy_scores_near_zero(tok):
    tasks = make_tasks("heldout", 50, seed=0, difficulty=2)

    async def run():
        return await asyncio.gather(*(run_episode(SearchEnv(), t, RandomSearch(tok), tok, seed=i,
                                                  limits=LIMITS) for i, t in enumerate(tasks)))
    trajs = asyncio.run(run())
    assert sum(map(is_success, trajs)) / len(trajs) <= 0.05


def test_bad_tool_calls_reach_the_model_as_errors(tok):
    task = make_tasks("train", 1, seed=0)[0]
    turns = ['<tool_call>\n{"name": "search", "arguments": {"query": 7}}\n</tool_call>',
             '<tool_call>\n{"name": "lookup", "arguments": {"query": "x"}}\n</tool_call>',
             '<tool_call>\n{"name": "search", "arguments": {"query": "  "}}\n</tool_call>',
             "<tool_call>\nsearch(capital)\n</tool_call>",
             f"The answer is {task.answer}."]
    traj = asyncio.run(run_episode(SearchEnv(), task, RandomSearch(tok, turns), tok, seed=0,
                                   limits=LIMITS))
    errors = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(errors) == 4 and all(e.startswith("error:") for e in errors)
    assert "invalid arguments" in errors[0] and "unknown tool" in errors[1]
    assert "empty" in errors[2] and "not valid JSON" in errors[3]
    assert traj.tool_errors == 3 and traj.parse_errors == 1 and traj.env_errors == 0
    assert is_success(traj)


def test_verifier_normalizes_but_is_exact():
    task = make_tasks("train", 1, seed=0, difficulty=2)[0]

    def score(text):
        async def run():
            env = SearchEnv()
            await env.reset(task, 0)
            return (await env.verify(ParsedTurn(text) if text is not None else None)).value
        return asyncio.run(run())

    assert score(f"The answer is {task.answer}.") == 1.0
    assert score(f"the answer is THE {task.answer.lower()}") == 1.0
    assert score(task.answer) == 0.0  # not the agreed format
    assert score(f"The answer is {task.metadata['chain'][1]}.") == 0.0  # the one-hop shortcut
    assert score(f"The answer is {task.answer} or {task.metadata['chain'][1]}.") == 0.0
    assert score(None) == 0.0


def test_short_training_run(tmp_path):
    cfg = load_config(CONFIG, [*TINY_ENV_RUN, *RL_MOVES, "model.build.corpus_tasks=50",
                               "sampling.max_new_tokens=48", f"output_dir={tmp_path}"])
    summary = train(cfg)
    assert summary["sft"]["expert_success"] >= 0.5
    check_short_run(cfg, summary, RandomSearch)
