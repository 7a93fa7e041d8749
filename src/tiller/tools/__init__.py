"""Tools: typed callables with JSON schemas, the executor (timeouts, retries, cache), record and
replay, fault injection, the per-run tool stack and the sandbox for untrusted code."""

from tiller.tools.registry import (
    Tool,
    ToolCall,
    ToolError,
    ToolOutcome,
    ToolRegistry,
    ToolResult,
    tool,
)

__all__ = ["Tool", "ToolCall", "ToolError", "ToolOutcome", "ToolRegistry", "ToolResult", "tool"]
