"""The embedded generation engine: continuous batching over a Hugging Face causal LM.

Episodes call `await engine.generate(prompt_ids, params, seed, session_id=...)` independently.
A worker thread keeps one running batch and loops over iterations:

1. control: apply what arrived since the last iteration (a weight update, an abort, pause,
   resume, a cache flush): the only place these happen, so never inside a forward;
2. admit: waiting requests join the batch (up to `max_batch_size` rows and
   `max_prefill_tokens` padded tokens per iteration). Each prefills only what the KV cache
   does not already hold (`kv_cache.PrefixCache`: the session's previous turn or a shared
   prefix), identical prompts are prefilled once, and only the last position's logits are
   computed;
3. decode: one forward of [rows, 1] for every running row, rows with different sampling
   parameters together (they are applied per row);
4. sample: one batched step (`sampling.sample`, per-request seeds) and one device-to-host copy
   of the tokens, logprobs and finite flags, the only host sync of the iteration;
5. retire: a row that sampled a stop token or reached its budget leaves at once, its answer is
   delivered and its KV stored for the session's next turn.

A weight update with in_flight="continue" recomputes the KV of every running row under the new
weights before the next decode (`_recompute_kv`), so each token is sampled by exactly the
version it records: that version's weights computed its logits and every key and value it
attended to.

Row i of the batch sits in slot i of preallocated per-layer KV buffers, its KV in columns
[0, length): a decode step writes each row's new key and value in place at its own length, with
explicit position ids and a 4-D mask the engine builds, so every row sees exactly its own
sequence. A prefill runs on its own cache (a cached prefix, padding, the new tokens) and its
real columns are then copied into free slots. Logprobs are those of the sampled tokens under
softmax(logits / T); see `tiller.rollout.sampling` for how top-k / top-p relate to them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from tiller.rollout.delta import DeltaUpdate
from tiller.rollout.kv_cache import KV, PrefixCache
from tiller.rollout.sampling import sample
from tiller.rollout.weight_sync import WeightSyncError, WeightUpdate

logger = logging.getLogger(__name__)

InFlight = Literal["continue", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # required: see __post_init__
    # the logprob reported per token: of the distribution sampled from (renormalised over the
    # top-k / top-p kept set), or of softmax(logits / T) before truncation (rollout.sampling)
    logprobs: Literal["sampled", "untruncated"] = "sampled"

    def __post_init__(self) -> None:
        # Without a stop token every turn runs to max_new_tokens and the episode is truncated:
        # a forgotten argument would look like a policy that never stops talking.
        if not self.stop_token_ids:
            raise ValueError("SamplingParams.stop_token_ids is empty, so no turn could end: pass "
                             "tiller.rollout.chat.stop_token_ids(tokenizer, "
                             "model.generation_config)")
        def whole(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        bad = [f"{name}={value!r} (expected {rule})" for name, value, ok, rule in (
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, whole(self.top_k) and self.top_k >= 0, "an int >= 0, 0 = off"),
            ("max_new_tokens", self.max_new_tokens,
             whole(self.max_new_tokens) and self.max_new_tokens >= 1, "an int >= 1"),
            ("stop_token_ids", self.stop_token_ids,
             all(whole(t) for t in self.stop_token_ids), "ints"),
            ("logprobs", self.logprobs, self.logprobs in ("sampled", "untruncated"),
             "'sampled' or 'untruncated'"),
        ) if not ok]
        if bad:
            raise ValueError("SamplingParams: " + "; ".join(bad))


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled), "length" or "abort"
    version: int  # the weight version when the request finished
    # per token, the version whose weights computed its logits and all the KV it attended to
    versions: tuple[int, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of prefilled


class Engine(Protocol):
    """What the agent loop and the trainer need from an engine, in-process or over HTTP."""

    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None
                       ) -> Generation: ...

    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool: ...

    def update_weights(self, update: WeightUpdate | DeltaUpdate, *,
                       in_flight: InFlight = "continue", timeout_s: float | None = None
                       ) -> int: ...

    def score(self, token_ids: list[int], *, timeout_s: float | None = None) -> list[float]:
        """log p(token_i | tokens_<i) at temperature 1 for i >= 1, under the engine's own
        weights (the parity check)."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    session_id: str | None
    request_id: str | None
    future: concurrent.futures.Future | asyncio.Future = field(repr=False)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)  # of an asyncio
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0
    cache_scope: str | None = None  # KV is reused only between requests of the same scope
    budget: int = 0
    kv_version: int = -1  # the weights that computed its KV; stored only if still current
    kv_len: int = 0  # tokens whose KV is in its slot (the prompt, then each one decoded)


@dataclass(frozen=True)
class _Prefilled:
    """What a prefill forward gives, per sequence (identical ones share a row's values)."""

    logits: torch.Tensor  # [rows, vocab], of each sequence's last token
    kv: KV  # per layer, [rows, heads, columns, dim], real columns where `mask` is 1
    mask: torch.Tensor  # [rows, columns]
    cached: list[int]  # tokens served by the prefix cache, per sequence
    ran: int  # tokens run through the model (identical sequences once)


@dataclass
class _Control:
    apply: Callable[[], object]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class EmbeddedEngine:
    """An in-process continuous-batching engine over a Hugging Face causal LM."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, *, max_batch_size: int = 128,
                 cache_bytes: int = 1 << 30, max_prefill_tokens: int = 16384,
                 control_timeout_s: float = 600.0):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.control_timeout_s = control_timeout_s
        self.max_context = getattr(model.config, "max_position_embeddings", 4096)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.version = 0
        self.cache = PrefixCache(cache_bytes)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = "logits_to_keep" in params
        attn = getattr(model.config, "_attn_implementation", None)
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"the embedded engine passes its own 4-D attention masks, which "
                             f"needs attn_implementation 'sdpa' or 'eager', not {attn!r}: load "
                             "the model with one of them (or serve it with SGLang or vLLM)")
        self._bool_mask = attn == "sdpa"
        layers = DynamicCache(config=model.config).layers
        if not all(type(layer) is DynamicLayer for layer in layers):
            raise ValueError(f"the embedded engine needs full-attention layers; "
                             f"{type(model).__name__} has sliding-window or other cache "
                             "layers: serve it with SGLang or vLLM (engine.backend: http)")
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._controls: deque[_Control] = deque()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._paused = False
        # the running batch: row i sits in slot i of every layer's KV buffer, its KV in columns
        # [0, kv_len); `_len` holds those lengths (= the next token's position) on the device
        self._rows: list[_Request] = []
        self._buf: KV = []  # per layer (keys, values), [row capacity, heads, columns, dim]
        self._len = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._row_params: dict[str, torch.Tensor] = {}
        self._admitting: list[_Request] = []  # taken from the queue, not yet in the batch
        self._max_top_k, self._any_top_p = 0, False
        self.counters = {name: 0 for name in (
            "requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "generated_tokens",
            "decode_steps", "decoded_row_steps", "prefill_calls",
            "aborted", "cancelled", "undelivered", "weight_updates", "recomputed_tokens",
            "failed_batches", "failed_requests")}
        self.busy_s = 0.0
        self.max_rows = 0
        # answers for asyncio callers, delivered once per loop per iteration: one wake-up of
        # each event loop instead of one per finished request
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._bursts: dict[asyncio.AbstractEventLoop, list[_Request]] = {}

    # ----- the API (any thread) -----

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None,
                       cache_scope: str | None = None) -> Generation:
        """One turn. `cache_scope`: the request reuses, and leaves, KV only within this scope
        (`tiller serve` gives each api key its own)."""
        self._check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()  # cancelling the await cancels the request
        request = _Request(list(prompt_ids), params, seed & (2**63 - 1), session_id,
                           request_id, future, loop, cache_scope=cache_scope)
        # Requests made in the same turn of the event loop reach the worker together, so a
        # burst (a GRPO group's first turns) is admitted, and its identical prompts prefilled,
        # at once.
        burst = self._bursts.setdefault(loop, [])
        if not burst:
            loop.call_soon(self._enqueue_burst, loop)
        burst.append(request)
        return await future

    def _enqueue_burst(self, loop: asyncio.AbstractEventLoop) -> None:
        self._enqueue(self._bursts.pop(loop, []))

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
               session_id: str | None = None, request_id: str | None = None
               ) -> concurrent.futures.Future:
        """Queue a request from any thread; the future resolves to its `Generation`.
        Cancelling the future ends the request (it leaves the batch at the next iteration)
        and counts as done at once for `concurrent.futures.wait` and `as_completed`."""
        self._check_prompt(prompt_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(self._on_done)
        self._check_open()
        self._enqueue([_Request(list(prompt_ids), params, seed & (2**63 - 1), session_id,
                                request_id, future)])
        return future

    def _on_done(self, future: concurrent.futures.Future) -> None:
        """A `submit` future's callback. `Future.cancel()` wakes only `result()` waiters: the
        waiters of `concurrent.futures.wait` and `as_completed` hear of a cancel when someone
        calls `set_running_or_notify_cancel` (an executor does, before it runs the work). The
        engine never marks a request running (so its caller can cancel it any time), so it
        calls that here, at the cancel, and wakes the worker to drop the request."""
        if future.cancelled():
            future.set_running_or_notify_cancel()
            with self._cond:
                self._cond.notify()

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        """A bad prompt fails its own caller here, not the batch it would have joined (on CUDA
        an out-of-vocabulary id is a device-side assert that breaks every later forward)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: the engine needs at least one token")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def _enqueue(self, requests: list[_Request]) -> None:
        """Queue `requests` for the worker; a prompt that fills the context is answered at
        once ("length", no tokens), and on a closed engine every request fails. Runs on the
        requests' event loop (or takes thread-safe futures), so it answers them directly."""
        queued = []
        for r in requests:
            if len(r.prompt_ids) >= self.max_context:
                _deliver([(r.future, Generation([], [], "length", self.version,
                                                prompt_tokens=len(r.prompt_ids)), None)])
            else:
                queued.append(r)
        with self._cond:
            closed = self._closed
            if not closed and queued:
                self._waiting.extend(queued)
                self._ensure_worker()
                self._cond.notify()
        if closed:
            _deliver([(r.future, None, RuntimeError("the engine was closed")) for r in queued])

    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        """End the request now (queued or running); its caller gets the partial output with
        finish_reason "abort". False when no such request is queued or running. Waits at
        most `timeout_s` (default `control_timeout_s`) for the safe point."""
        if request_id is None:
            raise ValueError("abort needs the request_id the request was made with")
        return bool(self._control(lambda: self._abort(lambda r: r.request_id == request_id),
                                  f"abort of request {request_id!r}", timeout_s))

    def update_weights(self, update: WeightUpdate | DeltaUpdate, *,
                       in_flight: InFlight = "continue", timeout_s: float | None = None) -> int:
        """Apply `update` between two decode steps and return the new version. Running requests
        go on under the new weights, their KV so far recomputed by them first (each token
        records the one version that computed it, see `_recompute_kv`) or, with
        in_flight="abort", end at once with their partial output. Stored KV is dropped: it was
        computed by the old weights. A delta applies only on top of its base version.
        An update applies whole or not at all: one that does not fit the model (any tensor's
        name, shape, dtype, or a delta's positions and values) raises `WeightSyncError` here,
        and one whose checksums do not match what the weights would become raises it at the
        safe point; both before a weight, a request or the cache is touched. Only a mismatch
        after writing (`WeightsInconsistent`: the weights are neither version, stop the run)
        leaves the version as it was with the weights changed.
        Waits at most `timeout_s` (default `control_timeout_s`) for the safe point."""
        if in_flight not in ("continue", "abort"):
            raise ValueError(f"in_flight must be 'continue' or 'abort', got {in_flight!r}")
        staged = update.stage(self.model)  # a bad update fails here, before the worker waits

        def apply() -> int:
            base = getattr(update, "base_version", None)
            if base is not None and base != self.version:
                raise WeightSyncError(f"delta update v{update.version} is against v{base}, but "
                                      f"the engine holds v{self.version}: send a full update")
            staged.verify()  # what the weights would become: refused here, nothing changed
            if in_flight == "abort":
                self._abort(lambda r: True, waiting=False)
            self.cache.flush()
            staged.write()
            self.version = update.version
            self.counters["weight_updates"] += 1
            self._recompute_kv()
            return self.version

        return self._control(apply, f"weight update v{update.version}", timeout_s)

    def score(self, token_ids: list[int], *, timeout_s: float | None = None) -> list[float]:
        """log p(token_i | tokens_<i) at temperature 1 for i >= 1, from one forward of the
        engine's own weights at a safe point (waits at most `timeout_s`, default
        `control_timeout_s`)."""
        self._check_prompt(token_ids)
        if len(token_ids) < 2:
            raise ValueError("score needs at least two tokens (the first has no prefix)")

        @torch.inference_mode()
        def run() -> list[float]:
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            return logp.tolist()

        return self._control(run, f"scoring {len(token_ids)} probe tokens", timeout_s)

    def pause(self) -> None:
        """Stop decoding after the current step; running rows keep their state and new
        requests queue until `resume`."""
        self._control(lambda: setattr(self, "_paused", True), "pause")

    def resume(self) -> None:
        self._control(lambda: setattr(self, "_paused", False), "resume")

    def flush_cache(self) -> int:
        """Drop the KV kept between turns and for shared prefixes; returns entries dropped."""
        return self._control(self.cache.flush, "cache flush")

    def stats(self) -> dict[str, float]:
        return {**self.counters, "busy_s": self.busy_s, "max_rows": self.max_rows,
                "cache_bytes": self.cache.bytes, "cache_entries": len(self.cache),
                "cache_hits": self.cache.hits, "cache_misses": self.cache.misses,
                "cache_evictions": self.cache.evictions, "version": self.version}

    def close(self) -> None:
        """Stop the worker; queued and running requests fail with RuntimeError."""
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
        self._fail_all(RuntimeError("the engine was closed"))

    # ----- the worker -----

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
        op = _Control(fn)
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

    def _loop(self) -> None:
        """The worker: iterate while there is work; exit after a second idle (it is restarted
        by the next call), so an engine nobody closes leaves no thread behind."""
        while True:
            with self._cond:
                while not self._closed and not self._controls and not (
                        (self._waiting or self._rows) and not self._paused):
                    if not self._cond.wait(timeout=1.0) and not self._controls and not (
                            self._waiting or self._rows):
                        self._worker = None
                        self._buf = []  # an idle engine holds no KV memory
                        return
                if self._closed:
                    return
                controls = list(self._controls)
                self._controls.clear()
            for op in controls:
                if not op.done.set_running_or_notify_cancel():
                    continue  # its caller timed out and cancelled it
                try:
                    op.done.set_result(op.apply())
                except Exception as e:  # the caller gets the error; the engine goes on
                    op.done.set_exception(e)
            self._flush_outbox()
            if self._paused:
                continue
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self._step()
                self.busy_s += time.perf_counter() - t0
            except Exception as e:  # hand the failure to every request of the batch
                logger.exception("engine iteration failed; its %d rows get the error",
                                 len(self._rows))
                self.counters["failed_batches"] += 1
                for r in {id(r): r for r in self._rows + self._admitting}.values():
                    self._resolve(r, error=e)
                self._reset_batch()
            self._flush_outbox()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = list(self._waiting) + self._rows
            self._waiting.clear()
            controls = list(self._controls)
            self._controls.clear()
        for r in pending:
            self._resolve(r, error=error)
        self._flush_outbox()
        for op in controls:
            if op.done.set_running_or_notify_cancel():
                op.done.set_exception(error)
        self._reset_batch()

    def _reset_batch(self) -> None:
        """Empty the batch and free the KV buffers (they are reallocated on demand)."""
        self._rows, self._buf = [], []
        self._len = self._len.new_zeros(0)
        self._last = self._last.new_zeros(0)

    def _step(self) -> None:
        self._drop_cancelled()
        new = self._admitting = self._take_admissions()
        logits = []
        if self._rows:
            logits.append(self._decode())
        if new:
            try:
                looked = [self.cache.lookup(r.prompt_ids, r.session_id, r.cache_scope)
                          for r in new]
                prefilled = self._prefill([r.prompt_ids for r in new], looked)
                self.counters["prefill_calls"] += 1
                self.counters["prefill_tokens"] += prefilled.ran
                width = max(len(r.prompt_ids) for r in new) + 1  # + the next decode's column
                self._ensure_capacity(len(self._rows) + len(new), width, like=prefilled.kv)
            except Exception as e:  # only the new requests fail; the running batch goes on
                logger.exception("engine: the prefill of %d new requests failed", len(new))
                self.counters["failed_requests"] += len(new)
                for r in new:
                    self._resolve(r, error=e)
            else:
                logits.append(self._admit(new, prefilled))
        if not logits:
            return
        rows = self._rows  # _admit appended the new rows after the running ones
        p = self._row_params
        steps = self._len - p["prompt_len"]  # each row's index of the token it samples
        logits = torch.cat(logits)
        tokens, lps = sample(logits, p["temperature"], p["top_k"], p["top_p"], p["seed"],
                             steps, max_top_k=self._max_top_k, any_top_p=self._any_top_p,
                             untruncated=p["untruncated"])
        finite = torch.isfinite(logits).all(-1) & torch.isfinite(lps)
        # the one host sync of the iteration: tokens, logprobs and the finite flags together
        packed = torch.stack([tokens.double(), lps.double(), finite.double()]).tolist()
        self._last, done = tokens, []
        for i, (r, token, lp, ok) in enumerate(zip(rows, *packed, strict=True)):
            if not ok:  # NaN/inf weights or activations: the request fails, loudly
                self.counters["failed_requests"] += 1
                self._resolve(r, error=RuntimeError(
                    f"the model's logits are not finite (NaN or inf) at weight version "
                    f"{self.version}, or temperature {r.params.temperature} overflows them"))
                for keys, values in self._buf:  # masked columns are read: they must be finite
                    keys[i].zero_()
                    values[i].zero_()
                done.append(i)
                continue
            token = int(token)
            r.out_ids.append(token)
            r.out_lp.append(lp)
            r.versions.append(self.version)
            if token in r.params.stop_token_ids:
                self._finish(i, "stop")
                done.append(i)
            elif len(r.out_ids) >= r.budget:
                self._finish(i, "length")
                done.append(i)
        self.counters["generated_tokens"] += len(rows)
        if done:
            self._remove_rows(done)

    def _drop_cancelled(self) -> None:
        """Requests whose caller went away (a cancelled episode): counted, never answered."""
        with self._cond:
            live = [r for r in self._waiting if not r.future.cancelled()]
            self.counters["cancelled"] += len(self._waiting) - len(live)
            self._waiting = deque(live)
        gone = [i for i, r in enumerate(self._rows) if r.future.cancelled()]
        if gone:
            self.counters["cancelled"] += len(gone)
            logger.info("engine: %d cancelled requests left the batch", len(gone))
            self._remove_rows(gone)

    def _take_admissions(self) -> list[_Request]:
        """Waiting requests, first come first served, while the batch has room and the
        padded prefill stays within max_prefill_tokens (one request always fits)."""
        new: list[_Request] = []
        with self._cond:
            while self._waiting and len(self._rows) + len(new) < self.max_batch_size:
                width = max(len(r.prompt_ids) for r in [*new, self._waiting[0]])
                if new and (len(new) + 1) * width > self.max_prefill_tokens:
                    break
                new.append(self._waiting.popleft())
        return new

    # ----- forward passes -----

    def _forward(self, ids: torch.Tensor, allowed: torch.Tensor, pos: torch.Tensor,
                 cache: DynamicCache, last_only: bool) -> torch.Tensor:
        """Logits of the last position of each row of `ids` [rows, q], run after `cache`.
        `allowed` [rows, 1, q, keys] says which keys each query sees. The engine builds this
        4-D mask itself, so the model uses it as given: HF's own mask builder would read the
        padding mask back from the device, a second host sync per step."""
        if self._bool_mask:
            attention = allowed
        else:  # eager attention adds the mask to the scores
            attention = torch.zeros(allowed.shape, dtype=self.model.dtype,
                                    device=allowed.device).masked_fill_(
                ~allowed, torch.finfo(self.model.dtype).min)
        kwargs = {self._cache_arg: cache}
        if last_only and self._keep_arg:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=pos,
                         use_cache=True, **kwargs)
        return out.logits[:, -1].float()

    def _decode(self) -> torch.Tensor:
        """One token for every running row: each writes its new KV column in place, at its own
        length, and attends to its columns [0, length]."""
        n = len(self._rows)
        width = max(r.kv_len for r in self._rows) + 1
        self._ensure_capacity(n, width)
        cols = torch.arange(width, device=self.device)
        allowed = (cols[None, :] <= self._len[:, None])[:, None, None, :]
        cache = _SlotCache(self._buf, n, width, self._len)
        logits = self._forward(self._last[:, None], allowed, self._len[:, None], cache,
                               last_only=False)
        self._len = self._len + 1
        for r in self._rows:
            r.kv_len += 1
        self.counters["decode_steps"] += 1
        self.counters["decoded_row_steps"] += n
        return logits

    def _prefill(self, seqs: list[list[int]], looked: list[tuple[int, KV | None]]
                 ) -> _Prefilled:
        """Run each token sequence after its cached prefix (`looked`: its length and KV, from
        the prefix cache; identical ones run once); changes nothing of the running batch."""
        groups: dict[tuple, int] = {}
        unique, index = [], []
        for seq, (c, kv) in zip(seqs, looked, strict=True):
            key = (tuple(seq), c)  # the same tokens' KV, whichever entry served it
            if key not in groups:
                groups[key] = len(unique)
                unique.append((seq, c, kv))
            index.append(groups[key])
        cmax = max(c for _, c, _ in unique)
        smax = max(len(seq) - c for seq, c, _ in unique)
        u = len(unique)
        ids = torch.full((u, smax), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((u, cmax + smax), dtype=torch.long)
        pos = torch.zeros((u, smax), dtype=torch.long)
        for j, (seq, c, _) in enumerate(unique):
            n = len(seq) - c
            ids[j, smax - n:] = torch.tensor(seq[c:])
            pos[j, smax - n:] = torch.arange(c, c + n)
            mask[j, cmax - c:cmax] = 1
            mask[j, cmax + smax - n:] = 1
        past: KV = []
        if cmax:  # each row's cached KV, right-aligned in a [u, heads, cmax, dim] block
            ref = next(kv for _, _, kv in unique if kv)
            for layer, (k_ref, _) in enumerate(ref):
                k = k_ref.new_zeros((u, k_ref.size(1), cmax, k_ref.size(3)))
                v = torch.zeros_like(k)
                for j, (_, c, kv) in enumerate(unique):
                    if kv:
                        k[j, :, cmax - c:] = kv[layer][0][0]
                        v[j, :, cmax - c:] = kv[layer][1][0]
                past.append((k, v))
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        width = cmax + smax
        col = torch.arange(width, device=self.device)
        query_col = (cmax + torch.arange(smax, device=self.device))[:, None]
        # causal over real columns; a padding query sees itself (a fully masked row is NaN)
        allowed = ((mask.bool()[:, None, None, :] & (col <= query_col))
                   | (col == query_col))
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in zip(cache.layers, past, strict=False):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        logits = self._forward(ids, allowed, pos, cache, last_only=True)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        sel = torch.tensor(index, device=self.device)
        if u < len(seqs):  # identical sequences share one prefill
            logits, mask = logits[sel], mask[sel]
            kv = [(k[sel], v[sel]) for k, v in kv]
        return _Prefilled(logits, kv, mask, [unique[j][1] for j in index],
                          sum(len(seq) - c for seq, c, _ in unique))

    def _write_slots(self, first: int, p: _Prefilled, width: int) -> None:
        """Copy each prefilled row's real KV columns, in order, into slots first, first + 1,
        ... (columns [0, width))."""
        u = p.mask.size(0)
        # stable sort of "is padding": each row's real columns first, in their order
        order = torch.argsort((p.mask == 0).to(torch.uint8), dim=1, stable=True)[:, :width]
        for (keys, values), (k, v) in zip(self._buf, p.kv, strict=True):
            idx = order[:, None, :, None].expand(u, k.size(1), width, k.size(3))
            keys[first:first + u, :, :width] = k.gather(2, idx)
            values[first:first + u, :, :width] = v.gather(2, idx)

    def _admit(self, new: list[_Request], p: _Prefilled) -> torch.Tensor:
        """Put the prefilled requests in the slots after the running rows; returns their
        logits."""
        lengths = [len(r.prompt_ids) for r in new]
        self._write_slots(len(self._rows), p, max(lengths))
        self._len = torch.cat([self._len, torch.tensor(lengths, device=self.device)])
        self._last = torch.cat([self._last, self._last.new_zeros(len(new))])  # the sampler's
        for r, c in zip(new, p.cached, strict=True):
            r.kv_len = len(r.prompt_ids)
            r.cached = c
            r.kv_version = self.version
            r.budget = min(r.params.max_new_tokens, self.max_context - len(r.prompt_ids))
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(r.prompt_ids)
            self.counters["cached_tokens"] += c
        self._rows = self._rows + new
        self.max_rows = max(self.max_rows, len(self._rows))
        self._set_row_params()
        return p.logits

    @torch.inference_mode()
    def _recompute_kv(self) -> None:
        """After a weight update that running rows continue through: run each row's tokens
        whose KV is in its slot (the prompt and every generated token but the last) through
        the new weights, and overwrite its slot with their KV. The row's next token is then
        sampled from the new version alone, whose weights computed its logits and every key
        and value it attends to, as its recorded version says. The cost is one prefill of
        the running rows (in chunks of at most max_prefill_tokens padded tokens, one row at
        least), what a resumed request (in_flight="abort") pays too. If it fails, the rows
        fail with the error, like a failed decode."""
        rows = self._rows
        try:
            start = 0
            while start < len(rows):
                end, width = start + 1, rows[start].kv_len
                while end < len(rows) and (end + 1 - start) * max(
                        width, rows[end].kv_len) <= self.max_prefill_tokens:
                    width = max(width, rows[end].kv_len)
                    end += 1
                seqs = [(r.prompt_ids + r.out_ids)[:r.kv_len] for r in rows[start:end]]
                p = self._prefill(seqs, [(0, None)] * len(seqs))
                self._write_slots(start, p, width)
                self.counters["recomputed_tokens"] += p.ran
                start = end
        except Exception as e:
            logger.exception("engine: recomputing the KV of %d running rows under weight "
                             "version %d failed; they get the error", len(rows), self.version)
            self.counters["failed_batches"] += 1
            for r in rows:
                self._resolve(r, error=e)
            self._reset_batch()
            return
        for r in rows:
            r.kv_version = self.version

    # ----- batch bookkeeping -----

    def _ensure_capacity(self, rows: int, columns: int, like: KV | None = None) -> None:
        """Grow the KV buffers (doubling, zero-filled: masked columns must be finite) to hold
        `rows` rows of `columns` columns, keeping the running rows' KV; `like` gives the
        layers' shapes when there is no buffer yet."""
        have_rows = self._buf[0][0].size(0) if self._buf else 0
        have_cols = self._buf[0][0].size(2) if self._buf else 0
        if rows <= have_rows and columns <= have_cols:
            return
        new_rows = have_rows if rows <= have_rows else min(self.max_batch_size,
                                                            max(rows, 2 * have_rows))
        new_cols = have_cols if columns <= have_cols else max(
            columns, min(self.max_context + 1, max(2 * have_cols, 64)))
        n, width = len(self._rows), max((r.kv_len for r in self._rows), default=0)
        grown = []
        for pair in self._buf or like:
            fresh = tuple(t.new_zeros((new_rows, t.size(1), new_cols, t.size(3))) for t in pair)
            if self._buf:
                for f, t in zip(fresh, pair, strict=True):
                    f[:n, :, :width] = t[:n, :, :width]
            grown.append(fresh)
        self._buf = grown

    @torch.inference_mode()  # also called from control ops, which run outside a step
    def _remove_rows(self, gone: list[int]) -> None:
        """Rows `gone` leave the batch at once. The last rows move into the freed slots (only
        their KV is copied), so the running rows stay in slots [0, rows)."""
        gone_set = set(gone)
        m = len(self._rows) - len(gone_set)
        holes = [i for i in sorted(gone_set) if i < m]
        movers = [i for i in range(m, len(self._rows)) if i not in gone_set]
        order = list(range(m))
        if holes:
            width = max(self._rows[i].kv_len for i in movers)
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for keys, values in self._buf:
                keys[dst, :, :width] = keys[src, :, :width]
                values[dst, :, :width] = values[src, :, :width]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        sel = torch.tensor(order, dtype=torch.long, device=self.device)
        self._rows = [self._rows[i] for i in order]
        self._len, self._last = self._len[sel], self._last[sel]
        self._set_row_params()

    def _set_row_params(self) -> None:
        rows, dev = self._rows, self.device
        self._row_params = {
            "temperature": torch.tensor([r.params.temperature for r in rows], device=dev),
            "top_k": torch.tensor([r.params.top_k for r in rows], device=dev),
            "top_p": torch.tensor([r.params.top_p for r in rows], device=dev),
            "seed": torch.tensor([r.seed for r in rows], dtype=torch.long, device=dev),
            "prompt_len": torch.tensor([len(r.prompt_ids) for r in rows], device=dev),
            "untruncated": torch.tensor([r.params.logprobs == "untruncated" for r in rows],
                                        dtype=torch.bool, device=dev),
        }
        self._max_top_k = max((r.params.top_k for r in rows), default=0)
        self._any_top_p = any(r.params.top_p < 1.0 for r in rows)

    def _finish(self, i: int, reason: str) -> None:
        r = self._rows[i]
        # KV computed by older weights is not kept: the next turn would reuse it
        if (reason != "abort" and self.cache.budget_bytes > 0
                and r.kv_version == self.version):
            # the KV of the prompt and every generated token but the last (never run)
            kv = [(k[i:i + 1, :, :r.kv_len].clone(), v[i:i + 1, :, :r.kv_len].clone())
                  for k, v in self._buf]
            self.cache.put(r.prompt_ids + r.out_ids[:-1], kv, r.session_id, r.cache_scope)
        self._answer(r, reason)

    def _answer(self, r: _Request, reason: str) -> None:
        self._resolve(r, Generation(r.out_ids, r.out_lp, reason, self.version,
                                    tuple(r.versions), prompt_tokens=len(r.prompt_ids),
                                    cached_tokens=r.cached))

    def _resolve(self, r: _Request, result: Generation | None = None,
                 error: BaseException | None = None) -> None:
        if r.loop is None:
            try:
                if error is None:
                    r.future.set_result(result)
                else:
                    r.future.set_exception(error)
            except concurrent.futures.InvalidStateError:  # cancelled by its caller meanwhile
                self.counters["cancelled"] += 1
        else:
            self._outbox.setdefault(r.loop, []).append((r.future, result, error))

    def _flush_outbox(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's event loop has closed: nobody is waiting
                self.counters["undelivered"] += len(items)
                logger.warning("engine: %d answers for a closed event loop were dropped",
                               len(items))

    def _abort(self, match: Callable[[_Request], bool], waiting: bool = True) -> int:
        """End the matching requests with finish_reason "abort" (partial output)."""
        n = 0
        if waiting:
            with self._cond:
                hit = [r for r in self._waiting if match(r)]
                self._waiting = deque(r for r in self._waiting if not match(r))
            for r in hit:
                self._answer(r, "abort")
            n += len(hit)
        hit = [i for i, r in enumerate(self._rows) if match(r)]
        aborted = [self._rows[i] for i in hit]
        if hit:
            self._remove_rows(hit)  # first: an answered request must not stay in the batch
        for r in aborted:
            self._answer(r, "abort")
        self.counters["aborted"] += n + len(hit)
        return n + len(hit)


def _deliver(items: list) -> None:
    """On the caller's event loop: answer each still-awaited future."""
    for future, result, error in items:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


class _SlotCache(DynamicCache):
    """The running batch's KV as the model sees it during a decode step: row i's new key and
    value are written in place at column `lengths[i]` of its slot, and attention reads the
    first `width` columns of the first `rows` slots (views, no copy)."""

    def __init__(self, buffers: KV, rows: int, width: int, lengths: torch.Tensor):
        super().__init__()
        self._buffers, self._width, self._lengths = buffers, width, lengths
        self._rows = torch.arange(rows, device=lengths.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._buffers[layer_idx]
        keys[self._rows, :, self._lengths] = key_states[:, :, 0]
        values[self._rows, :, self._lengths] = value_states[:, :, 0]
        n = self._rows.numel()
        return keys[:n, :, :self._width], values[:n, :, :self._width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width - 1
