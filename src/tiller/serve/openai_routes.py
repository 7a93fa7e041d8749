"""OpenAI-compatible routes: /v1/models, /v1/completions and /v1/chat/completions.

Chat prompts are rendered with the model's chat template (`ChatFormat`, `tools` included) and
each generated turn is parsed with the chat format's tool-call parser into `message.content` and
`message.tool_calls`. The engine answers a request only once it is finished, so `stream=true`
sends the finished output as Server-Sent Events (a role chunk, the content, the tool calls, the
finish reason, optionally the usage, then `[DONE]`), not token by token.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from tiller.engine.api import Generation, SamplingParams
from tiller.envs.actions import ParsedTurn
from tiller.rollout.chat import ChatFormat
from tiller.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    parse_body,
)
from tiller.serve.server import Server, check_chars, choice_seeds, client_of, draw_seed

NO_TOP_LOGPROBS = ("top log-probabilities are not supported: the engine returns only the "
                   "sampled token's log-probability")


def check_model_and_stop(body: CompletionRequest | ChatCompletionRequest, served: str) -> None:
    """404 for a model name other than `served`, 400 for stop strings (also the gateway's)."""
    if body.model != served:
        raise APIError(404, f"model {body.model!r} is not served here; GET /v1/models lists "
                            f"{served!r}")
    if body.stop:
        raise APIError(400, "stop strings are not supported; generation ends at the model's "
                            "stop tokens")


def _check_common(server: Server, body: CompletionRequest | ChatCompletionRequest) -> None:
    check_model_and_stop(body, server.settings.model_path)
    server.check_n(body.n)


def _finish(g: Generation, has_tool_calls: bool = False) -> str:
    if g.finish_reason == "stop" and has_tool_calls:
        return "tool_calls"
    return g.finish_reason  # "stop", "length" or "abort"


def usage(prompt: list[int], gens: list[Generation]) -> dict[str, Any]:
    completion = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": gens[0].cached_tokens}}


def _max_new(server: Server, prompt: list[int], max_new_tokens: int | None) -> int:
    """The new tokens a request asks for (default: the rest of the context), the prompt
    checked against them."""
    max_new = max_new_tokens or server.max_context - len(prompt)
    server.check_prompt(prompt, max_new)
    return max_new


async def _run(server: Server, request: Request,
               body: CompletionRequest | ChatCompletionRequest, prompt: list[int],
               max_new: int, prefix: str) -> tuple[str, list[Generation], int, SamplingParams]:
    """Generate `n` choices of a checked prompt; return (id, choices, seed, params)."""
    params = server.sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                             max_new_tokens=max_new)
    seed = draw_seed(body.seed)
    rid = f"{prefix}-{secrets.token_hex(12)}"
    gens = await server.generate(prompt, params, choice_seeds(seed, body.n), rid=rid,
                                 client=client_of(request))
    return rid, gens, seed, params


def _sse(events: list[dict[str, Any]]) -> StreamingResponse:
    def lines() -> Iterator[str]:
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


# ---- /v1/completions ----------------------------------------------------------------------

def _completion_logprobs(server: Server, g: Generation) -> dict[str, Any]:
    tokens = [server.tokenizer.decode([t]) for t in g.token_ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": list(g.logprobs),
            "top_logprobs": None, "text_offset": offsets}


def _completion_inputs(server: Server, raw: bytes
                       ) -> tuple[CompletionRequest, list[int], int]:
    """/v1/completions' body, prompt ids and new tokens, checked (in a worker thread)."""
    body: CompletionRequest = parse_body(raw, CompletionRequest)
    _check_common(server, body)
    if body.logprobs:
        raise APIError(400, f"logprobs={body.logprobs}: {NO_TOP_LOGPROBS}; use logprobs=0")
    if isinstance(body.prompt, str):
        server.check_text(len(body.prompt))
    prompt = (server.tokenizer.encode(body.prompt) if isinstance(body.prompt, str)
              else body.prompt)
    return body, prompt, _max_new(server, prompt, body.max_tokens)


async def completions(server: Server, request: Request) -> Any:
    body, prompt, max_new = await asyncio.to_thread(_completion_inputs, server,
                                                    await request.body())
    rid, gens, seed, params = await _run(server, request, body, prompt, max_new, "cmpl")
    choices = []
    for i, g in enumerate(gens):
        choice: dict[str, Any] = {
            "index": i, "text": server.completion_text(g.token_ids, params),
            "finish_reason": _finish(g), "seed": choice_seeds(seed, body.n)[i],
            "logprobs": _completion_logprobs(server, g) if body.logprobs == 0 else None}
        if body.return_token_ids:
            choice["token_ids"] = g.token_ids
        choices.append(choice)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": body.model}
    extra = {"prompt_token_ids": prompt} if body.return_token_ids else {}
    if not body.stream:
        return {**head, "choices": choices, "usage": usage(prompt, gens), **extra}
    events = []
    for c in choices:  # the text with its logprobs, then the finish reason (and token ids)
        events.append({**head, **extra, "choices": [{
            "index": c["index"], "text": c["text"], "logprobs": c["logprobs"],
            "finish_reason": None}]})
        last = {"index": c["index"], "text": "", "logprobs": None,
                "finish_reason": c["finish_reason"]}
        if body.return_token_ids:
            last["token_ids"] = c["token_ids"]
        events.append({**head, "choices": [last]})
    if body.stream_options and body.stream_options.include_usage:
        events.append({**head, "choices": [], "usage": usage(prompt, gens)})
    return _sse(events)


# ---- /v1/chat/completions -----------------------------------------------------------------

def template_message(m: ChatMessage) -> dict[str, Any]:
    """An OpenAI message as the chat template renders it: text parts joined, a developer
    message as a system one, tool-call arguments decoded from their JSON string."""
    content = (m.content if isinstance(m.content, str) or m.content is None
               else "".join(p.text for p in m.content))
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": content or ""}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError as e:
                raise APIError(400, f"tool call {c.function.name!r}: arguments are not a JSON "
                                    f"string ({e.msg})") from e
            calls.append({"type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        msg["tool_calls"] = calls
    return msg


def _chat_logprobs(tokenizer: Any, g: Generation) -> dict[str, Any]:
    """One entry per generated token, the end-of-turn token included (they line up with
    token_ids); top_logprobs is always empty."""
    entries = []
    for t, lp in zip(g.token_ids, g.logprobs, strict=True):
        text = tokenizer.decode([t])
        entries.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": []})
    return {"content": entries}


def chat_choice(tokenizer: Any, turn: ParsedTurn, g: Generation, index: int,
                body: ChatCompletionRequest) -> dict[str, Any]:
    """Choice `index` of a chat completion: `turn` (the parse of `g`'s ids) as the assistant
    message, each tool call with a fresh id and its arguments as a JSON string."""
    calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
             for c in turn.tool_calls]
    message: dict[str, Any] = {"role": "assistant",
                               "content": turn.content if turn.content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {
        "index": index, "message": message, "finish_reason": _finish(g, bool(calls)),
        "logprobs": _chat_logprobs(tokenizer, g) if body.logprobs else None}
    if turn.parse_errors:  # malformed calls: said, not dropped
        choice["tool_call_errors"] = turn.parse_errors
    if body.return_token_ids:
        choice["token_ids"] = g.token_ids
    return choice


def chat_inputs(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The request's messages and tools as the chat template renders them; 400 for
    top_logprobs (not supported) or tool-call arguments that are not JSON."""
    if body.top_logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs}: {NO_TOP_LOGPROBS}")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true")
    tools = ([t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
             if body.tools else None)
    return [template_message(m) for m in body.messages], tools


def render_error(e: Exception) -> APIError:
    """A chat template that raised on the request's messages: the request's fault, a 400."""
    return APIError(400, f"the chat template cannot render these messages: "
                         f"{type(e).__name__}: {e}"[:300])


TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError)


def json_values(data: Any, most: int) -> int:
    """The number of JSON values in `data` (objects, arrays and scalars; not keys), counted up
    to `most + 1` at most (it stops there)."""
    n, stack = 0, [data]
    while stack and n <= most:
        value = stack.pop()
        n += 1
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return n


def parse_chat(raw: bytes, max_tokens: int, limit: str, max_values: int,
               values_limit: str) -> ChatCompletionRequest:
    """A chat completion body, refused (400) when it cannot fit `max_tokens` (named `limit`)
    or holds over `max_values` JSON values (named `values_limit`).

    Before validation (pydantic holds the GIL while it validates, in a worker thread too:
    every route waits), from a plain `json.loads`: for more messages than tokens (each renders
    to at least one), and for more JSON values than `max_values` (validation walks every one:
    320,000 empty content parts in one message, or 120,000 tool calls, held the server for
    most of a second; the bound is fixed, not the context, which may be a million tokens).
    Before rendering: for more characters than CHARS_PER_TOKEN per token in what the template
    renders (contents, names, tool-call names and arguments, tool schemas)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # parse_body says what is wrong with it
        data = None
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list) and len(messages) > max_tokens:
        raise APIError(400, f"the conversation has {len(messages)} messages, over the limit "
                            f"of {max_tokens} (each renders to at least one token of {limit})")
    if json_values(data, max_values) > max_values:
        raise APIError(400, f"the request has over {max_values} JSON values, the limit of "
                            f"{values_limit} (objects, arrays and scalars: messages, content "
                            "parts, tool calls, tools and their fields; an empty content part "
                            "is 3)")
    body: ChatCompletionRequest = parse_body(raw, ChatCompletionRequest)
    chars = sum(len(json.dumps(t.model_dump(exclude_none=True, by_alias=True)))
                for t in body.tools or [])
    for m in body.messages:
        parts = [m.content] if isinstance(m.content, str) else [p.text for p in m.content or []]
        chars += sum(map(len, parts)) + len(m.name or "") + sum(
            len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or [])
    check_chars(chars, max_tokens, limit)
    return body


def _chat_inputs(server: Server, raw: bytes
                 ) -> tuple[ChatCompletionRequest, ChatFormat, list[int], int]:
    """/v1/chat/completions' body, chat format, rendered prompt and new tokens, checked and
    bounded before rendering (in a worker thread: rendering and tokenizing megabytes takes
    seconds)."""
    body = parse_chat(raw, server.max_prompt_tokens, "--max-prompt-tokens",
                      server.settings.max_json_values, "--max-json-values")
    _check_common(server, body)
    messages, tools = chat_inputs(body)
    try:
        chat = ChatFormat(server.tokenizer, tools)
        prompt = chat.prompt_ids(messages)
    except TEMPLATE_ERRORS as e:
        raise render_error(e) from e
    return body, chat, prompt, _max_new(server, prompt,
                                        body.max_completion_tokens or body.max_tokens)


async def chat_completions(server: Server, request: Request) -> Any:
    body, chat, prompt, max_new = await asyncio.to_thread(_chat_inputs, server,
                                                          await request.body())
    rid, gens, seed, _ = await _run(server, request, body, prompt, max_new, "chatcmpl")
    seeds = choice_seeds(seed, body.n)
    choices = [{**chat_choice(server.tokenizer, chat.parse(g.token_ids), g, i, body),
                "seed": seeds[i]} for i, g in enumerate(gens)]
    return chat_reply(body, rid, prompt, gens, choices)


def chat_reply(body: ChatCompletionRequest, rid: str, prompt: list[int],
               gens: list[Generation], choices: list[dict[str, Any]]) -> Any:
    """The chat completion (or, with stream=true, its Server-Sent Events) for `choices`."""
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": body.model}
    extra = {"prompt_token_ids": prompt} if body.return_token_ids else {}
    if not body.stream:
        return {**head, "choices": choices, "usage": usage(prompt, gens), **extra}

    head["object"] = "chat.completion.chunk"
    events = []
    for c in choices:
        i, msg = c["index"], c["message"]
        events.append({**head, **extra, "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]})
        if msg["content"]:
            events.append({**head, "choices": [
                {"index": i, "delta": {"content": msg["content"]}, "logprobs": c["logprobs"],
                 "finish_reason": None}]})
        for k, call in enumerate(msg.get("tool_calls", [])):
            events.append({**head, "choices": [
                {"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                 "finish_reason": None}]})
        last: dict[str, Any] = {"index": i, "delta": {}, "logprobs": None,
                                "finish_reason": c["finish_reason"]}
        last.update({k: c[k] for k in ("token_ids", "tool_call_errors", "seed") if k in c})
        events.append({**head, "choices": [last]})
    if body.stream_options and body.stream_options.include_usage:
        events.append({**head, "choices": [], "usage": usage(prompt, gens)})
    return _sse(events)


def add_openai_routes(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": server.settings.model_path, "object": "model", "created": server.created,
             "owned_by": "tiller", "max_model_len": server.max_context}]}

    @app.post("/v1/completions")
    async def completions_route(request: Request) -> Any:
        return await completions(server, request)

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request) -> Any:
        return await chat_completions(server, request)
