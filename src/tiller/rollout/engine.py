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
   of the tokens and logprobs, the only host sync of the iteration;
5. retire: a row that sampled a stop token or reached its budget leaves at once, its answer is
   delivered and its KV stored for the session's next turn.

Rows of the batch sit in one KV tensor per layer, [rows, heads, width, dim], with an attention
mask marking each row's real columns (a row may have padding on the left and holes where its
cached prefix met its new tokens) and explicit position ids, so every row sees exactly its
own sequence. Logprobs are those of the sampled tokens under softmax(logits / T); see
`tiller.rollout.sampling` for how top-k / top-p relate to them.
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

from tiller.rollout.kv_cache import KV, PrefixCache
from tiller.rollout.sampling import sample
from tiller.rollout.weight_sync import WeightUpdate

logger = logging.getLogger(__name__)

InFlight = Literal["continue", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # required: see __post_init__

    def __post_init__(self) -> None:
        # Without a stop token every turn runs to max_new_tokens and the episode is truncated:
        # a forgotten argument would look like a policy that never stops talking.
        if not self.stop_token_ids:
            raise ValueError("SamplingParams.stop_token_ids is empty, so no turn could end: pass "
                             "tiller.rollout.chat.stop_token_ids(tokenizer, "
                             "model.generation_config)")


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled), "length" or "abort"
    version: int  # the weight version when the request finished
    versions: tuple[int, ...] = ()  # the weight version that sampled each token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of prefilled


class Engine(Protocol):
    """What the agent loop and the trainer need from an engine, in-process or over HTTP."""

    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None
                       ) -> Generation: ...

    def abort(self, request_id: str) -> bool: ...

    def update_weights(self, update: WeightUpdate, *, in_flight: InFlight = "continue"
                       ) -> int: ...

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
    budget: int = 0
    segments: list[list[int]] = field(default_factory=list)  # real KV columns [start, end)


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
        self.version = 0
        self.cache = PrefixCache(cache_bytes)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = "logits_to_keep" in params
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
        # the running batch: rows, per-layer KV, mask, next input token and position per row
        self._rows: list[_Request] = []
        self._kv: KV = []
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._row_params: dict[str, torch.Tensor] = {}
        self._admitting: list[_Request] = []  # taken from the queue, not yet in the batch
        self._max_top_k, self._any_top_p = 0, False
        self.counters = {name: 0 for name in (
            "requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "generated_tokens",
            "decode_steps", "decoded_row_steps", "prefill_calls",
            "aborted", "cancelled", "undelivered", "weight_updates", "failed_batches",
            "failed_requests")}
        self.busy_s = 0.0
        self.max_rows = 0
        # answers for asyncio callers, delivered once per loop per iteration: one wake-up of
        # each event loop instead of one per finished request
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}

    # ----- the API (any thread) -----

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None
                       ) -> Generation:
        loop = asyncio.get_running_loop()
        future = loop.create_future()  # cancelling the await cancels the request
        self._enqueue(_Request(list(prompt_ids), params, seed & (2**63 - 1), session_id,
                               request_id, future, loop))
        return await future

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
               session_id: str | None = None, request_id: str | None = None
               ) -> concurrent.futures.Future:
        """Queue a request from any thread; the future resolves to its `Generation`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(_Request(list(prompt_ids), params, seed & (2**63 - 1), session_id,
                               request_id, future))
        return future

    def _enqueue(self, request: _Request) -> None:
        if len(request.prompt_ids) >= self.max_context:
            self._resolve(request, Generation([], [], "length", self.version,
                                              prompt_tokens=len(request.prompt_ids)))
            self._flush_outbox()
            return
        with self._cond:
            self._check_open()
            self._waiting.append(request)
            self._ensure_worker()
            self._cond.notify()

    def abort(self, request_id: str) -> bool:
        """End the request now (queued or running); its caller gets the partial output with
        finish_reason "abort". False when no such request is queued or running."""
        return bool(self._control(lambda: self._abort(lambda r: r.request_id == request_id),
                                  f"abort of request {request_id!r}"))

    def update_weights(self, update: WeightUpdate, *, in_flight: InFlight = "continue") -> int:
        """Apply `update` between two decode steps and return the new version. Running requests
        go on under the new weights (their tokens record the version that sampled each) or,
        with in_flight="abort", end at once with their partial output. Stored KV is dropped:
        it was computed by the old weights."""
        if in_flight not in ("continue", "abort"):
            raise ValueError(f"in_flight must be 'continue' or 'abort', got {in_flight!r}")
        update.check(self.model)  # a bad update fails here, before the worker waits on it

        def apply() -> int:
            if in_flight == "abort":
                self._abort(lambda r: True, waiting=False)
            update.apply_to(self.model)
            self.version = update.version
            self.cache.flush()
            self.counters["weight_updates"] += 1
            return self.version

        return self._control(apply, f"weight update v{update.version}")

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

    def _control(self, fn: Callable[[], object], what: str):
        op = _Control(fn)
        with self._cond:
            self._check_open()
            self._controls.append(op)
            self._ensure_worker()
            self._cond.notify()
        try:
            return op.done.result(timeout=self.control_timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"engine: {what} was not applied within "
                               f"{self.control_timeout_s:.0f}s (no safe point between decode "
                               "steps was reached)") from None

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
                        return
                if self._closed:
                    return
                controls = list(self._controls)
                self._controls.clear()
            for op in controls:
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
            if not op.done.done():
                op.done.set_exception(error)
        self._reset_batch()

    def _reset_batch(self) -> None:
        self._rows, self._kv = [], []
        self._mask = self._mask.new_zeros((0, 0))
        self._last = self._last.new_zeros(0)
        self._pos = self._pos.new_zeros(0)

    def _step(self) -> None:
        self._drop_cancelled()
        new = self._admitting = self._take_admissions()
        logits = []
        if self._rows:
            logits.append(self._decode())
        if new:
            logits.append(self._prefill(new))
        if not logits:
            return
        rows = self._rows  # _prefill appended the new rows after the running ones
        p = self._row_params
        steps = self._pos - p["prompt_len"]  # each row's index of the token it samples
        logits = torch.cat(logits)
        tokens, lps = sample(logits, p["temperature"], p["top_k"], p["top_p"], p["seed"],
                             steps, max_top_k=self._max_top_k, any_top_p=self._any_top_p)
        finite = torch.isfinite(logits).all(-1)
        # the one host sync of the iteration: tokens, logprobs and the finite flags together
        packed = torch.stack([tokens.double(), lps.double(), finite.double()]).tolist()
        self._last, keep = tokens, []
        for i, (r, token, lp, ok) in enumerate(zip(rows, *packed, strict=True)):
            if not ok:  # NaN/inf weights or activations: the request fails, loudly
                self.counters["failed_requests"] += 1
                self._resolve(r, error=RuntimeError(
                    f"the model's logits are not finite (NaN or inf) at weight version "
                    f"{self.version}"))
                continue
            token = int(token)
            r.out_ids.append(token)
            r.out_lp.append(lp)
            r.versions.append(self.version)
            if token in r.params.stop_token_ids:
                self._finish(i, "stop")
            elif len(r.out_ids) >= r.budget:
                self._finish(i, "length")
            else:
                keep.append(i)
        self.counters["generated_tokens"] += len(rows)
        if len(keep) < len(rows):
            self._select(keep)

    def _drop_cancelled(self) -> None:
        """Requests whose caller went away (a cancelled episode): counted, never answered."""
        with self._cond:
            live = [r for r in self._waiting if not r.future.cancelled()]
            self.counters["cancelled"] += len(self._waiting) - len(live)
            self._waiting = deque(live)
        keep = [i for i, r in enumerate(self._rows) if not r.future.cancelled()]
        if len(keep) < len(self._rows):
            self.counters["cancelled"] += len(self._rows) - len(keep)
            logger.info("engine: %d cancelled requests left the batch",
                        len(self._rows) - len(keep))
            self._select(keep)

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

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv: KV,
                 last_only: bool) -> tuple[torch.Tensor, KV]:
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in zip(cache.layers, kv, strict=False):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        kwargs = {self._cache_arg: cache}
        if last_only and self._keep_arg:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **kwargs)
        cache = getattr(out, self._cache_arg)
        return out.logits[:, -1].float(), [(layer.keys, layer.values) for layer in cache.layers]

    def _decode(self) -> torch.Tensor:
        n = len(self._rows)
        self._mask = torch.cat([self._mask, self._mask.new_ones((n, 1))], dim=1)
        logits, self._kv = self._forward(self._last[:, None], self._mask, self._pos[:, None],
                                         self._kv, last_only=False)
        width = self._mask.size(1)
        for r in self._rows:  # the column just written is real for every row
            r.segments[-1][1] = width
        self._pos = self._pos + 1
        self.counters["decode_steps"] += 1
        self.counters["decoded_row_steps"] += n
        return logits

    def _prefill(self, new: list[_Request]) -> torch.Tensor:
        """Run the uncached part of each new request's prompt (identical ones once), then
        append the new rows to the running batch."""
        looked = [self.cache.lookup(r.prompt_ids, r.session_id) for r in new]
        groups: dict[tuple, int] = {}
        unique, index = [], []
        for r, (c, kv) in zip(new, looked, strict=True):
            key = (tuple(r.prompt_ids), c, id(kv[0][0]) if kv else None)
            if key not in groups:
                groups[key] = len(unique)
                unique.append((r, c, kv))
            index.append(groups[key])
        cmax = max(c for _, c, _ in unique)
        smax = max(len(r.prompt_ids) - c for r, c, _ in unique)
        u = len(unique)
        ids = torch.full((u, smax), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((u, cmax + smax), dtype=torch.long)
        pos = torch.zeros((u, smax), dtype=torch.long)
        for j, (r, c, _) in enumerate(unique):
            s = len(r.prompt_ids) - c
            ids[j, smax - s:] = torch.tensor(r.prompt_ids[c:])
            pos[j, smax - s:] = torch.arange(c, c + s)
            mask[j, cmax - c:cmax] = 1
            mask[j, cmax + smax - s:] = 1
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
        logits, kv = self._forward(ids, mask, pos, past, last_only=True)
        self.counters["prefill_calls"] += 1
        self.counters["prefill_tokens"] += sum(len(r.prompt_ids) - c for r, c, _ in unique)
        if u < len(new):  # identical prompts share one prefill
            sel = torch.tensor(index, device=self.device)
            logits, mask = logits[sel], mask[sel]
            kv = [(k[sel], v[sel]) for k, v in kv]
        width = cmax + smax
        for r, j in zip(new, index, strict=True):
            _, c, _ = unique[j]
            s = len(r.prompt_ids) - c
            r.cached = c
            r.budget = min(r.params.max_new_tokens, self.max_context - len(r.prompt_ids))
            r.segments = [[cmax - c, cmax], [width - s, width]] if c else [[width - s, width]]
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(r.prompt_ids)
            self.counters["cached_tokens"] += c
        self._append_rows(new, kv, mask, pos[:, -1][torch.tensor(index, device=self.device)]
                          + 1)
        return logits

    # ----- batch bookkeeping -----

    def _append_rows(self, new: list[_Request], kv: KV, mask: torch.Tensor,
                     next_pos: torch.Tensor) -> None:
        """Join `new` (their KV is [len(new), heads, w, dim]) to the running batch; the
        narrower side is left-padded, so every row keeps its columns' order."""
        w_old, w_new = self._mask.size(1), mask.size(1)
        width = max(w_old, w_new)
        if self._rows and w_old < width:
            self._shift(width - w_old)
        if w_new < width:
            pad = width - w_new
            mask = torch.cat([mask.new_zeros((len(new), pad)), mask], dim=1)
            kv = [(_left_pad(k, pad), _left_pad(v, pad)) for k, v in kv]
            for r in new:
                r.segments = [[a + pad, b + pad] for a, b in r.segments]
        if self._rows:
            self._kv = [(torch.cat([k0, k1]), torch.cat([v0, v1]))
                        for (k0, v0), (k1, v1) in zip(self._kv, kv, strict=True)]
            self._mask = torch.cat([self._mask, mask])
            self._pos = torch.cat([self._pos, next_pos])
        else:
            self._kv, self._mask, self._pos = kv, mask, next_pos
        self._rows = self._rows + new
        self.max_rows = max(self.max_rows, len(self._rows))
        self._set_row_params()

    def _shift(self, pad: int) -> None:
        self._mask = torch.cat([self._mask.new_zeros((len(self._rows), pad)), self._mask], dim=1)
        self._kv = [(_left_pad(k, pad), _left_pad(v, pad)) for k, v in self._kv]
        for r in self._rows:
            r.segments = [[a + pad, b + pad] for a, b in r.segments]

    def _select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (finished rows leave), then drop the leading columns that are
        padding in every remaining row."""
        if not keep:
            self._reset_batch()
            return
        sel = torch.tensor(keep, device=self.device)
        self._rows = [self._rows[i] for i in keep]
        trim = min(r.segments[0][0] for r in self._rows)
        self._kv = [(k[sel, :, trim:], v[sel, :, trim:]) for k, v in self._kv]
        self._mask = self._mask[sel, trim:]
        self._pos = self._pos[sel]
        self._last = self._last[sel]
        for r in self._rows:
            r.segments = [[a - trim, b - trim] for a, b in r.segments]
        self._set_row_params()

    def _set_row_params(self) -> None:
        rows, dev = self._rows, self.device
        self._row_params = {
            "temperature": torch.tensor([r.params.temperature for r in rows], device=dev),
            "top_k": torch.tensor([r.params.top_k for r in rows], device=dev),
            "top_p": torch.tensor([r.params.top_p for r in rows], device=dev),
            "seed": torch.tensor([r.seed for r in rows], dtype=torch.long, device=dev),
            "prompt_len": torch.tensor([len(r.prompt_ids) for r in rows], device=dev),
        }
        self._max_top_k = max(r.params.top_k for r in rows)
        self._any_top_p = any(r.params.top_p < 1.0 for r in rows)

    def _finish(self, i: int, reason: str) -> None:
        r = self._rows[i]
        if reason != "abort" and self.cache.budget_bytes > 0:
            # the KV of the prompt and every generated token but the last (never run)
            kv = [(torch.cat([k[i:i + 1, :, a:b] for a, b in r.segments], dim=2),
                   torch.cat([v[i:i + 1, :, a:b] for a, b in r.segments], dim=2))
                  for k, v in self._kv]
            self.cache.put(r.prompt_ids + r.out_ids[:-1], kv, r.session_id)
        self._answer(r, reason)

    def _answer(self, r: _Request, reason: str) -> None:
        self._resolve(r, Generation(r.out_ids, r.out_lp, reason, self.version,
                                    tuple(r.versions), prompt_tokens=len(r.prompt_ids),
                                    cached_tokens=r.cached))

    def _resolve(self, r: _Request, result: Generation | None = None,
                 error: BaseException | None = None) -> None:
        if r.loop is None:
            if not r.future.done():
                if error is None:
                    r.future.set_result(result)
                else:
                    r.future.set_exception(error)
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
        keep = []
        for i, r in enumerate(self._rows):
            if match(r):
                self._answer(r, "abort")
                n += 1
            else:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._select(keep)
        self.counters["aborted"] += n
        return n


def _deliver(items: list) -> None:
    """On the caller's event loop: answer each still-awaited future."""
    for future, result, error in items:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


def _left_pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t.new_zeros((t.size(0), t.size(1), pad, t.size(3))), t], dim=2)
