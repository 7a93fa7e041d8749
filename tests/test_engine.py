import asyncio

import pytest
import torch

from tiller.envs.verifiers import Reward
from tiller.rollout.engine import EmbeddedEngine, SamplingParams
from tiller.rollout.trajectory import Status, Trajectory
from tiller.rollout.weight_sync import WeightUpdate
from tiller.train.batch import Batch, token_logprobs

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]


def sampling(**kwargs) -> SamplingParams:
    """Sampling that stops only at max_new_tokens, unless told otherwise (no token has id -1)."""
    return SamplingParams(**{"stop_token_ids": (-1,), **kwargs})


def gather(engine, prompts, params, seeds):
    async def go():
        pairs = zip(prompts, seeds, strict=True)
        return await asyncio.gather(*(engine.generate(p, params, s) for p, s in pairs))
    return asyncio.run(go())


def as_trajectory(prompt, gen):
    ids = prompt + gen.token_ids
    return Trajectory("t", 0, tuple(ids), (0,) * len(prompt) + (1,) * len(gen.token_ids),
                      (0.0,) * len(prompt) + tuple(gen.logprobs), len(prompt), (), (), (),
                      Reward(0.0), Status.COMPLETED)


def test_batched_sampling_matches_single_requests_and_trainer_logprobs(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(temperature=1.0, max_new_tokens=12)
    batched = gather(engine, PROMPTS, params, [1, 2, 3])
    for prompt, seed, gen in zip(PROMPTS, [1, 2, 3], batched, strict=True):
        alone = gather(engine, [prompt], params, [seed])[0]
        assert alone.token_ids == gen.token_ids  # independent of batch composition
        batch = Batch.collate([as_trajectory(prompt, gen)], pad_token_id=0)
        logp, _ = token_logprobs(model, batch)
        diff = (logp[0, len(prompt):] - torch.tensor(gen.logprobs)).abs().max()
        # left-padded KV-cached decode == right-padded full forward
        assert float(diff.detach()) < 1e-4


def test_stop_tokens_max_tokens_and_greedy(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    greedy = gather(engine, PROMPTS[:1], sampling(temperature=0.0, max_new_tokens=6), [0])[0]
    top1 = gather(engine, PROMPTS[:1], sampling(top_k=1, max_new_tokens=6), [5])[0]
    assert greedy.token_ids == top1.token_ids and greedy.finish_reason == "length"
    assert len(greedy.token_ids) == 6
    stop_at = greedy.token_ids[2]
    stopped = gather(engine, PROMPTS[:1],
                     sampling(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop_at,)),
                     [0])[0]
    first = greedy.token_ids.index(stop_at)
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_same_seed_same_tokens_other_seed_differs(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(max_new_tokens=16)
    a, b, c = gather(engine, [PROMPTS[0]] * 3, params, [4, 4, 5])
    assert a.token_ids == b.token_ids != c.token_ids


def test_weight_update_sets_version_and_changes_outputs(model, calc_model_dir):
    from tiller.models import load_model

    engine = EmbeddedEngine(load_model(calc_model_dir), pad_token_id=0)
    params = sampling(temperature=0.0, max_new_tokens=8)
    before = gather(engine, PROMPTS[:1], params, [0])[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.update_weights(WeightUpdate.full(model, version=7))
    after = gather(engine, PROMPTS[:1], params, [0])[0]
    assert (before.version, after.version, engine.version) == (0, 7, 7)
    assert before.token_ids != after.token_ids


def test_top_p_keeps_only_the_nucleus(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    greedy = gather(engine, PROMPTS[:1], sampling(temperature=0.0, max_new_tokens=8), [0])[0]
    # a nucleus smaller than any one token's mass keeps just the most likely token
    tiny = gather(engine, PROMPTS[:1] * 3, sampling(top_p=1e-6, max_new_tokens=8),
                  [1, 2, 3])
    assert all(g.token_ids == greedy.token_ids for g in tiny)
    wide = gather(engine, PROMPTS[:1] * 3, sampling(top_p=1.0, max_new_tokens=8), [1, 2, 3])
    assert len({tuple(g.token_ids) for g in wide}) > 1  # without truncation, seeds differ


def test_a_cancelled_request_does_not_hang_the_rest_of_its_batch(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(temperature=1.0, max_new_tokens=12)

    async def go():
        tasks = [asyncio.create_task(engine.generate(p, params, s))
                 for p, s in zip(PROMPTS, [1, 2, 3], strict=True)]
        while engine._pending or engine._worker is None:  # until the batch is in the worker
            await asyncio.sleep(0)
        tasks[1].cancel()
        return await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), timeout=20)

    first, third = asyncio.run(go())
    alone = gather(engine, [PROMPTS[0], PROMPTS[2]], params, [1, 3])
    assert [first.token_ids, third.token_ids] == [g.token_ids for g in alone]
    assert engine.cancelled == 1


def test_a_request_cancelled_before_its_batch_is_skipped(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(temperature=1.0, max_new_tokens=4)

    async def go():
        tasks = [asyncio.create_task(engine.generate(p, params, s))
                 for p, s in zip(PROMPTS, [1, 2, 3], strict=True)]
        await asyncio.sleep(0)  # every request is pending, no batch has started
        tasks[0].cancel()
        return await asyncio.wait_for(asyncio.gather(tasks[1], tasks[2]), timeout=20)

    outs = asyncio.run(go())
    assert all(len(g.token_ids) == 4 for g in outs)
    assert engine.cancelled == 1


def test_sampling_params_without_stop_tokens_are_rejected():
    # a forgotten stop set would silently truncate every turn at max_new_tokens
    with pytest.raises(ValueError, match="stop_token_ids is empty, so no turn could end"):
        SamplingParams(max_new_tokens=8)
