"""An MCP server written with fastmcp: a calculator and a lookup tool.

tiller starts it once per run (`env.tools.mcp` in config.yaml) and talks MCP over its stdin and
stdout; `python server.py http PORT` serves the same tools over streamable HTTP at
http://127.0.0.1:PORT/mcp instead. Nothing in it knows about tiller.
"""

from __future__ import annotations

import ast
import operator
import sys

from fastmcp import FastMCP
from fastmcp.exceptions import ToolError

mcp = FastMCP("calc-kb")

CAPITALS = {  # invented countries, so the answer cannot come from the model's pretraining
    "veltria": "Ombrel", "karsh": "Tulvane", "norrin": "Eskabad", "pell": "Quorra",
    "zandor": "Mirelle", "ostrava": "Keddin",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ToolError("only whole numbers with + - * and parentheses")


@mcp.tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers with + - * and parentheses."""
    if len(expression) > 200:
        raise ToolError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an expression: {e.msg}") from None
    return str(_eval(tree.body))


@mcp.tool
def lookup(country: str) -> str:
    """The capital city of a country."""
    capital = CAPITALS.get(country.strip().lower())
    if capital is None:
        raise ToolError(f"no country named {country!r}; known: {', '.join(sorted(CAPITALS))}")
    return capital


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        mcp.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), show_banner=False)
    else:
        mcp.run(show_banner=False)
