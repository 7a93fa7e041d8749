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

The running batch's KV slots and forward passes are in `slots`, the worker thread and
its safe points in `worker`. A forward pre-hook on each of the model's layers lets `close` stop
a forward between two layers (`Worker._check_closing`), so closing (Ctrl-C, SIGTERM) never
waits for a long prefill to end. Logprobs are those of the sampled tokens under
softmax(logits / T); see `tiller.engine.sampling` for how top-k / top-p relate to them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from tiller.engine.api import Generation, InFlight, SamplingParams
from tiller.engine.delta import DeltaUpdate
from tiller.engine.kv_cache import KV, PrefixCache
from tiller.engine.sampling import sample
from tiller.engine.slots import Prefilled, SlotBatch
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.engine.worker import Worker, deliver

logger = logging.getLogger(__name__)


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


class EmbeddedEngine(Worker, SlotBatch):
    """An in-process continuous-batching engine over a Hugging Face causal LM."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, *, max_batch_size: int = 128,
                 cache_bytes: int = 1 << 30, max_prefill_tokens: int = 16384,
                 control_timeout_s: float = 600.0):
        super().__init__(control_timeout_s)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
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
                             "layers: serve it with SGLang (engine.backend: sglang) or vLLM")
        self._waiting: deque[_Request] = deque()
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
        self.max_rows = 0
        self._bursts: dict[asyncio.AbstractEventLoop, list[_Request]] = {}
        # the layers: the children of the model's ModuleLists (a decoder's blocks)
        self._hooks = [layer.register_forward_pre_hook(lambda *_: self._check_closing())
                       for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                       for layer in m]

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
                deliver([(r.future, Generation([], [], "length", self.version,
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
            deliver([(r.future, None, RuntimeError("the engine was closed")) for r in queued])

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
        """Stop the worker (a forward in progress stops at its next layer); queued and running
        requests fail with RuntimeError."""
        self._stop_worker()
        for hook in self._hooks:  # the model may outlive its engine (tests, `tiller serve`)
            hook.remove()
        self._fail_all(RuntimeError("the engine was closed"))

    # ----- the worker -----

    def _has_work(self) -> bool:
        return bool(self._waiting or self._rows)

    def _idle(self) -> None:
        self._buf = []  # an idle engine holds no KV memory

    def _iterate(self) -> None:
        with torch.inference_mode():
            self._step()

    def _fail_iteration(self, error: Exception) -> None:
        """Hand the failure to every request of the batch."""
        logger.exception("engine iteration failed; its %d rows get the error", len(self._rows))
        self.counters["failed_batches"] += 1
        self._fail_batch(error)

    def _abandon_iteration(self) -> None:
        self._fail_batch(RuntimeError("the engine was closed"))

    def _fail_batch(self, error: Exception) -> None:
        """`error` to every request of the batch (running or being admitted); the batch reset."""
        for r in {id(r): r for r in self._rows + self._admitting}.values():
            self._resolve(r, error=error)
        self._reset_batch()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = list(self._waiting) + self._rows
            self._waiting.clear()
        for r in pending:
            self._resolve(r, error=error)
        self._flush_outbox()
        self._fail_controls(error)
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

    def _admit(self, new: list[_Request], p: Prefilled) -> torch.Tensor:
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
            self._post(r.loop, (r.future, result, error))

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


