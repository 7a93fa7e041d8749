"""TITO: the trajectory is exactly prompt ids + engine outputs + observation ids."""

import asyncio

import pytest
import torch

from tiller.config import ConfigError
from tiller.engine.api import Generation, SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.envs import ENVS
from tiller.envs.verifiers import Reward
from tiller.errors import RunError
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits, ExpertActor, run_episode
from tiller.rollout.chat import CHAT_TEMPLATE
from tiller.rollout.trajectory import Status
from tiller.tools.registry import ToolOutcome, ToolResult
from tiller.train.batch import Batch
from tiller.train.logprobs import token_logprobs

Calc = ENVS["calculator"]


class Recorder:
    """Wraps an actor and keeps every prompt it saw and every generation it returned."""

    def __init__(self, actor):
        self.actor, self.prompts, self.outputs = actor, [], []

    async def act(self, prompt_ids, messages, seed, session_id=None):
        self.prompts.append(list(prompt_ids))
        self.sessions = [*getattr(self, "sessions", []), session_id]
        gen = await self.actor.act(prompt_ids, messages, seed, session_id=session_id)
        self.outputs.append(gen)
        return gen


def episode(actor, tokenizer, limits, task, seed=0):
    return asyncio.run(run_episode(Calc(), task, actor, tokenizer, seed=seed, limits=limits))


def two_step_task():
    return next(t for t in Calc.make_tasks("train", 50, 3, 2) if t.metadata["problem"].steps)


def test_ids_are_prompt_plus_outputs_plus_observations(tokenizer, limits):
    task = two_step_task()
    rec = Recorder(ExpertActor(Calc, task, tokenizer))
    traj = episode(rec, tokenizer, limits, task)
    assert traj.status is Status.COMPLETED and traj.reward.value == 1.0
    assert traj.num_turns == 3 and traj.tool_calls == 2

    prompt = tokenizer.apply_chat_template(list(traj.messages[:2]), tools=Calc().tool_schemas(),
                                           add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(prompt, add_special_tokens=False)
    assert list(traj.token_ids[: traj.prompt_len]) == expected
    # Rebuild: each turn's prompt is the previous prompt + its output + the observation.
    for k, gen in enumerate(rec.outputs):
        assert rec.prompts[k] == list(traj.token_ids[: traj.turn_spans[k][0]])
        start, end = traj.turn_spans[k]
        assert list(traj.token_ids[start:end]) == gen.token_ids
        if k + 1 < len(rec.outputs):
            obs = traj.token_ids[end: traj.turn_spans[k + 1][0]]
            text = tokenizer.decode(list(obs))
            assert text.startswith("\n<|im_start|>user\n<tool_response>\n")
            assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The whole episode decodes to the chat template's rendering of its messages.
    full = tokenizer.apply_chat_template(list(traj.messages), tools=Calc().tool_schemas(),
                                         tokenize=False)
    assert tokenizer.decode(list(traj.token_ids)) + "\n" == full


def test_loss_mask_is_one_exactly_on_generated_tokens(tokenizer, limits):
    task = two_step_task()
    traj = episode(ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    in_span = [0] * len(traj.token_ids)
    for start, end in traj.turn_spans:
        in_span[start:end] = [1] * (end - start)
    assert list(traj.loss_mask) == in_span
    pairs = zip(traj.token_ids, traj.loss_mask, strict=True)
    generated = tokenizer.decode([t for t, m in pairs if m])
    assert generated.count("<tool_call>") == 2 and "<tool_response>" not in generated
    assert generated.endswith(f"The answer is {task.answer}.<|im_end|>")
    # tool output digits sit between the spans, masked out
    assert sum(traj.loss_mask) < len(traj.token_ids) - traj.prompt_len


def test_engine_logprobs_match_trainer_in_fp32(model, tokenizer, limits):
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(tokenizer.eos_token_id,))
    tasks = Calc.make_tasks("train", 6, 0, 2)

    async def go():
        return await asyncio.gather(*(
            run_episode(Calc(), t, EngineActor(engine, params), tokenizer, seed=i, limits=limits)
            for i, t in enumerate(tasks)))

    trajs = asyncio.run(go())
    batch = Batch.collate(trajs, tokenizer.pad_token_id)
    logp, _ = token_logprobs(model, batch)
    gap = ((logp - batch.rollout_logprobs).abs() * batch.loss_mask).max()
    assert batch.loss_mask.sum() > 20
    assert float(gap.detach()) < 1e-4


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6)])
def test_engine_logprobs_match_trainer_under_truncation(model, tokenizer, limits, top_k, top_p):
    """With top-k / top-p on, the engine reports the logprob of the distribution it sampled
    from (sampled, the default) or before truncation (untruncated); the trainer recomputes the
    same kind from the same weights."""
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    tasks = Calc.make_tasks("train", 4, 0, 2)
    out = {}
    for kind in ("sampled", "untruncated"):
        params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, max_new_tokens=16,
                                stop_token_ids=(tokenizer.eos_token_id,), logprobs=kind)

        async def go(params=params):
            return await asyncio.gather(*(
                run_episode(Calc(), t, EngineActor(engine, params), tokenizer, seed=i,
                            limits=limits) for i, t in enumerate(tasks)))

        out[kind] = Batch.collate(asyncio.run(go()), tokenizer.pad_token_id)
    sampled, untruncated = out["sampled"], out["untruncated"]
    assert torch.equal(sampled.input_ids, untruncated.input_ids)  # same tokens, other logprob
    mask = sampled.loss_mask
    with torch.no_grad():
        trunc, _ = token_logprobs(model, sampled, 0.8, top_k=top_k, top_p=top_p)
        full, _ = token_logprobs(model, sampled, 0.8)
    assert mask.sum() > 20
    assert float(((trunc - sampled.rollout_logprobs).abs() * mask).max()) < 1e-4
    assert float(((full - untruncated.rollout_logprobs).abs() * mask).max()) < 1e-4
    # the sampled logprob is the higher one wherever the kept mass is below 1
    gap = (sampled.rollout_logprobs - untruncated.rollout_logprobs)[mask > 0]
    assert float(gap.min()) > -1e-5 and float(gap.max()) > 1e-2


class Scripted:
    """Replays fixed assistant texts, tokenized, as if the model wrote them."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def act(self, prompt_ids, messages, seed, session_id=None):
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return Generation(ids, [0.0] * len(ids), "stop", 0)


def test_malformed_calls_become_error_observations_not_crashes(tokenizer, limits):
    task = Calc.make_tasks("train", 1, 0, 1)[0]
    p = task.metadata["problem"]
    texts = [
        '<tool_call>{"name": "calculate", "arguments": {</tool_call>',  # broken JSON
        '<tool_call>{"name": "calc", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>',  # bad field
        f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{p.a} * {p.b}"}}}}'
        "</tool_call>",
        f"The answer is {task.answer}.",
    ]
    traj = episode(Scripted(tokenizer, texts), tokenizer, limits, task)
    assert traj.status is Status.COMPLETED and traj.reward.value == 1.0
    assert (traj.parse_errors, traj.tool_errors, traj.tool_calls) == (1, 2, 3)
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error: tool call is not valid JSON")
    assert tool_msgs[1].startswith("error: unknown tool 'calc'")
    assert "expression" in tool_msgs[2] and tool_msgs[3] == str(p.a * p.b)


def test_turn_limit_and_token_budget_truncate(tokenizer, limits):
    task = two_step_task()
    short = episode(ExpertActor(Calc, task, tokenizer), tokenizer,
                    EpisodeLimits(max_turns=1, max_episode_tokens=512), task)
    assert short.status is Status.TRUNCATED and short.reward.value == 0.0
    tiny = episode(ExpertActor(Calc, task, tokenizer), tokenizer,
                   EpisodeLimits(max_turns=6, max_episode_tokens=short.prompt_len + 5), task)
    assert tiny.status is Status.TRUNCATED and len(tiny.token_ids) <= short.prompt_len + 5


def test_expert_with_guesses_sometimes_skips_the_tool(tokenizer, limits):
    tasks = Calc.make_tasks("train", 40, 0, 1)
    trajs = [episode(ExpertActor(Calc, t, tokenizer, guess_prob=0.5), tokenizer, limits, t, i)
             for i, t in enumerate(tasks)]
    no_tool = sum(t.tool_calls == 0 for t in trajs)
    assert 10 <= no_tool <= 30
    assert all(t.reward.value == 1.0 for t in trajs if t.tool_calls)


class FailingCalc(Calc):
    """The calculator env with one part broken (raising `error`, or a default per part), and a
    record of whether close ran."""

    def __init__(self, broken: str = "", verify_env_error: bool = False,
                 error: Exception | None = None, **kwargs):
        super().__init__(**kwargs)
        self.broken, self.verify_env_error, self.closed = broken, verify_env_error, 0
        self.error = error

    def fail(self, part: str, default: Exception) -> None:
        if self.broken == part:
            raise self.error or default

    async def reset(self, task, seed):
        self.fail("reset", ConnectionError("sandbox did not start"))
        return await super().reset(task, seed)

    async def step(self, action):
        self.fail("step", OSError("tool server gone"))
        return await super().step(action)

    async def verify(self, final):
        self.fail("verify", OSError("checker gone"))
        reward = await super().verify(final)
        if self.verify_env_error:  # what the code env answers when its sandbox fails
            return Reward(0.0, {"tests": 0.0}, env_error=True)
        return reward

    async def close(self):
        self.closed += 1
        if self.broken == "close":
            raise OSError("temp dir busy")


def run_with(env, actor, tokenizer, limits, task):
    return asyncio.run(run_episode(env, task, actor, tokenizer, seed=0, limits=limits))


def test_env_error_reported_by_the_verifier_is_an_env_error_episode(tokenizer, limits):
    task = two_step_task()
    env = FailingCalc(verify_env_error=True)
    traj = run_with(env, ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    assert traj.status is Status.ENV_ERROR and traj.reward.env_error
    assert traj.env_errors == 1 and traj.reward.value == 0.0
    assert traj.info["error"] == "env.verify: the verifier reported env_error"
    assert traj.num_turns == 3 and env.closed == 1  # the episode itself ran to the end


def test_a_failing_reset_is_an_env_error_episode_and_close_still_runs(tokenizer, limits):
    task = two_step_task()
    env = FailingCalc("reset")
    traj = run_with(env, ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    assert traj.status is Status.ENV_ERROR and traj.env_errors == 1
    assert traj.info["error"] == "env.reset: ConnectionError: sandbox did not start"
    assert traj.token_ids == () and traj.num_turns == 0 and env.closed == 1


def test_a_failing_step_still_closes_the_env(tokenizer, limits):
    task = two_step_task()
    env = FailingCalc("step")
    traj = run_with(env, ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    assert traj.status is Status.ENV_ERROR and traj.num_turns == 1 and env.closed == 1
    assert traj.info["error"] == "env.step: OSError: tool server gone"


def test_a_failing_close_is_logged_and_recorded_not_swallowed(tokenizer, limits, caplog):
    task = two_step_task()
    env = FailingCalc("close")
    with caplog.at_level("WARNING", logger="tiller.rollout.episode"):
        traj = run_with(env, ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    # the episode's data is sound: it keeps its status and reward
    assert traj.status is Status.COMPLETED and traj.reward.value == 1.0
    assert traj.info == {"close_error": "env.close: OSError: temp dir busy"}
    assert "env.close: OSError: temp dir busy" in caplog.text and env.closed == 1


class Broken:
    """An engine that fails on its second call."""

    def __init__(self, tokenizer, task):
        self.expert, self.calls = ExpertActor(Calc, task, tokenizer), 0

    async def act(self, prompt_ids, messages, seed, session_id=None):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("CUDA error: device-side assert")
        return await self.expert.act(prompt_ids, messages, seed)


def test_an_engine_failure_aborts_the_episode_with_the_error_recorded(tokenizer, limits):
    task = two_step_task()
    env = FailingCalc()
    traj = run_with(env, Broken(tokenizer, task), tokenizer, limits, task)
    assert traj.status is Status.ABORTED and traj.num_turns == 1 and env.closed == 1
    assert traj.info["error"] == "engine: RuntimeError: CUDA error: device-side assert"
    assert all(m["role"] != "error" for m in traj.messages)  # messages stay renderable


async def sandbox_down(call):
    return ToolResult(call, ToolOutcome.ENV_ERROR, "sandbox down")


def test_an_engine_failure_after_a_tool_env_error_is_aborted_not_env_error(tokenizer, limits):
    # aborted wins: an env_error status would hide the engine failure from rl.max_aborted_frac
    task = two_step_task()
    env = FailingCalc(wrap=lambda registry: sandbox_down)
    traj = run_with(env, Broken(tokenizer, task), tokenizer, limits, task)
    assert traj.status is Status.ABORTED and traj.env_errors == 1 and traj.num_turns == 1
    assert traj.info["error"] == "engine: RuntimeError: CUDA error: device-side assert"


@pytest.mark.parametrize("part", ["reset", "step", "verify"])
@pytest.mark.parametrize("error", [ConfigError("code sandbox: bwrap not found; install it"),
                                   RunError("the tool server refuses this run")])
def test_config_and_run_errors_in_the_env_stop_the_run(tokenizer, limits, part, error):
    # fail-closed start-up problems are the run's, not one episode's env_error (success 0)
    task = two_step_task()
    env = FailingCalc(part, error=error)
    with pytest.raises(type(error)) as raised:
        run_with(env, ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    assert raised.value is error and env.closed == 1


class BadShape:
    """A custom actor whose generation has one logprob too few."""

    async def act(self, prompt_ids, messages, seed, session_id=None):
        return Generation([1, 2, 3], [0.0, 0.0], "stop", 0)


class NoneContentCalc(FailingCalc):
    """A calculator whose tool messages have no text (an env bug the template cannot render)."""

    async def step(self, action):
        result = await super().step(action)
        for m in result.messages:
            m["content"] = None
        return result


def test_loop_failures_abort_the_episode_instead_of_raising(tokenizer, limits):
    task = two_step_task()
    expert = ExpertActor(Calc, task, tokenizer)
    raising = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    raising.chat_template = CHAT_TEMPLATE.replace(
        "{%- elif m.role == 'tool' %}",
        "{%- elif m.role == 'tool' %}{{ raise_exception('no tool role here') }}")
    cases = [
        (FailingCalc(), expert, raising, "chat template: TemplateError: no tool role here"),
        (NoneContentCalc(), expert, tokenizer, "chat template: UndefinedError: "),
        (FailingCalc(), BadShape(), tokenizer, "agent loop: ValueError: a generated turn needs "
                                               "one logprob per id: got 3 ids and 2 logprobs"),
    ]
    for env, actor, tok, error in cases:
        traj = run_with(env, actor, tok, limits, task)
        assert traj.status is Status.ABORTED and env.closed == 1, error
        assert traj.info["error"].startswith(error)


class BadPrompt(FailingCalc):
    async def reset(self, task, seed):
        return [{"role": "user", "content": None}]


def test_a_prompt_the_template_cannot_render_aborts_the_episode(tokenizer, limits):
    task = two_step_task()
    env = BadPrompt()
    traj = run_with(env, ExpertActor(Calc, task, tokenizer), tokenizer, limits, task)
    assert traj.status is Status.ABORTED and traj.token_ids == () and env.closed == 1
    assert traj.info["error"].startswith("agent loop: UndefinedError: ")


class EndsConversation:
    """Answers correctly, but stops on <|endoftext|> (a generation_config eos, not the
    template's end of turn) as a Qwen base model can."""

    def __init__(self, tokenizer, task):
        self.tokenizer, self.task, self.calls = tokenizer, task, 0

    async def act(self, prompt_ids, messages, seed, session_id=None):
        self.calls += 1
        ids = self.tokenizer.encode(f"The answer is {self.task.answer}.<|endoftext|>",
                                    add_special_tokens=False)
        return Generation(ids, [0.0] * len(ids), "stop", 0)


def test_a_stop_on_another_eos_ends_the_conversation(tokenizer, limits):
    # the template has no turn after <|endoftext|>: continuing would append observations the
    # chat template never renders, so the episode ends: completed, scored with no final answer
    task = two_step_task()
    actor = EndsConversation(tokenizer, task)
    traj = run_with(FailingCalc(), actor, tokenizer, limits, task)
    assert traj.status is Status.COMPLETED and actor.calls == 1 and traj.num_turns == 1
    assert traj.reward.value == 0.0 and traj.info == {"ended_by": "<|endoftext|>"}
    assert tokenizer.decode([traj.token_ids[-1]]) == "<|endoftext|>"
    assert traj.messages[-1] == {"role": "assistant",
                                 "content": f"The answer is {task.answer}."}


class Versioned:
    """The expert's turns, answered as an engine would after weight updates or an abort."""

    def __init__(self, tokenizer, task, versions=None, finish_reason="stop"):
        self.expert = ExpertActor(Calc, task, tokenizer)
        self.versions, self.finish_reason, self.turn = versions, finish_reason, 0

    async def act(self, prompt_ids, messages, seed, session_id=None):
        gen = await self.expert.act(prompt_ids, messages, seed)
        self.turn += 1
        n = len(gen.token_ids)
        return Generation(gen.token_ids, gen.logprobs, self.finish_reason, version=9,
                          versions=tuple(self.versions(self.turn, n)) if self.versions else ())


def test_a_turn_spanning_a_weight_update_counts_as_its_oldest_version(tokenizer, limits):
    task = two_step_task()
    # turn 1 sampled under v3 then v4; later turns under v4
    actor = Versioned(tokenizer, task, lambda turn, n: [3] * (n // 2) + [4] * (n - n // 2)
                      if turn == 1 else [4] * n)
    traj = episode(actor, tokenizer, limits, task)
    assert traj.status is Status.COMPLETED and traj.versions[0] == 3
    assert set(traj.versions[1:]) == {4}


def test_an_aborted_turn_aborts_the_episode(tokenizer, limits):
    traj = episode(Versioned(tokenizer, two_step_task(), finish_reason="abort"), tokenizer,
                   limits, two_step_task())
    assert traj.status is Status.ABORTED
    assert traj.info["error"] == "engine: the request was aborted mid-turn"
