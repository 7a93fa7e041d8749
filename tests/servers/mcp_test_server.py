"""A fastmcp server for tests/test_mcp.py: the example's calculator and lookup, plus what the
failure tests need. It writes its pid to $MCP_PID_FILE when it starts (a restart overwrites it);
with $MCP_BAD_SCHEMA set it also lists a tool whose input schema is not valid JSON Schema.
`python mcp_test_server.py http PORT` serves over streamable HTTP."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fastmcp.tools.base import Tool, ToolResult

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mcp"))
from server import mcp  # noqa: E402  (the example's calculate and lookup)


@mcp.tool
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return f"slept {seconds:g}s"


@mcp.tool
def big(chars: int) -> str:
    """An answer of `chars` characters: '<', x's, '>'."""
    return "<" + "x" * (chars - 2) + ">"


@mcp.tool
def pid() -> int:
    """The server's process id."""
    return os.getpid()


class BrokenSchema(Tool):
    async def run(self, arguments: dict) -> ToolResult:
        return ToolResult(content="never")


if os.environ.get("MCP_BAD_SCHEMA"):
    mcp.add_tool(BrokenSchema(name="broken", description="A tool with an invalid schema.",
                              parameters={"type": "object",
                                          "properties": {"x": {"type": "strung"}}}))

if __name__ == "__main__":
    if os.environ.get("MCP_PID_FILE"):
        Path(os.environ["MCP_PID_FILE"]).write_text(str(os.getpid()))
    if sys.argv[1:2] == ["http"]:
        mcp.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), show_banner=False)
    else:
        mcp.run(show_banner=False)
