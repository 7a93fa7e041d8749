"""Chat formats: a tokenizer's chat template, and the parser of the tool calls and reasoning
that the model family writes.

tiller's own Hermes template (the models it builds) writes tool calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside an assistant turn; tool
results come back as `<tool_response>...</tool_response>` in a user turn. Qwen3 adds
`<think>...</think>` reasoning before the answer; Llama 3 writes one JSON object
`{"name": ..., "parameters": {...}}` as the whole turn. Parsers never raise: every malformed
call becomes a message in `parse_errors`, which the environment turns into an error
observation for the model.

`ChatFormat` is what the agent loop needs from a chat template, for any model family: the
first prompt's ids, the ids of the observation after a generated turn (the "bridge", exact
even for templates that re-render history differently), the parse of a generated turn, and
the template's end-of-turn token. docs/formats.md lists the families and how each was tested.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import GenerationConfig, PreTrainedTokenizerBase

from tiller.envs.actions import ParsedTurn
from tiller.errors import ConfigError
from tiller.tools.registry import ToolCall

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [
    "<|endoftext|>",
    IM_START,
    IM_END,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    "<tool_response>",
    "</tool_response>",
]

# Qwen2.5/Hermes layout: every message is `<|im_start|>role\ncontent<|im_end|>\n`; tool
# schemas go in the system turn (in a shorter preamble than Qwen's, since every prompt token
# costs CPU time in the demo); consecutive tool results share one user turn.
CHAT_TEMPLATE = r"""
{%- if tools or messages[0].role == 'system' %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}
{{- '\n\n# Tools\n<tools>' }}
{%- for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}
{{- '\n</tools>\nCall a tool as <tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (m.content or '') }}
{%- for tc in m.tool_calls or [] %}
{%- set f = tc.function if tc.function is defined else tc %}
{%- if m.content or not loop.first %}{{ '\n' }}{% endif %}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""


def _loads(text: str) -> tuple[object, str | None]:
    """json.loads that reports instead of raising: also on deep nesting (RecursionError) and
    on integers longer than Python's 4300-digit conversion limit (ValueError)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at char {e.pos}"
    except (ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {str(e)[:100]}"


def _parse_one(body: str, args_key: str = "arguments") -> ToolCall | str:
    obj, error = _loads(body)
    if error is not None:
        return f"tool call is not valid JSON ({error}): {body.strip()[:200]}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f'tool call must be an object with a string "name": {body.strip()[:200]}'
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        args, error = _loads(args)
        if error is not None:
            return f"arguments of {obj['name']!r} are a string that is not JSON: {error}"
    return ToolCall(name=obj["name"], arguments=args)


def _strip_tags(text: str) -> str:
    """`text` with tool-call tags removed until none is left, "<tool_<tool_call>call>" included.

    One pass with a stack of kept characters: a tag can only appear as the stack's suffix when a
    '>' is pushed, and is popped then. Linear, where replacing until no tag is left is quadratic
    on "<tool_" * n + "<tool_call>" + "call>" * n (one layer per pass)."""
    kept: list[str] = []
    for ch in text:
        kept.append(ch)
        if ch == ">":
            for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
                if len(kept) >= len(tag) and "".join(kept[-len(tag):]) == tag:
                    del kept[-len(tag):]
                    break
    return "".join(kept)


def parse_tool_calls(text: str,
                     parse_one: Callable[[str], ToolCall | str] = _parse_one) -> ParsedTurn:
    """Parse a generated assistant turn (the eos marker, if present, is ignored).

    Never raises, on any string. Each `<tool_call>` is closed by the first `</tool_call>`
    after it; the scan uses `str.find`, so it is linear in the text (a lazy regex retried
    from every unclosed tag is quadratic), and so is the removal of leftover tags.
    """
    text = text.split(IM_END, 1)[0]
    calls: list[ToolCall] = []
    errors: list[str] = []
    rest: list[str] = []  # the text outside well-delimited calls
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            break
        rest.append(text[pos:start])
        parsed = parse_one(text[start + len(TOOL_CALL_OPEN):end])
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        pos = end + len(TOOL_CALL_CLOSE)
    rest.append(text[pos:])
    content = "".join(rest)
    if TOOL_CALL_OPEN in content or TOOL_CALL_CLOSE in content:
        errors.append("unbalanced <tool_call> tags: every <tool_call> needs a </tool_call>")
        content = _strip_tags(content)
    return ParsedTurn(content=content.strip(), tool_calls=calls, parse_errors=errors)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PYTHON_TAG = "<|python_tag|>"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest) of a turn that may open with `<think>...</think>` (Qwen3, DeepSeek
    R1). A turn cut off inside its reasoning is all reasoning; one with no `</think>` has none."""
    if THINK_CLOSE in text:
        reasoning, rest = text.split(THINK_CLOSE, 1)
        return reasoning.replace(THINK_OPEN, "", 1).strip(), rest
    if text.lstrip().startswith(THINK_OPEN):
        return text.lstrip()[len(THINK_OPEN):].strip(), ""
    return "", text


def parse_reasoning_tool_calls(text: str) -> ParsedTurn:
    """Qwen3: `<think>` reasoning, then Hermes `<tool_call>`s (see `parse_tool_calls`)."""
    reasoning, rest = split_reasoning(text)
    turn = parse_tool_calls(rest)
    return ParsedTurn(turn.content, turn.tool_calls, turn.parse_errors, reasoning)


def parse_llama3_tool_calls(text: str) -> ParsedTurn:
    """Llama 3.1-3.3: a tool call is the whole turn, one JSON object
    `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`); anything else is
    a plain answer. A turn that opens with "{" but is no such object is a parse error."""
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return ParsedTurn(content=body)
    obj, _ = _loads(body)
    key = "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters"
    parsed = _parse_one(body, key)
    if isinstance(parsed, str):
        return ParsedTurn(content="", parse_errors=[parsed])
    return ParsedTurn(content="", tool_calls=[parsed])


def _tagged(text: str, tag: str) -> list[tuple[str, str]]:
    """Every `<tag=NAME>BODY</tag>` in `text`, as (NAME, BODY), scanned with `str.find`
    (linear, where a lazy regex retried from every unclosed tag is quadratic)."""
    found, pos, opening, closing = [], 0, f"<{tag}=", f"</{tag}>"
    while (start := text.find(opening, pos)) >= 0:
        name_end = text.find(">", start)
        end = text.find(closing, name_end) if name_end >= 0 else -1
        if end < 0:
            break
        found.append((text[start + len(opening):name_end], text[name_end + 1:end]))
        pos = end + len(closing)
    return found


def _xml_call(body: str) -> ToolCall | str:
    """One `<function=NAME><parameter=KEY>\nVALUE\n</parameter>...</function>` call. Values
    are text; one that is a JSON object or array is decoded (the template writes those as
    JSON), any other stays a string for the tool's own validation to read."""
    functions = _tagged(body, "function")
    if len(functions) != 1:
        return f"a tool call needs one <function=...>...</function>: {body.strip()[:200]}"
    name, inner = functions[0]
    args: dict[str, Any] = {}
    for key, value in _tagged(inner, "parameter"):
        value = value.removeprefix("\n").removesuffix("\n")
        if value.lstrip()[:1] in ("{", "["):
            decoded, error = _loads(value)
            if error is not None:
                return f"parameter {key!r} of {name!r} is not JSON ({error})"
            value = decoded
        args[key.strip()] = value
    return ToolCall(name=name.strip(), arguments=args)


def parse_xml_tool_calls(text: str) -> ParsedTurn:
    """Qwen3.5/3.6 and Qwen3-Coder: `<think>` reasoning, then `<tool_call>` blocks holding
    XML function calls (see `_xml_call`); the scan is `parse_tool_calls`'s."""
    reasoning, rest = split_reasoning(text)
    turn = parse_tool_calls(rest, _xml_call)
    return ParsedTurn(turn.content, turn.tool_calls, turn.parse_errors, reasoning)


HARMONY_START, HARMONY_MESSAGE, HARMONY_CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
HARMONY_END, HARMONY_CALL, HARMONY_RETURN = "<|end|>", "<|call|>", "<|return|>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(HARMONY_CHANNEL) + r"\s*(\w+)")


def parse_harmony(text: str) -> ParsedTurn:
    """gpt-oss (harmony): a turn is one or more messages, each `header<|message|>body` closed
    by <|end|>, <|call|> or <|return|>, the next opening with `<|start|>assistant`. A message
    to `functions.NAME` (in its header) is a tool call whose body is the JSON arguments; the
    analysis channel is reasoning; the rest (final channel) is the answer."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    for part in text.split(HARMONY_START):
        header, sep, body = part.partition(HARMONY_MESSAGE)
        if not sep:
            if part.strip() and part.strip() != "assistant":
                errors.append(f"a harmony message without <|message|>: {part.strip()[:200]}")
            continue
        for closer in (HARMONY_END, HARMONY_CALL, HARMONY_RETURN):
            body = body.split(closer, 1)[0]
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        if recipient:
            obj, error = _loads(body)
            if error is not None or not isinstance(obj, dict):
                errors.append(f"arguments of {recipient.group(1)!r} are not a JSON object "
                              f"({error or type(obj).__name__}): {body.strip()[:200]}")
            else:
                calls.append(ToolCall(name=recipient.group(1), arguments=obj))
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body.strip())
        else:
            content.append(body.strip())
    return ParsedTurn("\n".join(c for c in content if c), calls, errors,
                      "\n".join(r for r in reasoning if r))


@dataclass(frozen=True)
class Family:
    """How one model family writes an assistant turn: the parser of its tool calls and
    reasoning, the marker in a chat template that identifies it (for `auto`), and the
    tokens besides the template's end-of-turn token that close an assistant message:
    `stops` are sampled as a turn's end that the conversation goes on after (gpt-oss ends a
    tool call with <|call|>, an answer with <|return|>); `closers` also close one in the
    rendered history (gpt-oss writes an earlier answer with <|end|>)."""

    parse: Callable[[str], ParsedTurn]
    marker: str
    stops: tuple[str, ...] = ()
    closers: tuple[str, ...] = ()


# Detection order matters: a Qwen3 template holds <tool_call> too.
FAMILIES: dict[str, Family] = {
    "llama3": Family(parse_llama3_tool_calls, "<|start_header_id|>"),
    "harmony": Family(parse_harmony, HARMONY_CHANNEL, (HARMONY_CALL,),
                      (HARMONY_CALL, HARMONY_END, HARMONY_RETURN)),
    "qwen3.5": Family(parse_xml_tool_calls, "<function="),
    "qwen3": Family(parse_reasoning_tool_calls, THINK_OPEN),
    "hermes": Family(parse_tool_calls, TOOL_CALL_OPEN),
}


def detect_family(template: str) -> str:
    """The family whose marker the chat template holds; "hermes" (tiller's own format, and
    Qwen2.5's) when none does."""
    return next((name for name, f in FAMILIES.items() if f.marker in template), "hermes")


_PROBE = "tiller-end-of-turn-probe"


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str:
    """The token the chat template closes an assistant turn with (`<|im_end|>` for the
    Hermes/Qwen template): the first token the template renders after an assistant message's
    content. It must be one added (atomic) token, or the model has no way to say "my turn is
    over"; ConfigError (one line) otherwise."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except (TemplateError, ValueError, TypeError) as e:
        raise ConfigError(f"the tokenizer's chat template cannot render a user/assistant "
                          f"exchange ({type(e).__name__}: {e}); use a chat model's template") from e
    after = text.split(_PROBE, 1)[1] if _PROBE in text else ""
    ids = tokenizer.encode(after, add_special_tokens=False)
    if not ids or ids[0] not in tokenizer.added_tokens_decoder:
        raise ConfigError(f"cannot determine the chat template's end-of-turn token: after an "
                          f"assistant message it renders {after[:40]!r}, not a special token; "
                          "use a model whose chat template ends each turn with one")
    return tokenizer.convert_ids_to_tokens(ids[0])


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None = None,
    family: str = "auto",
) -> tuple[int, ...]:
    """What ends a generated turn: the chat template's end-of-turn token, the family's other
    turn ends (gpt-oss's <|call|>), then every id of the model's
    `generation_config.eos_token_id` (an int or a list). The tokenizer's `eos_token` is not
    assumed to end a turn: for many models it ends the whole document instead."""
    chat = ChatFormat(tokenizer, None, family)
    stops = FAMILIES[chat.family].stops
    ids = [chat.end_of_turn_id, *(tokenizer.convert_tokens_to_ids(t) for t in stops)]
    eos = getattr(generation_config, "eos_token_id", None)
    ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(ids))  # unique, in order


CHAT_FORMATS = ("auto", *FAMILIES)


class ChatFormat:
    """A tokenizer's chat template as the agent loop uses it, for one episode's tool schemas
    and one family's parser (`family`: a name in FAMILIES, or "auto" to detect it from the
    template).

    The prompt is rendered once; after that only new ids are appended: the engine's ids for a
    generated turn (never re-rendered), and for an observation the text the template renders
    after the turn just generated, tokenized on its own:

        full = render(messages[:-1] + [turn with a marker] + new, generation_prompt)
        obs  = full after the first end-of-turn token that follows the marker

    The marker stands where every template renders the turn: in its content, or for a
    tool-call turn (Llama 3 renders only the call) in the calls' arguments. Nothing before
    the turn is compared, so this is exact also for templates that are not prefix-stable
    (Qwen3 and gpt-oss drop earlier reasoning, Llama 3 writes today's date): what they change
    in the history is `agent.history`'s business, not the bridge's. It assumes that what the
    template renders after the turn does not depend on the turn's text, which holds for
    every template tested (docs/formats.md).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None = None,
                 family: str = "auto"):
        if family not in CHAT_FORMATS:
            raise ConfigError(f"config field model.chat_format: got {family!r}; expected one "
                              f"of {', '.join(CHAT_FORMATS)}")
        self.tokenizer, self.tools = tokenizer, tools
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.family = detect_family(template) if family == "auto" else family
        fam = FAMILIES[self.family]
        self._parse = fam.parse
        self.end_of_turn = end_of_turn_token(tokenizer)
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        # sampled tokens that end a turn the conversation can go on after
        self.turn_end_ids: frozenset[int] = frozenset(
            [self.end_of_turn_id, *tokenizer.convert_tokens_to_ids(list(fam.stops))])
        # what closes an assistant message in the rendered history (for the bridge)
        self.closers = tuple(dict.fromkeys([self.end_of_turn, *fam.closers]))

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A prompt rendered by the template: every message, then the generation prompt."""
        return self.tokenizer.encode(self.render(messages, True), add_special_tokens=False)

    def parse(self, ids: list[int]) -> ParsedTurn:
        """A generated turn's ids, decoded only to find its reasoning and tool calls."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return self._parse(text.split(self.end_of_turn, 1)[0])

    def observation_ids(self, messages: list[dict], new: list[dict]) -> list[int]:
        """The ids the template renders for `new` messages and the next generation prompt
        after the assistant turn that ends `messages`. ValueError if the template does not
        render that turn, or closes it with no end-of-turn token."""
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("observation_ids needs the messages to end with the assistant turn")
        after = self.render([*messages[:-1], _marked(messages[-1]), *new], True)
        at = after.rfind(_BRIDGE_PROBE)
        if at < 0:
            raise ValueError("the chat template does not render the assistant turn's content "
                             "or tool calls")
        ends = [(pos, len(t)) for t in self.closers if (pos := after.find(t, at)) >= 0]
        if not ends:
            raise ValueError(f"the chat template rendered no {self.end_of_turn!r} after the "
                             "assistant turn")
        pos, n = min(ends)
        return self.tokenizer.encode(after[pos + n:], add_special_tokens=False)


_BRIDGE_PROBE = "tiller-bridge-probe"


def _marked(turn: dict) -> dict:
    """`turn` with the bridge's marker where templates render it: in every tool call's
    arguments for a tool-call turn, else as its content."""
    calls = turn.get("tool_calls")
    if not calls:
        return {**turn, "content": _BRIDGE_PROBE}
    marked = []
    for call in calls:
        fn = call.get("function", call)
        fn = {**fn, "arguments": {"probe": _BRIDGE_PROBE}}
        marked.append({**call, "function": fn} if "function" in call else fn)
    return {**turn, "tool_calls": marked}
