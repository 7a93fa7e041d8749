import asyncio
import concurrent.futures
import copy
import random
import threading
import time

import pytest
import torch

from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.envs.verifiers import Reward
from tiller.rollout.trajectory import Status, Trajectory
from tiller.train.batch import Batch
from tiller.train.logprobs import token_logprobs

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


def trainer_gaps(model, prompt, gen) -> torch.Tensor:
    """Per generated token, |engine logprob - trainer logprob|, the trainer scoring prompt +
    generation in one full forward."""
    batch = Batch.collate([as_trajectory(prompt, gen)], pad_token_id=0)
    logp, _ = token_logprobs(model, batch)
    return (logp[0, len(prompt):] - torch.tensor(gen.logprobs)).abs().detach()


def trainer_gap(model, prompt, gen) -> float:
    """The largest of `trainer_gaps`."""
    return float(trainer_gaps(model, prompt, gen).max())


def test_batched_sampling_matches_single_requests_and_trainer_logprobs(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(temperature=1.0, max_new_tokens=12)
    batched = gather(engine, PROMPTS, params, [1, 2, 3])
    for prompt, seed, gen in zip(PROMPTS, [1, 2, 3], batched, strict=True):
        alone = gather(engine, [prompt], params, [seed])[0]
        assert alone.token_ids == gen.token_ids  # independent of batch composition
        assert trainer_gap(model, prompt, gen) < 1e-4  # KV-cached decode == full forward


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


def wait_until(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_cancelled_request_leaves_the_batch_and_the_rest_are_unaffected(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(temperature=1.0, max_new_tokens=300)

    async def go():
        tasks = [asyncio.create_task(engine.generate(p, params, s))
                 for p, s in zip(PROMPTS, [1, 2, 3], strict=True)]
        while engine.counters["decode_steps"] < 3:  # all three are decoding
            await asyncio.sleep(0.001)
        tasks[1].cancel()
        return await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), timeout=60)

    first, third = asyncio.run(go())
    alone = gather(engine, [PROMPTS[0], PROMPTS[2]], params, [1, 3])
    assert [first.token_ids, third.token_ids] == [g.token_ids for g in alone]
    assert engine.counters["cancelled"] == 1


def test_a_request_cancelled_while_queued_never_runs(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(temperature=1.0, max_new_tokens=4)
    engine.pause()  # requests queue, nothing is admitted

    async def go():
        tasks = [asyncio.create_task(engine.generate(p, params, s))
                 for p, s in zip(PROMPTS, [1, 2, 3], strict=True)]
        await asyncio.sleep(0.05)
        tasks[0].cancel()
        await asyncio.sleep(0)
        engine.resume()
        return await asyncio.wait_for(asyncio.gather(tasks[1], tasks[2]), timeout=20)

    outs = asyncio.run(go())
    assert all(len(g.token_ids) == 4 for g in outs)
    assert engine.counters["cancelled"] == 1 and engine.counters["requests"] == 2


def test_a_cancelled_submit_future_completes_wait_and_as_completed(model):
    """concurrent.futures.wait and as_completed see a cancelled submit() future as done at
    once, running or queued (Future.cancel() alone wakes only result() waiters); the engine
    then drops both, and the queued one never runs."""
    engine = EmbeddedEngine(model, pad_token_id=0)
    try:
        running = engine.submit(PROMPTS[0], sampling(max_new_tokens=3000), seed=1)
        wait_until(lambda: engine.counters["decode_steps"] >= 3, "decoding to start")
        engine.pause()
        queued = engine.submit(PROMPTS[1], sampling(max_new_tokens=4), seed=2)
        assert running.cancel() and queued.cancel()
        done, not_done = concurrent.futures.wait([running, queued], timeout=5)
        assert done == {running, queued} and not not_done
        assert set(concurrent.futures.as_completed([running, queued], timeout=5)) == done
        engine.resume()
        wait_until(lambda: engine.counters["cancelled"] == 2, "the engine to drop both")
        assert engine.counters["requests"] == 1  # the queued one was never admitted
        after = engine.submit(PROMPTS[2], sampling(max_new_tokens=2), seed=3)
        assert len(after.result(timeout=30).token_ids) == 2
    finally:
        engine.close()


def test_a_request_arriving_mid_decode_joins_without_waiting(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    long = engine.submit(PROMPTS[0], sampling(max_new_tokens=2000), seed=1)
    wait_until(lambda: engine.counters["decode_steps"] >= 5, "the long request to decode")
    steps_before = engine.counters["decode_steps"]
    greedy4 = sampling(temperature=0.0, max_new_tokens=4)
    short = engine.submit(PROMPTS[1], greedy4, seed=2)
    out = short.result(timeout=60)
    assert not long.done()  # the short one finished while the long one kept decoding
    # it joined the running batch: 4 tokens took 3 decode steps after its prefill
    assert engine.counters["decode_steps"] - steps_before <= 3 + 2
    assert engine.max_rows == 2
    assert out.token_ids == gather(engine, [PROMPTS[1]], greedy4, [2])[0].token_ids
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        long.result(timeout=10)


def close_in_forward(engine: EmbeddedEngine, in_first: threading.Event,
                     release: threading.Event, what: str) -> None:
    """Once `what` (a forward held by a hook until `release`) has begun, close the engine from
    another thread, let the forward go on, and require close to return within 10 s."""
    assert in_first.wait(30), f"{what} never started"
    closing = threading.Thread(target=engine.close)
    closing.start()
    wait_until(lambda: engine._closed, "close to begin")
    release.set()
    closing.join(10)
    assert not closing.is_alive(), "close still waits for the forward"


def test_close_stops_a_forward_before_its_next_layer_and_fails_its_requests(model):
    """Ctrl-C or SIGTERM during an evaluation closes the engine while its worker may be deep in
    a prefill (minutes for a batch of thousands of tokens through a 135M model on a loaded CPU:
    a SIGTERM'd SmolLM2 run went on for over 100 s, issue 23). Close stops the forward before
    its next layer, fails the request, and takes the engine's hooks off the model."""
    layers = list(model.model.layers)
    assert len(layers) == 2
    in_first, release, ran_after_close = threading.Event(), threading.Event(), []

    def hold(module, args, output):  # the first forward waits in its first layer for close
        if not in_first.is_set():
            in_first.set()
            assert release.wait(30), "the test never released the forward"

    def count(module, args):  # runs after the engine's own hook: only if that let it through
        if release.is_set():
            ran_after_close.append(layers.index(module))

    engine = EmbeddedEngine(model, pad_token_id=0)
    ours = [layers[0].register_forward_hook(hold),
            *(layer.register_forward_pre_hook(count) for layer in layers)]
    try:
        request = engine.submit(PROMPTS[0], sampling(max_new_tokens=50), seed=1)
        close_in_forward(engine, in_first, release, "the prefill")
        assert ran_after_close == []  # without the stop, layer 1 ran: [1]
        with pytest.raises(RuntimeError, match="the engine was closed"):
            request.result(timeout=5)
        assert [len(layer._forward_pre_hooks) for layer in layers] == [1, 1]  # ours alone
    finally:
        for hook in ours:
            hook.remove()


def test_requests_with_different_sampling_params_share_a_batch(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    kinds = [sampling(temperature=0.0, max_new_tokens=9), sampling(temperature=0.7, top_k=5),
             sampling(top_p=0.8, max_new_tokens=12), sampling(temperature=1.3)]

    async def together():
        return await asyncio.gather(*(engine.generate(PROMPTS[i % 3], k, seed=i)
                                      for i, k in enumerate(kinds)))

    crowd = asyncio.run(together())
    # requests made in one turn of the event loop are admitted together
    assert engine.max_rows == 4 and engine.counters["prefill_calls"] == 1
    for i, (k, g) in enumerate(zip(kinds, crowd, strict=True)):
        alone = gather(EmbeddedEngine(model, 0), [PROMPTS[i % 3]], k, [i])[0]
        assert g.token_ids == alone.token_ids and len(g.token_ids) == k.max_new_tokens
        assert g.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_a_request_gives_the_same_tokens_alone_and_in_a_crowded_batch(model):
    rng = random.Random(0)
    crowd = [[rng.randrange(10, 590) for _ in range(rng.randrange(2, 60))] for _ in range(40)]
    params = sampling(max_new_tokens=32)
    target = [7, 8, 9, 10, 11]
    engine = EmbeddedEngine(model, pad_token_id=0)
    alone = gather(engine, [target], params, [99])[0]
    crowded = gather(EmbeddedEngine(model, pad_token_id=0), crowd + [target], params,
                     list(range(40)) + [99])[-1]
    assert crowded.token_ids == alone.token_ids
    assert crowded.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def two_turns(engine, model, obs=(21, 22, 23, 24, 25, 26, 27), session="s"):
    params = sampling(max_new_tokens=10)
    prompt = list(range(5, 45))
    first = asyncio.run(engine.generate(prompt, params, seed=1, session_id=session))
    second_prompt = prompt + first.token_ids + list(obs)
    before = dict(engine.counters)
    second = asyncio.run(engine.generate(second_prompt, params, seed=2, session_id=session))
    prefilled = engine.counters["prefill_tokens"] - before["prefill_tokens"]
    return first, second, second_prompt, prefilled


def test_the_next_turn_prefills_only_its_new_tokens_with_identical_results(model):
    cached = EmbeddedEngine(model, pad_token_id=0)
    first, second, prompt2, prefilled = two_turns(cached, model)
    # the observation and the previous turn's last token (sampled, never run) are new
    assert prefilled == 7 + 1
    assert second.cached_tokens == len(prompt2) - 8 and cached.cache.hits == 1
    plain = EmbeddedEngine(model, pad_token_id=0, cache_bytes=0)
    p_first, p_second, _, p_prefilled = two_turns(plain, model)
    assert p_prefilled == len(prompt2) and p_second.cached_tokens == 0
    assert (first.token_ids, second.token_ids) == (p_first.token_ids, p_second.token_ids)
    assert second.logprobs == pytest.approx(p_second.logprobs, abs=1e-5)
    # engine/trainer agreement with the cache on: the trainer scores the whole sequence
    assert trainer_gap(model, prompt2, second) < 1e-4


def test_a_shared_prefix_is_reused_across_episodes_in_whole_blocks(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    params = sampling(max_new_tokens=3)
    system = list(range(100, 140))  # 40 tokens: two whole blocks of 16
    asyncio.run(engine.generate(system + [5, 6], params, seed=0, session_id="a"))
    other = asyncio.run(engine.generate(system + [7, 8, 9], params, seed=0, session_id="b"))
    assert other.cached_tokens == 32
    fresh = gather(EmbeddedEngine(model, 0, cache_bytes=0), [system + [7, 8, 9]], params, [0])[0]
    assert other.token_ids == fresh.token_ids


def test_identical_prompts_arriving_together_are_prefilled_once(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    outs = gather(engine, [PROMPTS[2]] * 4, sampling(max_new_tokens=5), [1, 2, 3, 4])
    assert engine.counters["prefill_tokens"] == len(PROMPTS[2])
    assert len({tuple(g.token_ids) for g in outs}) > 1  # the seeds still differ


def test_the_kv_budget_evicts_least_recently_used_and_results_do_not_change(model):
    c = model.config  # bytes of one token's KV: layers * (k, v) * kv heads * head dim * fp32
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    engine = EmbeddedEngine(model, pad_token_id=0, cache_bytes=per_token * 60)
    params = sampling(max_new_tokens=6)
    prompts = [[10 + i] * 30 for i in range(4)]
    outs = [asyncio.run(engine.generate(p, params, seed=i, session_id=str(i)))
            for i, p in enumerate(prompts)]
    assert engine.cache.bytes == per_token * 35 and engine.cache.evictions == 3
    assert len(engine.cache) == 1  # each 35-token entry fits alone
    # session 0 was evicted: its next turn re-prefills and gives what a cold engine gives
    turn2 = prompts[0] + outs[0].token_ids + [3, 4]
    again = asyncio.run(engine.generate(turn2, params, seed=9, session_id="0"))
    assert again.cached_tokens == 0
    cold = gather(EmbeddedEngine(model, 0, cache_bytes=0), [turn2], params, [9])[0]
    assert again.token_ids == cold.token_ids


def test_abort_returns_the_partial_output_with_its_logprobs(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    future = engine.submit(PROMPTS[0], sampling(max_new_tokens=3000), seed=3, request_id="r1")
    wait_until(lambda: engine.counters["decode_steps"] >= 4, "decoding to start")
    assert engine.abort("r1") is True
    out = future.result(timeout=30)
    assert out.finish_reason == "abort" and 4 <= len(out.token_ids) < 3000
    assert len(out.logprobs) == len(out.token_ids) == len(out.versions)
    full = gather(engine, [PROMPTS[0]], sampling(max_new_tokens=len(out.token_ids)), [3])[0]
    assert full.token_ids == out.token_ids  # a prefix of what it would have generated
    assert engine.abort("r1") is False and engine.abort("nobody") is False
    assert engine.counters["aborted"] == 1


def test_a_queued_request_can_be_aborted(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    engine.pause()
    future = engine.submit(PROMPTS[0], sampling(), seed=3, request_id="q")
    assert engine.abort("q") is True
    out = future.result(timeout=10)
    assert (out.token_ids, out.finish_reason) == ([], "abort")


def perturbed(model, version):
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return WeightUpdate.full(other, version)


def test_a_turn_spanning_a_weight_update_is_sampled_by_the_version_each_token_records(model):
    """in_flight="continue": the running request's KV is recomputed by the new weights before
    its next token, so every token's logprob is the one its recorded version gives it with
    the whole context (the trainer's full forward under that version, to 1e-4). Before, the
    tokens after the update attended to keys and values of the old weights while labelled
    with the new version (off by up to 17 nats here). The KV it ends with is all v7's,
    so the session's next turn may reuse it."""
    torch.manual_seed(1)
    old = copy.deepcopy(model)
    update = perturbed(model, 7)
    engine = EmbeddedEngine(model, pad_token_id=0)
    future = engine.submit(PROMPTS[0], sampling(max_new_tokens=400), seed=3, session_id="s")
    wait_until(lambda: engine.counters["decode_steps"] >= 5, "decoding to start")
    assert engine.update_weights(update) == 7
    out = future.result(timeout=60)
    assert out.finish_reason == "length" and len(out.token_ids) == 400 and out.version == 7
    switch = out.versions.index(7)
    assert 5 <= switch < 400
    assert out.versions == (0,) * switch + (7,) * (400 - switch)
    # the prompt and the tokens sampled before the update, but the last (never run yet)
    assert engine.counters["recomputed_tokens"] == len(PROMPTS[0]) + switch - 1
    assert float(trainer_gaps(old, PROMPTS[0], out)[:switch].max()) < 1e-4
    assert float(trainer_gaps(model, PROMPTS[0], out)[switch:].max()) < 1e-4
    assert len(engine.cache) == 1
    engine.close()


def test_a_weight_update_can_abort_the_requests_in_flight(model):
    torch.manual_seed(1)
    engine = EmbeddedEngine(model, pad_token_id=0)
    future = engine.submit(PROMPTS[0], sampling(max_new_tokens=3000), seed=3)
    wait_until(lambda: engine.counters["decode_steps"] >= 3, "decoding to start")
    engine.update_weights(perturbed(model, 2), in_flight="abort")
    out = future.result(timeout=30)
    assert out.finish_reason == "abort" and set(out.versions) == {0} and out.token_ids
    assert engine.version == 2


def test_a_bad_update_is_refused_and_the_engine_keeps_its_version(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    update = WeightUpdate(3, {"no.such.tensor": torch.zeros(1)}, partial=True)
    with pytest.raises(WeightSyncError, match="no.such.tensor"):
        engine.update_weights(update)
    with pytest.raises(ValueError, match="in_flight"):
        engine.update_weights(WeightUpdate.full(model, 1), in_flight="later")
    assert engine.version == 0


def test_pause_holds_requests_until_resume_and_flush_empties_the_cache(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    two_turns(engine, model)
    assert len(engine.cache) == 1
    engine.pause()
    future = engine.submit(PROMPTS[1], sampling(max_new_tokens=3), seed=0)
    time.sleep(0.2)
    assert not future.done() and engine.counters["requests"] == 2
    engine.resume()
    assert len(future.result(timeout=30).token_ids) == 3
    assert engine.flush_cache() == 2 and len(engine.cache) == 0 and engine.cache.bytes == 0


def test_a_control_call_that_gets_no_safe_point_times_out_naming_what_it_waited_for(model):
    engine = EmbeddedEngine(model, pad_token_id=0, control_timeout_s=0.2)
    entered, gate = threading.Event(), threading.Event()

    def stuck(*_):  # a forward that hangs until the gate opens
        entered.set()
        gate.wait(30)

    hook = model.register_forward_pre_hook(stuck)
    try:
        first = engine.submit(PROMPTS[0], sampling(max_new_tokens=2), seed=0)
        assert entered.wait(30)  # the worker is inside the forward, not before it
        with pytest.raises(TimeoutError, match="weight update v5 was not applied within 0.2s"):
            engine.update_weights(WeightUpdate.full(model, 5))
    finally:
        gate.set()
        hook.remove()
    assert len(first.result(timeout=30).token_ids) == 2
    engine.submit(PROMPTS[0], sampling(max_new_tokens=2), seed=0).result(timeout=30)
    # the caller was told it failed, so it never happens later behind its back
    assert engine.version == 0 and engine.counters["weight_updates"] == 0
    engine.close()


def test_bad_prompts_and_sampling_params_fail_their_caller_only(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.submit([], sampling(), seed=0)
    with pytest.raises(ValueError, match="token id 600 is outside the vocabulary"):
        asyncio.run(engine.generate([5, 600], sampling(), seed=0))
    with pytest.raises(ValueError, match=r"top_p=0 \(expected in \(0, 1\]\); max_new_tokens=0"):
        sampling(top_p=0, max_new_tokens=0)
    with pytest.raises(ValueError, match="request_id"):
        engine.abort(None)


def test_a_failing_prefill_fails_only_the_new_requests(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    running = engine.submit(PROMPTS[0], sampling(max_new_tokens=300), seed=1)
    wait_until(lambda: engine.counters["decode_steps"] >= 3, "decoding to start")

    def poison(_, args, kwargs):  # a prompt holding token 599 breaks the model's forward
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.size(1) > 1 and bool((ids == 599).any()):
            raise RuntimeError("poisoned prompt")

    hook = model.register_forward_pre_hook(poison, with_kwargs=True)
    try:
        bad = engine.submit([5, 599, 7], sampling(max_new_tokens=3), seed=2)
        with pytest.raises(RuntimeError, match="poisoned prompt"):
            bad.result(timeout=30)
    finally:
        hook.remove()
    out = running.result(timeout=60)
    assert len(out.token_ids) == 300 and out.finish_reason == "length"
    alone = gather(EmbeddedEngine(model, 0), [PROMPTS[0]], sampling(max_new_tokens=300), [1])[0]
    assert out.token_ids == alone.token_ids
    assert engine.counters["failed_requests"] == 1 and engine.counters["failed_batches"] == 0


def test_every_decoded_row_step_is_a_token_of_a_live_request(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    rng = random.Random(1)
    stops = tuple(range(100, 160))  # rows stop at different steps
    outs = gather(engine, [[rng.randrange(10, 590) for _ in range(rng.randrange(2, 30))]
                           for _ in range(24)], sampling(max_new_tokens=40, stop_token_ids=stops),
                  list(range(24)))
    c = engine.counters
    assert len({len(g.token_ids) for g in outs}) > 5  # rows did leave at different steps
    assert c["decoded_row_steps"] + c["requests"] == c["generated_tokens"] == sum(
        len(g.token_ids) for g in outs)


def test_an_iteration_reads_the_device_back_once(model, monkeypatch):
    engine = EmbeddedEngine(model, pad_token_id=0)
    reads = {"n": 0, "on": False}
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                 "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            if reads["on"]:
                reads["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step = engine._step

    def counted_step():
        reads["on"] = True
        try:
            step()
        finally:
            reads["on"] = False

    engine._step = counted_step
    params = sampling(max_new_tokens=20, top_p=0.9, top_k=5)
    futures = [engine.submit([5, 6, 7 + i], params, i) for i in range(4)]
    futures.append(engine.submit(list(range(5, 60)), params, 9, session_id="s"))
    for f in futures:
        f.result(timeout=30)
    iterations = engine.counters["decode_steps"] + (engine.counters["decode_steps"] == 0)
    assert reads["n"] <= iterations + engine.counters["prefill_calls"]
    assert reads["n"] >= iterations  # the spy does see the one read per iteration


def test_a_group_hitting_a_shared_prefix_is_still_prefilled_once(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    system = list(range(100, 140))
    engine.submit(system + [5, 6], sampling(max_new_tokens=3), 0, session_id="old").result(30)
    before = engine.counters["prefill_tokens"]
    group = system + [7, 8, 9, 10]

    async def go():
        return await asyncio.gather(*(engine.generate(group, sampling(max_new_tokens=3), s,
                                                      session_id=f"g/{s}") for s in range(8)))

    outs = asyncio.run(go())
    assert outs[0].cached_tokens == 32
    assert engine.counters["prefill_tokens"] - before == len(group) - 32


def test_sessions_arriving_at_random_times_match_a_cold_engine(model):
    """Threads run multi-turn sessions that join and leave the batch at random moments, with
    mixed sampling parameters, stop sets and shared prefixes, through a small batch and prefill
    budget (so rows queue, shift and trim): every turn equals a cold single-request engine."""
    rng = random.Random(3)
    engine = EmbeddedEngine(model, pad_token_id=0, max_batch_size=5, max_prefill_tokens=120)
    system = [rng.randrange(10, 590) for _ in range(37)]
    results, lock = [], threading.Lock()

    def episode(e):
        r = random.Random(e)
        time.sleep(r.random() * 0.05)
        prompt = (system if r.random() < 0.7 else []) + [r.randrange(10, 590)
                                                         for _ in range(r.randrange(1, 30))]
        for _ in range(r.randrange(1, 4)):
            params = SamplingParams(
                temperature=r.choice([0.0, 0.7, 1.0]), top_k=r.choice([0, 0, 5]),
                top_p=r.choice([1.0, 1.0, 0.9]), max_new_tokens=r.randrange(1, 25),
                stop_token_ids=tuple(r.sample(range(10, 590), r.randrange(1, 40))))
            seed = r.randrange(1 << 40)
            gen = engine.submit(prompt, params, seed, session_id=f"e{e}").result(timeout=120)
            with lock:
                results.append((list(prompt), params, seed, gen))
            prompt = prompt + gen.token_ids + [r.randrange(10, 590)
                                               for _ in range(r.randrange(1, 8))]
            time.sleep(r.random() * 0.02)

    threads = [threading.Thread(target=episode, args=(e,)) for e in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) >= 16 and engine.cache.hits > 0 and engine.max_rows == 5
    cold = EmbeddedEngine(model, pad_token_id=0, cache_bytes=0)
    for prompt, params, seed, gen in results:
        want = cold.submit(prompt, params, seed).result(timeout=120)
        assert gen.token_ids == want.token_ids
        assert gen.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_sampling_params_without_stop_tokens_are_rejected():
    # a forgotten stop set would silently truncate every turn at max_new_tokens
    with pytest.raises(ValueError, match="stop_token_ids is empty, so no turn could end"):
        SamplingParams(max_new_tokens=8)


def test_a_failing_decode_fails_its_batch_and_the_engine_serves_the_next(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    broken = {"on": True}

    def hook(_, args, kwargs):  # decode steps (one new token per row) fail
        if broken["on"] and kwargs["input_ids"].size(1) == 1:
            raise RuntimeError("CUDA error: device-side assert triggered")

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        futures = [engine.submit(p, sampling(max_new_tokens=3), seed=0) for p in PROMPTS]
        for f in futures:  # every request, including those being admitted, gets the error
            with pytest.raises(RuntimeError, match="device-side assert"):
                f.result(timeout=30)
        assert engine.counters["failed_batches"] >= 1 and engine.counters["failed_requests"] == 0
        broken["on"] = False
        assert len(engine.submit(PROMPTS[0], sampling(max_new_tokens=3), 0).result(30)
                   .token_ids) == 3
    finally:
        handle.remove()


def test_non_finite_logits_fail_their_requests_loudly(model):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    engine = EmbeddedEngine(model, pad_token_id=0)
    futures = [engine.submit(p, sampling(max_new_tokens=3), seed=0) for p in PROMPTS]
    for f in futures:
        with pytest.raises(RuntimeError, match=r"logits are not finite \(NaN or inf\) at weight "
                                               r"version 0"):
            f.result(timeout=30)
    assert engine.counters["failed_requests"] == 3 and engine.counters["requests"] == 3


def test_aborting_a_row_that_is_not_last_moves_the_last_row_into_its_slot(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    first = engine.submit(PROMPTS[0], sampling(max_new_tokens=3000), seed=1, request_id="a")
    second = engine.submit(PROMPTS[2], sampling(max_new_tokens=40), seed=2, request_id="b")
    wait_until(lambda: engine.max_rows == 2 and engine.counters["decode_steps"] >= 3,
               "both rows to decode")
    assert engine.abort("a") is True
    assert first.result(timeout=30).finish_reason == "abort"
    out = second.result(timeout=60)  # now in slot 0: its KV moved with it
    alone = gather(EmbeddedEngine(model, 0), [PROMPTS[2]], sampling(max_new_tokens=40), [2])[0]
    assert out.token_ids == alone.token_ids and out.finish_reason == "length"
    assert engine.counters["aborted"] == 1


def test_kv_buffers_grow_only_in_the_dimension_that_is_short(model):
    model.config.max_position_embeddings = 32768
    engine = EmbeddedEngine(model, pad_token_id=0)
    futures = []
    for i in range(40):  # requests trickle in: rows grow many times, columns stay short
        futures.append(engine.submit([5 + i % 7, 6, 7, 8], sampling(max_new_tokens=20), seed=i))
        time.sleep(0.002)
    for f in futures:
        f.result(timeout=60)
    rows, _, columns, _ = engine._buf[0][0].shape if engine._buf else (0, 0, 0, 0)
    # rows double past the most ever running (how many arrive together follows the machine's
    # timing); columns hold the longest row (4 + 20 tokens) in the first 64
    assert engine.max_rows > 1 and rows <= 2 * engine.max_rows and columns <= 64


def test_a_row_with_non_finite_activations_fails_alone_and_leaves_its_slot_clean(model):
    m = copy.deepcopy(model)
    head = torch.nn.Linear(m.config.hidden_size, m.config.vocab_size)
    with torch.no_grad():
        head.weight.copy_(m.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[599] = -1e4  # finite, and never sampled
        m.lm_head = head  # untied from the embeddings
        m.get_input_embeddings().weight[599] = float("nan")  # a token whose activations are NaN
    engine = EmbeddedEngine(m, pad_token_id=0, max_batch_size=8)
    params = sampling(max_new_tokens=5, stop_token_ids=(599,))  # 599 is never sampled
    alone = engine.submit([5, 6, 7, 8, 9], params, seed=3).result(timeout=30)
    keeper = engine.submit(list(range(1, 101)), sampling(max_new_tokens=300), seed=1)
    wait_until(lambda: engine.counters["decode_steps"] >= 2, "a long row to hold the batch")
    bad = engine.submit([599] + list(range(1, 80)), params, seed=2)
    with pytest.raises(RuntimeError, match="not finite"):
        bad.result(timeout=30)
    again = engine.submit([5, 6, 7, 8, 9], params, seed=3).result(timeout=30)  # a reused slot
    assert again.token_ids == alone.token_ids
    assert keeper.result(timeout=60).finish_reason == "length"


def test_a_temperature_too_small_for_float32_fails_loudly_not_with_garbage(model):
    engine = EmbeddedEngine(model, pad_token_id=0)
    with pytest.raises(RuntimeError, match="not finite.*temperature 1e-40"):
        engine.submit(PROMPTS[0], sampling(temperature=1e-40), seed=0).result(timeout=30)


def test_sampling_params_need_ints_and_the_engine_its_own_masks(model):
    with pytest.raises(ValueError, match=r"top_k=2.0 \(expected an int >= 0"):
        sampling(top_k=2.0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(1.5,))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="needs attn_implementation 'sdpa' or 'eager'"):
        EmbeddedEngine(model, pad_token_id=0)


def test_close_during_a_control_forward_fails_the_control_ops_queued_behind_it(model):
    """A control op (here a scoring forward) stopped between layers by close fails, and so do
    the ops taken with it that had not run yet: their callers learn at once that the engine
    was closed, instead of waiting out control_timeout_s (review s8 F0)."""
    from tiller.engine.worker import ControlOp

    layers = list(model.model.layers)
    in_first, release = threading.Event(), threading.Event()

    def hold(module, args, output):  # the scoring forward waits in its first layer for close
        if not in_first.is_set():
            in_first.set()
            assert release.wait(30), "the test never released the forward"

    engine = EmbeddedEngine(model, pad_token_id=0, control_timeout_s=600.0)
    hook = layers[0].register_forward_hook(hold)
    forward = torch.inference_mode()(lambda: model(input_ids=torch.tensor([PROMPTS[0]])))
    ops = [ControlOp(forward), ControlOp(lambda: "applied")]
    try:
        with engine._cond:  # both in one batch of the worker
            engine._controls.extend(ops)
            engine._ensure_worker()
            engine._cond.notify_all()
        close_in_forward(engine, in_first, release, "the scoring forward")
        for op in ops:  # without the fix the second one waited 600 s
            with pytest.raises(RuntimeError, match="the engine was closed"):
                op.done.result(timeout=5)
    finally:
        hook.remove()
