"""The plug-in's tools: `add` as a `@tool` object, `multiply` as a plain typed function (tiller
makes it a tool when a config lists it: env.tools=[tiller_example_plugin.tools:multiply])."""

from __future__ import annotations

from tiller.tools.registry import tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.

    Returns:
        The sum a + b.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product a * b.
    """
    return a * b
