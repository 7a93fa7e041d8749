"""OpenEnv environments (`env.name: openenv`): tiller's WebSocket adapter held to a real
openenv-core server (examples/openenv/guess_env.py, served locally without Docker): the example
trains a few steps; reset, step, observations, rewards and done map onto an episode; a rejected
action is the policy's fault while a server error, a timeout or a dead server is an env_error;
every session is closed; a server that is not OpenEnv is one line before any work."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import TextActor, free_port, gone, processes_with, rl_rows
from openenv_loop import Bisector
from safetensors.torch import load_file

from tiller.config import load_config
from tiller.controller import train
from tiller.envs.openenv import OpenEnvEnv
from tiller.errors import ConfigError
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.run import Run
from tiller.tools.registry import ToolOutcome

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openenv" / "config.yaml"
GUESS = ROOT / "examples" / "openenv" / "guess_env.py"
TEST_SERVER = ROOT / "tests" / "servers" / "openenv_test_server.py"
LIMITS = EpisodeLimits(max_turns=7, max_episode_tokens=2048)


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


def start_server(script: Path, port: int, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(script), "--port", str(port)],
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    import httpx

    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "the OpenEnv server exited before it answered /health"
        assert time.monotonic() < deadline, "the OpenEnv server did not answer in 120 s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def test_server(tmp_path_factory):
    """The test server (guess_env with failure hooks), shared by the module; its sessions'
    closes go to the returned log."""
    log = tmp_path_factory.mktemp("openenv") / "closed.log"
    port = free_port()
    proc = start_server(TEST_SERVER, port, {"OPENENV_CLOSE_LOG": str(log)})
    yield f"http://127.0.0.1:{port}", log
    proc.terminate()
    proc.wait(20)


def configured(tmp_path: Path, **openenv) -> type[OpenEnvEnv]:
    cfg = load_config(None, ["model.path=unused", "env.name=openenv",
                             f"env.openenv={json.dumps(openenv)}"])
    cls = OpenEnvEnv.configure(cfg)
    cls.start(tmp_path)
    return cls


def secret(task) -> int:
    """The number guess_env picks for `task` (its reset seed)."""
    import random

    return random.Random(task.metadata["seed"]).randint(1, 16)


def call(guess) -> str:
    return f'<tool_call>\n{{"name": "step", "arguments": {{"guess": {json.dumps(guess)}}}}}\n' \
           "</tool_call>"


def closed(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.is_file() else 0


def wait_closed(log: Path, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while closed(log) < n:
        assert time.monotonic() < deadline, f"{n - closed(log)} session(s) never closed"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_openenv_example_trains_a_few_steps(tmp_path, monkeypatch):
    """examples/openenv/config.yaml end to end: tiller starts guess_env.py, builds a tiny
    model on its openings, trains 3 RL steps (odd samples play bisection, so rewards vary),
    evaluates, and stops the server."""
    servers = []
    start = OpenEnvEnv.start.__func__

    def spy(cls, run_dir):  # records the server each run starts
        start(cls, run_dir)
        servers.append(cls.server)

    monkeypatch.setattr(OpenEnvEnv, "start", classmethod(spy))
    cfg = load_config(EXAMPLE, [
        f"env.openenv.command=[{sys.executable}, {GUESS}, --port, '{{port}}']",
        "agent.loop=openenv_loop:run_episode", "logging.report=false"])
    summary = train(cfg, tmp_path / "run")
    steps = rl_rows(tmp_path / "run")
    assert len(steps) == 3
    for r in steps:  # bisection wins every game (16 numbers, 6 tries), the tiny policy none
        assert r["env_error_rate"] == 0.0
        assert r["reward_mean"] == pytest.approx(0.5) and r["check/done"] >= 0.5
    assert summary["heldout_after_rl"]["tasks"] == 8
    before = load_file(tmp_path / "run" / "base_model" / "model.safetensors")
    after = load_file(Path(summary["checkpoint"]) / "model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before), "RL left the weights"
    assert len(servers) == 1 and servers[0].proc.poll() is not None, "server left running"
    assert "Traceback" not in (tmp_path / "run" / "openenv.log").read_text()


@pytest.mark.slow
def test_a_run_that_fails_after_starting_the_server_stops_it(tmp_path, monkeypatch):
    servers = []
    start = OpenEnvEnv.start.__func__

    def spy(cls, run_dir):
        start(cls, run_dir)
        servers.append(cls.server)

    monkeypatch.setattr(OpenEnvEnv, "start", classmethod(spy))
    cfg = load_config(EXAMPLE, [
        f"env.openenv.command=[{sys.executable}, {GUESS}, --port, '{{port}}']",
        "model.build=null", f"model.path={tmp_path / 'no-such-model'}"])
    with pytest.raises(Exception, match="no-such-model"):
        Run(cfg, tmp_path / "run")  # the model fails to load after the server started
    assert len(servers) == 1 and servers[0].proc.poll() is not None, "server left running"


@pytest.mark.slow
def test_an_episode_maps_reset_step_observations_reward_and_done(tmp_path, tokenizer,
                                                                 test_server):
    url, log = test_server
    cls = configured(tmp_path, url=url, observation_field="message", system="Find it.")
    before = closed(log)
    task = cls.make_tasks("train", 1, seed=0)[0]
    traj = asyncio.run(run_episode(cls(), task, Bisector(tokenizer, None), tokenizer,
                                   seed=0, limits=LIMITS))
    assert traj.status.value == "completed" and traj.env_errors == 0
    assert traj.reward.value == 1.0
    assert traj.reward.checks == {"return": 1.0, "done": 1.0, "steps": float(
        len(traj.tool_results)), "invalid_actions": 0.0}
    messages = traj.messages
    assert messages[0] == {"role": "system", "content": "Find it."}
    assert messages[1]["content"].startswith("I picked a whole number from 1 to 16")
    hints = [r.content for _, r in traj.tool_results]  # the last (done) is not rendered
    assert hints[-1] == "Correct!" and all(h in ("No: higher.", "No: lower.") for h in hints[:-1])
    assert all(r.outcome is ToolOutcome.OK for _, r in traj.tool_results)
    wait_closed(log, before + 1)  # the session ended with the episode

    # the same seed is the same game: the same hints for the same guesses
    again = asyncio.run(run_episode(cls(), task, Bisector(tokenizer, None), tokenizer,
                                    seed=1, limits=LIMITS))
    assert again.messages == messages
    schema = cls().tool_schemas()[0]["function"]
    assert schema["name"] == "step" and set(schema["parameters"]["properties"]) == {"guess"}


def test_tool_name_and_reset_kwargs_reach_the_policy_and_the_server(tmp_path, tokenizer,
                                                                     test_server):
    url, _ = test_server
    cls = configured(tmp_path, url=url, tool_name="guess_number", observation_field="message",
                     reset_kwargs={"greeting": "Welcome."})
    assert [s["function"]["name"] for s in cls().tool_schemas()] == ["guess_number"]
    task = cls.make_tasks("train", 1, seed=0)[0]
    wrong = 2 if secret(task) == 1 else 1
    turns = [call(wrong).replace('"step"', '"guess_number"'), call(wrong), "I stop."]
    traj = asyncio.run(run_episode(cls(), task, TextActor(tokenizer, turns), tokenizer, seed=0,
                                   limits=LIMITS))
    assert traj.messages[0]["content"].startswith("Welcome. I picked a whole number")
    named, step = (r for _, r in traj.tool_results)
    assert (named.outcome, named.content) == (ToolOutcome.OK, "No: higher.")
    assert (step.outcome.value, step.content) == (
        "tool_error", "unknown tool 'step'; available: guess_number")
    assert traj.reward.checks["steps"] == 1.0 and traj.env_errors == 0


@pytest.mark.slow
def test_text_field_sends_the_plain_text_as_the_action(tmp_path, tokenizer):
    port = free_port()
    proc = start_server(TEST_SERVER, port, {"OPENENV_TEXT_ACTION": "1"})
    try:
        cls = configured(tmp_path, url=f"http://127.0.0.1:{port}", text_field="text",
                         observation_field="message")
        assert cls().tool_schemas() == []
        task = cls.make_tasks("train", 1, seed=0)[0]
        wrong = 2 if secret(task) == 1 else 1
        turns = [f"My guess is {wrong}.", call(4), f"Then {secret(task)}!"]
        traj = asyncio.run(run_episode(cls(), task, TextActor(tokenizer, turns), tokenizer,
                                       seed=0, limits=EpisodeLimits(3, 2048)))
    finally:
        proc.terminate()
        proc.wait(20)
    replies = [m["content"] for m in traj.messages if m["role"] == "user"][1:]
    assert replies == ["No: higher.",  # the plain text went as {"text": ...}: a step
                       "error: this environment has no tools; reply with plain text"]
    assert traj.reward.value == 1.0  # "Then <secret>!": the second step, done (not rendered)
    assert traj.reward.checks["steps"] == 2.0 and traj.reward.checks["done"] == 1.0
    assert traj.env_errors == 0 and traj.status.value == "completed"


@pytest.mark.parametrize("guess,outcome,content", [
    (15, "tool_error", "invalid action: VALIDATION_ERROR: Invalid message"),  # the server's
    (99, "tool_error", "invalid arguments for 'step': arguments: guess: 99 is greater than the "
                       "maximum of 16"),  # tiller's check of the action schema: never sent
    ("eight", "tool_error", "invalid arguments for 'step': arguments: guess: 'eight' is not of "
                            "type 'integer'"),
    (11, "env_error", "step failed: OpenEnvError: SESSION_ERROR: Unable to serialize unknown "
                      "type: <class 'ValueError'>"),  # openenv-core's own failure
    (13, "env_error", "step failed: OpenEnvError: EXECUTION_ERROR: the environment broke on "
                      "13"),
    (14, "env_error", "step failed: TimeoutError: the OpenEnv server did not answer step "
                      "within 1s"),
])
def test_whose_fault_a_failed_step_is(tmp_path, tokenizer, test_server, guess, outcome, content):
    url, log = test_server
    cls = configured(tmp_path, url=url, timeout_s=1)
    before = closed(log)
    task = cls.make_tasks("train", 1, seed=0)[0]
    actor = TextActor(tokenizer, [call(guess), "I give up."])
    traj = asyncio.run(run_episode(cls(), task, actor, tokenizer, seed=0, limits=LIMITS))
    [(_, result)] = traj.tool_results
    assert (result.outcome.value, result.content) == (outcome, content)
    expected = "env_error" if outcome == "env_error" else "completed"
    assert traj.status.value == expected and traj.env_errors == (outcome == "env_error")
    assert traj.reward.checks["invalid_actions"] == (guess == 15)
    assert traj.reward.checks["steps"] == 0.0  # no step counted: none answered
    wait_closed(log, before + 1)  # closed after a failure too (a timed-out one by the server)


@pytest.mark.slow
def test_a_server_killed_mid_episode_is_an_env_error(tmp_path, tokenizer):
    port = free_port()
    proc = start_server(GUESS, port)
    try:
        cls = configured(tmp_path, url=f"http://127.0.0.1:{port}")

        class Killer(TextActor):
            async def act(self, prompt_ids, messages, seed, session_id=None):
                if sum(m["role"] == "assistant" for m in messages) == 1:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                return await super().act(prompt_ids, messages, seed, session_id)

        task = cls.make_tasks("train", 1, seed=0)[0]
        traj = asyncio.run(run_episode(cls(), task, Killer(tokenizer, [call(1), call(2), "x"]),
                                       tokenizer, seed=0, limits=LIMITS))
    finally:
        proc.kill()
        proc.wait(10)
    assert [r.outcome.value for _, r in traj.tool_results] == ["ok", "env_error"]
    assert traj.status.value == "env_error"
    assert "OpenEnvError: the session closed" in traj.tool_results[1][1].content


class Garbage(http.server.BaseHTTPRequestHandler):
    """Answers every GET with `body` (HTML, or JSON that is not OpenEnv's)."""

    body = b"<html>hello</html>"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


class JsonNoWs(Garbage):
    """/health and /schema as OpenEnv answers them, but no /ws."""

    def do_GET(self):  # noqa: N802
        self.body = json.dumps({"status": "healthy"} if self.path == "/health" else {
            "action": {"type": "object", "properties": {"guess": {"type": "integer"}}}
        }).encode()
        super().do_GET()


@pytest.mark.parametrize("handler,message", [
    (Garbage, "is not an OpenEnv server: GET /health answered '<html>hello</html>'"),
    (JsonNoWs, "is not an OpenEnv server: a probe reset over /ws failed: cannot open a session "
               "at ws://127.0.0.1:{port}/ws: InvalidMessage: did not receive a valid HTTP "
               "response"),
])
def test_a_server_that_answers_garbage_is_one_line_before_any_work(tmp_path, handler,
                                                                     message):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        cfg = load_config(EXAMPLE, [f"env.openenv={{url: 'http://127.0.0.1:{port}'}}"])
        with pytest.raises(ConfigError) as e:
            Run(cfg, tmp_path / "run")
    finally:
        server.shutdown()
        server.server_close()
    assert str(e.value).startswith(f"config field env.openenv: the server at "
                                   f"http://127.0.0.1:{port} ")
    assert message.format(port=port) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "base_model").exists()


@pytest.mark.parametrize("openenv,message", [
    ({"url": "http://127.0.0.1:{port}"},
     "config field env.openenv.url: http://127.0.0.1:{port}/health does not answer: "
     "ConnectError"),
    ({"command": [sys.executable, "-c", "import sys; sys.exit('no openenv here')", "{port}"]},
     "config field env.openenv.command: the server exited with status 1 before it answered "
     "/health (its output ends: 'no openenv here')"),
    ({"command": ["/nonexistent/server", "{port}"]},
     "config field env.openenv.command: got ['/nonexistent/server', '{{port}}']; it did not "
     "start: FileNotFoundError"),
])
def test_a_server_that_does_not_start_or_answer_is_one_line(tmp_path, openenv, message):
    port = free_port()
    openenv = json.loads(json.dumps(openenv).replace("{port}", str(port))) if "url" in openenv \
        else openenv
    cfg = load_config(EXAMPLE, [f"env.openenv={json.dumps(openenv)}"])
    with pytest.raises(ConfigError) as e:
        Run(cfg, tmp_path / "run")
    assert message.format(port=port) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (["env.openenv=null"], "config field env.openenv: env.name is openenv, so name the server"),
    (["env.openenv.command=[python, server.py]"], "command must hold '{port}'"),
    (["env.tools.replay={path: t.sqlite}"], "config field env.tools.replay: env openenv's "
                                            "steps go to the server's session"),
    (["env.name=calculator"], "config field env.openenv: only used with env.name: openenv"),
    (["env.tools.executor={default: {timeout_s: 5}}"],
     "config field env.tools.executor: env openenv's steps go to the server's session, not "
     "through the tool stack, so env.tools.executor would do nothing; remove it"),
    (["env.tools.gate.threshold=0.5"],
     "config field env.tools.gate: env openenv's steps go to the server's session, not "
     "through the tool stack, so env.tools.gate would do nothing; remove it"),
])
def test_openenv_config_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        Run(load_config(EXAMPLE, overrides), tmp_path / "run")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_tiller_train_leaves_no_openenv_server(tmp_path, sig):
    """`tiller train` on the example, signalled once its server is up and the model is being
    built: SIGTERM closes the run as Ctrl-C does (the server stopped, exit 128 + 15); SIGKILL
    gives it no chance, and the server dies with it (PR_SET_PDEATHSIG)."""
    script = tmp_path / "guess_env.py"  # its path marks the server's command line
    shutil.copy(GUESS, script)
    out, log = tmp_path / "run", (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiller", "train", str(EXAMPLE),
         f"env.openenv.command=[{sys.executable}, {script}, --port, '{{port}}']",
         "rl.steps=400", "logging.report=false", "-o", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not (out / "base_model").exists():  # past start(): the server answered
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not start its server"
            time.sleep(0.2)
        servers = processes_with(str(script))
        assert servers
        proc.send_signal(sig)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    output = (tmp_path / "train.log").read_text()
    assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else -sig), \
        output[-2000:]
    assert all(gone(pid, 20) for pid in servers), f"{sig.name} left the OpenEnv server running"
