import time

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tiller.envs.actions import ParsedTurn
from tiller.rollout.chat import CHAT_TEMPLATE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from tiller.tools.registry import ToolCall


def test_template_renders_every_role_in_hermes_layout(tokenizer):
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "What is 2*3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculate",
                                              "arguments": {"expression": "2 * 3"}}},
            {"type": "function", "function": {"name": "calculate",
                                              "arguments": {"expression": "1 + 1"}}}]},
        {"role": "tool", "content": "6"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "The answer is 6."},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert text.startswith("<|im_start|>system\nBe exact.\n\n# Tools\n<tools>\n{")
    assert '"name": "calculate"' in text.split("</tools>")[0]
    assert (
        "<|im_start|>user\nWhat is 2*3?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 * 3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
        "<|im_end|>\n"
        # consecutive tool results share one user turn
        "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 6.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_without_tools_or_system(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_special_tokens_are_single_ids(tokenizer):
    for tok in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"]:
        assert len(tokenizer.encode(tok, add_special_tokens=False)) == 1


def test_parse_valid_call():
    turn = parse_tool_calls(
        'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 * 3"}}'
        "\n</tool_call><|im_end|>"
    )
    assert turn.tool_calls == [ToolCall("calculate", {"expression": "2 * 3"})]
    assert turn.parse_errors == []
    assert turn.content == "Let me compute."


def test_parse_multiple_calls_in_order():
    turn = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert [c.name for c in turn.tool_calls] == ["a", "b"]
    assert turn.tool_calls[1].arguments == {"y": 2}  # JSON-string arguments are decoded


def test_parse_malformed_calls_become_errors_not_exceptions():
    turn = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": {</tool_call>'  # broken JSON
        '<tool_call>["not", "an", "object"]</tool_call>'  # no name
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
        "<tool_call>{\"name\": \"c\""  # never closed
    )
    assert [c.name for c in turn.tool_calls] == ["ok"]
    assert len(turn.parse_errors) == 3
    assert "not valid JSON" in turn.parse_errors[0]
    assert 'string "name"' in turn.parse_errors[1]
    assert "unbalanced" in turn.parse_errors[2]


def test_plain_answer_has_no_calls():
    turn = parse_tool_calls("The answer is 42.")
    assert turn.tool_calls == [] and turn.parse_errors == []
    assert turn.content == "The answer is 42."


def test_deep_nesting_and_huge_numbers_are_parse_errors_not_exceptions():
    # json.loads raises RecursionError on deep nesting and ValueError on a >4300-digit int
    for body in ["[" * 3000, "[" * 3000 + "]" * 3000, '{"a": ' * 3000, "1" * 5000,
                 '{"name": "a", "arguments": "' + "[" * 3000 + '"}']:
        turn = parse_tool_calls(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
        assert turn.tool_calls == [] and len(turn.parse_errors) == 1, body[:20]
        assert turn.parse_errors[0].startswith(("tool call is not valid JSON", "arguments of"))


def test_many_unclosed_tags_parse_in_linear_time():
    start = time.perf_counter()
    turn = parse_tool_calls(TOOL_CALL_OPEN * 200_000)
    assert time.perf_counter() - start < 2.0  # a regex scan from every tag is quadratic
    assert turn.parse_errors == ["unbalanced <tool_call> tags: every <tool_call> needs a "
                                 "</tool_call>"]
    assert turn.content == ""


def test_nested_leftover_tags_are_removed_in_linear_time():
    # each removed "<tool_call>" joins a "<tool_" and a "call>" into the next one: replacing
    # until none is left takes one pass per layer, ~30 s for these 440 KB (0.1 s linear)
    n = 40_000
    start = time.perf_counter()
    turn = parse_tool_calls("<tool_" * n + TOOL_CALL_OPEN + "call>" * n + "ok")
    assert time.perf_counter() - start < 2.0
    assert turn.content == "ok" and turn.tool_calls == [] and len(turn.parse_errors) == 1


# Pieces the parser reacts to, so random text hits its branches rather than only plain text.
_PIECES = st.sampled_from([
    TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_", "call>", "</tool_", "<|im_end|>", "{", "}", "[",
    "]", '"', ":", ",", "\\", '"name"', '"arguments"', '"calculate"', "null", "1e999", "-0",
    "\\ud800", "\ud800", '{"name": "a", "arguments": ', '{"name": "a", "arguments": "{',
    "\x00", "\n",
])
_TEXT = st.one_of(
    st.text(max_size=40),  # any code points, lone surrogates included
    st.lists(_PIECES | st.text(max_size=3), max_size=12).map("".join),
    st.builds(lambda open_, body, n, close: open_ + body * n + close,  # nesting, huge inputs
              st.sampled_from([TOOL_CALL_OPEN, "", "x"]), _PIECES | st.text(max_size=3),
              st.integers(0, 5000), st.sampled_from([TOOL_CALL_CLOSE, "", "<|im_end|>"])),
)
# The two ways json.loads raises other than JSONDecodeError, inside a call or inside its
# string arguments: nesting past the recursion limit (RecursionError), and an integer of more
# than 4300 digits (ValueError). (prefix, repeated unit, suffix) of a call body:
_DEEP = st.sampled_from([("", "[", ""), ("", '{"a":', ""), ("", "{", ""),
                         ('{"name":"a","arguments":"', "[", '"}'),
                         ('{"name":"a","arguments":"', '{\\"a\\":', '"}')])
_DIGITS = st.sampled_from([("", ""), ('{"name":"a","arguments":{"x":', "}}"),
                           ('{"name":"a","arguments":"', '"}'), ("[", "]")])
_CRASHERS = st.one_of(
    st.builds(lambda part, n: TOOL_CALL_OPEN + part[0] + part[1] * n + part[2] + TOOL_CALL_CLOSE,
              _DEEP, st.integers(1000, 5000)),
    st.builds(lambda part, n: TOOL_CALL_OPEN + part[0] + "7" * n + part[1] + TOOL_CALL_CLOSE,
              _DIGITS, st.integers(4300, 6000)),
)
_fuzzed = []


@settings(max_examples=10_000, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=list(HealthCheck))
@given(_TEXT | _CRASHERS)
@example(TOOL_CALL_OPEN + "[" * 5000 + TOOL_CALL_CLOSE)
@example(TOOL_CALL_OPEN + '{"name":"a","arguments":"' + "[" * 5000 + '"}' + TOOL_CALL_CLOSE)
@example(TOOL_CALL_OPEN + "1" * 4301 + TOOL_CALL_CLOSE)
@example(TOOL_CALL_OPEN + '{"name":"a","arguments":"' + "1" * 4301 + '"}' + TOOL_CALL_CLOSE)
def _parse_never_raises(text):
    _fuzzed.append(1)
    turn = parse_tool_calls(text)
    assert isinstance(turn, ParsedTurn)
    assert all(isinstance(c, ToolCall) and isinstance(c.name, str) for c in turn.tool_calls)
    assert all(isinstance(e, str) for e in turn.parse_errors)
    assert TOOL_CALL_OPEN not in turn.content and TOOL_CALL_CLOSE not in turn.content
    if TOOL_CALL_OPEN not in text and TOOL_CALL_CLOSE not in text:
        assert turn == ParsedTurn(text.split("<|im_end|>", 1)[0].strip())


@pytest.mark.slow
def test_parser_never_raises_on_10k_fuzzed_inputs():
    _parse_never_raises()
    assert len(_fuzzed) >= 10_000
