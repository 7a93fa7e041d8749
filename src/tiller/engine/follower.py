"""Engines that follow another's weight pushes: under `cluster.backend: ray` each rollout worker
generates on the run's engine servers through an `HttpEngine` of its own (sessions sticky,
requests on a dead server retried on another, counted), while the run's engine (in the run's
process) pushes every weight version to those servers.

A follower pushes nothing; it takes the pusher's view of the servers (`router_state` ->
`adopt`) twice per push: before it, the version being pushed is marked pending on every server
(an answer sampled under it is fresh), and after it, each server's pushed version, the one
before, its boot id and whether the push found it down. So a follower checks every answer's
weight version and boot id as the pusher would (`HttpEngine._check_fresh`), and a server it
marked down stays down until a push that started after it saw it die finds it up (the pusher's
state from a push that reached the server before it died says "up": not taken); then it rejoins,
counted in `servers_rejoined`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from tiller.config import Config
from tiller.engine.http import HttpEngine
from tiller.errors import RunError

log = logging.getLogger(__name__)

ADOPT_TIMEOUT_S = 30.0  # for the engine's loop to take a pushed state (it runs no long work)


def router_state(engine: HttpEngine, pending: int | None = None) -> dict[str, Any]:
    """What a follower of `engine` needs (`adopt`): its version and each server's pushed
    versions, boot id and down mark; `pending`: a version about to be pushed."""
    return {"version": engine.version, "pending": pending, "servers": [
        {"url": s.url, "version": s.version, "previous": s.previous, "boot_id": s.boot_id,
         "down": s.down, "last_error": s.last_error} for s in engine.servers]}


def adopt(engine: HttpEngine, state: dict[str, Any]) -> None:
    """Take the pusher's `router_state`: with `pending`, only mark that version as being pushed
    to every server; else each server's versions, boot id and down mark, and the engine's
    version (a server this engine marked down is up again only when a push newer than the
    version it was marked down at, `Server.dead_at`, found it up: counted in
    `servers_rejoined`). Applied on the engine's own loop, where answers are checked
    (`_check_fresh`), so no check sees a server's versions half taken."""

    async def apply() -> None:
        _apply(engine, state)

    engine._call(apply(), "taking the pusher's server state", ADOPT_TIMEOUT_S)


def _apply(engine: HttpEngine, state: dict[str, Any]) -> None:
    theirs = state["servers"]
    if [s["url"] for s in theirs] != [s.url for s in engine.servers]:
        raise RunError(f"http engine: the pusher's servers {[s['url'] for s in theirs]} are "
                       f"not this follower's {[s.url for s in engine.servers]}")
    for mine, t in zip(engine.servers, theirs, strict=True):
        if state["pending"] is not None:
            mine.pending = state["pending"]
            continue
        mine.version, mine.previous, mine.boot_id = t["version"], t["previous"], t["boot_id"]
        mine.pending = None
        if mine.down and not t["down"]:
            if t["version"] <= mine.dead_at:  # that push reached it before this engine saw
                log.info("engine server %s stays down: the pusher's last push (v%d) found it "
                         "up before this engine saw it die (at v%d)", mine.url, t["version"],
                         mine.dead_at)
                continue
            engine.counters["servers_rejoined"] += 1
        mine.down, mine.last_error = t["down"], t["last_error"]
    if state["pending"] is None:
        engine.version = state["version"]


@dataclass(frozen=True)
class Followed:
    """What a follower needs of the run's servers: their URLs, the context length the run's
    engine checked, and the API key it sends (`run_api_key`; a SecretStr: its repr hides it)."""

    urls: list[str]
    max_context: int
    api_key: SecretStr | None = None


def run_api_key(cfg: Config) -> SecretStr | None:
    """The key the run's engine sends (engine.api_key, else this process's TILLER_API_KEY:
    `factory.connect`): resolved in the run's process and handed to each follower, whose own
    environment (a Ray worker's: the raylet's) is not the run's."""
    e = cfg.engine
    if e.api_key:
        return e.api_key
    key = os.environ.get("TILLER_API_KEY")
    return SecretStr(key) if key else None


def follow_servers(cfg: Config, servers: Followed) -> HttpEngine:
    """An engine over the run's servers (engine.backend http, vllm or sglang) that generates,
    aborts and counts, and pushes nothing: prompts bounded by `servers.max_context` as the
    run's engine checked it, with the run's API key."""
    from tiller.engine.sglang import SglangDialect
    from tiller.engine.vllm import VllmEngine
    from tiller.engine.wire import TILLER

    e = cfg.engine
    # weights_dir: never written (a follower pushes nothing)
    common: dict[str, Any] = dict(weights_dir=Path(e.weights_dir or "weights"),
                                  request_timeout_s=e.request_timeout_s,
                                  max_retries=e.max_retries)
    engine: HttpEngine
    key = servers.api_key.get_secret_value() if servers.api_key else None
    if e.backend == "vllm":
        engine = VllmEngine(servers.urls, shapes={}, api_key=key, **common)
    else:
        engine = HttpEngine(servers.urls, api_key=key, **common,
                            dialect=SglangDialect() if e.backend == "sglang" else TILLER)
    engine.max_context = servers.max_context
    if cfg.managed_servers:  # the run's engine started them: no engine.urls to fix
        engine.down_hint = ("tiller started them and does not restart them: each server's "
                            "log is in the run folder's servers/")
    return engine
