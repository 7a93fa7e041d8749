"""The connection side of tiller's HTTP servers (`tiller serve`, the agent gateway, `tiller view`):
uvicorn with a read deadline per request and a cap on open connections, so connections that
never finish their request (slowloris) cannot hold the server's file descriptors.

uvicorn has no timeout on reading a request: its keep-alive timer runs only between requests
and is cancelled by any byte received (uvicorn issue #157, `--timeout-request-start`, is
open), so a connection that sends its headers slowly, or nothing, stays open forever; and its
`limit_concurrency` answers 503 only once a whole request has arrived. `GuardedH11` subclasses
uvicorn's h11 protocol (uvicorn's `http=` option takes a protocol class) and adds:

- a read deadline: a request must arrive whole (request line, headers, body) within
  `read_timeout_s` of its first byte, and a new connection must send one within
  `read_timeout_s` of opening; otherwise the connection is closed. Idle time between requests
  stays uvicorn's keep-alive timeout (`keep_alive_s`);
- a connection cap: a connection opened while `max_connections` are open takes the place of
  the connection that has been idle longest between requests (keep-alive), closed as nginx
  does; when none is idle (every one is mid-request or awaiting its first), it is answered 503
  and closed at once, before anything is read. So the process never runs out of file
  descriptors (the open-file limit is raised to fit the cap, or the start refused), and
  connections kept alive after one cheap request (`GET /health` needs no key) cannot lock new
  clients out;
- counted refusals: each is counted (`ConnectionGuard.counts`) and logged at most once per
  `log_interval_s` per kind, with the number since the last line.

The h11 protocol is used even where httptools is installed: the deadline reads h11's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tiller.errors import ConfigError

logger = logging.getLogger(__name__)

FD_RESERVE = 256  # open files kept free beside the connections (model files, threads, logs)
_BODY = json.dumps({"error": {"message": "too many open connections; retry later",
                              "type": "server_error", "code": 503}}).encode()
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may hold of a server before it has been answered."""

    read_timeout_s: float = 10.0  # a whole request (line, headers, body) from its first byte
    keep_alive_s: int = 5  # idle time between requests (uvicorn's timeout_keep_alive)
    max_connections: int = 512  # open at once; one more replaces the longest-idle or gets 503
    log_interval_s: float = 10.0  # at most one log line per kind of refusal per interval

    def __post_init__(self) -> None:
        if not self.read_timeout_s > 0 or self.keep_alive_s < 1 or self.max_connections < 1:
            raise ConfigError(f"connection limits need read_timeout_s > 0, keep_alive_s >= 1 "
                              f"and max_connections >= 1; got {self}")


class ConnectionGuard:
    """The limits of one server, its refusal counts and their rate-limited log lines."""

    MESSAGES = {
        "connections_refused": "refused {n} connection(s): {limit} were open, none idle "
                               "(max_connections={limit}; answered 503 and closed)",
        "read_timeouts": "closed {n} connection(s) that sent no whole request within "
                         "{timeout:g} s (read_timeout_s)",
        "idle_closed": "closed {n} idle keep-alive connection(s) to make room for new ones "
                       "(max_connections={limit} were open)",
    }

    def __init__(self, limits: ConnectionLimits, name: str):
        self.limits, self.name = limits, name
        self.counts: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._quiet_until: dict[str, float] = {}  # kind -> loop time of its next log line

    def refused(self, kind: str, loop: asyncio.AbstractEventLoop) -> None:
        """Count one refusal of `kind`; log it now, or in one line at the interval's end."""
        self.counts[kind] += 1
        self._unlogged[kind] += 1
        now = loop.time()
        if kind not in self._quiet_until or now >= self._quiet_until[kind]:
            self._log(kind, now)
        elif self._unlogged[kind] == 1:  # the first held back: flushed when the interval ends
            loop.call_at(self._quiet_until[kind], self._log, kind, None)

    def _log(self, kind: str, now: float | None) -> None:
        n = self._unlogged.pop(kind, 0)
        if n:
            lim = self.limits
            logger.warning("%s: %s (%d in all; logged at most once per %g s)", self.name,
                           self.MESSAGES[kind].format(n=n, limit=lim.max_connections,
                                                      timeout=lim.read_timeout_s),
                           self.counts[kind], lim.log_interval_s)
        if now is not None:
            self._quiet_until[kind] = now + self.limits.log_interval_s

    def flush(self) -> None:
        """Log what is counted and not yet logged (when the server stops)."""
        for kind in list(self._unlogged):
            self._log(kind, None)

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol class, bound to this guard."""
        return type("GuardedH11", (GuardedH11,), {"guard": self})


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the read deadline and the connection cap (module doc)."""

    guard: ConnectionGuard
    _deadline: asyncio.TimerHandle | None = None
    _idle_since = 0.0  # loop time of its last response (when it is idle between requests)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guard.limits.max_connections:
            idle = self._longest_idle()
            if idle is None:
                self.guard.refused("connections_refused", self.loop)
                transport.write(REFUSED)
                transport.close()
                return
            self.guard.refused("idle_closed", self.loop)
            idle.timeout_keep_alive_handler()  # what its keep-alive timer would do later
        self._arm()  # a new connection gets read_timeout_s to send its first request

    def _longest_idle(self) -> GuardedH11 | None:
        """The open connection idle between requests (uvicorn's keep-alive timer runs only
        then) for the longest time, or None."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11)
                and c.timeout_keep_alive_task is not None and not c.transport.is_closing()]
        return min(idle, key=lambda c: c._idle_since, default=None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()
        self._update()

    def _update(self) -> None:
        """Armed while a request is arriving (a partial head is buffered, or the body is still
        coming), off otherwise: while the app works on a whole request, and between requests
        (uvicorn's keep-alive timer then runs)."""
        their = self.conn.their_state
        arriving = their is h11.SEND_BODY or (their is h11.IDLE
                                             and bool(self.conn.trailing_data[0]))
        if arriving:
            if self._deadline is None:  # counted from the request's first byte
                self._arm()
        elif their is not h11.IDLE or self.cycle is not None:
            self._disarm()  # (an idle new connection stays armed from its opening)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.guard.limits.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.guard.refused("read_timeouts", self.loop)
            self.transport.close()


def ensure_file_limit(max_connections: int) -> None:
    """Raise this process's soft open-file limit to fit `max_connections` plus FD_RESERVE (up
    to the hard limit); ConfigError when even the hard limit is lower."""
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ConfigError(f"max_connections={max_connections} needs {need} open files "
                              f"({FD_RESERVE} kept for the rest of the process), but the hard "
                              f"limit is {hard} (ulimit -Hn): lower max_connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def server(app: Any, limits: ConnectionLimits, *, name: str, log_level: str = "warning",
           **uvicorn_options: Any) -> tuple[uvicorn.Server, ConnectionGuard]:
    """A uvicorn server for `app` with `limits` (and the guard that counts its refusals);
    `uvicorn_options` are uvicorn.Config's (host, port, lifespan, ...). Websocket upgrades
    are off: no tiller route speaks it."""
    ensure_file_limit(limits.max_connections)
    guard = ConnectionGuard(limits, name)
    config = uvicorn.Config(app, http=guard.protocol(), ws="none", log_level=log_level,
                            timeout_keep_alive=limits.keep_alive_s, **uvicorn_options)
    return uvicorn.Server(config), guard



def run(server: uvicorn.Server, guard: ConnectionGuard) -> None:
    """Serve until SIGINT/SIGTERM, as `uvicorn.run` does (exit code 3 when it never started:
    the port taken, say; uvicorn has logged why); then log the refusals not yet logged."""
    try:
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
            server.run()
    finally:
        guard.flush()
    if not server.started:
        raise SystemExit(3)
