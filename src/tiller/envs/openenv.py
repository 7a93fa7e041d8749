"""OpenEnv environments (`env.name: openenv`): an OpenEnv server's reset/step as tiller episodes.

OpenEnv (openenv-core) serves an environment over HTTP and a WebSocket: `POST /reset` and
`POST /step` build a fresh environment per request (stateless: a multi-step episode cannot use
them), while each `/ws` connection is one session with its own environment instance. tiller
speaks that WebSocket protocol itself, with `websockets` and `httpx`, rather than through
openenv-core's client: openenv-core imports gradio and its web UI whenever its client is
imported (23 times as long as websockets and httpx: docs/results.md, "Environments from the
ecosystem"; and gradio, pandas and openai as dependencies of every training run); the protocol
is four JSON messages, and tests/test_openenv.py holds tiller's side of it to a real
openenv-core server (examples/openenv/guess_env.py).

    client -> {"type": "reset", "data": {"seed": s, ...}} | {"type": "step", "data": {action}}
              | {"type": "close"}
    server -> {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
              | {"type": "error", "data": {"message": ..., "code": ...}}

A config names the server by `url`, or by a `command` that tiller starts for the run (its
`{port}` replaced by a free loopback port) and stops at the end (its process group; on Linux
the server also dies with tiller, PR_SET_PDEATHSIG, and `tiller train` takes SIGTERM as
Ctrl-C, so the run still stops it). Before any work tiller checks
it: `/health` and `/schema` answer JSON, the action schema is one tiller can render, and a
probe episode's reset answers an observation; anything else is one line.

An episode: a task is a reset seed; `reset` opens a session and the opening observation is the
user message. The policy acts through one tool (`tool_name`, default `step`) whose arguments
are the action's fields (the action's JSON schema, validated before anything is sent), or,
with `text_field`, with its plain text put in that string field of the action. Each
observation comes back as the tool result (or a user message); the episode ends when the
server says `done`, when the policy answers without a tool call (tool mode), or at
`env.max_turns`. The reward is the return, the sum of the step rewards.

Whose fault: an action the server rejects (`VALIDATION_ERROR`) is the policy's (`tool_error`);
a server error (`EXECUTION_ERROR` and every other code), an answer that is not the protocol, a
closed connection or a timeout is the environment's (`env_error`: the episode is kept out of
the loss). The session is closed at the end of every episode. Steps do not go through the
tool stack, so `env.tools` settings that would do nothing (replay, faults, an executor or a
gate other than the defaults) are refused in one line.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Env, StepResult, Task, register_env
from tiller.envs.source_config import OpenEnvConfig
from tiller.envs.splits import draw_split, stable_id
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError, one_line
from tiller.tools.executor import ExecutorConfig
from tiller.tools.registry import ToolCall, ToolError, ToolOutcome, ToolRegistry, ToolResult
from tiller.tools.schemas import SchemaError, schema_tool
from tiller.tools.stack import GateConfig

if TYPE_CHECKING:
    from tiller.config import Config

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20  # a WebSocket message tiller parses
MAX_HTTP_BYTES = 1 << 20  # /health and /schema answers
POLICY_CODES = {"VALIDATION_ERROR"}  # the action was rejected: the policy's fault


class OpenEnvError(ConnectionError):
    """The server failed (an error answer, garbage, a closed connection): an env_error."""


class Server:
    """The run's OpenEnv server: started by tiller (`command`) or reached (`url`)."""

    def __init__(self, cfg: OpenEnvConfig, run_dir: Path):
        self.cfg, self.proc, self.log = cfg, None, run_dir / "openenv.log"
        self.url = cfg.url.rstrip("/") if cfg.url else ""
        if cfg.command is not None:
            port = _free_port()
            argv = [a.replace("{port}", str(port)) for a in cfg.command]
            with self.log.open("ab") as log:
                try:
                    if shutil.which(argv[0]) is None:  # said here: the wrapper would exec it
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
                    self.proc = subprocess.Popen(dying_with_this_process(argv), stdout=log,
                                                 stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
                except OSError as e:
                    raise ConfigError(f"config field env.openenv.command: got {cfg.command}; it "
                                      f"did not start: {one_line(e)}") from e
            self.url = f"http://127.0.0.1:{port}"

    @property
    def ws_url(self) -> str:
        return "ws" + self.url.removeprefix("http") + "/ws"

    def wait_healthy(self) -> None:
        """/health must answer: at once for a url, within start_timeout_s for a command's
        server (polled while it starts); otherwise one line."""
        import httpx

        deadline = time.monotonic() + self.cfg.start_timeout_s
        while True:
            try:
                health = _get_json(self.url + "/health")
                break
            except httpx.TransportError as e:
                if self.proc is None:
                    raise ConfigError(f"config field env.openenv.url: {self.url}/health does "
                                      f"not answer: {one_line(e)}") from e
                if self.proc.poll() is not None:
                    raise ConfigError(f"config field env.openenv.command: the server exited "
                                      f"with status {self.proc.returncode} before it answered "
                                      f"/health{_tail(self.log)}") from e
                if time.monotonic() > deadline:
                    raise ConfigError(f"config field env.openenv.command: {self.url}/health "
                                      f"did not answer within start_timeout_s="
                                      f"{self.cfg.start_timeout_s:g}: {one_line(e)}") from e
                time.sleep(0.2)
        if not isinstance(health, dict):
            raise self.garbage("GET /health", health)

    def garbage(self, what: str, got: Any) -> ConfigError:
        return ConfigError(f"config field env.openenv: the server at {self.url} is not an "
                           f"OpenEnv server: {what} answered {str(got)[:160]!r}")

    def stop(self) -> None:
        """Stop the command's server and everything in its process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                logger.warning("the OpenEnv server (pid %d) outlived %s", self.proc.pid, sig.name)


# Execs argv[2:] with PR_SET_PDEATHSIG set to SIGKILL: the server dies with the thread that
# started it (in a run, the main thread), also when tiller itself is killed and cannot stop it.
# It exits instead when that parent is already gone (the race before prctl).
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit("tiller exited before its OpenEnv server started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_this_process(argv: list[str]) -> list[str]:
    """`argv` run through `_DIE_WITH_PARENT` (Linux; elsewhere `argv` itself): a prctl in the
    child without `preexec_fn`, which is not safe in a process with threads."""
    if sys.platform != "linux":
        return argv
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return f" (its output ends: {lines[-1][:200]!r})" if lines else ""


def _get_json(url: str) -> Any:
    """A GET's JSON answer, read at most MAX_HTTP_BYTES; garbage comes back as the text."""
    import httpx

    with httpx.stream("GET", url, timeout=10.0) as r:
        body = b""
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_HTTP_BYTES:
                return f"(more than {MAX_HTTP_BYTES} bytes)"
    try:
        return json.loads(body) if r.status_code == 200 else f"HTTP {r.status_code}: {body[:100]!r}"
    except ValueError:
        return body.decode(errors="replace")


def parse_answer(raw: Any) -> tuple[dict[str, Any], float, bool]:
    """(observation, reward, done) of a server's observation message; OpenEnvError for an error
    answer (its code kept) or anything that is not the protocol."""
    try:
        msg = json.loads(raw)
    except (TypeError, ValueError):
        raise OpenEnvError(f"not JSON: {str(raw)[:160]!r}") from None
    data = msg.get("data") if isinstance(msg, dict) else None
    if isinstance(msg, dict) and msg.get("type") == "error" and isinstance(data, dict):
        error = OpenEnvError(f"{data.get('code')}: {str(data.get('message'))[:300]}")
        error.code = data.get("code")  # type: ignore[attr-defined]
        raise error
    if not (isinstance(msg, dict) and msg.get("type") == "observation" and isinstance(data, dict)
            and isinstance(data.get("observation"), dict)
            and isinstance(data.get("done", False), bool)
            and isinstance(data.get("reward") or 0, (int, float))):
        raise OpenEnvError(f"not an observation message: {str(raw)[:160]!r}")
    return data["observation"], float(data.get("reward") or 0.0), bool(data.get("done", False))


class Session:
    """One WebSocket session: one environment instance on the server."""

    def __init__(self, ws: Any, timeout_s: float):
        self.ws, self.timeout_s, self.broken = ws, timeout_s, False

    @classmethod
    async def open(cls, url: str, timeout_s: float) -> Session:
        from websockets.asyncio.client import connect

        try:
            ws = await connect(url, open_timeout=timeout_s, max_size=MAX_MESSAGE_BYTES,
                               close_timeout=5)
        except Exception as e:  # refused, timed out, or a handshake websockets rejects
            raise OpenEnvError(f"cannot open a session at {url}: {one_line(e)}") from e
        return cls(ws, timeout_s)

    async def request(self, kind: str, data: dict[str, Any]) -> tuple[dict[str, Any], float,
                                                                        bool]:
        """Send one message and parse its answer; a timeout or a closed connection breaks the
        session (its state is unknown), so every later request is an env_error too."""
        from websockets.exceptions import ConnectionClosed

        if self.broken:
            raise OpenEnvError("the session broke earlier in this episode")
        try:
            await self.ws.send(json.dumps({"type": kind, "data": data}))
            raw = await asyncio.wait_for(self.ws.recv(), self.timeout_s)
        except asyncio.TimeoutError:
            self.broken = True
            raise TimeoutError(f"the OpenEnv server did not answer {kind} within "
                               f"{self.timeout_s:g}s") from None
        except ConnectionClosed as e:
            self.broken = True
            raise OpenEnvError(f"the session closed: {one_line(e)}") from e
        return parse_answer(raw)

    async def close(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            if not self.broken:  # the server ends the session and closes the socket itself
                await self.ws.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(self.ws.wait_closed(), self.timeout_s)
        except (ConnectionClosed, asyncio.TimeoutError):
            pass  # closed already, or the server did not: closed from this side below
        finally:
            await self.ws.close()


@register_env
class OpenEnvEnv(Env):
    """Episodes on the OpenEnv server `env.openenv` names; configured per run."""

    name: ClassVar[str] = "openenv"
    requires: ClassVar[dict[str, str]] = {"websockets": "openenv", "httpx": "openenv",
                                          "jsonschema": "openenv"}
    has_expert: ClassVar[bool] = False
    has_difficulty: ClassVar[bool] = False
    settings: ClassVar[OpenEnvConfig]
    server: ClassVar[Server | None] = None
    action_schema: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.session: Session | None = None
        self.rewards: list[float] = []
        self.done = False
        self.invalid_actions = 0
        self.registry = ToolRegistry([])
        if self.settings.text_field is None:
            self.registry = ToolRegistry([schema_tool(
                self.settings.tool_name, "Take one action in the environment.",
                self.action_schema, self._act, env_errors=(Exception,))])

    @classmethod
    def configure(cls, cfg: Config) -> type[OpenEnvEnv]:
        settings = cfg.env.openenv
        if settings is None:
            raise ConfigError("config field env.openenv: env.name is openenv, so name the "
                              "server: {url: http://...} or {command: [..., '{port}']}")
        tools = cfg.env.tools
        for field, value, default in (("replay", tools.replay, None),
                                      ("faults", tools.faults, None),
                                      ("executor", tools.executor, ExecutorConfig()),
                                      ("gate", tools.gate, GateConfig())):
            if value != default:  # (a run folder's config.yaml holds the defaults: fine)
                raise ConfigError(f"config field env.tools.{field}: env openenv's steps go to "
                                  "the server's session, not through the tool stack, so "
                                  f"env.tools.{field} would do nothing; remove it")
        return type("OpenEnvEnv[server]", (cls,), {"settings": settings})

    @classmethod
    def start(cls, run_dir: Path) -> None:
        """Start (or reach) the server and check it, before any work: /health, /schema, an
        action schema tiller can render, a probe reset answering an observation."""
        cls.server = Server(cls.settings, run_dir)
        try:
            cls.server.wait_healthy()
            schema = _get_json(cls.server.url + "/schema")
            if not (isinstance(schema, dict) and isinstance(schema.get("action"), dict)):
                raise cls.server.garbage("GET /schema", schema)
            cls.action_schema = _action_schema(schema["action"], cls.settings)
            asyncio.run(cls._probe())
        except BaseException:
            cls.stop()
            raise

    @classmethod
    async def _probe(cls) -> None:
        assert cls.server is not None
        try:
            session = await Session.open(cls.server.ws_url, cls.settings.timeout_s)
            try:
                await session.request("reset", {"seed": 0, **cls.settings.reset_kwargs})
            finally:
                await session.close()
        except (OpenEnvError, TimeoutError) as e:
            raise ConfigError(f"config field env.openenv: the server at {cls.server.url} is not "
                              f"an OpenEnv server: a probe reset over /ws failed: {e}") from e

    @classmethod
    def stop(cls) -> None:
        if cls.server is not None:
            cls.server.stop()

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int, difficulty: int = 1,
                   heldout_fraction: float = 0.2) -> list[Task]:  # type: ignore[override]
        """`n` reset seeds of `split` (split by a hash of the seed: what an episode is, the
        server decides from it)."""
        rng = random.Random(f"openenv/{split}/{seed}")
        seeds = draw_split(split, n, rng, lambda r: r.randrange(2**31), str, heldout_fraction)
        return [Task(id=stable_id("openenv", str(s)), prompt="", answer=None, split=split,
                     system=cls.settings.system, metadata={"seed": s}) for s in seeds]

    @classmethod
    def tokenizer_corpus(cls, tasks: list[Task], tokenizer: Any) -> list[str]:
        """Each task's opening (a reset on the server) rendered with the action tool."""

        async def openings() -> list[list[dict[str, Any]]]:
            out = []
            for task in tasks:
                env = cls()
                try:
                    out.append(await env.reset(task, 0))
                finally:
                    await env.close()
            return out

        return [tokenizer.apply_chat_template(m, tools=cls().tool_schemas() or None,
                                              tokenize=False) for m in asyncio.run(openings())]

    @staticmethod
    def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                    guess_prob: float) -> str:
        raise ConfigError("env openenv has no scripted expert: give SFT conversations in "
                          "data.sft, or set sft.enabled=false")

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.registry.schemas()

    def show(self, observation: dict[str, Any]) -> str:
        field = self.settings.observation_field
        if field is not None:
            return str(observation.get(field, ""))
        return json.dumps(observation, ensure_ascii=False)

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        assert self.server is not None, "OpenEnvEnv.start was not called"
        self.session = await Session.open(self.server.ws_url, self.settings.timeout_s)
        observation, _, self.done = await self.session.request(
            "reset", {"seed": task.metadata["seed"], **self.settings.reset_kwargs})
        system = [{"role": "system", "content": task.system}] if task.system else []
        return [*system, {"role": "user", "content": self.show(observation)}]

    async def _act(self, **action: Any) -> str:
        """The action tool: one step of the session."""
        assert self.session is not None
        if self.done:
            raise ToolError("the episode is over")
        try:
            observation, reward, self.done = await self.session.request("step", action)
        except OpenEnvError as e:
            if getattr(e, "code", None) in POLICY_CODES:
                self.invalid_actions += 1
                raise ToolError(f"invalid action: {e}") from e
            raise
        self.rewards.append(reward)
        return self.show(observation)

    async def step(self, action: ParsedTurn) -> StepResult:
        if self.settings.text_field is not None:
            return await self._text_step(action)
        if not action.tool_calls and not action.parse_errors:
            return StepResult(messages=[], done=True)  # a plain answer ends the episode
        results: list[ToolResult] = []
        for call in action.tool_calls:
            results.append(await self.registry.invoke(call))
        messages = [{"role": "tool", "content": f"error: {err}"} for err in action.parse_errors]
        for r in results:
            text = r.content if r.outcome is ToolOutcome.OK else f"error: {r.content}"
            messages.append({"role": "tool", "name": r.call.name, "content": text})
        return StepResult(messages=messages, done=self.done, tool_results=results)

    async def _text_step(self, action: ParsedTurn) -> StepResult:
        if action.tool_calls or action.parse_errors:
            msg = "error: this environment has no tools; reply with plain text"
            return StepResult([{"role": "user", "content": msg}], done=False)
        call = ToolCall(self.settings.tool_name, {self.settings.text_field: action.content})
        try:
            content = await self._act(**call.arguments)
        except ToolError as e:  # the server rejected the text: the policy's fault
            return StepResult([{"role": "user", "content": f"error: {e}"}], done=False,
                              tool_results=[ToolResult(call, ToolOutcome.TOOL_ERROR, str(e))])
        return StepResult([{"role": "user", "content": content}], done=self.done)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()

    async def verify(self, final: ParsedTurn | None) -> Reward:
        """The return (the sum of the step rewards), with whether the server said done."""
        total = sum(self.rewards)
        return Reward(total, {"return": total, "done": float(self.done),
                              "steps": float(len(self.rewards)),
                              "invalid_actions": float(self.invalid_actions)})


def _action_schema(schema: dict[str, Any], cfg: OpenEnvConfig) -> dict[str, Any]:
    """The action's JSON schema as the policy's tool arguments: OpenEnv's own `metadata`
    field left out. A schema tiller cannot render, or a `text_field` that is not a string
    field of it, is one line."""
    properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    action = {**schema, "properties": properties}
    try:
        schema_tool(cfg.tool_name, "", action, lambda **kw: None)
    except SchemaError as e:
        raise ConfigError(f"config field env.openenv: the server's action schema: {e}") from e
    if cfg.text_field is not None:
        field = properties.get(cfg.text_field)
        if not (isinstance(field, dict) and field.get("type") == "string"):
            raise ConfigError(f"config field env.openenv.text_field: got {cfg.text_field!r}; "
                              "the action has no string field of that name (fields: "
                              f"{', '.join(properties) or 'none'})")
        others = set(schema.get("required", [])) - {cfg.text_field}
        if others:
            raise ConfigError(f"config field env.openenv.text_field: the action also requires "
                              f"{', '.join(sorted(others))}, which plain text cannot give")
    return action
