"""The embedded engine's worker thread and its safe points.

One thread runs the engine's iterations while there is work. Everything that changes the
engine from outside (a weight update, an abort, pause, resume, a cache flush, scoring) is a
control operation: queued from any thread, applied by the worker between two iterations (a
safe point, never inside a forward), and waited for with a timeout that names it. Answers for
asyncio callers go through an outbox, delivered once per event loop per iteration: one wake-up
of each loop instead of one per finished request.

Closing the engine does not wait for the forward in progress to end: the work calls
`_check_closing` between the layers of each forward (the embedded engine's forward pre-hooks),
which raises `Closing` in the worker once the engine is closing, so a close waits at most one
layer. A prefill of thousands of tokens through a 135M model on a loaded CPU takes minutes, and
a Ctrl-C or SIGTERM during an evaluation waited that long (issue 23).

`Worker` is this machinery; `EmbeddedEngine` subclasses it and supplies the work
(`_has_work`, `_iterate`, `_fail_iteration`, `_abandon_iteration`, `_idle`) and the `counters`
it keeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class Closing(BaseException):
    """Raised in the worker between two layers of a forward once the engine is closing: the
    forward stops there. A BaseException, so the handlers of a failed prefill or iteration
    (which fail requests and let the engine go on) do not take it."""


@dataclass
class ControlOp:
    """A control operation waiting for the worker's next safe point."""

    apply: Callable[[], object]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Worker:
    """A worker thread that iterates while there is work and applies control operations only
    between iterations; it exits after a second idle and is restarted by the next call."""

    counters: dict[str, int]  # the subclass's; the outbox counts "undelivered" answers in it

    def __init__(self, control_timeout_s: float):
        self.control_timeout_s = control_timeout_s
        self._cond = threading.Condition()
        self._controls: deque[ControlOp] = deque()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._paused = False
        self.busy_s = 0.0
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}

    # ----- what the subclass supplies -----

    def _has_work(self) -> bool:
        """Whether an iteration has something to do (called holding `_cond`)."""
        raise NotImplementedError

    def _iterate(self) -> None:
        """One iteration of the work."""
        raise NotImplementedError

    def _fail_iteration(self, error: Exception) -> None:
        """An iteration raised `error`: hand it to whoever was waiting on that work."""
        raise NotImplementedError

    def _abandon_iteration(self) -> None:
        """`close` stopped an iteration between two layers: fail the requests it was running
        (those still queued are failed by close)."""

    def _idle(self) -> None:
        """The worker exits after a second idle: free what only a running worker needs."""

    # ----- the machinery -----

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was closed")

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="tiller-engine",
                                            daemon=True)
            self._worker.start()

    def _control(self, fn: Callable[[], object], what: str, timeout_s: float | None = None):
        timeout = self.control_timeout_s if timeout_s is None else timeout_s
        op = ControlOp(fn)
        with self._cond:
            self._check_open()
            self._controls.append(op)
            self._ensure_worker()
            self._cond.notify()
        try:
            return op.done.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if op.done.cancel():  # never applied later, behind the caller's back
                raise TimeoutError(f"embedded engine: {what} was not applied within "
                                   f"{timeout:g}s (no safe point between decode steps was "
                                   "reached); it is cancelled") from None
            # it started just as the wait ran out: give it a moment to finish, never forever
            # (an operation stuck inside a forward would otherwise hang its caller)
            try:
                return op.done.result(timeout=min(timeout, 5.0))
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"embedded engine: {what} started but did not finish within "
                                   f"{timeout + min(timeout, 5.0):g}s") from None

    def _check_closing(self) -> None:
        """Called by the work between two layers of a forward: in the worker of an engine that
        is closing, stop the forward (`Closing`)."""
        if self._closed and threading.current_thread() is self._worker:
            raise Closing()

    def _loop(self) -> None:
        """The worker: iterate while there is work; exit after a second idle (it is restarted
        by the next call), so an engine nobody closes leaves no thread behind; exit within a
        layer of a forward when the engine closes."""
        try:
            self._serve()
        except Closing:
            logger.info("engine: closed during a forward; it stopped between two layers")
            self._abandon_iteration()
            self._flush_outbox()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._controls and not (
                        self._has_work() and not self._paused):
                    if not self._cond.wait(timeout=1.0) and not self._controls and not (
                            self._has_work()):
                        self._worker = None
                        self._idle()
                        return
                if self._closed:
                    return
                controls = list(self._controls)
                self._controls.clear()
            for i, op in enumerate(controls):
                if not op.done.set_running_or_notify_cancel():
                    continue  # its caller timed out and cancelled it
                try:
                    op.done.set_result(op.apply())
                except Exception as e:  # the caller gets the error; the engine goes on
                    op.done.set_exception(e)
                except Closing:  # a scoring or recompute forward stopped by close: it and
                    closed = RuntimeError("the engine was closed")  # the ops not run yet
                    op.done.set_exception(closed)
                    for rest in controls[i + 1:]:
                        if rest.done.set_running_or_notify_cancel():
                            rest.done.set_exception(closed)
                    raise
            self._flush_outbox()
            if self._paused:
                continue
            try:
                t0 = time.perf_counter()
                self._iterate()
                self.busy_s += time.perf_counter() - t0
            except Exception as e:
                self._fail_iteration(e)
            self._flush_outbox()

    def _stop_worker(self) -> None:
        """Close: the worker exits at its next safe point; waits at most control_timeout_s."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=self.control_timeout_s)
            if worker.is_alive():
                logger.error("engine: the worker thread did not stop within %gs "
                             "(control_timeout_s) of close: it is stuck in a forward or a "
                             "control call; its requests fail now", self.control_timeout_s)

    def _fail_controls(self, error: BaseException) -> None:
        """Every queued control operation fails with `error` (the engine closed)."""
        with self._cond:
            controls = list(self._controls)
            self._controls.clear()
        for op in controls:
            if op.done.set_running_or_notify_cancel():
                op.done.set_exception(error)

    def _post(self, loop: asyncio.AbstractEventLoop, item: tuple) -> None:
        """Queue (future, result, error) for an asyncio caller on `loop`."""
        self._outbox.setdefault(loop, []).append(item)

    def _flush_outbox(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # the caller's event loop has closed: nobody is waiting
                self.counters["undelivered"] += len(items)
                logger.warning("engine: %d answers for a closed event loop were dropped",
                               len(items))


def deliver(items: list) -> None:
    """On the caller's event loop: answer each still-awaited future."""
    for future, result, error in items:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
