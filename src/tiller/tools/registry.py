"""Tools: typed Python functions the policy calls, with JSON schemas from their type hints.

A tool is an ordinary (sync or async) function with type hints and a Google-style docstring;
`@tool` derives the JSON schema the chat template shows the model, and `ToolRegistry.invoke`
validates the model's arguments before calling it. Every call ends in a `ToolResult` whose
`outcome` keeps the policy's mistakes (`tool_error`: unknown tool, bad arguments, a rejected
input) apart from the environment's (`env_error`: the tool crashed, timed out or is down).

Who is at fault for an exception a tool raises is decided by its type (`Tool.blame`): errors of
handling the policy's arguments (`POLICY_ERRORS`: `ToolError`, `ValueError`, `TypeError`,
`ArithmeticError`) are `tool_error`, so a policy cannot escape its penalty (or learn to crash
tools) by feeding a tool input it chokes on; infrastructure failures (`ENV_ERRORS`: timeouts,
`OSError` and so connection errors) and anything unclassified are `env_error`. A tool adds its
own classes with `@tool(policy_errors=..., env_errors=...)`, which are checked first.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pydantic
from transformers.utils import get_json_schema

from tiller.errors import ConfigError, import_dotted, one_line
from tiller.tools.threads import run_in_thread


class ToolError(Exception):
    """Raised by a tool that rejects its input: the policy's fault, shown to the model."""


# The default rule (docs/tools.md): checked after a tool's own classes, environment first, since
# TimeoutError and ConnectionError are OSErrors and an OSError is never the policy's doing.
POLICY_ERRORS: tuple[type[BaseException], ...] = (ToolError, ValueError, TypeError,
                                                  ArithmeticError)
ENV_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, OSError)


class ToolOutcome(str, Enum):
    OK = "ok"
    TOOL_ERROR = "tool_error"
    ENV_ERROR = "env_error"


@dataclass(frozen=True)
class ToolCall:
    """One call as the policy wrote it. `arguments` is whatever JSON the model produced."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    outcome: ToolOutcome
    content: str
    latency_s: float = 0.0


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    args_model: type[pydantic.BaseModel] = field(repr=False, compare=False)
    policy_errors: tuple[type[BaseException], ...] = ()  # the tool's own tool_error classes
    env_errors: tuple[type[BaseException], ...] = ()  # the tool's own env_error classes

    def blame(self, error: Exception) -> ToolOutcome:
        """Whose fault `error` is: the tool's own classes first (env before policy), then the
        default rule; an exception nobody classified is the environment's."""
        for env, policy in ((self.env_errors, self.policy_errors), (ENV_ERRORS, POLICY_ERRORS)):
            if isinstance(error, env):
                return ToolOutcome.ENV_ERROR
            if isinstance(error, policy):
                return ToolOutcome.TOOL_ERROR
        return ToolOutcome.ENV_ERROR

    async def __call__(self, **arguments: Any) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**arguments)
        # Sync tools run in a thread of their own so a slow one never blocks the event loop
        # that drives every other episode's generation, nor (timed out) the loop's shutdown.
        return await run_in_thread(self.fn, **arguments)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         policy_errors: tuple[type[BaseException], ...] = (),
         env_errors: tuple[type[BaseException], ...] = ()) -> Any:
    """Make a `Tool` from a typed function; usable as `@tool` or `@tool(name=..., ...)`.
    `policy_errors` / `env_errors` are exception classes this tool raises that are the policy's
    (`tool_error`) or the environment's (`env_error`) fault, overriding the default rule."""

    def wrap(f: Callable[..., Any]) -> Tool:
        # transformers' schema, its `return` (the return annotation and the docstring's
        # "Returns:" section) included: chat templates render the whole dict (`tool | tojson`)
        schema = get_json_schema(f)
        if name:
            schema["function"]["name"] = name
        # A pydantic model of the signature turns a wrong type, a missing or an unexpected
        # field into a message the model can act on.
        args_model = pydantic.create_model(
            f"{f.__name__}_args",
            **{
                p.name: (
                    p.annotation if p.annotation is not inspect.Parameter.empty else Any,
                    ... if p.default is inspect.Parameter.empty else p.default,
                )
                for p in inspect.signature(f, eval_str=True).parameters.values()
            },
            __config__=pydantic.ConfigDict(extra="forbid"),
        )
        return Tool(name=schema["function"]["name"], fn=f, schema=schema, args_model=args_model,
                    policy_errors=tuple(policy_errors), env_errors=tuple(env_errors))

    return wrap(fn) if fn is not None else wrap


def load_tools(paths: Iterable[str], field: str = "env.tools.functions") -> list[Tool]:
    """The tools that config `field` lists as dotted paths (`package.module:name`), each a
    `@tool` object or a plain typed function with a Google-style docstring (made a `Tool`
    here). Any path that cannot become a tool, or two tools of one name, is a one-line
    ConfigError naming `field`."""
    tools: dict[str, Tool] = {}
    for path in paths:
        obj = import_dotted(path, field)
        try:
            t = obj if isinstance(obj, Tool) else tool(obj)
        except Exception as e:  # transformers' schema parser: no docstring, an untyped arg...
            raise ConfigError(f"config field {field}: got {path!r}; cannot make a tool of it: "
                              f"{one_line(e)}") from e
        if t.name in tools:
            raise ConfigError(f"config field {field}: got {path!r}; a tool named {t.name!r} "
                              "is listed twice")
        tools[t.name] = t
    return list(tools.values())


class ToolRegistry:
    """The tools of one environment, callable by name with validated arguments."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools = {t.name: t for t in tools}

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def extend(self, tools: Iterable[Tool]) -> None:
        """Add `tools` (e.g. the run's `env.tools.functions`); a name already here is a
        ValueError: a tool is never replaced behind the env's back."""
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"tool {t.name!r} is already registered")
            self.tools[t.name] = t

    def check(self, call: ToolCall) -> dict[str, Any] | str:
        """Validated arguments, or the error message the model should see."""
        t = self.tools.get(call.name)
        if t is None:
            return f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"
        if not isinstance(call.arguments, dict):
            return f"arguments of {call.name!r} must be a JSON object, got {call.arguments!r}"
        try:
            return dict(t.args_model(**call.arguments))
        except pydantic.ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}"
                for err in e.errors()
            )
            return f"invalid arguments for {call.name!r}: {problems}"

    async def invoke(self, call: ToolCall) -> ToolResult:
        """Run one call; never raises for anything the policy or the tool did."""
        start = time.perf_counter()
        args = self.check(call)
        if isinstance(args, str):
            return ToolResult(call, ToolOutcome.TOOL_ERROR, args, time.perf_counter() - start)
        t = self.tools[call.name]
        try:
            value = await t(**args)
        except ToolError as e:  # written for the model: shown as it is
            return ToolResult(call, ToolOutcome.TOOL_ERROR, str(e), time.perf_counter() - start)
        except Exception as e:  # every other exception is classified, never swallowed
            outcome = t.blame(e)
            msg = (f"{type(e).__name__}: {e}" if outcome is ToolOutcome.TOOL_ERROR
                   else f"{call.name} failed: {type(e).__name__}: {e}")
            return ToolResult(call, outcome, msg, time.perf_counter() - start)
        content = value if isinstance(value, str) else json.dumps(value)
        return ToolResult(call, ToolOutcome.OK, content, time.perf_counter() - start)
