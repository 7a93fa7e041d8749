"""Blocking calls off the event loop, each in a daemon thread of its own.

Sync tools and the sandbox used to share asyncio's default executor with everything else in the
process: a timed-out call's thread stayed in the pool, `asyncio.run` waited for it on exit (a
tool that never returns hung the phase), and calls queued behind each other's threads, so a
tool's timeout could fire while it was still waiting for a thread. Here each call gets its own
daemon thread: no queueing, and nothing waits for a thread the caller gave up on. Python cannot
kill a thread, so such a thread runs on in the background; each is counted
(`abandoned_threads`) and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_abandoned = 0
_lock = threading.Lock()


def abandoned_threads() -> int:
    """Calls given up on (timed out or cancelled) while their thread was still running."""
    return _abandoned


async def run_in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a new daemon thread, awaited like `asyncio.to_thread` (the
    context variables go along)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():  # the caller may have been cancelled meanwhile
            setter(value)

    def work() -> None:
        try:
            result = context.run(fn, *args, **kwargs)
        except StopIteration as e:  # a future cannot hold StopIteration: it would never settle
            error = RuntimeError(f"{getattr(fn, '__name__', 'call')} raised StopIteration")
            error.__cause__ = e
            outcome: tuple[Callable[[Any], None], Any] = (future.set_exception, error)
        except BaseException as e:  # handed to the awaiting caller, which re-raises it
            outcome = (future.set_exception, e)
        else:
            outcome = (future.set_result, result)
        # a closed loop: the caller gave up long ago (counted then)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    thread = threading.Thread(target=work, name=f"tiller-{getattr(fn, '__name__', 'call')}",
                              daemon=True)
    thread.start()
    try:
        return await future
    except asyncio.CancelledError:
        if thread.is_alive():
            global _abandoned
            with _lock:
                _abandoned += 1
            logger.warning("tiller tools: abandoned a running %s thread (%d so far); it runs "
                           "on in the background", thread.name, _abandoned)
        raise
