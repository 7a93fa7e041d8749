import asyncio

import pytest

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
            "return": {"type": "number"},  # the annotation, rendered as chat templates do
        },
    }


def test_schema_carries_the_return_description_and_qwen3_template_renders_it():
    """A docstring's Returns: section joins the return type, and the chat template a Qwen3
    tokenizer ships (trl's copy) shows the model the whole schema, return included."""
    from pathlib import Path

    import trl
    from transformers.utils.chat_template_utils import render_jinja_template

    @tool
    def lookup(key: str) -> dict:
        """Look a key up.

        Args:
            key: What to look up.

        Returns:
            The record stored under the key.
        """
        return {"key": key}

    assert lookup.schema["function"]["return"] == {
        "type": "object", "description": "The record stored under the key."}
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    rendered, _ = render_jinja_template([[{"role": "user", "content": "hi"}]],
                                        tools=[lookup.schema], chat_template=template)
    text = rendered[0]
    assert '"return": {"type": "object", "description": "The record stored under the key."}' in text


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


def test_calculator_input_it_chokes_on_is_the_policys_fault():
    """A 5,000-digit operand makes int() raise ValueError: the policy's input, so tool_error
    (before, every non-ToolError exception was env_error and escaped the penalty)."""
    from tiller.envs.calculator import calculate

    result = asyncio.run(ToolRegistry([calculate]).invoke(
        ToolCall("calculate", {"expression": "9" * 5000 + " * 2"})))
    assert result.outcome is ToolOutcome.TOOL_ERROR
    assert result.content.startswith("ValueError: Exceeds the limit (4300 digits)")


@tool
def divide(a: int, b: int) -> float:
    """Divide two numbers, over a flaky service.

    Args:
        a: The dividend.
        b: The divisor; a negative one makes the service drop the connection.
    """
    if b < 0:
        raise ConnectionResetError("service went away")
    return a / b


def test_argument_errors_are_tool_errors_and_infrastructure_errors_env_errors():
    registry = ToolRegistry([divide])

    def outcome(a, b):
        return asyncio.run(registry.invoke(ToolCall("divide", {"a": a, "b": b}))).outcome

    assert outcome(1, 0) is ToolOutcome.TOOL_ERROR  # ZeroDivisionError: an ArithmeticError
    assert outcome(1, -1) is ToolOutcome.ENV_ERROR  # ConnectionError: an OSError
    assert outcome(6, 3) is ToolOutcome.OK


class QuotaExceeded(Exception):
    """A service's own exception, raised when the policy asks for too much."""


@tool(policy_errors=(QuotaExceeded,), env_errors=(ValueError,))
def fetch(n: int) -> str:
    """Fetch n records.

    Args:
        n: How many.
    """
    if n > 100:
        raise QuotaExceeded(f"{n} records is over the quota of 100")
    raise ValueError("the service sent a malformed page")  # this service's ValueError is its own


def test_a_tool_overrides_the_rule_per_exception_class():
    registry = ToolRegistry([fetch])
    over = asyncio.run(registry.invoke(ToolCall("fetch", {"n": 101})))
    malformed = asyncio.run(registry.invoke(ToolCall("fetch", {"n": 1})))
    assert (over.outcome, over.content) == (ToolOutcome.TOOL_ERROR,
                                            "QuotaExceeded: 101 records is over the quota of 100")
    assert malformed.outcome is ToolOutcome.ENV_ERROR  # the default would blame the policy
    assert malformed.content == "fetch failed: ValueError: the service sent a malformed page"


def test_tool_stacks_stats_merge_as_one_stacks():
    """The run's and its Ray rollout workers' tool counters as one stack's: counts summed, the
    outcome rates weighted by each stack's calls, peak concurrency the largest of one stack's."""
    from tiller.tools.stack import merged_stats

    run = {"tool_calls/calculate": 0.0, "ok_rate/calculate": 0.0, "env_error_rate/calculate": 0.0,
           "tool_timeouts/calculate": 0.0, "tool_peak_concurrency/calculate": 0.0,
           "tool_abandoned_threads": 0.0}
    w0 = {"tool_calls/calculate": 3.0, "ok_rate/calculate": 2 / 3,
          "env_error_rate/calculate": 1 / 3, "tool_timeouts/calculate": 1.0,
          "tool_peak_concurrency/calculate": 2.0, "tool_abandoned_threads": 1.0}
    w1 = {"tool_calls/calculate": 1.0, "ok_rate/calculate": 1.0, "env_error_rate/calculate": 0.0,
          "tool_timeouts/calculate": 0.0, "tool_peak_concurrency/calculate": 1.0,
          "tool_abandoned_threads": 0.0}
    assert merged_stats([run, w0, w1]) == pytest.approx({
        "tool_calls/calculate": 4.0, "ok_rate/calculate": 0.75,
        "env_error_rate/calculate": 0.25, "tool_timeouts/calculate": 1.0,
        "tool_peak_concurrency/calculate": 2.0, "tool_abandoned_threads": 1.0})
    assert merged_stats([run]) == run
