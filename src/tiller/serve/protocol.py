"""Request bodies of `tiller serve`, with SGLang-style and OpenAI's field names, and its errors.

Every model forbids unknown fields and NaN/inf and parses strictly (a quoted number is not a
number), so a misspelled or unsupported field is a 400 naming it, never silently ignored.
Limits that depend on the server (context length, `--max-n`) are checked by the routes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_INT = 2**31 - 1  # bound of every count that reaches torch (top_k, token counts)


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "code"}}` with `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
             500: "server_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


async def read_body(request: Any, model: type[_Strict]) -> Any:
    """The request's body parsed as `model` (`parse_body`) in a worker thread: a body of
    megabytes (a quarter of a million messages) takes seconds to validate, which must not
    hold up the event loop and every other request with it."""
    return await asyncio.to_thread(parse_body, await request.body(), model)


def parse_body(raw: bytes, model: type[_Strict]) -> Any:
    """`raw` as `model`, or APIError 400 naming the problem: invalid UTF-8, malformed JSON,
    an unknown field, a wrong type or a value out of range."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from e
    try:
        return model.model_validate_json(text or "{}")
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        raise APIError(400, f"invalid request: {problems}") from e


# ---- SGLang-style: POST /generate -------------------------------------------------------------

class GenerateSamplingParams(_Strict):
    temperature: float = Field(1.0, ge=0, description="0 samples greedily")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_INT, description="-1 or 0: no top-k truncation")
    max_new_tokens: int = Field(128, ge=1, le=MAX_INT, description="SGLang's default")
    stop_token_ids: list[int] | None = Field(None, description="default: the model's stop ids")
    stop: str | list[str] | None = Field(None, description="stop strings: not supported")
    seed: int | None = Field(None, ge=0, lt=2**63, description="drawn (and reported) if absent")


class GenerateRequest(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    stream: bool = Field(False, description="not supported: 400 when true")
    rid: str | None = Field(None, min_length=1, max_length=200,
                            description="request id, for /abort_request")
    session_id: str | None = Field(None, min_length=1, max_length=200,
                                   description="tiller: keep this conversation's KV cache")


# ---- OpenAI-compatible: /v1/completions and /v1/chat/completions ----------------------------

class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_INT,
                       description="vLLM/SGLang extension (-1: off); 0 is off too here")
    n: int = Field(1, ge=1, le=MAX_INT)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = Field(False, description="tiller: prompt_token_ids, token_ids")


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT,
                                   description="null: the rest of the context")
    logprobs: int | None = Field(None, ge=0, le=5)


class FunctionDef(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              serialize_by_alias=True)  # dumps "return"

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    return_: dict[str, Any] | None = Field(
        None, alias="return", description="the return type and its description, as tiller's "
        "tool schemas (transformers' get_json_schema) carry them and templates render them")
    strict: bool | None = Field(None, description="accepted and ignored (OpenAI clients send "
                                "it); arguments are parsed, not constrained")

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # the chat template renders the schema as the model was trained to read it: an object
        if v is not None and v.get("type") != "object":
            raise ValueError('a tool\'s parameters must be a JSON schema of "type": "object"')
        return v


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCallMessage(_Strict):
    id: str | None = Field(None, description="accepted and ignored: the chat template does not "
                           "render call ids")
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = Field(None, description="accepted and ignored (the openai client "
                                     "sends it in tool messages; the template does not render "
                                     "it)")
    refusal: None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto"] | None = Field(None, description="only 'auto' is supported")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT,
                                   description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# ---- control ------------------------------------------------------------------------------

class UpdateWeightsRequest(_Strict):
    model_path: str = Field(min_length=1, max_length=4096,
                            description="a folder below --weights-root")
    weight_version: int | None = Field(None, ge=0, lt=2**62,
                                       description="default: the current + 1")
    abort_all_requests: bool = Field(False, description="abort in-flight requests (partial) "
                                     "instead of continuing them under the new weights")
    load_format: Literal["safetensors"] | None = None


class ScoreRequest(_Strict):
    input_ids: list[int] = Field(min_length=2, description="the tokens to score (the parity "
                                 "probe): the answer has log p(token_i | tokens_<i), i >= 1")


class AbortRequest(_Strict):
    rid: str | None = None
    abort_all: bool = False


class EmptyRequest(_Strict):
    """/pause_generation, /continue_generation, /flush_cache: no fields (an empty body or
    `{}`); anything else is a 400 naming it."""
