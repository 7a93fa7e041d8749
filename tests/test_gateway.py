"""The agent gateway: black-box agent programs written against the official `openai` client
run through a real uvicorn server on 127.0.0.1, and every token they were served is the engine's.

A tiny model overfit on one scripted calculator episode makes the agent's turns deterministic
(greedy: a `calculate` call, then the answer), so the bridge between calls is exercised."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from tiller.config import load_config
from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.envs import ENVS
from tiller.errors import ConfigError
from tiller.gateway.program import ProgramEpisode, load_program
from tiller.gateway.server import Gateway
from tiller.models import load_model, load_tokenizer
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits, run_episode
from tiller.rollout.chat import ChatFormat, stop_token_ids
from tiller.rollout.collect import collect_expert
from tiller.rollout.trajectory import Status
from tiller.train.batch import Batch

ROOT = Path(__file__).parents[1]
LIMITS = EpisodeLimits(max_turns=6, max_episode_tokens=512)
CALC = ENVS["calculator"]


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


@pytest.fixture(scope="module")
def task():
    return CALC.make_tasks("train", 1, 3, 2)[0]


@pytest.fixture(scope="module")
def agent_model_dir(calc_model_dir, task, tmp_path_factory):
    """The tiny model overfit on the expert's whole episode of `task` (every generated turn),
    so greedy decoding replays it: a call, then the answer."""
    tok = load_tokenizer(calc_model_dir)
    (traj,) = collect_expert(CALC, [task], tok, guess=0.0, limits=LIMITS, seed=0)
    assert traj.num_turns >= 2
    model = load_model(calc_model_dir)
    torch.manual_seed(0)
    ids = torch.tensor([traj.token_ids])
    mask = torch.tensor(traj.loss_mask[1:], dtype=torch.bool)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(80):
        logits = model(ids).logits[0, :-1]  # position t predicts token t + 1
        loss = F.cross_entropy(logits[mask], ids[0, 1:][mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    out = tmp_path_factory.mktemp("gateway") / "agent_model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


class RecordingActor:
    """The engine's actor, keeping every (prompt, generation) it was asked for and answered."""

    def __init__(self, actor):
        self.actor, self.calls = actor, []

    async def act(self, prompt_ids, messages, seed, session_id=None):
        gen = await self.actor.act(prompt_ids, messages, seed, session_id=session_id)
        self.calls.append((list(prompt_ids), gen))
        return gen


@pytest.fixture(scope="module")
def engine(agent_model_dir):
    tok = load_tokenizer(agent_model_dir)
    model = load_model(agent_model_dir).eval()
    eng = EmbeddedEngine(model, tok.pad_token_id, max_batch_size=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=48,
                            stop_token_ids=stop_token_ids(tok, model.generation_config))
    yield {"engine": eng, "params": params, "tok": tok}
    eng.close()


@pytest.fixture(scope="module")
def gateway():
    gw = Gateway().start()
    yield gw
    gw.close()


def _episode(gateway, engine, program, *, reward="verifier", timeout=60.0, task=None,
             limits=LIMITS):
    actor = RecordingActor(EngineActor(engine["engine"], engine["params"]))
    episode = ProgramEpisode(gateway, program, timeout, reward)
    task = task or CALC.make_tasks("train", 1, 3, 2)[0]
    traj = asyncio.run(episode(CALC(), task, actor, engine["tok"], seed=0, limits=limits))
    return traj, actor.calls


def _assert_exact(traj, calls):
    """Each generated turn is one engine answer, kept whole, after exactly the tokens the
    engine was given as its prompt (its segment so far); the loss mask is 1 on those ids
    only, and the logprobs there are the engine's."""
    assert traj.num_turns == len(calls)
    mask = [0] * len(traj.token_ids)
    starts = [s for s, _ in traj.segments()]
    for (start, end), (prompt, gen) in zip(traj.turn_spans, calls, strict=True):
        segment_start = max(s for s in starts if s <= start)
        assert list(traj.token_ids[segment_start:start]) == prompt
        assert list(traj.token_ids[start:end]) == gen.token_ids
        assert list(traj.logprobs[start:end]) == gen.logprobs
        mask[start:end] = [1] * (end - start)
    assert list(traj.loss_mask) == mask


@pytest.mark.integration
def test_example_agent_tokens_are_the_engines_and_match_the_agent_loop(gateway, engine, task):
    """The openai-SDK example runs unmodified through the gateway: one exact sequence whose
    every generated token is the engine's, each later prompt is the stream so far plus the
    bridge, and the trajectory is the one tiller's own agent loop writes for the same task."""
    program = load_program("openai_agent.agent:main")
    traj, calls = _episode(gateway, engine, program, task=task)
    assert traj.status is Status.COMPLETED, traj.info
    assert traj.segment_starts == () and len(calls) == 2
    _assert_exact(traj, calls)
    (p0, g0), (p1, _) = calls
    g0 = g0.token_ids
    assert p1[: len(p0) + len(g0)] == p0 + g0  # token in, token out: nothing re-rendered
    chat = ChatFormat(engine["tok"], CALC().tool_schemas())
    history, new = list(traj.messages[:3]), [traj.messages[3]]
    assert new[0]["role"] == "tool"
    assert p1[len(p0) + len(g0):] == chat.observation_ids(history, new)  # the bridge
    assert traj.reward.value == 1.0 and traj.tool_calls == 1

    loop_actor = EngineActor(engine["engine"], engine["params"])
    own = asyncio.run(run_episode(CALC(), task, loop_actor, engine["tok"], seed=0,
                                  limits=LIMITS))
    assert own.token_ids == traj.token_ids and own.loss_mask == traj.loss_mask
    assert own.reward == traj.reward


@pytest.mark.integration
def test_history_rewrite_splits_into_exact_segments(gateway, engine, task):
    """The compacting agent rewrites its history after each tool round: every later call
    starts a new exact sequence, counted with reason history_rewritten, and each trains as
    its own row made of that call's prompt and the engine's answer."""
    program = load_program("openai_agent.agent:compact_main")
    before = gateway.stats().get("gateway/splits/history_rewritten", 0.0)
    traj, calls = _episode(gateway, engine, program, task=task)
    assert len(calls) >= 2
    assert traj.split_reasons == ("history_rewritten",) * (len(calls) - 1)
    _assert_exact(traj, calls)
    for (start, end), (prompt, gen) in zip(traj.segments(), calls, strict=True):
        assert list(traj.token_ids[start:end]) == prompt + gen.token_ids
    chat = ChatFormat(engine["tok"], CALC().tool_schemas())
    assert "Results so far" in traj.messages[1]["content"]  # the compacted note
    assert calls[-1][0] == chat.prompt_ids(list(traj.messages[:2]))  # rendered afresh
    rows = Batch.collate([traj], engine["tok"].pad_token_id).input_ids
    for row, (prompt, gen) in zip(rows, calls, strict=True):
        ids = prompt + gen.token_ids
        assert row[: len(ids)].tolist() == ids
    assert gateway.stats()["gateway/splits/history_rewritten"] == before + len(calls) - 1


class GatedActor:
    """The engine's actor, held back until `release` is set: a call stays in flight."""

    def __init__(self, actor):
        self.actor, self.release = actor, asyncio.Event()

    async def act(self, prompt_ids, messages, seed, session_id=None):
        await self.release.wait()
        return await self.actor.act(prompt_ids, messages, seed, session_id=session_id)


MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.integration
def test_misuse_gets_a_4xx_with_a_clear_message_and_is_counted(gateway, engine):
    """No key, an unknown key, an ended session, a malformed body, an unknown field, a wrong
    model, n > 1, an unknown route, a second call while one is in flight, a call past the turn
    limit: each a 4xx naming the problem; none reaches the trajectory; all are counted."""
    before = gateway.stats()
    actor = GatedActor(EngineActor(engine["engine"], engine["params"]))
    limits = EpisodeLimits(max_turns=1, max_episode_tokens=512)

    async def go():
        session = gateway.open(actor, engine["tok"], task_id="t", sample_index=0, seed=0,
                               limits=limits)
        auth = {"Authorization": f"Bearer {session.key}"}
        ok = {"model": gateway.model, "messages": MESSAGES}
        sdk = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:

            async def error(status, **request):
                r = await http.post("/chat/completions", **request)
                assert r.status_code == status, r.text
                return r.json()["error"]["message"]

            assert "missing session key" in await error(401, json=ok)
            with pytest.raises(openai.AuthenticationError, match="unknown session key"):
                await openai.AsyncOpenAI(base_url=gateway.base_url, api_key="sk-wrong",
                                         max_retries=0).chat.completions.create(**ok)
            assert "invalid request" in await error(
                400, content=b"{not json", headers={**auth, "content-type": "application/json"})
            assert "temprature" in await error(400, json={**ok, "temprature": 1},
                                               headers=auth)
            with pytest.raises(openai.NotFoundError, match="'gpt-4o' is not served"):
                await sdk.chat.completions.create(model="gpt-4o", messages=MESSAGES)
            assert "one choice per call" in await error(400, json={**ok, "n": 2},
                                                        headers=auth)
            r = await http.post("/completions", json=ok, headers=auth)
            assert r.status_code == 404 and "POST /v1/chat/completions" in r.text

            first = asyncio.ensure_future(sdk.chat.completions.create(**ok))
            while not session.busy:
                await asyncio.sleep(0.01)
            assert "call in flight" in await error(409, json=ok, headers=auth)
            actor.release.set()
            reply = await first
            assert reply.choices[0].message.role == "assistant"
            assert "env.max_turns" in await error(400, json=ok, headers=auth)
            assert session.calls == 1 and session.rejected == 6
            assert session.refused and "turn limit" in session.refused
            gateway.close_session(session)
            assert "session has ended" in await error(404, json=ok, headers=auth)
        await sdk.close()
        return session

    session = asyncio.run(go())
    assert session.builder.finish(None, Status.COMPLETED).num_turns == 1  # only the answered
    after = gateway.stats()
    grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k)}
    assert grew == {"gateway/sessions": 1, "gateway/calls": 1, "gateway/rejected/401": 2,
                    "gateway/rejected/400": 4, "gateway/rejected/404": 3,
                    "gateway/rejected/409": 1, "gateway/late_calls": 1}


async def raises(base_url, api_key, model, task):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
        await c.chat.completions.create(model=model, messages=task["messages"])
    raise RuntimeError("boom")


async def hangs(base_url, api_key, model, task):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
        await c.chat.completions.create(model=model, messages=task["messages"])
        await c.chat.completions.create(model=model, messages=task["messages"])  # gated


def scores(value):
    async def program(base_url, api_key, model, task):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
            await c.chat.completions.create(model=model, messages=task["messages"])
        return value
    return program


async def no_calls(base_url, api_key, model, task):
    return 1.0


async def wrong_signature(url):
    return None


@pytest.mark.integration
def test_failing_programs_are_aborted_episodes_with_the_reason(gateway, engine):
    """A program that raises, hangs past its timeout (its call in flight is cancelled and
    counted), returns no reward (agent.reward=program) or makes no call is an aborted
    episode saying why; one refused at the turn limit is truncated; a program's reward is its
    number, or its mapping's "reward"."""
    traj, _ = _episode(gateway, engine, raises)
    assert traj.status is Status.ABORTED and traj.num_turns == 1
    assert traj.info["error"] == "agent.program: RuntimeError: boom"

    gated = GatedActor(EngineActor(engine["engine"], engine["params"]))

    async def first_call_only(prompt_ids, messages, seed, session_id=None):
        if not gated.release.is_set() and not getattr(gated, "served", False):
            gated.served = True
            return await gated.actor.act(prompt_ids, messages, seed, session_id=session_id)
        return await GatedActor.act(gated, prompt_ids, messages, seed, session_id)

    gated.act = first_call_only
    before = gateway.stats().get("gateway/cancelled_at_close", 0.0)
    episode = ProgramEpisode(gateway, hangs, 2.0, "verifier")
    traj = asyncio.run(episode(CALC(), CALC.make_tasks("train", 1, 3, 2)[0], gated,
                               engine["tok"], seed=0, limits=LIMITS))
    assert traj.status is Status.ABORTED and "did not return within 2 s" in traj.info["error"]
    assert traj.num_turns == 1  # the first call; the second was cancelled, not lost
    assert gateway.stats()["gateway/cancelled_at_close"] == before + 1

    example = load_program("openai_agent.agent:main")  # two calls, one allowed
    traj, calls = _episode(gateway, engine, example, limits=EpisodeLimits(1, 512))
    assert traj.status is Status.TRUNCATED and len(calls) == 1 and traj.num_turns == 1
    assert "turn limit" in traj.info["truncated"] and traj.info["gateway_rejected"] == "1"
    assert "BadRequestError" in traj.info["error"] and traj.reward.value == 0.0

    traj, _ = _episode(gateway, engine, scores({"reward": 0.25, "steps": 3}), reward="program")
    assert traj.status is Status.COMPLETED and traj.reward.value == 0.25
    assert dict(traj.reward.checks) == {"steps": 3.0}
    traj, _ = _episode(gateway, engine, scores(True), reward="program")
    assert traj.reward.value == 1.0
    traj, _ = _episode(gateway, engine, scores("junk"), reward="program")
    assert traj.status is Status.ABORTED and "expected a finite number" in traj.info["error"]
    traj, calls = _episode(gateway, engine, no_calls, reward="program")
    assert traj.status is Status.ABORTED and not calls and not traj.token_ids
    assert "made no chat completion call" in traj.info["error"]


def test_agent_program_config_errors_are_one_line():
    base = ["model.build.vocab_size=600", "agent.program=openai_agent.agent:main"]
    with pytest.raises(ConfigError, match="agent.program.*agent.loop must stay the default"):
        load_config(None, [*base, "agent.loop=custom_loop:run_episode"])
    with pytest.raises(ConfigError, match="agent.memory: got 'drop_oldest'.*agent.program"):
        load_config(None, [*base, "agent.memory=drop_oldest"])
    with pytest.raises(ConfigError, match="agent.reward: got 'program'; it needs"):
        load_config(None, ["model.build.vocab_size=600", "agent.reward=program"])
    with pytest.raises(ConfigError, match="agent.program_timeout_s"):
        load_config(None, [*base, "agent.program_timeout_s=0"])
    with pytest.raises(ConfigError, match="agent.program: got 'nope.agent:main'; cannot"):
        load_program("nope.agent:main")
    with pytest.raises(ConfigError, match="expected an async function"):
        load_program("openai_agent.agent:run_tool")
    with pytest.raises(ConfigError, match="must accept the keyword arguments base_url"):
        load_program("test_gateway:wrong_signature")


@pytest.mark.slow
@pytest.mark.integration
def test_rl_through_the_gateway_trains_exactly_the_sampled_tokens(agent_model_dir, tmp_path,
                                                                  monkeypatch):
    """`tiller train` with agent.program (in-process, as the CLI runs it): two GRPO steps on
    the example agent's episodes, and every generated turn of every trained row is one engine
    answer, after exactly the context the engine was given, with the engine's logprobs."""
    from helpers import RL_MOVES, tiny_rl

    from tiller.controller import train
    from tiller.train.trainer import Trainer

    sampled, batches = {}, []
    generate, rl_step = EmbeddedEngine.generate, Trainer.rl_step

    async def recording_generate(self, prompt_ids, params, seed, **kw):
        gen = await generate(self, prompt_ids, params, seed, **kw)
        # a group's episodes may sample the same turn; each answer's logprobs are kept (which
        # requests share a batch moves them by float noise)
        sampled.setdefault((tuple(prompt_ids), tuple(gen.token_ids)), []).append(
            torch.tensor(gen.logprobs, dtype=torch.float32))
        return gen

    def recording_step(self, batch, *args, **kw):
        batches.append(batch)
        return rl_step(self, batch, *args, **kw)

    monkeypatch.setattr(EmbeddedEngine, "generate", recording_generate)
    monkeypatch.setattr(Trainer, "rl_step", recording_step)
    cfg = load_config("configs/calculator.yaml", tiny_rl(
        agent_model_dir, "rl.steps=2", "rl.group_size=2", "eval.tasks=2",
        "env.tools.gate.enabled=false", "agent.program=openai_agent.agent:main", *RL_MOVES))
    summary = train(cfg, tmp_path / "run")
    assert summary["rl"]["ledger"]["trained"] == 8
    assert len(batches) == 2
    for batch in batches:
        for r, spans in enumerate(batch.turn_spans):
            row = batch.input_ids[r].tolist()
            expected = torch.zeros(batch.loss_mask.shape[1])
            assert spans
            for s, e in spans:
                answers = sampled[(tuple(row[:s]), tuple(row[s:e]))]  # sampled just so
                assert any(torch.equal(batch.rollout_logprobs[r, s:e], lp) for lp in answers)
                expected[s:e] = 1
            assert torch.equal(batch.loss_mask[r], expected)


@pytest.mark.integration
def test_expert_demonstrations_run_through_the_program(gateway, engine, task):
    """With agent.program, SFT's scripted expert plays the model behind the gateway: its
    demonstrations are the program's conversations, token for token those of tiller's loop."""
    episode = ProgramEpisode(gateway, load_program("openai_agent.agent:main"), 60.0, "verifier")
    (traj,) = collect_expert(CALC, [task], engine["tok"], guess=0.0, limits=LIMITS, seed=0,
                             episode_fn=episode)
    (own,) = collect_expert(CALC, [task], engine["tok"], guess=0.0, limits=LIMITS, seed=0)
    assert traj.status is Status.COMPLETED and traj.reward.value == 1.0
    assert traj.token_ids == own.token_ids and traj.loss_mask == own.loss_mask


@pytest.mark.integration
def test_streamed_call_is_recorded_like_any_other(gateway, engine):
    """stream=true answers the finished turn as Server-Sent Events; the turn is recorded, and
    return_token_ids shows the exact prompt and ids the trajectory keeps."""
    actor = RecordingActor(EngineActor(engine["engine"], engine["params"]))

    async def go():
        session = gateway.open(actor, engine["tok"], task_id="s", sample_index=0, seed=0,
                               limits=LIMITS)
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key,
                                      max_retries=0) as sdk:
            stream = await sdk.chat.completions.create(
                model=gateway.model, messages=MESSAGES, stream=True, temperature=0.3,
                extra_body={"return_token_ids": True})
            chunks = [c async for c in stream]
        gateway.close_session(session)
        return session, chunks

    ignored = gateway.stats().get("gateway/sampling_fields_ignored", 0.0)
    session, chunks = asyncio.run(go())
    assert gateway.stats()["gateway/sampling_fields_ignored"] == ignored + 1  # the run's hold
    (prompt, gen), = actor.calls
    first, last = chunks[0].model_dump(), chunks[-1].model_dump()
    assert first["prompt_token_ids"] == prompt
    assert last["choices"][0]["token_ids"] == gen.token_ids
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    traj = session.builder.finish(None, Status.COMPLETED)
    assert list(traj.token_ids) == prompt + gen.token_ids
