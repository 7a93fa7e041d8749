from tiller.rollout.chat import CHAT_TEMPLATE, parse_tool_calls
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
