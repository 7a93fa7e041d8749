import asyncio

from tiller.tools.registry import ToolCall, ToolError, ToolOutcome, ToolRegistry, tool


@tool
def scale(value: int, factor: float = 2.0) -> float:
    """Multiply a number.

    Args:
        value: The number to scale.
        factor: By how much.
    """
    if value < 0:
        raise ToolError("value must be non-negative")
    return value * factor


@tool
def broken(x: str) -> str:
    """Always crashes.

    Args:
        x: Anything.
    """
    raise RuntimeError("disk on fire")


def run(call):
    return asyncio.run(ToolRegistry([scale, broken]).invoke(call))


def test_schema_from_type_hints_and_docstring():
    assert scale.schema == {
        "type": "function",
        "function": {
            "name": "scale",
            "description": "Multiply a number.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "description": "The number to scale."},
                    "factor": {"type": "number", "description": "By how much."},
                },
                "required": ["value"],
            },
        },
    }


def test_ok_call_with_default():
    r = run(ToolCall("scale", {"value": 3}))
    assert (r.outcome, r.content) == (ToolOutcome.OK, "6.0")


def test_bad_arguments_are_tool_errors_with_a_message():
    wrong_type = run(ToolCall("scale", {"value": "three"}))
    missing = run(ToolCall("scale", {}))
    extra = run(ToolCall("scale", {"value": 1, "bogus": 2}))
    unknown = run(ToolCall("nope", {}))
    not_object = run(ToolCall("scale", [1, 2]))
    for r in (wrong_type, missing, extra, unknown, not_object):
        assert r.outcome is ToolOutcome.TOOL_ERROR
    assert "value" in wrong_type.content and "integer" in wrong_type.content
    assert "Field required" in missing.content
    assert "bogus" in extra.content
    assert "unknown tool 'nope'" in unknown.content and "scale" in unknown.content
    assert "JSON object" in not_object.content


def test_rejected_input_is_policy_fault_and_crash_is_env_fault():
    rejected = run(ToolCall("scale", {"value": -1}))
    crashed = run(ToolCall("broken", {"x": "a"}))
    assert (rejected.outcome, rejected.content) == (ToolOutcome.TOOL_ERROR,
                                                    "value must be non-negative")
    assert crashed.outcome is ToolOutcome.ENV_ERROR
    assert "RuntimeError: disk on fire" in crashed.content
