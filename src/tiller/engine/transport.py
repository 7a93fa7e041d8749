"""The HTTP pieces under the router of `tiller.engine.http`: a server's state as the router
sees it, which answers say a server is dead, the capped read of an answer, and a call on every
server at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from tiller.errors import RunError

T = TypeVar("T")

DOWN_STATUSES = (502, 503, 504)  # a proxy in front of a dead server, overload, a gateway timeout
# the largest answer read: a turn of 131072 tokens at ~200 bytes each (id, logprob, text) is 26
# MB, a parity probe's prompt logprobs (at most 4096 tokens) under 1 MB; a server sending more is
# broken, and its answer is not held in memory whole
MAX_ANSWER_BYTES = 32 << 20


@dataclass
class Server:
    """One server at `url` and what the router knows of it."""

    url: str
    inflight: int = 0  # generate requests sent and not yet answered
    completed: int = 0  # generate requests it answered
    down: bool = False
    last_error: str = ""
    version: int = 0  # the weight version it confirmed at the last push
    previous: int = 0  # the one before (an answer finished just before the push may carry it)
    pending: int | None = None  # the version being pushed to it now
    boot_id: str | None = None  # what it reported at the last push (None: it reports none)
    dead_at: int = -1  # the newest version pushed or being pushed when this engine marked it
    #                    down: only a later push that finds it up brings it back (`follower`)


async def read_capped(r: httpx.Response, what: str) -> bytes:
    """The body of the streamed answer `r`, read until `MAX_ANSWER_BYTES` and no further (a
    RunError naming `what` past it)."""
    chunks, size = [], 0
    async for chunk in r.aiter_bytes():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise RunError(f"{what} answered more than {MAX_ANSWER_BYTES} bytes (the largest "
                           f"answer tiller reads, transport.MAX_ANSWER_BYTES): not read "
                           f"further")
        chunks.append(chunk)
    return b"".join(chunks)


async def each_server(servers: list[Server], act: Callable[[Server], Awaitable[T]]
                      ) -> list[T]:
    """`act(server)` on every server at once; every call ends before any error is raised (a
    weight push is never left half-applied, nor its folder removed under a server still
    loading it), then the first in server order is. Else the results, in server order."""
    results = await asyncio.gather(*(act(s) for s in servers), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return list(results)
