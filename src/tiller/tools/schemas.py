"""Tools declared by a JSON Schema instead of a Python signature: MCP tools and OpenEnv actions.

`@tool` derives a tool's schema from a typed function. A tool that lives elsewhere (an MCP
server, an OpenEnv server's action) comes with its own JSON Schema instead; `schema_tool` turns
one into a `Tool` that tiller treats like any other: the chat template renders
`{"type": "function", "function": {"name", "description", "parameters": <the schema>}}`, and
the registry validates the model's arguments against the schema (with `jsonschema`) before the
call goes anywhere, so a call with bad arguments is the policy's `tool_error` and never reaches
the server (nor the fault injector, which sits behind validation).

What tiller can render is checked once, when the tool is made (`SchemaError`, one line naming
the tool): the schema must be a valid JSON Schema for its draft (2020-12 unless `$schema` says
otherwise), its root must be `{"type": "object", ...}` (a call's arguments are a JSON object),
`properties` must map names to schemas, and every `required` name must be a property.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pydantic
from pydantic_core import PydanticCustomError

from tiller.tools.registry import Tool


class SchemaError(ValueError):
    """A tool's JSON Schema that tiller cannot render or validate against; one line."""


def check_schema(name: str, schema: Any) -> Any:
    """The `jsonschema` validator of a tool's input schema, or `SchemaError` naming the tool
    and what is wrong."""
    import jsonschema  # the openenv extra lists it; the mcp extra's SDK depends on it

    if not isinstance(schema, dict):
        raise SchemaError(f"tool {name!r}: its input schema is a {type(schema).__name__}, not "
                          "a JSON object")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "(root)"
        raise SchemaError(f"tool {name!r}: its input schema is not a valid JSON Schema at "
                          f"{where}: {' '.join(e.message.split())[:200]}") from e
    if schema.get("type") != "object":
        raise SchemaError(f"tool {name!r}: its input schema must have \"type\": \"object\" at "
                          f"the root (the arguments are a JSON object), got "
                          f"{schema.get('type')!r}")
    properties = schema.get("properties", {})
    missing = sorted(set(schema.get("required", [])) - set(properties))
    if missing:
        raise SchemaError(f"tool {name!r}: its input schema requires {', '.join(missing)}, "
                          "which it does not define under \"properties\"")
    return cls(schema)


def _args_model(name: str, validator: Any) -> type[pydantic.BaseModel]:
    """A pydantic model that accepts exactly the objects `validator` accepts: `ToolRegistry`
    validates every tool's arguments through its `args_model`, and turns its errors into the
    message the model reads."""

    def valid(data: Any) -> Any:
        errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
        if errors:
            problems = "; ".join(  # the registry prefixes "arguments: "
                f"{'/'.join(map(str, e.absolute_path))}: {e.message}" if e.absolute_path
                else e.message for e in errors[:5])
            raise PydanticCustomError("json_schema", problems[:500])
        return data

    return pydantic.create_model(
        f"{name}_args", __config__=pydantic.ConfigDict(extra="allow"),
        __validators__={"_schema": pydantic.model_validator(mode="before")(
            classmethod(lambda cls, data: valid(data)))})


def schema_tool(name: str, description: str, schema: Any, fn: Callable[..., Any],
                policy_errors: tuple[type[BaseException], ...] = (),
                env_errors: tuple[type[BaseException], ...] = ()) -> Tool:
    """A `Tool` named `name` whose arguments are checked against the JSON Schema `schema`
    (`SchemaError` if tiller cannot use it) and whose calls go to `fn(**arguments)`."""
    validator = check_schema(name, schema)
    rendered = {"type": "function", "function": {
        "name": name, "description": description or "", "parameters": schema}}
    return Tool(name=name, fn=fn, schema=rendered, args_model=_args_model(name, validator),
                policy_errors=policy_errors, env_errors=env_errors)
