"""The HTTP backend: the engine protocol over servers (`tiller serve`, SGLang, vLLM), each
spoken to in its dialect (`tiller.engine.wire`; vLLM's engine overrides the request hooks).

Token in, token out: a request carries the prompt's token ids and asks for each sampled
token's logprob; the answer's `output_ids` are appended as they are and must equal the ids in
`output_token_logprobs` (a server that re-tokenised or mixed up requests is a loud error).

The router (docs/engine.md, "Routing"): sessions stick to their first server, new ones go to
the least loaded; a request failing on a dead or restarted server (another version or boot id)
marks it down and is retried elsewhere (counted, logged); a 500 while /health answers fails
the request; a down server is probed at the next push; all down: one line naming each.
All HTTP runs on one event loop in a thread the engine owns (`generate` may be awaited from
any event loop, control calls come from any thread); each waits at most `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tiller.engine.api import Generation, SamplingParams
from tiller.engine.delta import DeltaUpdate
from tiller.engine.parts import PartsUpdate
from tiller.engine.servers import Launched
from tiller.engine.transport import DOWN_STATUSES, Server, each_server, read_capped
from tiller.engine.updates import WeightUpdate, empty_version_folder
from tiller.engine.wire import (
    TILLER,
    ServerDown,
    TillerDialect,
    check_logprob_kind,
    check_model_info,
    error_text,
    parse_generation,
    short,
)
from tiller.errors import ConfigError, RunError
from tiller.files import folder_below, remove_tree

logger = logging.getLogger(__name__)
T = TypeVar("T")
Update = WeightUpdate | DeltaUpdate | PartsUpdate  # what a push writes and sends

MAX_SESSIONS = 1 << 16  # sticky sessions remembered (LRU); a forgotten one is just placed again
HEALTH_TIMEOUT_S = 5.0  # a down server that cannot answer /health within this stays down
KEEPALIVE_S = 2.0  # idle connections kept this long: under the servers' keep-alive timeout
EXIT_WAIT_S = 3.0  # every server down: how long the started ones get to show their exit


class HttpEngine:
    """`Engine` over the servers at `urls`; weight versions go through `weights_dir`, a folder
    every server can read (below each `tiller serve --weights-root`), inside `root` (the run
    folder, whose folders down to each version's are never links; default `weights_dir`)."""

    def __init__(self, urls: list[str], *, weights_dir: str | Path, api_key: str | None = None,
                 request_timeout_s: float = 300.0, max_retries: int = 2,
                 root: str | Path | None = None, managed: Launched | None = None,
                 dialect: TillerDialect = TILLER):
        self.managed = managed  # the servers tiller started, stopped at close
        # what to do when every server is down, where `_all_down`'s default (restart them or
        # fix engine.urls) is wrong: a follower's servers that the run's engine started
        self.down_hint: str | None = None
        self.exit_waited = False  # `_all_down` gave the started servers `EXIT_WAIT_S` once
        if not urls:
            raise ConfigError("config field engine.urls: list at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.dialect, self.takes_deltas = dialect, dialect.takes_deltas
        self.weights_dir = Path(weights_dir)
        self.root = self.weights_dir if root is None else Path(root)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.version = 0
        # the servers' context length, from check_servers; None: prompts go out unchecked
        self.max_context: int | None = None
        self.counters = dict.fromkeys(
            ("requests", "retries", "failed_requests", "session_moves", "servers_marked_down",
             "stale_answers", "weight_pushes", "push_skipped_down", "servers_rejoined",
             "control_skipped_down", "weight_removal_failures", "health_retries"), 0)
        self._sessions: OrderedDict[str, Server] = OrderedDict()
        self._rids: dict[str, Server] = {}  # request id -> the server it is running on
        self._written: list[Path] = []  # weight folders this engine wrote (only these are removed)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no connection cap: 128 concurrent episodes must not queue behind httpx's default 100.
        # Idle connections are dropped after 2 s, before the server drops them (uvicorn: 5 s,
        # httpx's default is also 5 s): a request sent on a connection the server is closing
        # fails with ReadError and would mark a healthy server down.
        self._client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(request_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=KEEPALIVE_S))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="tiller-http-engine")
        self._thread.start()

    # ------------------------------------------------------------------ the loop thread
    def _call(self, coro: Coroutine[Any, Any, T], what: str, timeout: float | None = None) -> T:
        """Run `coro` on the engine's loop and wait for it from this (non-loop) thread."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        wait = timeout if timeout is not None else self.request_timeout_s + 10.0
        try:
            return future.result(wait)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise RunError(f"http engine: {what} took more than {wait:.0f} s "
                           f"(engine.request_timeout_s={self.request_timeout_s})") from e

    async def _post(self, server: Server, path: str, body: dict | None = None,
                    timeout: float | None = None, missing_ok: bool = False) -> Any:
        """POST (GET without a body) and decode the JSON answer (at most `MAX_ANSWER_BYTES`);
        ServerDown for what says the server is dead (no answer, 502/503/504, a 500 with
        /health not answering), RunError (one line) for a 4xx, a 500 of a healthy server or an
        answer past the cap, which no other server would answer differently (`missing_ok`:
        None for a 404)."""
        request = self._client.build_request(
            "GET" if body is None else "POST", server.url + path, json=body,
            **({} if timeout is None else {"timeout": timeout}))
        budget = self.request_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + budget  # the /health checks after a 500 included
        try:
            r = await self._client.send(request, stream=True)
            try:
                data = await read_capped(r, f"server {server.url}: {path}")
            finally:
                await r.aclose()
        except httpx.TimeoutException as e:
            wait = self.request_timeout_s if timeout is None else timeout
            raise ServerDown(f"{path}: no answer within {wait:g} s ({type(e).__name__})") from e
        except httpx.TransportError as e:  # connect/read errors
            raise ServerDown(f"{type(e).__name__}: {e}".rstrip(": ")) from e
        text = data.decode("utf-8", "replace")
        if r.status_code in DOWN_STATUSES:
            raise ServerDown(f"HTTP {r.status_code}: {short(text)}")
        if r.status_code == 500 and path != "/health":
            # the request broke something, or the server is breaking down? A second try on a
            # transport error (counted, logged): after an exception uvicorn closes the
            # connection its 500 came on, and httpx may hand /health that connection
            # (ReadError, server healthy). Both within the request's own time budget.
            for attempt in (1, 2):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerDown(f"HTTP 500: {error_text(text)}; then no time left "
                                     f"for /health within the request's {budget:g} s")
                try:
                    await self._post(server, "/health", timeout=min(HEALTH_TIMEOUT_S, left))
                    break
                except (ServerDown, RunError) as e:
                    cause = e.__cause__  # a timeout is not retried
                    if attempt == 2 or not isinstance(cause, httpx.TransportError) \
                            or isinstance(cause, httpx.TimeoutException):
                        raise ServerDown(f"HTTP 500: {error_text(text)}; then /health: {e}") from e
                    self.counters["health_retries"] += 1
                    logger.warning("server %s: %s answered HTTP 500 and /health then failed "
                                   "(%s); trying /health once more", server.url, path, e)
        if r.status_code == 404 and missing_ok:
            return None
        if r.status_code >= 400:
            hint = " (set engine.api_key or TILLER_API_KEY)" if r.status_code == 401 else ""
            raise RunError(f"server {server.url}: {path} answered HTTP {r.status_code}: "
                           f"{error_text(text)}{hint}")
        try:
            return json.loads(data)
        except ValueError:
            return text
        except RecursionError as e:
            raise RunError(f"server {server.url}: {path} answered JSON nested past the "
                           f"parser's depth: {short(text)}") from e

    def _mark_down(self, server: Server, error: str) -> None:
        if not server.down:
            server.dead_at = max(server.version, server.pending or 0, self.version)
            self.counters["servers_marked_down"] += 1
            logger.warning("engine server %s is down (%s); it gets no new requests until the "
                           "next weight push finds it healthy", server.url, error)
        server.down, server.last_error = True, error

    def _all_down(self) -> RunError:
        """Every server is down: one line with each one's last error and, for the servers
        tiller started, the exit code and last log line of each that exited. The first time,
        they get up to `EXIT_WAIT_S` to show their exit (a killed server's connections fail
        just before its exit can be seen); later calls (the other requests in flight, on the
        event loop) do not wait again."""
        states = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
        wait_s, self.exit_waited = (0.0 if self.exit_waited else EXIT_WAIT_S), True
        exited = self.managed.exited(wait_s) if self.managed is not None else []
        hint = ("; ".join(exited) if exited else self.down_hint or
                f"restart them ({self.dialect.name}) or fix engine.urls")
        return RunError(f"every {self.dialect.name} server is down ({states}): {hint}")

    # ------------------------------------------------------------------ routing
    def _pick(self, session_id: str | None) -> Server:
        """The session's server if it is up, else the up server with the fewest requests in
        flight (the session then sticks to it)."""
        if session_id is not None and session_id in self._sessions:
            server = self._sessions[session_id]
            if not server.down:
                self._sessions.move_to_end(session_id)
                return server
            self.counters["session_moves"] += 1
        up = [s for s in self.servers if not s.down]
        if not up:
            raise self._all_down()
        server = min(up, key=lambda s: s.inflight)  # min keeps the first of equals
        if session_id is not None:
            self._sessions[session_id] = server
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return server

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None,
                       request_id: str | None = None) -> Generation:
        future = asyncio.run_coroutine_threadsafe(
            self._generate(list(prompt_ids), params, seed, session_id,
                           request_id or uuid.uuid4().hex), self._loop)
        return await asyncio.wrap_future(future)  # cancelling this cancels the request

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, seed: int,
                        session_id: str | None, rid: str) -> Generation:
        max_new = params.max_new_tokens
        if self.max_context is not None:  # as the embedded engine: the context bounds a turn
            if len(prompt_ids) >= self.max_context:
                return Generation([], [], "length", self.version, prompt_tokens=len(prompt_ids))
            max_new = min(max_new, self.max_context - len(prompt_ids))
        path, body = self._request(prompt_ids, params, max_new, seed, rid, session_id)
        self.counters["requests"] += 1
        for attempt in range(self.max_retries + 1):
            try:
                server = self._pick(session_id)
            except RunError:  # every server was already down
                self.counters["failed_requests"] += 1
                raise
            self._rids[rid] = server
            server.inflight += 1
            started = self.version  # the oldest weights that can have sampled this answer
            try:
                answer = await self._post(server, path, body)
                gen = self._parse(server, answer, len(prompt_ids), started, params)
            except RunError as e:  # a 4xx, a 500 about this request, a malformed answer
                self.counters["failed_requests"] += 1
                logger.warning("engine request %s failed on %s, not retried: %s", rid,
                               server.url, e)
                raise
            except ServerDown as e:
                self._mark_down(server, str(e))
                if all(s.down for s in self.servers):  # no other server to retry on
                    self.counters["failed_requests"] += 1
                    raise self._all_down() from e
                if attempt == self.max_retries:
                    self.counters["failed_requests"] += 1
                    raise RunError(f"engine request {rid}: failed on {attempt + 1} server(s) "
                                   f"(engine.max_retries={self.max_retries}); last: "
                                   f"{server.url}: {e}") from e
                self.counters["retries"] += 1
                logger.warning("engine request %s failed on %s (%s); retry %d of %d on another "
                               "server", rid, server.url, e, attempt + 1, self.max_retries)
                continue
            finally:
                server.inflight -= 1
                self._rids.pop(rid, None)
            server.completed += 1
            return gen
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _request(self, prompt_ids: list[int], params: SamplingParams, max_new: int, seed: int,
                 rid: str, session_id: str | None) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of a generate request: /generate in the dialect's words."""
        return "/generate", self.dialect.generate_body(prompt_ids, params, max_new, seed, rid,
                                                       session_id)

    def _parse(self, server: Server, answer: Any, prompt_tokens: int, started: int,
               params: SamplingParams) -> Generation:
        """The checked `Generation` of a generate answer (`wire.parse_generation` in the
        dialect), from the weights pushed to `server` (`_check_fresh`)."""
        gen = parse_generation(server.url, answer, prompt_tokens, started, self.dialect)
        check_logprob_kind(server.url, answer, params)
        self._check_fresh(server, answer, gen)
        return gen

    def _check_fresh(self, server: Server, answer: dict, gen: Generation) -> None:
        """ServerDown when the answer was sampled from weights other than those pushed to
        `server`: another boot id (it restarted) or a version neither confirmed nor being
        pushed nor the one before (an answer that finished just before a push applied carries
        that one, and the trajectory records it as its version)."""
        boot = answer["meta_info"].get("boot_id")
        if server.boot_id is not None and boot != server.boot_id:
            problem = f"boot id {boot!r}, not {server.boot_id!r} as at the last weight push"
        elif gen.version not in (server.version, server.pending, server.previous):
            problem = f"weight version {gen.version}, not the pushed {server.version}"
        else:
            return
        self.counters["stale_answers"] += 1
        raise ServerDown(f"restarted: answered with {problem}; down until the next weight push")

    # ------------------------------------------------------------------ control
    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        """Ask the server running `request_id` to end it (its `generate` then returns the partial
        output, finish_reason "abort"); False when no server is running it. Waits at most
        `timeout_s` (default `request_timeout_s`) for the answer."""
        server = self._rids.get(request_id)
        if server is None:
            return False
        answer = self._call(self._post(server, "/abort_request", {"rid": request_id},
                                       timeout=timeout_s, missing_ok=True),
                            f"abort of {request_id} on {server.url}",
                            None if timeout_s is None else timeout_s + 1.0)
        if answer is None:  # 404: it finished before the abort arrived
            return False
        return not isinstance(answer, dict) or int(answer.get("aborted", 1)) > 0

    def _on_each(self, servers: list[Server], act: Callable[[Server], Awaitable[T]], what: str,
                 timeout: float | None = None) -> list[T]:
        """`act(server)` on each of `servers` at once, on the engine's loop, and their results
        in server order (`each_server`); `what` names the operation if it runs past `timeout`."""
        return self._call(each_server(servers, act), what, timeout)

    def _on_up(self, act: Callable[[Server], Awaitable[Any]], what: str,
               timeout: float | None = None) -> list[tuple[Server, Any]]:
        """`act(server)` on every up server at once (`_on_each`), and (server, result) of
        each that answered: `act` returns `_SKIPPED` for one it found dead now. None up, or
        none answering, is a RunError."""
        up = [s for s in self.servers if not s.down]
        if not up:
            raise self._all_down()
        results = self._on_each(up, act, f"{what} on {len(up)} server(s)", timeout)
        answered = [(s, r) for s, r in zip(up, results, strict=True) if r is not _SKIPPED]
        if not answered:
            raise self._all_down()
        return answered

    async def _control(self, server: Server, path: str, body: dict, *,
                       timeout: float | None = None, doing: str = "") -> Any:
        """POST a control call to `server`: its answer, or `_SKIPPED` when the server is dead
        now (marked down with `doing` before the error, logged, counted in
        `control_skipped_down`, like at a weight push). A 4xx or a 500 of a healthy server is
        a RunError naming it."""
        try:
            return await self._post(server, path, body, timeout=timeout)
        except ServerDown as e:
            self._mark_down(server, f"{doing}{e}")
            self.counters["control_skipped_down"] += 1
            logger.warning("%s: server %s is down (%s); skipped", path, server.url, e)
            return _SKIPPED

    def _fan_out(self, path: str, body: dict | None = None) -> list[Any]:
        """The answers of every up server to a POST to each at once (`_control`); none: RunError."""
        act = partial(self._control, path=path, body=body if body is not None else {})
        return [answer for _, answer in self._on_up(act, path)]

    def pause(self) -> None:
        self._fan_out("/pause_generation", self.dialect.pause_body())

    def resume(self) -> None:
        self._fan_out("/continue_generation")

    def flush_cache(self) -> int:
        """Entries dropped over every server (what each reports as `entries_dropped`)."""
        return sum(int(a.get("entries_dropped", 0)) if isinstance(a, dict) else 0
                   for a in self._fan_out("/flush_cache"))

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out["servers_up"] = float(sum(not s.down for s in self.servers))
        out["inflight"] = float(sum(s.inflight for s in self.servers))
        return out

    # ------------------------------------------------------------------ start-up and weights
    def check_servers(self, vocab_size: int, max_context: int, dtype: str | None = None) -> None:
        """Every server answers its model info (`dialect.model_info_path`) with the trainer's
        vocabulary size, context length and (when given) the engine dtype (`model.dtype`), where
        it reports them; otherwise one ConfigError naming the server (the first in server
        order, whichever answered first: the same misconfiguration gives the same message on
        every start)."""
        check = partial(self._check_model, vocab_size=vocab_size, max_context=max_context,
                        dtype=dtype)
        self._on_each(self.servers, check, f"{self.dialect.model_info_path} on every server")
        self.max_context = max_context

    async def _check_model(self, server: Server, *, vocab_size: int, max_context: int,
                           dtype: str | None) -> None:
        try:
            info = await self._post(server, self.dialect.model_info_path,
                                    timeout=HEALTH_TIMEOUT_S)
        except ServerDown as e:
            raise ConfigError(f"config field engine.urls: server {server.url} is not "
                              f"reachable ({e}); start it ({self.dialect.name})") from e
        check_model_info(info, server.url, self.dialect, vocab_size=vocab_size,
                         max_context=max_context, dtype=dtype)

    def update_weights(self, update: Update, *, in_flight: str = "continue",
                       timeout_s: float | None = None) -> int:
        """Write `update` to `<weights_dir>/v<version>` (emptied first: `new_weights_folder`)
        and have every server load it (all at once, each waited for at most `timeout_s`,
        default `request_timeout_s`), each echoing success and the version. A delta goes only
        to the servers up now (a server that was down missed versions; it rejoins at the next
        full update). A server that answers otherwise (an error, 4xx, another version) is a
        RunError naming it: it holds weights the trainer does not know. A dead one (no answer,
        timeout, 502/503/504, a 500 and no /health) is marked down and skipped
        (`push_skipped_down`), like a server already down that does not answer /health; one
        that does loads the weights and rejoins. No server taking them is a RunError, and the
        folder (per-rank parts are written there first) is removed. Older versions this
        engine wrote are removed after."""
        if in_flight not in ("continue", "abort"):
            raise ValueError(f"in_flight must be 'continue' or 'abort', got {in_flight!r}")
        if isinstance(update, DeltaUpdate | PartsUpdate) and not self.takes_deltas:
            raise RunError(f"weight push v{update.version}: {self.dialect.name} loads full "
                           "checkpoints only; set weight_sync.mode: full, shards: gathered")
        # per-rank parts: the ranks wrote them into the folder `new_weights_folder` gave
        folder = (self.weights_folder(update.version) if isinstance(update, PartsUpdate)
                  else self.new_weights_folder(update.version))
        fresh = folder not in self._written  # a failed push removes only a folder it wrote
        self._save(update, folder)
        body = self.dialect.push_body(str(folder), update.version, in_flight == "abort")
        push = partial(self._push, update=update, body=body, timeout_s=timeout_s)
        try:
            wait = None if timeout_s is None else timeout_s + 10.0
            pushed = self._on_each(self.servers, push,
                                   f"weight push v{update.version} to every server", wait)
            if not any(pushed):
                raise self._all_down()
        except BaseException:
            if fresh:  # no server holds it as the trainer's current weights
                self.counters["weight_removal_failures"] += remove_tree(folder)
            raise
        self.counters["weight_pushes"] += 1
        for old in self._written:
            if old != folder:  # each entry left behind is logged and counted
                self.counters["weight_removal_failures"] += remove_tree(old)
        self._written = [folder]
        self.version = update.version
        return update.version

    def weights_folder(self, version: int) -> Path:  # made; links on the way refused
        return folder_below(self.root, self.weights_dir / f"v{version}").resolve()

    def new_weights_folder(self, version: int) -> Path:
        """`weights_folder(version)` emptied (`updates.empty_version_folder`: files this engine
        did not write are logged), so a server reads only this push's files; a RunError when
        it cannot be emptied."""
        folder = self.weights_folder(version)
        failures = empty_version_folder(folder, version, ours=folder in self._written)
        if failures:
            self.counters["weight_removal_failures"] += failures
            raise RunError(f"weight push v{version}: could not empty {folder} ({failures} "
                           f"entries not removed, each logged): a server would read what is "
                           f"left there as part of the version")
        return self.weights_folder(version)

    def _save(self, update: Update, folder: Path) -> None:
        update.save(folder)  # where the servers load it from

    async def _push(self, server: Server, *, update: Update, body: dict,
                    timeout_s: float | None) -> bool:
        """Have `server` load the saved `update` (`body`): True when it did, False when it was
        skipped as down (`update_weights`)."""
        if server.down and not await self._may_rejoin(server, update):
            return False
        server.pending = update.version
        try:
            answer = await self._post(server, "/update_weights_from_disk", body,
                                      timeout=timeout_s)
            done = isinstance(answer, dict) and answer.get("success") is True
            echoed = answer.get("weight_version") if done else None
            if done and self.dialect.reads_back_version:  # the answer carries no version
                info = await self._post(server, self.dialect.model_info_path,
                                        timeout=timeout_s)
                echoed = info.get("weight_version") if isinstance(info, dict) else None
        except ServerDown as e:  # it died: like a dead server, it gets no requests
            self._mark_down(server, f"weight update v{update.version}: {e}")
            self.counters["push_skipped_down"] += 1
            logger.warning("weight push v%d: server %s failed (%s); marked down, skipped",
                           update.version, server.url, e)
            return False
        finally:
            server.pending = None
        if not (done and self.dialect.pushed_version(echoed) == update.version):
            read = (f", then {self.dialect.model_info_path} weight_version {echoed!r}"
                    if done and self.dialect.reads_back_version else "")
            what = ("it does not hold the trainer's weights" if done else "the push failed "
                    "(the server's answer says how; its weights may have changed)")
            raise RunError(f"weight push v{update.version}: server {server.url} answered "
                           f"{short(answer)}{read} (expected success and weight_version "
                           f"{update.version}): {what}")
        server.previous, server.version = server.version, update.version
        server.boot_id = answer.get("boot_id")
        if server.down:
            server.down = False
            self.counters["servers_rejoined"] += 1
            logger.warning("weight push v%d: server %s is back and rejoins", update.version,
                           server.url)
        return True

    async def _may_rejoin(self, server: Server, update: Update) -> bool:
        """A down server takes a full update when it answers /health now and, if tiller started
        it (`managed`: it is never restarted, so its port may now be another process's), its
        model info reports the boot id it had; otherwise (no answer, an error status, another
        boot id) it stays down and is skipped (logged, counted in `push_skipped_down`). A
        server at engine.urls may come back under another boot id: its operator restarted
        it."""
        if getattr(update, "base_version", None) is not None:  # a delta, or parts with one
            self.counters["push_skipped_down"] += 1
            logger.warning("weight push v%d (a delta): server %s is down; skipped until a "
                           "full update", update.version, server.url)
            return False
        try:
            await self._post(server, "/health", timeout=HEALTH_TIMEOUT_S)
            if self.managed is not None and server.boot_id is not None:
                path = self.dialect.model_info_path
                info = await self._post(server, path, timeout=HEALTH_TIMEOUT_S)
                boot = info.get("boot_id") if isinstance(info, dict) else None
                if boot != server.boot_id:
                    raise RunError(f"{path} answered boot id {boot!r}, not {server.boot_id!r}: "
                                   f"another process has its port (tiller does not restart "
                                   f"the servers it started)")
        except (ServerDown, RunError) as e:
            server.last_error = str(e)
            self.counters["push_skipped_down"] += 1
            logger.warning("weight push v%d: server %s is still down (%s); skipped",
                           update.version, server.url, e)
            return False
        return True

    def score_servers(self, token_ids: list[int], *, timeout_s: float | None = None
                      ) -> dict[str, list[float]]:
        """Every up server's scores of `token_ids` (`dialect.score_request`: log p(token_i |
        tokens_<i), i >= 1), by URL,
        each from the version last pushed to it (else a RunError naming both). A server found
        dead now (no answer within `timeout_s`, default `request_timeout_s`, a connection
        error, 502/503/504) is marked down and skipped, logged and counted in
        `control_skipped_down`, as at a weight push; none answering is a RunError."""
        score = partial(self._score_on, token_ids=token_ids, timeout_s=timeout_s)
        wait = None if timeout_s is None else timeout_s + 10.0
        return {s.url: got for s, got in self._on_up(score, "scoring the parity probe", wait)}

    async def _score_on(self, server: Server, *, token_ids: list[int],
                        timeout_s: float | None) -> list[float] | object:
        path, body = self.dialect.score_request(token_ids)
        answer = await self._control(server, path, body, timeout=timeout_s,
                                     doing="scoring the parity probe: ")
        if answer is _SKIPPED:
            return _SKIPPED
        logprobs, version = self.dialect.parse_score(server.url, answer, token_ids)
        if version != server.version:
            raise RunError(f"server {server.url}: scored the parity probe under weight version "
                           f"{version!r}, not the pushed {server.version}")
        return logprobs

    def score(self, token_ids: list[int], *, timeout_s: float | None = None) -> list[float]:
        """The first up server's scores of `token_ids` (see `score_servers`)."""
        return next(iter(self.score_servers(token_ids, timeout_s=timeout_s).values()))

    def close(self) -> None:
        """Close the connections and stop the loop thread, then the managed servers; requests
        still waiting fail."""
        try:
            self._close_client()
        finally:
            if self.managed is not None:
                self.managed.close()

    def _close_client(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._client.aclose(), "closing the HTTP client", timeout=10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            if self._thread.is_alive():
                raise RunError("http engine: its loop thread did not stop within 10 s")
            self._loop.close()


_SKIPPED = object()  # what a control call to a server found down returns
