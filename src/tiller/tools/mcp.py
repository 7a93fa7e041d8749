"""MCP tools (`env.tools.mcp`): the tools of MCP servers, with every guarantee tiller's own have.

A config lists servers, each started as a subprocess speaking MCP over stdio (`command`) or
reached over streamable HTTP (`url`):

    env:
      tools:
        mcp:
          - {name: calc, command: [python, calc_server.py]}
          - {name: kb, url: "http://127.0.0.1:8000/mcp"}

When the run starts (before any work), tiller starts or connects to each server, lists its
tools and turns each input schema into a tiller tool (`tiller.tools.schemas`: a schema tiller
cannot render is one line naming the tool). Every episode's registry gets those tools, so their
calls go through the run's tool stack like any other: the registry validates the arguments, then
the fault injector, the executor (per-tool timeout, retries of env errors, the cache,
concurrency limits, counters) and the replay store. Whose fault a failure is:

- the server answered with a tool error (`isError`: the tool raised, an unknown tool, arguments
  the server rejects) or a JSON-RPC "invalid params" error: `tool_error`, the policy's;
- a closed connection (the server died), a transport failure, a server that is down, any other
  protocol error, the executor's timeout: `env_error`, the environment's.

An answer longer than the server's `max_result_chars` (64k characters by default) reaches the
policy cut to its start and end around a marker saying how much was cut and which knob cut it,
and is counted (`mcp_truncated/<server>`): the tool did answer, so it stays `ok` (or a
`tool_error` if the server flagged it as one). The cap bounds the prompt and the traces, not
the client's memory: the SDK reads each whole JSON-RPC message before tiller sees it.

The servers live on an event loop of their own, in a thread (`McpHub`): a run starts a fresh
`asyncio.run` per phase, and an MCP session must outlive them. A call made on a phase's loop is
handed to the hub's loop and awaited there; the executor's timeout cancels it on both sides.
A server whose connection closes is restarted (stdio) or reconnected (HTTP), at most
`max_restarts` times, each restart logged and counted (`mcp_restarts/<server>`); the call that
found it dead is an `env_error`. At the end of the run (and when it fails or is interrupted)
every server is stopped: the SDK closes its stdin, then terminates and kills its process group.

Record/replay: a recording run also stores each server's tool listing in the replay file, so a
replay starts no server at all: the tools are built from the recorded listing and every call
is served from the file (a miss is an `env_error`, as for any tool).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tiller.errors import ConfigError, one_line, require_package
from tiller.tools.registry import Tool, ToolError
from tiller.tools.schemas import SchemaError, schema_tool

if TYPE_CHECKING:
    from tiller.tools.replay import ReplayStore

try:
    _Group: type[BaseException] = BaseExceptionGroup  # Python 3.11+
except NameError:  # 3.10: the backport anyio depends on
    from exceptiongroup import BaseExceptionGroup as _Group

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 20.0  # the SDK takes up to ~6 s per stdio server (stdin close, TERM, KILL)
LIST_PAGES = 100  # tools/list pages read before a server is deemed to paginate forever


class McpServerConfig(BaseModel):
    """One entry of `env.tools.mcp`: a server started with `command` or reached at `url`."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the server's name in "
                      "errors, logs and metrics (mcp_restarts/<name>)")
    command: list[str] | None = Field(
        None, min_length=1, description="argv of a server speaking MCP over stdio, started as "
        "a subprocess once per run (restarted if it dies)")
    url: str | None = Field(None, pattern=r"^https?://", description="a running server's "
                            "streamable-HTTP endpoint, e.g. http://127.0.0.1:8000/mcp")
    env: dict[str, str] = Field(default_factory=dict, description="command only: environment "
                                "variables for the server, on top of the MCP SDK's safe "
                                "defaults (HOME, PATH, USER, ...; the rest is not inherited)")
    cwd: str | None = Field(None, description="command only: the server's working directory")
    start_timeout_s: float = Field(60.0, gt=0, description="how long the server may take to "
                                   "start (or answer) and list its tools, at the start and at "
                                   "each restart")
    max_restarts: int = Field(5, ge=0, description="restarts (reconnects for a url) after its "
                              "connection closes, per run; after that its calls are env_errors")
    max_result_chars: int = Field(
        65536, ge=100, description="characters of one answer the policy reads; a longer one "
        "keeps its start and end around a marker saying what was cut, and is counted "
        "(mcp_truncated/<name>). The SDK has read the whole answer into memory by then")

    @model_validator(mode="after")
    def _one_source(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("set exactly one of command (a stdio server tiller starts) or url "
                             "(a streamable-HTTP server)")
        if self.url is not None and (self.env or self.cwd):
            raise ValueError("env and cwd only apply to a server tiller starts (command)")
        return self


class McpConnectionError(ConnectionError):
    """The server's connection closed or failed (an env_error, as every OSError)."""


def innermost(e: BaseException) -> BaseException:
    """The first leaf of (nested) exception groups: what anyio's task groups wrap."""
    while isinstance(e, _Group) and e.exceptions:
        e = e.exceptions[0]
    return e


def capped(text: str, limit: int, field: str) -> str | None:
    """`text` cut to its first and last `limit // 2` characters around a marker saying what
    was cut, or None when it fits."""
    if len(text) <= limit:
        return None
    half = limit // 2
    return (f"{text[:half]}\n[... {len(text) - 2 * half} characters of the answer cut: "
            f"{field}.max_result_chars={limit} ...]\n{text[-half:]}")


def result_text(result: Any) -> str:
    """The text the model reads from a CallToolResult: its text blocks; other blocks (images,
    audio, binary resources) as one-line placeholders; the structured content when there is
    no block at all."""
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            what = getattr(block, "mime_type", None) or getattr(block, "uri", None) or ""
            parts.append(f"[{kind} {what}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


class McpServer:
    """One server's connection, supervised on the hub's loop: (re)connects, lists the tools,
    serves calls, restarts after a closed connection. Every method runs on the hub's loop."""

    def __init__(self, cfg: McpServerConfig, field: str, log_path: Path):
        self.cfg, self.field, self.log_path = cfg, field, log_path
        self.session: Any = None
        self.listing: list[dict[str, Any]] | None = None
        self.generation = 0  # connections so far; a failed call breaks only its own
        self.restarts = 0
        self.down: str | None = None  # why the server was given up (no more restarts)
        self.start_error: str | None = None
        self.task: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()  # a live session, or given up: waiting calls wake
        self._broken = asyncio.Event()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Connect the first time; a ConfigError (one line) if the server does not come up."""
        self.task = asyncio.get_running_loop().create_task(self._supervise())
        try:
            await asyncio.wait_for(self._settled.wait(), self.cfg.start_timeout_s + 5)
        except asyncio.TimeoutError:
            self.start_error = (f"did not finish the MCP handshake and tools/list within "
                                f"start_timeout_s={self.cfg.start_timeout_s:g}")
        if self.session is None:
            source = (f"command {self.cfg.command}" if self.cfg.command
                      else f"url {self.cfg.url!r}")
            verb = "did not start" if self.cfg.command else "does not answer"
            raise ConfigError(f"config field {self.field}: {source} {verb}: "
                              f"{self.start_error}{self._stderr_tail()}")

    def _stderr_tail(self) -> str:
        if not self.cfg.command or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return f" (its stderr ends: {lines[-1][:200]!r})" if lines else ""

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                await self._connect_once()
                error = "its connection closed"
            except asyncio.CancelledError:  # the hub is closing and gave up waiting
                raise
            except BaseException as e:  # anyio wraps transport failures in exception groups
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                error = one_line(innermost(e))
                if isinstance(innermost(e), TimeoutError) and not str(innermost(e)):
                    error = (f"no answer to the MCP handshake and tools/list within "
                             f"start_timeout_s={self.cfg.start_timeout_s:g}")
            if self._stop.is_set():
                return
            if self.listing is None:  # never came up: start() reports it
                self.start_error = error
                self._settled.set()
                return
            if self.restarts >= self.cfg.max_restarts:
                self.down = (f"MCP server {self.cfg.name} is down ({error}) after "
                             f"{self.restarts} restarts (config field {self.field}.max_restarts)")
                logger.error("%s; its calls are env_errors from now on", self.down)
                self._settled.set()
                return
            self.restarts += 1
            logger.warning("MCP server %s: %s; %s it (%d of at most %d)", self.cfg.name, error,
                           "restarting" if self.cfg.command else "reconnecting",
                           self.restarts, self.cfg.max_restarts)
            with contextlib.suppress(asyncio.TimeoutError):  # a backoff, cut short by stop
                await asyncio.wait_for(self._stop.wait(), min(0.25 * 2 ** (self.restarts - 1), 5))

    def _transport(self, log: Any) -> Any:
        if self.cfg.command:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            argv = self.cfg.command
            return stdio_client(StdioServerParameters(
                command=argv[0], args=argv[1:], env=self.cfg.env or None, cwd=self.cfg.cwd),
                errlog=log)
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(self.cfg.url)

    async def _connect_once(self) -> None:
        """One connection's life: until a call finds it broken, the transport fails, or stop."""
        import anyio
        from mcp import ClientSession

        async with contextlib.AsyncExitStack() as stack:
            log = stack.enter_context(self.log_path.open("a")) if self.cfg.command else None
            read, write = await stack.enter_async_context(self._transport(log))
            session = await stack.enter_async_context(ClientSession(read, write))
            with anyio.fail_after(self.cfg.start_timeout_s):
                await session.initialize()
                listing = await _list_tools(session)
            if self.listing is not None and listing != self.listing:
                logger.warning("MCP server %s lists other tools after its restart; the run "
                               "keeps the first listing (the one the policy is shown)",
                               self.cfg.name)
            self.listing = self.listing or listing
            self.session, self.generation = session, self.generation + 1
            self._broken.clear()
            self._settled.set()
            try:
                waits = [asyncio.ensure_future(e.wait()) for e in (self._broken, self._stop)]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
            finally:
                self.session = None
                self._settled.clear()

    async def call(self, tool: str, arguments: dict[str, Any]) -> Any:
        """The server's CallToolResult; raises ToolError (the policy's fault) or another
        exception (the environment's)."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, INVALID_PARAMS

        if self.session is None and self.down is None:
            try:  # restarting: wait for it (the executor's timeout still bounds the call)
                await asyncio.wait_for(self._settled.wait(), self.cfg.start_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"MCP server {self.cfg.name} did not come back within "
                                   f"{self.cfg.start_timeout_s:g}s") from None
        session, generation = self.session, self.generation
        if session is None:
            raise McpConnectionError(self.down or f"MCP server {self.cfg.name} is not running")
        try:
            return await session.call_tool(tool, arguments)
        except MCPError as e:
            if e.code == INVALID_PARAMS:  # the server rejects the policy's arguments
                raise ToolError(e.message) from e
            if e.code == CONNECTION_CLOSED:
                self._break(generation)
                raise McpConnectionError(f"MCP server {self.cfg.name}: connection closed "
                                         "(the server died?)") from e
            raise RuntimeError(f"MCP server {self.cfg.name}: error {e.code}: {e.message}") from e
        except Exception as e:
            import anyio

            if isinstance(innermost(e), (anyio.ClosedResourceError, anyio.BrokenResourceError,
                                         anyio.EndOfStream)):
                self._break(generation)
                raise McpConnectionError(f"MCP server {self.cfg.name}: {one_line(e)}") from e
            raise

    def _break(self, generation: int) -> None:
        if generation == self.generation:
            self._broken.set()

    async def stop(self) -> None:
        """End the connection; one still starting (or restarting) is cancelled rather than
        waited for. Either way the SDK's transport stops the server as it unwinds."""
        self._stop.set()
        if self.task is None:
            return
        if self.session is None:
            self.task.cancel()
        done, _ = await asyncio.wait([self.task], timeout=CLOSE_TIMEOUT_S)
        if not done:
            self.task.cancel()
            await asyncio.wait([self.task], timeout=5)


async def _list_tools(session: Any) -> list[dict[str, Any]]:
    """Every tool the server lists (all pages), as plain JSON: name, description, schema."""
    from mcp_types import PaginatedRequestParams

    tools: list[dict[str, Any]] = []
    cursor = None
    for _ in range(LIST_PAGES):
        page = await session.list_tools(
            params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += [{"name": t.name, "description": t.description or "",
                   "input_schema": t.input_schema} for t in page.tools]
        cursor = page.next_cursor
        if not cursor:
            return tools
    raise RuntimeError(f"tools/list still had more pages after {LIST_PAGES}")


class McpHub:
    """The run's MCP servers on an event loop in a thread of their own. `close` stops every
    server (also registered with atexit, in case the owner never calls it)."""

    def __init__(self, configs: list[McpServerConfig], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tiller-mcp",
                                       daemon=True)
        self.thread.start()
        self.servers: dict[str, McpServer] = {}
        self.closed = False
        atexit.register(self.close)
        try:
            self._on_loop(self._make(configs, log_dir), timeout=10)
            limit = max(c.start_timeout_s for c in configs) + 10
            self._on_loop(self._start_all(), timeout=limit)
        except BaseException:  # a server that did not start, or Ctrl-C: none may stay
            self.close()
            raise

    async def _make(self, configs: list[McpServerConfig], log_dir: Path) -> None:
        for i, c in enumerate(configs):  # the events inside belong to this loop
            self.servers[c.name] = McpServer(c, f"env.tools.mcp[{i}] ({c.name})",
                                             log_dir / f"{c.name}.stderr.log")

    async def _start_all(self) -> None:
        await asyncio.gather(*(s.start() for s in self.servers.values()))

    async def _stop_all(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()))

    def _on_loop(self, coro: Any, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RuntimeError(f"the MCP servers did not start within {timeout:g}s") from None

    async def call(self, server: str, tool: str, arguments: dict[str, Any]) -> Any:
        """`server`'s answer to a call, awaited on the caller's loop (cancelling it cancels
        the request on the hub's loop)."""
        future = asyncio.run_coroutine_threadsafe(
            self.servers[server].call(tool, arguments), self.loop)
        return await asyncio.wrap_future(future)

    def restarts(self) -> dict[str, int]:
        return {name: s.restarts for name, s in self.servers.items()}

    def close(self) -> None:
        """Stop every server and the hub's thread; bounded, and safe to call twice."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        try:
            future = asyncio.run_coroutine_threadsafe(self._stop_all(), self.loop)
            future.result(CLOSE_TIMEOUT_S + 5)
        except Exception as e:  # logged: a server process may be left behind
            logger.error("stopping the MCP servers failed: %s", one_line(e))
        finally:
            left = [n for n, s in self.servers.items() if s.task and not s.task.done()]
            if left:
                logger.error("MCP servers %s did not stop within %gs", left, CLOSE_TIMEOUT_S)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()


def listing_key(server: str) -> str:
    return f"mcp/{server}/tools"


class McpTools:
    """`env.tools.mcp` for one run: the servers (none in replay mode) and their tools."""

    def __init__(self, configs: list[McpServerConfig], run_dir: Path,
                 store: ReplayStore | None = None):
        require_package("mcp", "mcp", "env.tools.mcp")
        names = [c.name for c in configs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"config field env.tools.mcp: server name(s) {', '.join(twice)} "
                              "appear twice; give each server its own name")
        self.replay = store is not None and store.mode == "replay"
        self.truncated = {c.name: 0 for c in configs}  # answers cut to max_result_chars
        self.hub = None if self.replay else McpHub(configs, run_dir / "mcp")
        try:
            listings = {c.name: self._listing(c, i, store) for i, c in enumerate(configs)}
            self.tools = self._tools(configs, listings)
        except BaseException:
            self.close()
            raise

    def _listing(self, cfg: McpServerConfig, index: int, store: ReplayStore | None
                 ) -> list[dict[str, Any]]:
        if self.hub is not None:
            listing = self.hub.servers[cfg.name].listing
            assert listing is not None  # started
            if store is not None:  # a replay of this recording needs no server
                store.put_meta(listing_key(cfg.name), json.dumps(listing))
            return listing
        assert store is not None
        recorded = store.get_meta(listing_key(cfg.name))
        if recorded is None:
            raise ConfigError(f"config field env.tools.mcp[{index}] ({cfg.name}): the replay "
                              f"file {str(store.path)!r} holds no tool listing of this server "
                              "(record one with env.tools.replay.mode=record)")
        return json.loads(recorded)

    def _tools(self, configs: list[McpServerConfig],
               listings: dict[str, list[dict[str, Any]]]) -> list[Tool]:
        tools: dict[str, Tool] = {}
        owner: dict[str, str] = {}
        for i, c in enumerate(configs):
            for spec in listings[c.name]:
                name = spec["name"]
                if name in tools:
                    raise ConfigError(f"config field env.tools.mcp[{i}] ({c.name}): its tool "
                                      f"{name!r} has the name of a tool of server "
                                      f"{owner[name]!r}; tool names must be unique")
                try:
                    tools[name] = schema_tool(name, spec["description"], spec["input_schema"],
                                              self._caller(c, i, name),
                                              env_errors=(Exception,))
                except SchemaError as e:
                    raise ConfigError(f"config field env.tools.mcp[{i}] ({c.name}): {e}") from e
                owner[name] = c.name
        return list(tools.values())

    def _caller(self, cfg: McpServerConfig, index: int, tool: str) -> Any:
        """The tool function: the server's answer as text (at most `max_result_chars`, a
        longer one cut and counted), or a ToolError when the server says the call failed.
        Every other exception is an env_error (`env_errors`)."""
        server, field = cfg.name, f"env.tools.mcp[{index}] ({cfg.name})"

        async def call(**arguments: Any) -> str:
            if self.hub is None:  # replay serves every call; reaching here is a bug
                raise RuntimeError(f"MCP server {server} is not running (replay mode)")
            result = await self.hub.call(server, tool, arguments)
            text = result_text(result)
            cut = capped(text, cfg.max_result_chars, field)
            if cut is not None:
                self.truncated[server] += 1
                text = cut
            if result.is_error:
                raise ToolError(text)
            return text

        call.__name__ = tool
        return call

    def restarts(self) -> dict[str, int]:
        return self.hub.restarts() if self.hub is not None else {}

    def close(self) -> None:
        if self.hub is not None:
            self.hub.close()
