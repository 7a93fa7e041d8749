"""What an environment from the ecosystem costs per call, against tiller's own equivalent.

    python benchmarks/ecosystem.py            # needs the mcp and openenv extras, bubblewrap

Each row is measured in this run and set against its baseline from the same run:
- an MCP tool (examples/mcp/server.py over stdio) through the run's tool stack, against a
  tiller tool function doing the same work through the same stack;
- a Harbor shell command (unpack the workdir, run, pack it) and a Harbor test run, against
  one bare `Sandbox.run_python` (the code env's tool);
- importing openenv-core's client (which imports gradio), and the mcp SDK, against what
  tiller's OpenEnv adapter imports (websockets and httpx), each in a fresh interpreter.

The MCP server's start is timed with the SDK already imported: it is the server's own start,
handshake and tool listing, once per run; the SDK's import is the import row.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiller.config import load_config  # noqa: E402
from tiller.envs.harbor import HarborEnv  # noqa: E402
from tiller.tools.registry import ToolCall, ToolRegistry, tool  # noqa: E402
from tiller.tools.sandbox import Sandbox  # noqa: E402
from tiller.tools.stack import ToolsConfig, ToolStack  # noqa: E402


@tool
def calculate(expression: str) -> str:
    """Multiply two numbers written 'a * b'.

    Args:
        expression: 'a * b'
    """
    a, b = expression.split(" * ")
    return str(int(a) * int(b))


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


async def call_times(invoke, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        result = await invoke(ToolCall("calculate", {"expression": f"{i} * 7"}))
        out.append(time.perf_counter() - t)
        assert result.content == str(i * 7), result
    return out


def mcp_rows(n: int, scratch: Path) -> list[tuple[str, float, str]]:
    # the SDK imported first: the start row is the server's start and handshake alone (the
    # SDK's import, once per process, is its own row in import_rows)
    import mcp.client.stdio  # noqa: F401

    t = time.perf_counter()
    stack = ToolStack(ToolsConfig.model_validate({"mcp": [
        {"name": "calc", "command": [sys.executable, str(ROOT / "examples/mcp/server.py")]}]}),
        scratch)
    start = time.perf_counter() - t
    try:
        mcp = asyncio.run(call_times(stack.wrapper("bench")(ToolRegistry([])), n))
    finally:
        t = time.perf_counter()
        stack.close()
        stop = time.perf_counter() - t
    own_stack = ToolStack(ToolsConfig(), scratch)
    own = asyncio.run(call_times(own_stack.wrapper("bench")(ToolRegistry([calculate])), n))
    base = median_ms(own)
    return [("tool call: tiller function (baseline)", base, "1.00"),
            ("tool call: MCP over stdio", median_ms(mcp), f"{median_ms(mcp) / base:.1f}"),
            ("MCP server start (once per run)", 1000 * start, ""),
            ("MCP server stop (once per run)", 1000 * stop, "")]


def harbor_rows(n: int) -> list[tuple[str, float, str]]:
    cls = HarborEnv.configure(load_config(ROOT / "examples/harbor/config.yaml", [
        f"env.harbor.tasks={ROOT / 'examples/harbor/tasks'}"]))
    env = cls()
    task = cls.make_tasks("train", 1, 0)[0]

    async def run() -> tuple[list[float], list[float]]:
        await env.reset(task, 0)
        shell, tests = [], []
        for i in range(n):
            t = time.perf_counter()
            await env._shell(f"echo {i} >> log.txt")
            shell.append(time.perf_counter() - t)
        for _ in range(max(n // 4, 3)):
            t = time.perf_counter()
            reward = await env.verify(None)
            tests.append(time.perf_counter() - t)
            assert not reward.env_error, reward
        return shell, tests

    box = Sandbox()
    bare = []
    for _ in range(n):
        t = time.perf_counter()
        assert box.run_python("print(1)").ok
        bare.append(time.perf_counter() - t)
    shell, tests = asyncio.run(run())
    base = median_ms(bare)
    return [("sandbox run_python (baseline)", base, "1.00"),
            ("Harbor shell command", median_ms(shell), f"{median_ms(shell) / base:.1f}"),
            ("Harbor tests (test.sh)", median_ms(tests), f"{median_ms(tests) / base:.1f}")]


def import_rows(repeats: int) -> list[tuple[str, float, str]]:
    def seconds(code: str) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    ours = seconds("import websockets.asyncio.client, httpx")
    theirs = seconds("import openenv.core")
    sdk = seconds("import mcp, mcp.client.stdio, mcp.client.streamable_http")
    return [("import: tiller's OpenEnv client deps (baseline)", 1000 * ours, "1.00"),
            ("import: openenv.core (pulls gradio)", 1000 * theirs, f"{theirs / ours:.1f}"),
            ("import: the mcp SDK (once per process)", 1000 * sdk, f"{sdk / ours:.1f}")]


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        rows = [*mcp_rows(50, Path(scratch)), *harbor_rows(12), *import_rows(3)]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'median ms':>10}  {'ratio':>6}")
    for name, ms, ratio in rows:
        print(f"{name:{width}}  {ms:10.1f}  {ratio:>6}")


if __name__ == "__main__":
    main()
