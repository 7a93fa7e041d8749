"""The TrajectoryBuilder, and the ~20-line custom loop of the docs against tiller's own loop."""

import asyncio
from pathlib import Path

import pytest
from custom_loop import run_episode as custom_episode

from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.envs import ENVS
from tiller.envs.verifiers import Reward
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits, ExpertActor, run_episode
from tiller.rollout.chat import stop_token_ids
from tiller.rollout.trajectory import Status, TrajectoryBuilder

Calc = ENVS["calculator"]
LIMITS = EpisodeLimits(max_turns=5, max_episode_tokens=2000)  # the custom loop has no budget


def test_builder_keeps_ids_mask_logprobs_spans_and_versions_aligned():
    b = TrajectoryBuilder("t", sample_index=3)
    b.append_prompt([1, 2, 3])
    b.append_generated([4, 5], [-0.5, -0.25], version=7)
    b.append_observation([6])
    b.append_generated([8], [-1.0], version=8)
    traj = b.finish(Reward(1.0), Status.COMPLETED, tool_calls=1, info={"k": "v"})
    assert traj.token_ids == (1, 2, 3, 4, 5, 6, 8) and len(b) == 7
    assert traj.loss_mask == (0, 0, 0, 1, 1, 0, 1)
    assert traj.logprobs == (0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.0)
    assert (traj.prompt_len, traj.turn_spans, traj.versions) == (3, ((3, 5), (6, 7)), (7, 8))
    assert (traj.sample_index, traj.tool_calls, traj.info) == (3, 1, {"k": "v"})


def test_builder_rejects_misaligned_appends():
    b = TrajectoryBuilder("t")
    b.append_prompt([1])
    b.append_prompt([2])  # the prompt may come in pieces, before any turn
    with pytest.raises(ValueError, match="one logprob per id: got 2 ids and 1 logprobs"):
        b.append_generated([3, 4], [-0.1], version=0)
    b.append_generated([3], [-0.1], version=0)
    with pytest.raises(ValueError, match="the prompt comes first"):
        b.append_prompt([5])
    assert b.prompt_len == 2 and b.token_ids == [1, 2, 3]


def both_loops(make_actor, tokenizer, tasks):
    async def go(loop):
        return await asyncio.gather(*(
            loop(Calc(), t, make_actor(t), tokenizer, seed=i, limits=LIMITS)
            for i, t in enumerate(tasks)))
    return asyncio.run(go(run_episode)), asyncio.run(go(custom_episode))


def test_custom_loop_writes_the_default_loops_tokens_for_the_expert(tokenizer):
    tasks = Calc.make_tasks("train", 8, 3, 2)
    ours, theirs = both_loops(lambda t: ExpertActor(Calc, t, tokenizer, 0.3), tokenizer, tasks)
    assert sum(t.num_turns for t in ours) > len(tasks)  # tool calls and observations happen
    for a, b in zip(ours, theirs, strict=True):
        assert (a.token_ids, a.loss_mask, a.logprobs) == (b.token_ids, b.loss_mask, b.logprobs)
        assert (a.turn_spans, a.status, a.reward) == (b.turn_spans, b.status, b.reward)


def test_custom_loop_writes_the_default_loops_tokens_for_the_engine(model, tokenizer):
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=16,
                            stop_token_ids=stop_token_ids(tokenizer, model.generation_config))
    tasks = Calc.make_tasks("train", 4, 0, 2)
    ours, theirs = both_loops(lambda t: EngineActor(engine, params), tokenizer, tasks)
    assert sum(t.num_generated for t in ours) > 30
    for a, b in zip(ours, theirs, strict=True):
        assert (a.token_ids, a.loss_mask, a.turn_spans) == (b.token_ids, b.loss_mask, b.turn_spans)
        # which episodes share an engine batch moves logprobs by float noise only
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("doc", ["docs/plugins.md", "docs/architecture.md"])
def test_the_docs_show_exactly_the_tested_loop(doc):
    text = Path(doc).read_text()
    shown = text[text.index("```python\nasync def run_episode") + len("```python\n"):]
    shown = shown[: shown.index("```")]
    assert shown in Path("tests/custom_loop.py").read_text() and shown.count("\n") >= 20
