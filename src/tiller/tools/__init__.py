"""Tools: typed callables with JSON schemas, the executor (timeouts, retries, cache), record and
replay, fault injection, the per-run tool stack and the sandbox for untrusted code.

The public names below load on first use, so the stdlib-only modules of this package (the
sandbox and its threads) import under a bare Python without pydantic or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Tool", "ToolCall", "ToolError", "ToolOutcome", "ToolRegistry", "ToolResult", "tool"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("tiller.tools.registry"), name)
    raise AttributeError(f"module 'tiller.tools' has no attribute {name!r}")
