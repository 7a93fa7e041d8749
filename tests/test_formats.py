"""The chat-format matrix: real vocabularies, real chat templates, tiller's real agent loop.

For each format (tests/real_vocab.py builds the tokenizers offline) a scripted actor writes
multi-turn tool episodes in that family's own syntax, and a tiny random-weight model over the
real vocabulary samples through the embedded engine. The checks:

- exact TITO: the trajectory is the prompt, then each turn's ids exactly as the actor or
  engine returned them, then each observation exactly as the template renders it after the
  turn just generated; every prompt the actor saw is the trajectory up to its turn;
- mask: the loss mask is 1 exactly on the generated ids;
- tool-call parse: the env receives the tool calls the actor wrote, with their arguments;
- reasoning kept: sampled reasoning stays in the trajectory and is trained, although the
  template drops it from later prompts; agent.history=template splits the episode there.
"""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch
from real_vocab import (
    gpt_oss_tokenizer,
    llama3_tokenizer,
    qwen3_tokenizer,
    qwen35_tokenizer,
    trl_template,
)
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen3Config

from tiller.engine.api import Generation, SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Env, StepResult, Task
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError
from tiller.models import load_tokenizer
from tiller.rollout.agent_loop import (
    EngineActor,
    EpisodeLimits,
    check_rollout_setup,
    run_episode,
)
from tiller.rollout.chat import FAMILIES, ChatFormat, stop_token_ids
from tiller.rollout.trajectory import Status
from tiller.tools.registry import ToolCall, ToolOutcome, ToolResult
from tiller.train.batch import Batch
from tiller.train.logprobs import token_logprobs

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}]
VALUES = {"a": "42", "b": "7"}


def with_template(tokenizer, name):
    tok = copy.copy(tokenizer)
    tok.chat_template = trl_template(name)
    return tok


def hermes_call(key):
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


def think(text, rest):
    return f"<think>\n{text}\n</think>\n\n{rest}"


def xml_call(key):
    return (f"<tool_call>\n<function=lookup>\n<parameter=key>\n{key}\n</parameter>\n"
            f"</function>\n</tool_call>")


def thought(text, rest):  # after a generation prompt that opens <think>
    return f"{text}\n</think>\n\n{rest}"


def llama_call(key):
    return f'{{"name": "lookup", "parameters": {{"key": "{key}"}}}}'


def harmony(reasoning, rest):
    return f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant{rest}"


def harmony_call(key):
    return (f'<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>'
            f'{{"key": "{key}"}}<|call|>')


def harmony_final(text):
    return f"<|channel|>final<|message|>{text}<|return|>"


# format -> (tokenizer, family detected, the scripted turns: call a, answer, call b, answer)
FORMATS = {
    "qwen3": (qwen3_tokenizer, "qwen3", [
        think("I need a.", hermes_call("a")), think("a is known.", "a is 42."),
        think("Now b.", hermes_call("b")), think("Done.", "b is 7.")]),
    "qwen3.6": (qwen35_tokenizer, "qwen3.5", [
        thought("I need a.", xml_call("a")), thought("a is known.", "a is 42."),
        thought("Now b.", xml_call("b")), thought("Done.", "b is 7.")]),
    "qwen2.5": (lambda: with_template(qwen3_tokenizer(), "qwen2_5"), "hermes", [
        hermes_call("a"), "a is 42.", hermes_call("b"), "b is 7."]),
    "llama3.2": (llama3_tokenizer, "llama3", [
        llama_call("a"), "a is 42.", llama_call("b"), "b is 7."]),
    "llama3.1": (lambda: with_template(llama3_tokenizer(), "llama3_1"), "llama3", [
        llama_call("a"), "a is 42.", llama_call("b"), "b is 7."]),
    "gpt-oss": (gpt_oss_tokenizer, "harmony", [
        harmony("I need a.", harmony_call("a")), harmony("a is known.", harmony_final("a is 42.")),
        harmony("Now b.", harmony_call("b")), harmony("Done.", harmony_final("b is 7."))]),
}
EXPECTED_CALLS = [ToolCall("lookup", {"key": "a"}), None, ToolCall("lookup", {"key": "b"}), None]


class LookupEnv(Env):
    """Tool calls get `lookup`'s answer; the first plain answer gets a follow-up user query
    (so a template that drops reasoning before the last query re-renders the history); the
    second ends the episode. Every action it receives is kept, to check the parser."""

    name = "lookup"

    def __init__(self):
        self.actions: list[ParsedTurn] = []

    async def reset(self, task, seed):
        return [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": task.prompt}]

    async def step(self, action):
        self.actions.append(action)
        if action.tool_calls:
            results = [ToolResult(c, ToolOutcome.OK, VALUES.get(c.arguments.get("key"), "?"))
                       for c in action.tool_calls]
            return StepResult([{"role": "tool", "name": "lookup", "content": r.content}
                               for r in results], False, results)
        if len(self.actions) < 3:
            return StepResult([{"role": "user", "content": "And b?"}], False)
        return StepResult([], True)

    def tool_schemas(self):
        return TOOLS

    async def verify(self, final):
        return Reward(float(final is not None and "7" in final.content))

    @staticmethod
    def make_tasks(split, n, seed, difficulty):
        return [Task(f"{split}-{i}", "What is a?", "42", split) for i in range(n)]

    @staticmethod
    def expert_turn(task, messages, rng, guess_prob):
        return "a is 42."


class Scripted:
    """An actor that writes fixed turns (in a format's own syntax; the end-of-turn token is
    added unless the turn ends with its own stop) and keeps every prompt it was given and
    every generation it returned."""

    def __init__(self, tokenizer, turns, chat):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.turns = [ids if ids and ids[-1] in chat.turn_end_ids else [*ids, chat.end_of_turn_id]
                      for ids in self.turns]
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def act(self, prompt_ids, messages, seed, session_id=None):
        ids = self.turns[len(self.outputs)]
        self.prompts.append(list(prompt_ids))
        self.outputs.append(ids)
        return Generation(list(ids), [0.0] * len(ids), "stop", version=0)


class Recorder:
    def __init__(self, actor):
        self.actor, self.prompts, self.outputs = actor, [], []

    async def act(self, prompt_ids, messages, seed, session_id=None):
        self.prompts.append(list(prompt_ids))
        gen = await self.actor.act(prompt_ids, messages, seed, session_id=session_id)
        self.outputs.append(list(gen.token_ids))
        return gen


def scripted_episode(fmt, history="stream"):
    build, _, turns = FORMATS[fmt]
    return scripted_episode_on(build(), turns, history)


def scripted_episode_on(tok, turns, history="stream"):
    chat = ChatFormat(tok, TOOLS)
    actor, env = Scripted(tok, turns, chat), LookupEnv()
    limits = EpisodeLimits(max_turns=6, max_episode_tokens=4096, history=history)
    task = LookupEnv.make_tasks("train", 1, 0, 1)[0]
    traj = asyncio.run(run_episode(env, task, actor, tok, seed=0, limits=limits))
    return tok, chat, actor, env, traj


def check_exact(tok, chat, actor, traj):
    """Trajectory = prompt + (turn + observation)*, each observation the template's own text
    for the new messages, cut right after the end-of-turn token that closes the turn."""
    assert traj.status is Status.COMPLETED, traj.info
    messages = list(traj.messages)
    assert list(traj.token_ids[: traj.prompt_len]) == chat.prompt_ids(messages[:2])
    turn_msgs = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(traj.turn_spans) == len(actor.outputs) == len(turn_msgs)
    for k, (start, end) in enumerate(traj.turn_spans):
        assert list(traj.token_ids[start:end]) == actor.outputs[k]
        assert actor.prompts[k] == list(traj.token_ids[: start])
        if k + 1 < len(traj.turn_spans):
            obs = tok.decode(list(traj.token_ids[end: traj.turn_spans[k + 1][0]]))
            full = chat.render(messages[: turn_msgs[k + 1]], True)
            assert full.endswith(obs)
            assert any(full[: len(full) - len(obs)].endswith(c) for c in chat.closers)
    generated = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert generated == [t for out in actor.outputs for t in out]  # the mask: exactly these


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_scripted_tool_episode_is_exact_and_parsed(fmt):
    tok, chat, actor, env, traj = scripted_episode(fmt)
    assert chat.family == FORMATS[fmt][1]
    check_exact(tok, chat, actor, traj)
    assert traj.num_turns == 4 and traj.tool_calls == 2 and traj.parse_errors == 0
    assert traj.reward.value == 1.0
    assert [a.tool_calls[0] if a.tool_calls else None for a in env.actions] == EXPECTED_CALLS
    assert [a.content for a in env.actions if not a.tool_calls] == ["a is 42.", "b is 7."]


def test_qwen3_reasoning_is_parsed_kept_and_trained_though_the_template_drops_it():
    tok, chat, actor, env, traj = scripted_episode("qwen3")
    assert [a.reasoning for a in env.actions] == ["I need a.", "a is known.", "Now b.",
                                                "Done."]
    think_id = tok.convert_tokens_to_ids("</think>")
    masked = [m for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if t == think_id]
    assert masked == [1, 1, 1, 1]  # every sampled </think> is in the trajectory, trained
    # the template's own rendering of the third prompt drops the first two turns' reasoning
    # (they come before the last user query): the stream is not a re-rendering of history
    third = traj.turn_spans[2][0]
    messages = list(traj.messages)
    rendered = chat.prompt_ids(messages[: [i for i, m in enumerate(messages)
                                            if m["role"] == "assistant"][2]])
    assert rendered != list(traj.token_ids[:third])
    assert "I need a." not in tok.decode(rendered)
    assert "I need a." in tok.decode(list(traj.token_ids[:third]))


# Qwen3 drops reasoning before the last user query: one split, at the follow-up. trl's
# gpt-oss template also writes a tool call's header differently from the model ("to=" before
# the channel, no <|constrain|>) and an earlier answer's <|return|> as <|end|>: every turn.
@pytest.mark.parametrize("fmt, splits", [("qwen3", 1), ("qwen3.6", 1), ("qwen2.5", 0),
                                         ("llama3.2", 0), ("gpt-oss", 3)])
def test_template_history_splits_where_the_template_rewrites_the_stream(fmt, splits):
    tok, chat, actor, env, traj = scripted_episode(fmt, history="template")
    assert traj.status is Status.COMPLETED and traj.num_turns == 4
    assert len(traj.segment_starts) == splits
    assert traj.split_reasons == ("template_history",) * splits
    messages = list(traj.messages)
    turn_msgs = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, (start, end) in enumerate(traj.turn_spans):
        seg_start, seg_end = next(s for s in traj.segments() if s[0] <= start < s[1])
        assert seg_end >= end
        # each segment is exact: what the actor saw is the template's prompt at that turn
        # (equal to the stream where no split happened), then its own output
        assert actor.prompts[k] == list(traj.token_ids[seg_start:start])
        assert actor.prompts[k] == chat.prompt_ids(messages[: turn_msgs[k]])
        assert list(traj.token_ids[start:end]) == actor.outputs[k]
    generated = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert generated == [t for out in actor.outputs for t in out]


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3.6", "llama3.2"])
def test_renderers_hand_written_renderer_agrees_on_every_turn(fmt):
    """An independent implementation: the `renderers` package's Python renderer of the family
    gives the same first prompt, the same next prompts where it can bridge, and the same
    parse of every turn."""
    from renderers.configs import Llama3RendererConfig, Qwen3RendererConfig, Qwen36RendererConfig
    from renderers.llama_3 import Llama3Renderer
    from renderers.qwen3 import Qwen3Renderer
    from renderers.qwen36 import Qwen36Renderer

    tok, chat, actor, env, traj = scripted_episode(fmt)
    renderer = {
        "qwen3": lambda: Qwen3Renderer(tok, Qwen3RendererConfig()),
        "qwen3.6": lambda: Qwen36Renderer(tok, Qwen36RendererConfig()),
        "llama3.2": lambda: Llama3Renderer(tok, Llama3RendererConfig(date_string=date_string(tok))),
    }[fmt]()
    messages = list(traj.messages)
    assert renderer.render_ids(messages[:2], tools=TOOLS, add_generation_prompt=True) == (
        actor.prompts[0])
    turn_msgs = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    bridged = 0
    for k, out in enumerate(actor.outputs):
        parsed = renderer.parse_response(out, tools=TOOLS, prompt_ids=actor.prompts[k])
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
            (c.name, c.arguments) for c in env.actions[k].tool_calls]
        assert (parsed.reasoning_content or "") == env.actions[k].reasoning
        if k + 1 < len(actor.outputs):
            new = messages[turn_msgs[k] + 1: turn_msgs[k + 1]]
            b = renderer.bridge_to_next_turn(actor.prompts[k], out, new, tools=TOOLS)
            if b is not None:  # None: it re-renders there (a new user query, for Qwen3)
                bridged += 1
                assert b.token_ids == actor.prompts[k + 1]
    assert bridged >= 2


def date_string(tok):
    """The date the Llama 3 template writes today (so renderers writes the same one)."""
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    return text.split("Today Date: ", 1)[1].split("\n", 1)[0]


def tiny_model(tok, arch, end_of_turn_id, seed=0):
    """A random-weight model over the real vocabulary whose turns end after a few tokens:
    one constant embedding dimension survives the final norm, and only the end-of-turn row
    of the (untied) output layer reads it, which lifts that token to ~20% per step."""
    cfg_cls = Qwen3Config if arch == "qwen3" else LlamaConfig
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=end_of_turn_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 30.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[end_of_turn_id, 0] = 1.3
    return model.eval()


class EchoEnv(LookupEnv):
    """Whatever the model writes, the next turn gets a tool result, three times."""

    async def step(self, action):
        self.actions.append(action)
        done = len(self.actions) == 3
        return StepResult([] if done else [{"role": "tool", "name": "lookup",
                                            "content": f"result {len(self.actions)}"}], done)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, arch", [("qwen3", "qwen3"), ("qwen3.6", "qwen3"),
                                       ("llama3.2", "llama")])
def test_engine_sampled_episodes_are_exact_and_logprobs_match_the_trainer(fmt, arch):
    check_engine_sampled(FORMATS[fmt][0](), arch)


def check_engine_sampled(tok, arch):
    """Three-turn episodes sampled by `tiny_model` over `tok`'s vocabulary: exact, and the
    trainer's logprobs on them are the engine's."""
    chat = ChatFormat(tok, TOOLS)
    model = tiny_model(tok, arch, chat.end_of_turn_id)
    engine = EmbeddedEngine(model, tok.pad_token_id)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(chat.end_of_turn_id,))
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=4096)
    tasks = LookupEnv.make_tasks("train", 4, 0, 1)
    recs = [Recorder(EngineActor(engine, params)) for _ in tasks]

    async def go():
        return await asyncio.gather(*(run_episode(EchoEnv(), t, r, tok, seed=i, limits=limits)
                                      for i, (t, r) in enumerate(zip(tasks, recs, strict=True))))

    trajs = asyncio.run(go())
    full = [t for t in trajs if t.num_turns == 3]
    assert len(full) >= 2, [(t.status, t.num_turns) for t in trajs]  # most end each turn
    for traj, rec in zip(trajs, recs, strict=True):
        if traj.num_turns == 3:
            check_exact(tok, chat, rec, traj)
    batch = Batch.collate(full, tok.pad_token_id)
    logp, _ = token_logprobs(model, batch)
    gap = ((logp - batch.rollout_logprobs).abs() * batch.loss_mask).max()
    assert batch.loss_mask.sum() >= 6 * len(full)
    assert float(gap.detach()) < 1e-4


def test_the_vocabularies_are_the_real_ones():
    """Known ids of the published tokenizers (tokenizer.json of Qwen3 and Llama 3.1)."""
    qwen, llama = qwen3_tokenizer(), llama3_tokenizer()
    assert len(qwen) == 151669 and len(llama) == 128256
    assert qwen.encode("Hello world") == [9707, 1879]
    assert qwen.convert_tokens_to_ids(["<|im_end|>", "<tool_call>", "<think>"]) == [
        151645, 151657, 151667]
    assert llama.encode("Hello world", add_special_tokens=False) == [9906, 1917]
    assert llama.convert_tokens_to_ids(["<|eot_id|>", "<|python_tag|>"]) == [128009, 128010]
    qwen35 = qwen35_tokenizer()
    assert len(qwen35) == 248077
    assert qwen35.convert_tokens_to_ids(["<|im_end|>", "<think>"]) == [248046, 248068]


def test_stop_tokens_include_the_familys_own_turn_ends():
    tok = gpt_oss_tokenizer()
    assert stop_token_ids(tok) == tuple(tok.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    qwen = qwen3_tokenizer()
    assert stop_token_ids(qwen, GenerationConfig(eos_token_id=[151645, 151643])) == (
        151645, 151643)


def test_config_names_every_family():
    from typing import get_args

    from tiller.config import AgentConfig, ModelConfig
    assert set(get_args(ModelConfig.model_fields["chat_format"].annotation)) == {"auto",
                                                                                  *FAMILIES}
    assert get_args(AgentConfig.model_fields["history"].annotation) == ("stream", "template")


def test_unknown_chat_format_and_history_are_one_line_errors():
    tok = qwen3_tokenizer()
    with pytest.raises(ConfigError, match=r"^config field model.chat_format: got 'qwen9'; "
                                          r"expected one of auto, llama3, harmony, qwen3\.5, "
                                          r"qwen3, hermes$"):
        ChatFormat(tok, TOOLS, "qwen9")
    cfg = Qwen3Config(max_position_embeddings=4096)
    with pytest.raises(ConfigError, match=r"^config field agent.history: got 'raw'; expected "
                                          r"one of stream, template$"):
        check_rollout_setup(tok, cfg, EpisodeLimits(history="raw"))
    check_rollout_setup(tok, cfg, EpisodeLimits())  # the real Qwen3 template starts


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_real_template_passes_the_start_up_check(fmt):
    check_rollout_setup(FORMATS[fmt][0](), Qwen3Config(max_position_embeddings=4096),
                        EpisodeLimits(history="template"))


def test_llama3_parser_reports_a_malformed_call_and_keeps_plain_text():
    parse = FAMILIES["llama3"].parse
    assert parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}') == ParsedTurn(
        "", [ToolCall("f", {"x": 1})])
    assert parse('{"name": "f", "arguments": "{\\"x\\": 2}"}').tool_calls == [
        ToolCall("f", {"x": 2})]
    bad = parse('{"name": "f", "parameters": ')
    assert bad.tool_calls == [] and bad.parse_errors[0].startswith("tool call is not valid JSON")
    assert parse("The answer is {x}.") == ParsedTurn("The answer is {x}.")


def test_harmony_parser_reads_channels_recipients_and_bad_arguments():
    parse = FAMILIES["harmony"].parse
    turn = parse(harmony("plan", harmony_call("a")))
    assert turn == ParsedTurn("", [ToolCall("lookup", {"key": "a"})], reasoning="plan")
    # the template's header order (recipient first) reads the same
    assert parse('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>'
                 '{"x": 1}<|call|>').tool_calls == [ToolCall("f", {"x": 1})]
    bad = parse('<|channel|>commentary to=functions.f<|message|>{"x": <|call|>')
    assert bad.tool_calls == [] and bad.parse_errors[0].startswith("arguments of 'f' are not")
    assert parse(harmony_final("hi")) == ParsedTurn("hi")
    assert parse("<|channel|>final").parse_errors  # cut off before its <|message|>


def test_xml_parser_reads_parameters_and_reports_a_broken_call():
    parse = FAMILIES["qwen3.5"].parse
    turn = parse(thought("plan", xml_call("a")))
    assert turn == ParsedTurn("", [ToolCall("lookup", {"key": "a"})], reasoning="plan")
    obj = parse('<tool_call>\n<function=f>\n<parameter=x>\n{"y": [1]}\n</parameter>\n'
                '<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>')
    assert obj.tool_calls == [ToolCall("f", {"x": {"y": [1]}, "n": "3"})]
    bad = parse("<tool_call>\n<function=f>\n<parameter=x>\n{oops\n</parameter>\n</function>"
                "\n</tool_call>")
    assert bad.tool_calls == [] and bad.parse_errors[0].startswith("parameter 'x' of 'f' is not")
    assert parse("<tool_call>no function</tool_call>").parse_errors[0].startswith(
        "a tool call needs one <function=")


def test_qwen3_parser_splits_reasoning_even_when_cut_off():
    parse = FAMILIES["qwen3"].parse
    turn = parse(think("plan", hermes_call("a")))
    assert turn.reasoning == "plan" and turn.tool_calls == [ToolCall("lookup", {"key": "a"})]
    assert parse("<think>\nstill thinking") == ParsedTurn("", reasoning="still thinking")
    assert parse("no reasoning here") == ParsedTurn("no reasoning here")


def test_random_scripts_with_junk_never_break_the_bridge():
    """Turns of random text (special tokens, braces, tags) in the qwen3 format: the loop
    never aborts and the trajectory stays exact."""
    tok = qwen3_tokenizer()
    chat = ChatFormat(tok, TOOLS)
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "{", "}", '"name"', "a",
              "<|im_start|>", "user", "\n", " ", "<tool_response>"]
    for _ in range(5):
        turns = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
                 for _ in range(3)]
        actor, env = Scripted(tok, turns, chat), EchoEnv()
        limits = EpisodeLimits(max_turns=3, max_episode_tokens=4096)
        traj = asyncio.run(run_episode(env, LookupEnv.make_tasks("train", 1, 0, 1)[0], actor,
                                       tok, seed=0, limits=limits))
        check_exact(tok, chat, actor, traj)


# SmolLM2-135M-Instruct (tiller models fetch): its real 49,152-token vocabulary and the
# tool-aware ChatML template the fetch gives it; Hermes calls, no reasoning
SMOLLM2_TURNS = [hermes_call("a"), "a is 42.", hermes_call("b"), "b is 7."]


@pytest.mark.slow
def test_smollm2_scripted_tool_episode_is_exact_parsed_and_prefix_stable(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    tok_, chat, actor, env, traj = scripted_episode_on(tok, SMOLLM2_TURNS)
    assert chat.family == "hermes" and chat.end_of_turn == "<|im_end|>"
    assert stop_token_ids(tok, GenerationConfig.from_pretrained(smollm2_dir)) == (2,)
    check_exact(tok, chat, actor, traj)
    assert traj.num_turns == 4 and traj.tool_calls == 2 and traj.parse_errors == 0
    assert [a.tool_calls[0] if a.tool_calls else None for a in env.actions] == EXPECTED_CALLS
    assert [a.content for a in env.actions if not a.tool_calls] == ["a is 42.", "b is 7."]
    # prefix-stable: re-rendering the history gives the stream, so history=template never splits
    *_, template_traj = scripted_episode_on(tok, SMOLLM2_TURNS, history="template")
    assert template_traj.segment_starts == () and template_traj.token_ids == traj.token_ids
    check_rollout_setup(tok, LlamaConfig(max_position_embeddings=8192),
                        EpisodeLimits(history="template"))


@pytest.mark.slow
def test_smollm2_engine_sampled_episodes_are_exact(smollm2_dir):
    check_engine_sampled(load_tokenizer(smollm2_dir), "llama")
