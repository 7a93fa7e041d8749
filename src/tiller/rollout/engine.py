"""The embedded generation engine: batched, KV-cached sampling for many concurrent episodes.

Episodes call `await engine.generate(prompt_ids, params, seed)` independently; the engine
gathers whatever requests are waiting into one left-padded batch, runs prefill and cached
decoding in a worker thread (so tools and envs keep running on the event loop), and answers
each with its token ids, the log-probability of each sampled token, and the weight version
that sampled it. Each request draws from its own seeded generator, so what an episode samples
does not depend on which other episodes shared its batch.

Log-probabilities are of the temperature-scaled distribution before top-k / top-p truncation,
which is what the trainer recomputes; with truncation on, the two differ by design.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from tiller.rollout.weight_sync import WeightUpdate

logger = logging.getLogger(__name__)


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
    finish_reason: str  # "stop" (a stop token was sampled) or "length"
    version: int
    versions: tuple[int, ...] = ()  # weight version of each token
    prompt_tokens: int = 0  # tokens in the prompt
    cached_tokens: int = 0  # prompt tokens whose KV was reused (not prefilled)


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: asyncio.Future = field(repr=False)


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class EmbeddedEngine:
    """An in-process engine over a Hugging Face causal LM."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, max_batch_size: int = 64):
        self.model = model.eval()
        self.device = next(model.parameters()).device  # inputs and generators live there
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_context = getattr(model.config, "max_position_embeddings", 4096)
        self.version = 0
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters
            else "past_key_values"
        )
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self._lock = threading.Lock()  # weight updates never interleave with a batch
        self.cancelled = 0  # requests whose episode was cancelled before the answer came

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, seed: int
    ) -> Generation:
        if len(prompt_ids) >= self.max_context:
            return Generation([], [], "length", self.version)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), params, seed, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        # Yield once so that every episode ready at this moment joins the first batch.
        await asyncio.sleep(0)
        while self._pending:
            self._pending = [r for r in self._pending if self._live(r)]
            if not self._pending:
                break
            params = self._pending[0].params
            batch = [r for r in self._pending if r.params == params][: self.max_batch_size]
            self._pending = [r for r in self._pending if all(r is not b for b in batch)]
            try:
                outs = await asyncio.to_thread(self._run_batch, batch)
            except Exception as e:  # hand the failure to every waiting episode
                for r in batch:
                    if self._live(r):
                        r.future.set_exception(e)
                continue
            for r, out in zip(batch, outs, strict=True):
                if self._live(r):
                    r.future.set_result(out)
            await asyncio.sleep(0)

    def _live(self, request: _Request) -> bool:
        """False (and counted) for a request cancelled while it waited: its episode is gone,
        and answering its future would raise and stop the worker for everyone else."""
        if request.future.cancelled():
            self.cancelled += 1
            logger.info("engine request cancelled (%d so far)", self.cancelled)
            return False
        return True

    def update_weights(self, update: WeightUpdate) -> None:
        with self._lock:
            update.apply_to(self.model)
            self.version = update.version

    def stats(self) -> dict[str, float]:
        return {"cancelled": float(self.cancelled)}

    def close(self) -> None:
        """Nothing to stop: batches run on the caller's event loop and a worker thread per
        batch."""

    def _forward(self, ids, mask, pos, cache):
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         use_cache=True, **kwargs)
        return out.logits[:, -1].float(), getattr(out, self._cache_arg)

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Request]) -> list[Generation]:
        with self._lock:
            return self._decode(batch)

    def _decode(self, batch: list[_Request]) -> list[Generation]:
        p = batch[0].params
        n, width = len(batch), max(len(r.prompt_ids) for r in batch)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for i, r in enumerate(batch):  # left padding keeps every row's next token aligned
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        budget = [min(p.max_new_tokens, self.max_context - len(r.prompt_ids)) for r in batch]
        gens = [torch.Generator(self.device).manual_seed(r.seed) for r in batch]
        out_ids: list[list[int]] = [[] for _ in batch]
        out_lp: list[list[float]] = [[] for _ in batch]
        reason = ["length"] * n
        done = torch.zeros(n, dtype=torch.bool)

        logits, cache = self._forward(ids, mask, pos, None)
        for step in range(max(budget)):
            if p.temperature > 0:
                logp = torch.log_softmax(logits / p.temperature, dim=-1)
                probs = _filter_logits(logp, p.top_k, p.top_p).softmax(-1)
                token = torch.stack(
                    [torch.multinomial(probs[i], 1, generator=gens[i])[0] for i in range(n)]
                )
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = logits.argmax(-1)
            lp = logp.gather(-1, token[:, None])[:, 0]
            for i in range(n):
                if done[i]:
                    continue
                out_ids[i].append(int(token[i]))
                out_lp[i].append(float(lp[i]))
                if int(token[i]) in p.stop_token_ids:
                    reason[i], done[i] = "stop", True
                elif len(out_ids[i]) >= budget[i]:
                    done[i] = True
            if bool(done.all()) or step == max(budget) - 1:
                break
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            pos = pos[:, -1:] + 1
            logits, cache = self._forward(token[:, None], mask, pos, cache)
        return [
            Generation(o, lp_, r, self.version)
            for o, lp_, r in zip(out_ids, out_lp, reason, strict=True)
        ]
