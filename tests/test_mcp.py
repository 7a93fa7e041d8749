"""MCP tools (`env.tools.mcp`): a fastmcp server's tools (examples/mcp/server.py: a calculator
and a lookup) through the run's tool stack, with the guarantees tiller's own tools have:
a tiny run trains on them through the dataset env, a recorded run replays with the server
stopped, a server killed mid-episode is an env_error and is restarted, a slow tool times out
as an env_error, faults are injected behind validation, every server is stopped at the end of
a run (also an interrupted one), and each bad server is one line before any work."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TextActor, alive, free_port, gone, numbers, processes_with, rl_rows
from safetensors.torch import load_file

from tiller.config import load_config
from tiller.controller import train
from tiller.envs.base import Task, ToolEnv
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.run import Run
from tiller.tools.mcp import result_text
from tiller.tools.registry import ToolCall, ToolOutcome, ToolRegistry
from tiller.tools.stack import ToolsConfig, ToolStack

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "servers" / "mcp_test_server.py"
EXAMPLE = ROOT / "examples" / "mcp" / "config.yaml"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The example's reward module and tests/mcp_loop.py, as `PYTHONPATH=examples/mcp` would."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "mcp"))
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


def stdio(pid_file: Path | None = None, name: str = "calc", **extra) -> dict:
    env = {"MCP_PID_FILE": str(pid_file)} if pid_file else {}
    return {"name": name, "command": [sys.executable, str(SERVER)], "env": env, **extra}


def example(*overrides: str) -> list[str]:
    """The example's overrides for a test: its server run with this interpreter."""
    return ["agent.loop=mcp_loop:run_episode", "logging.report=false", *overrides]


def mcp_override(entry: dict) -> str:
    return f"env.tools.mcp=[{json.dumps(entry)}]"


def test_a_fastmcp_server_trains_a_tiny_run_through_the_dataset_env(tmp_path):
    """The example end to end: build a tiny model, 2 RL steps on the JSONL whose episodes call
    the server's calculate and lookup (the scripted half of each group), held-out eval; the
    calls go through the stack (counted per tool) and RL changed the weights. The server is
    stopped when the run ends."""
    pid_file = tmp_path / "server.pid"
    cfg = load_config(EXAMPLE, example(mcp_override(stdio(pid_file))))
    summary = train(cfg, tmp_path / "run")
    steps = rl_rows(tmp_path / "run")
    assert len(steps) == 2
    calls = {t: sum(r.get(f"tool_calls/{t}", 0) for r in steps) for t in ("calculate", "lookup")}
    assert calls["calculate"] > 0 and calls["lookup"] > 0, calls
    for r in steps:  # the scripted half answers right through the server, the policy does not
        assert r["env_error_rate"] == 0.0 and r["mcp_restarts/calc"] == 0.0
        assert 0.0 < r["reward_mean"] < 1.0
        for t in calls:
            assert r.get(f"ok_rate/{t}", 1.0) == 1.0
    assert summary["heldout_after_rl"]["tasks"] == 4
    before = load_file(tmp_path / "run" / "base_model" / "model.safetensors")
    after = load_file(Path(summary["checkpoint"]) / "model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before), "RL left the weights"
    assert gone(int(pid_file.read_text())), "the MCP server outlived its run"


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            assert proc.poll() is None, "the MCP server exited before it listened"
            assert time.monotonic() < deadline, f"the MCP server did not listen in {timeout_s}s"
            time.sleep(0.1)


def episodes(run_dir: Path) -> list[tuple]:
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(run_dir / "traces.sqlite")) as con:
        return con.execute(
            "SELECT phase, rl_step, task_id, sample_index, status, reward, messages, token_ids "
            "FROM episodes ORDER BY phase, rl_step, task_id, sample_index").fetchall()


def test_a_recorded_run_replays_identically_with_the_server_stopped(tmp_path):
    """Record a run against a streamable-HTTP server, stop the server, replay: the tools come
    from the recorded listing, every call from the file, and the episodes are identical."""
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = tmp_path / "tools.sqlite"
    url = {"name": "calc", "url": f"http://127.0.0.1:{port}/mcp"}
    try:
        wait_listening(port, server)
        train(load_config(EXAMPLE, example(
            mcp_override(url), f"env.tools.replay={{path: {db}, mode: record}}")),
            tmp_path / "rec")
    finally:
        server.kill()
        server.wait(10)
    with pytest.raises(OSError):  # nothing answers there now
        socket.create_connection(("127.0.0.1", port), 0.5)
    train(load_config(EXAMPLE, example(
        mcp_override(url), f"env.tools.replay={{path: {db}, mode: replay}}")), tmp_path / "rep")

    rec, rep = episodes(tmp_path / "rec"), episodes(tmp_path / "rep")
    assert len(rec) == len(rep) > 0 and rec == rep
    assert any('"role": "tool"' in e[6] for e in rec)  # the episodes did call the server
    live = [sum(r.get(f"tool_calls/{t}", 0) for r in rl_rows(d) for t in ("calculate", "lookup"))
            for d in (tmp_path / "rec", tmp_path / "rep")]
    assert live[0] > 0 and live[1] == 0  # the replay made no live call
    assert all(r["replay_misses"] == 0 for r in rl_rows(tmp_path / "rep"))

    def seen(d):  # what the episodes saw; the live per-tool counters differ by design
        skip = ("/calculate", "/lookup", "/calc")
        return [r for r in numbers(d, skip) if r["phase"] != "gate"]

    assert seen(tmp_path / "rec") == seen(tmp_path / "rep")


class OneToolEnv(ToolEnv):
    """A ToolEnv with no tools of its own: the run's MCP tools are all it has."""

    name = "one_tool_test"

    def __init__(self, wrap=None):
        super().__init__([], wrap=wrap)

    async def verify(self, final):
        return Reward(1.0 if final is not None else 0.0)

    @staticmethod
    def make_tasks(split, n, seed, difficulty):
        return [Task(id=f"t{i}", prompt="Compute.", answer=None, split=split) for i in range(n)]

    @staticmethod
    def expert_turn(task, messages, rng, guess_prob):
        raise NotImplementedError


def call_text(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class KillingActor(TextActor):
    """Plays `turns`; kills the server (SIGKILL) before the turn numbered `kill_before`."""

    def __init__(self, tok, turns, pid_file: Path, kill_before: int):
        super().__init__(tok, turns)
        self.pid_file, self.kill_before = pid_file, kill_before

    async def act(self, prompt_ids, messages, seed, session_id=None):
        if sum(m["role"] == "assistant" for m in messages) == self.kill_before:
            os.kill(int(self.pid_file.read_text()), signal.SIGKILL)
        return await super().act(prompt_ids, messages, seed, session_id)


def wait_pid_change(pid_file: Path, old: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while int(pid_file.read_text() or old) == old:
        assert time.monotonic() < deadline, "the server was not restarted"
        time.sleep(0.05)
    return int(pid_file.read_text())


@pytest.mark.slow
def test_a_server_killed_mid_episode_is_env_error_and_is_restarted(tmp_path, tokenizer):
    """Turn 1's call answers; the server is killed; turn 2's call is an env_error (so the
    episode is), the server is restarted (counted), the next episode's calls answer; with
    retries, a call that meets a dead server waits for the restart and succeeds."""
    pid_file = tmp_path / "server.pid"
    cfg = ToolsConfig.model_validate({"mcp": [stdio(pid_file)]})
    stack = ToolStack(cfg, tmp_path)
    try:
        first = int(pid_file.read_text())
        limits = EpisodeLimits(max_turns=4, max_episode_tokens=1024)
        turns = [call_text("calculate", expression="6 * 7"), call_text("lookup", country="Pell"),
                 "done"]
        actor = KillingActor(tokenizer, turns, pid_file, kill_before=1)
        env = OneToolEnv(wrap=stack.wrapper("ep1"))
        traj = asyncio.run(run_episode(env, Task("t", "Compute.", None, "train"), actor,
                                       tokenizer, seed=0, limits=limits))
        assert traj.status.value == "env_error" and traj.env_errors == 1
        assert [r.outcome for _, r in traj.tool_results] == [ToolOutcome.OK,
                                                             ToolOutcome.ENV_ERROR]
        assert traj.tool_results[0][1].content == "42"
        assert "connection closed" in traj.info["error"]
        assert gone(first)

        second = wait_pid_change(pid_file, first)
        env = OneToolEnv(wrap=stack.wrapper("ep2"))
        traj = asyncio.run(run_episode(env, Task("t2", "Compute.", None, "train"),
                                       TextActor(tokenizer, turns), tokenizer, seed=0,
                                       limits=limits))
        assert traj.status.value == "completed" and traj.env_errors == 0
        assert [r.content for _, r in traj.tool_results] == ["42", "Quorra"]
        stats = stack.stats()
        assert stats["mcp_restarts/calc"] == 1.0
        assert stats["env_error_rate/lookup"] == 0.5  # 1 of 2 calls, before the restart
    finally:
        stack.close()
    assert gone(second)

    # retries of a transport failure: the retry waits for the restart
    retrying = ToolsConfig.model_validate({
        "mcp": [stdio(pid_file)], "executor": {"default": {"retries": 2, "backoff_s": 0.1}}})
    stack = ToolStack(retrying, tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))
        old = int(pid_file.read_text())
        os.kill(old, signal.SIGKILL)
        assert gone(old)
        result = asyncio.run(invoke(ToolCall("calculate", {"expression": "2 + 3"})))
        assert (result.outcome, result.content, result.attempts) == (ToolOutcome.OK, "5", 2)
        assert stack.stats()["mcp_restarts/calc"] == 1.0
    finally:
        stack.close()


def test_a_server_past_max_restarts_is_down_and_its_calls_are_env_errors(tmp_path):
    pid_file = tmp_path / "server.pid"
    stack = ToolStack(ToolsConfig.model_validate({"mcp": [stdio(pid_file, max_restarts=0)]}),
                      tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))
        calc = ToolCall("calculate", {"expression": "2 + 3"})
        assert asyncio.run(invoke(calc)).content == "5"
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        assert gone(pid)
        deadline = time.monotonic() + 20
        while "is down" not in (result := asyncio.run(invoke(calc))).content:
            assert result.outcome is ToolOutcome.ENV_ERROR  # the call that found it dead
            assert time.monotonic() < deadline, result.content
            time.sleep(0.1)
        assert result.outcome is ToolOutcome.ENV_ERROR
        assert result.content == (
            "calculate failed: McpConnectionError: MCP server calc is down (its connection "
            "closed) after 0 restarts (config field env.tools.mcp[0] (calc).max_restarts)")
        again = asyncio.run(invoke(calc))
        assert (again.outcome, again.content) == (ToolOutcome.ENV_ERROR, result.content)
        assert stack.stats()["mcp_restarts/calc"] == 0.0
        assert int(pid_file.read_text()) == pid  # never restarted
    finally:
        stack.close()


def test_a_servers_cwd_is_where_its_command_starts(tmp_path):
    """A relative script path resolves against `cwd` (the server would not start elsewhere)."""
    entry = {"name": "calc", "command": [sys.executable, SERVER.name], "cwd": str(SERVER.parent)}
    stack = ToolStack(ToolsConfig.model_validate({"mcp": [entry]}), tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))
        result = asyncio.run(invoke(ToolCall("calculate", {"expression": "6 * 7"})))
        assert (result.outcome, result.content) == (ToolOutcome.OK, "42")
    finally:
        stack.close()
    with pytest.raises(ConfigError, match=r"env.tools.mcp\[0\] \(calc\): command .* did not "
                                          r"start: .*can't open file"):
        ToolStack(ToolsConfig.model_validate({"mcp": [{**entry, "cwd": str(tmp_path)}]}),
                  tmp_path)


@pytest.mark.slow
def test_a_slow_tool_times_out_as_env_error_and_the_server_keeps_serving(tmp_path):
    cfg = ToolsConfig.model_validate({"mcp": [stdio()],
                                      "executor": {"tools": {"slow": {"timeout_s": 0.5}}}})
    stack = ToolStack(cfg, tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))

        async def calls():
            slow = await invoke(ToolCall("slow", {"seconds": 3.0}))
            t = time.perf_counter()
            fast = await invoke(ToolCall("calculate", {"expression": "1 + 1"}))
            return slow, fast, time.perf_counter() - t

        slow, fast, fast_s = asyncio.run(calls())
        assert slow.outcome is ToolOutcome.ENV_ERROR and slow.timed_out
        assert slow.content == "slow timed out after 0.5s"
        assert (fast.outcome, fast.content) == (ToolOutcome.OK, "2")
        assert fast_s < 2.0  # not queued behind the abandoned slow call
        stats = stack.stats()
        assert stats["tool_timeouts/slow"] == 1.0 and stats["env_error_rate/slow"] == 1.0
        assert stats["mcp_restarts/calc"] == 0.0  # a timeout is not a dead server
    finally:
        stack.close()


def test_an_answer_over_max_result_chars_keeps_its_start_and_end_and_is_counted(tmp_path):
    cfg = ToolsConfig.model_validate({"mcp": [stdio(max_result_chars=1000)]})
    stack = ToolStack(cfg, tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))

        async def calls():
            return [await invoke(ToolCall("big", {"chars": n})) for n in (1000, 5000)]

        fits, over = asyncio.run(calls())
        assert (fits.outcome, fits.content) == (ToolOutcome.OK, "<" + "x" * 998 + ">")
        assert over.outcome is ToolOutcome.OK  # the tool answered: the policy reads its ends
        assert over.content == ("<" + "x" * 499 + "\n[... 4000 characters of the answer cut: "
                                "env.tools.mcp[0] (calc).max_result_chars=1000 ...]\n"
                                + "x" * 499 + ">")
        assert stack.stats()["mcp_truncated/calc"] == 1.0
    finally:
        stack.close()


def test_per_tool_concurrency_limits_apply_to_mcp_calls(tmp_path):
    cfg = ToolsConfig.model_validate({"mcp": [stdio()], "executor": {
        "tools": {"slow": {"max_concurrency": 2, "timeout_s": 30}}}})
    stack = ToolStack(cfg, tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))

        async def burst():
            return await asyncio.gather(*(invoke(ToolCall("slow", {"seconds": 0.2}))
                                          for _ in range(6)))

        assert [r.content for r in asyncio.run(burst())] == ["slept 0.2s"] * 6
        stats = stack.stats()
        assert stats["tool_peak_concurrency/slow"] == 2.0 and stats["ok_rate/slow"] == 1.0
    finally:
        stack.close()


def test_a_server_that_fails_to_start_stops_the_others_at_once(tmp_path):
    """One server is starting, one never answers the handshake, one does not exist: the error
    is the missing one's, and neither of the others outlives it nor is waited for."""
    marker = f"tiller-test-{tmp_path.name}"  # in both command lines (the server ignores it)
    silent = f"import time; time.sleep(120)  # {marker}"
    cfg = ToolsConfig.model_validate({"mcp": [
        {**stdio(), "command": [sys.executable, str(SERVER), marker]},
        {"name": "silent", "command": [sys.executable, "-c", silent]},
        {"name": "broken", "command": ["/nonexistent/mcp-server"]}]})
    t = time.monotonic()
    with pytest.raises(ConfigError, match=r"env.tools.mcp\[2\] \(broken\)"):
        ToolStack(cfg, tmp_path)
    assert time.monotonic() - t < 30  # not the silent one's start_timeout_s (60)
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == [], "a server outlived the start-up error"


def test_outcomes_faults_and_cache_apply_to_mcp_tools(tmp_path):
    """The server's tool errors are the policy's; arguments are validated against the
    server's schema before anything is sent; faults are injected behind that validation; a
    cached call does not reach the server again."""
    cfg = ToolsConfig.model_validate({
        "mcp": [stdio()], "faults": {"crash_prob": 1.0, "tools": ["lookup"]},
        "executor": {"tools": {"calculate": {"cache": True}}}})
    stack = ToolStack(cfg, tmp_path)
    try:
        invoke = stack.wrapper("ep")(ToolRegistry([]))
        calls = [("calculate", {"expression": "(3 + 4) * 6"}),
                 ("calculate", {"expression": "import os"}), ("calculate", {"expr": "1"}),
                 ("calculate", {"expression": "(3 + 4) * 6"}),
                 ("lookup", {"country": "Pell"}), ("lookup", {"place": "Pell"})]

        async def run_all():
            return [await invoke(ToolCall(n, a)) for n, a in calls]

        r = asyncio.run(run_all())
        assert [x.outcome.value for x in r] == ["ok", "tool_error", "tool_error", "ok",
                                                 "env_error", "tool_error"]
        assert r[0].content == "42" and r[3].cached
        assert r[1].content == "not an expression: invalid syntax"
        assert r[2].content.startswith("invalid arguments for 'calculate': arguments: "
                                       "'expression' is a required property")
        assert "injected crash" in r[4].content  # valid arguments, then the fault
        assert stack.injector.injected == {"crash/lookup": 1}
        assert stack.stats()["tool_cache_hits/calculate"] == 1.0
    finally:
        stack.close()


def test_result_text_renders_every_content_block():
    import mcp_types as t

    result = t.CallToolResult(content=[
        t.TextContent(type="text", text="a"),
        t.ImageContent(type="image", data="AAAA", mime_type="image/png"),
        t.EmbeddedResource(type="resource", resource=t.TextResourceContents(
            uri="file:///x.txt", text="inside")),
    ])
    assert result_text(result) == "a\n[image image/png]\ninside"
    assert result_text(t.CallToolResult(content=[], structured_content={"k": 1})) == '{"k": 1}'


@pytest.mark.parametrize("entries,message", [
    ([{"name": "calc", "command": ["/nonexistent/mcp-server"]}],
     "config field env.tools.mcp[0] (calc): command ['/nonexistent/mcp-server'] did not "
     "start: FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/mcp-server'"),
    ([{"name": "calc", "command": [sys.executable, "-c",
                                   "import sys; sys.exit('no fastmcp here')"]}],
     "did not start: MCPError: Connection closed (its stderr ends: 'no fastmcp here')"),
    ([{"name": "calc", "command": [sys.executable, "-c", "import time; time.sleep(60)"],
       "start_timeout_s": 1}],
     "did not start: no answer to the MCP handshake and tools/list within start_timeout_s=1"),
    ([{"name": "kb", "url": "http://127.0.0.1:{port}/mcp"}],
     "config field env.tools.mcp[0] (kb): url 'http://127.0.0.1:{port}/mcp' does not answer: "
     "ConnectError: All connection attempts failed"),
    ([{**stdio(), "env": {"MCP_BAD_SCHEMA": "1"}}],
     "config field env.tools.mcp[0] (calc): tool 'broken': its input schema is not a valid JSON "
     "Schema at properties/x/type: 'strung' is not valid under any of the given schemas"),
    ([stdio(), stdio(name="calc2")],
     "config field env.tools.mcp[1] (calc2): its tool 'calculate' has the name of a tool of "
     "server 'calc'; tool names must be unique"),
    ([stdio(), stdio()],
     "config field env.tools.mcp: server name(s) calc appear twice"),
], ids=["command-missing", "command-exits", "command-silent", "url-silent", "bad-schema",
        "tool-clash", "name-twice"])
@pytest.mark.slow
def test_a_bad_server_is_one_line_before_any_work(tmp_path, entries, message):
    port = free_port()  # nothing listens there
    for e in entries:
        if "url" in e:
            e["url"] = e["url"].format(port=port)
    cfg = load_config(EXAMPLE, example(f"env.tools.mcp={json.dumps(entries)}"))
    with pytest.raises(ConfigError) as e:
        Run(cfg, tmp_path / "run")
    assert message.format(port=port) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "base_model").exists()  # no model built


def test_mcp_tools_join_any_tool_env_and_a_name_clash_is_one_line(tmp_path):
    from tiller.envs import ENVS
    from tiller.plugins import check_env_tools

    stack = ToolStack(ToolsConfig.model_validate({"mcp": [stdio()]}), tmp_path)
    try:
        sql = ENVS["sql"](wrap=stack.wrapper("ep"))  # its own tools, then the server's
        assert list(sql.registry.tools) == ["query", "execute", "calculate", "lookup", "slow",
                                            "big", "pid"]
        with pytest.raises(ConfigError, match=r"^config field env.tools.mcp: tool name\(s\) "
                                              r"calculate are already tools of env calculator"):
            check_env_tools(ENVS["calculator"], stack.mcp_tools, "env.tools.mcp")
    finally:
        stack.close()


def test_mcp_tools_on_an_env_that_takes_no_tools_are_one_line(tmp_path):
    cfg = load_config(ROOT / "configs" / "calculator.yaml", [
        "env.name=guess_number", mcp_override(stdio()), "logging.report=false"])
    with pytest.raises(ConfigError, match=r"^config field env.tools.mcp: env guess_number is "
                                          r"not a ToolEnv"):
        Run(cfg, tmp_path / "run")


@pytest.mark.slow
def test_an_interrupted_run_stops_its_server(tmp_path):
    """Ctrl-C in the middle of RL: the run closes, and the server process is gone."""
    pid_file = tmp_path / "server.pid"
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "examples" / "mcp"), str(ROOT / "tests")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiller", "train", str(EXAMPLE), *example(
            mcp_override(stdio(pid_file)), "rl.steps=400"), "-o", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").is_file() or not rl_rows(out):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach RL"
            time.sleep(0.2)
        pid = int(pid_file.read_text())
        assert alive(pid)
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + signal.SIGINT, output[-2000:]  # interrupted, not finished
    assert gone(pid), "Ctrl-C left the MCP server running"
