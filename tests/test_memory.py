"""agent.memory: what a long episode keeps, and that each choice keeps TITO exact."""

import asyncio
import json

import pytest

from tiller.config import ConfigError, load_config
from tiller.engine.api import Generation
from tiller.envs import ENVS
from tiller.envs.verifiers import Reward
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.chat import ChatFormat
from tiller.rollout.collect import run_one
from tiller.rollout.memory import (
    TRUNCATED_MARK,
    MemoryPolicy,
    drop_oldest,
    exchanges,
    truncate_tool_outputs,
)
from tiller.rollout.trajectory import Status, Trajectory

Calc = ENVS["calculator"]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%d * 11"}}\n</tool_call>'


def talk(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for k in range(turns):
        msgs += [{"role": "assistant", "content": f"a{k}"}, {"role": "tool", "content": f"t{k}"}]
    return msgs


def test_exchanges_start_at_each_assistant_turn():
    msgs = talk(2) + [{"role": "tool", "content": "t1b"}]
    assert [[m["content"] for m in ex] for ex in exchanges(msgs, 2)] == [["a0", "t0"],
                                                                         ["a1", "t1", "t1b"]]


def test_drop_oldest_keeps_the_opening_and_the_newest_exchanges_that_fit():
    msgs = talk(3)
    names = lambda c: [m["content"] for m in c]  # noqa: E731
    assert names(drop_oldest(msgs, 2, lambda c: len(c) <= 4)) == ["s", "u", "a2", "t2"]
    # at least the oldest exchange goes, even when everything would fit
    assert names(drop_oldest(msgs, 2, lambda c: True)) == ["s", "u", "a1", "t1", "a2", "t2"]
    assert drop_oldest(msgs, 2, lambda c: False) is None  # not even the newest fits
    assert drop_oldest(talk(1), 2, lambda c: True) is None  # nothing can be dropped


def test_truncate_tool_outputs_cuts_only_tool_messages_and_counts(tokenizer):
    long = " ".join(str(i) for i in range(40))
    msgs = [{"role": "user", "content": long}, {"role": "tool", "content": long},
            {"role": "tool", "content": "7"}]
    ids = tokenizer.encode(long, add_special_tokens=False)
    out, cut = truncate_tool_outputs(msgs, tokenizer, 10)
    assert cut == 1 and out[0] == msgs[0] and out[2] == msgs[2]
    assert out[1]["content"] == (tokenizer.decode(ids[:10])
                                 + TRUNCATED_MARK.format(n=len(ids) - 10))
    assert msgs[1]["content"] == long  # the env's messages are not changed in place


class Scripted:
    """Plays `turns` in order and records each turn's prompt ids and context messages."""

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.seen = tokenizer, turns, []

    async def act(self, prompt_ids, messages, seed, session_id=None):
        self.seen.append((list(prompt_ids), [dict(m) for m in messages]))
        text = self.turns[len(self.seen) - 1]
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return Generation(ids, [-0.1] * len(ids), "stop", version=0)


def many_calls_episode(tokenizer, memory: MemoryPolicy, budget: int, calls: int = 5):
    task = Calc.make_tasks("train", 1, 0, 2)[0]
    actor = Scripted(tokenizer, [CALL % (k + 2) for k in range(calls)] + ["The answer is 1."])
    limits = EpisodeLimits(max_turns=calls + 1, max_episode_tokens=budget, memory=memory)
    traj = asyncio.run(run_episode(Calc(), task, actor, tokenizer, seed=0, limits=limits))
    return traj, actor.seen


def test_drop_oldest_goes_on_in_new_exact_sequences_where_full_memory_truncates(tokenizer):
    full, _ = many_calls_episode(tokenizer, MemoryPolicy(), budget=200)
    assert full.status is Status.TRUNCATED and full.segment_starts == ()

    traj, seen = many_calls_episode(tokenizer, MemoryPolicy("drop_oldest", reserve_tokens=40),
                                    budget=200)
    assert traj.status is Status.COMPLETED and traj.tool_calls == 5 and traj.num_turns == 6
    assert len(traj.segment_starts) >= 1 and set(traj.split_reasons) == {"memory_dropped"}
    chat = ChatFormat(tokenizer, Calc().tool_schemas())
    first_turn: dict[int, int] = {}  # sequence -> its first turn
    for k, (start, _) in enumerate(traj.turn_spans):
        first_turn.setdefault(sum(s <= start for s in traj.segment_starts), k)
    assert sorted(first_turn) == list(range(len(traj.segments())))
    for j, (start, end) in enumerate(traj.segments()):
        prompt, context = seen[first_turn[j]]
        assert end - start <= 200  # every sequence fits the budget
        # each sequence starts with its context rendered as a fresh prompt, and each turn's
        # prompt is exactly its sequence so far (token in, token out inside a sequence)
        assert list(traj.token_ids[start:start + len(prompt)]) == prompt
        assert prompt == chat.prompt_ids(context)
        assert context[:2] == list(traj.messages[:2])  # the opening is always kept
    for k, (start, _) in enumerate(traj.turn_spans):
        seq_start = max(s for s in (0, *traj.segment_starts) if s <= start)
        assert seen[k][0] == list(traj.token_ids[seq_start:start])
    # every generated id, as sampled, is in the trajectory with mask 1; nothing else is
    generated = [i for span in traj.turn_spans for i in range(*span)]
    assert [i for i, m in enumerate(traj.loss_mask) if m] == generated
    assert all(traj.logprobs[i] == -0.1 for i in generated)
    # the conversation record keeps every message, the dropped ones too
    assert sum(m["role"] == "tool" for m in traj.messages) == 5


def test_truncate_tool_output_keeps_one_exact_sequence(tokenizer):
    task = Calc.make_tasks("train", 1, 0, 2)[0]
    call = json.dumps({"name": "calculate", "arguments": {"expression": "nonsense " * 30}})
    actor = Scripted(tokenizer, [f"<tool_call>\n{call}\n</tool_call>", "The answer is 1."])
    limits = EpisodeLimits(6, 512, MemoryPolicy("truncate_tool_output", tool_output_tokens=8))
    traj = asyncio.run(run_episode(Calc(), task, actor, tokenizer, seed=0, limits=limits))
    assert traj.status is Status.COMPLETED and traj.tool_outputs_truncated == 1
    tool = [m for m in traj.messages if m["role"] == "tool"][0]["content"]
    assert tool.endswith("more tokens cut]")
    # the second turn saw the cut text, and the stream is the template's rendering of the
    # conversation as the model saw it: one exact sequence
    assert seen_tool(actor.seen[1][1]) == tool
    chat = ChatFormat(tokenizer, Calc().tool_schemas())
    assert traj.segment_starts == ()
    assert tokenizer.decode(list(traj.token_ids)) + "\n" == chat.render(list(traj.messages),
                                                                          False)


def seen_tool(messages):
    return [m for m in messages if m["role"] == "tool"][0]["content"]


def test_memory_knobs_are_validated():
    base = ["model.build={}"]
    with pytest.raises(ConfigError, match="agent.tool_output_tokens: got 5; it is only used"):
        load_config(None, [*base, "agent.tool_output_tokens=5"])
    with pytest.raises(ConfigError, match="agent.memory: drop_oldest needs"):
        load_config(None, [*base, "agent.memory=drop_oldest", "sampling.max_new_tokens=64",
                           "env.max_episode_tokens=64"])
    cfg = load_config(None, [*base, "agent.memory=drop_oldest"])
    assert cfg.l_max == cfg.env.max_turns * cfg.sampling.max_new_tokens


def test_a_custom_loop_is_handed_the_memory_policy_and_not_checked_for_it():
    """agent.memory with a custom agent.loop loads (no error): the loop gets the policy as
    `limits.memory` and honours it only if it applies it (agent.program refuses it, in
    test_gateway.py)."""
    cfg = load_config(None, ["model.build.vocab_size=600", "agent.memory=drop_oldest",
                             "agent.loop=custom_loop:run_episode"])
    assert cfg.agent.memory == "drop_oldest"
    seen = []

    async def loop(env, task, actor, tokenizer, *, seed, sample_index, limits):
        seen.append(limits.memory)
        return Trajectory("t", 0, (), (), (), 0, (), (), (), Reward(0.0), Status.COMPLETED)

    policy = MemoryPolicy("drop_oldest", reserve_tokens=64)
    task = ENVS["calculator"].make_tasks("train", 1, 0, 1)[0]
    asyncio.run(run_one(task, 0, None, episode_fn=loop, make_env=lambda *a: None,
                        tokenizer=None, limits=EpisodeLimits(memory=policy), seed=0,
                        tag=("rl", 0)))
    assert seen == [policy]
