"""The embedded engine's running batch: its KV slots and the forward passes over them.

Row i of the batch sits in slot i of preallocated per-layer KV buffers, its KV in columns
[0, length): a decode step writes each row's new key and value in place at its own length, with
explicit position ids and a 4-D mask the engine builds, so every row sees exactly its own
sequence. A prefill runs on its own cache (a cached prefix, padding, the new tokens) and its
real columns are then copied into free slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from tiller.engine.kv_cache import KV


@dataclass(frozen=True)
class Prefilled:
    """What a prefill forward gives, per sequence (identical ones share a row's values)."""

    logits: torch.Tensor  # [rows, vocab], of each sequence's last token
    kv: KV  # per layer, [rows, heads, columns, dim], real columns where `mask` is 1
    mask: torch.Tensor  # [rows, columns]
    cached: list[int]  # tokens served by the prefix cache, per sequence
    ran: int  # tokens run through the model (identical sequences once)


class SlotBatch:
    """The KV slots of `EmbeddedEngine`'s running batch and the forward passes that read and
    write them; the engine holds the state named below."""

    model: PreTrainedModel
    device: torch.device
    pad_token_id: int
    max_batch_size: int
    max_context: int
    counters: dict[str, int]
    _rows: list[Any]  # the running requests; row i's KV is in slot i, columns [0, kv_len)
    _buf: KV  # per layer (keys, values), [row capacity, heads, columns, dim]
    _len: torch.Tensor  # [rows], each row's KV length (= the next token's position)
    _last: torch.Tensor  # [rows], each row's last sampled token
    _bool_mask: bool  # sdpa takes a boolean mask; eager adds a float one to the scores
    _cache_arg: str  # the forward's name for the cache argument
    _keep_arg: bool  # whether the forward takes logits_to_keep
    _row_params: dict[str, torch.Tensor]  # per row: sampling parameters, seed, prompt length
    _max_top_k: int
    _any_top_p: bool

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
        cache = SlotCache(self._buf, n, width, self._len)
        logits = self._forward(self._last[:, None], allowed, self._len[:, None], cache,
                               last_only=False)
        self._len = self._len + 1
        for r in self._rows:
            r.kv_len += 1
        self.counters["decode_steps"] += 1
        self.counters["decoded_row_steps"] += n
        return logits

    def _prefill(self, seqs: list[list[int]], looked: list[tuple[int, KV | None]]
                 ) -> Prefilled:
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
        return Prefilled(logits, kv, mask, [unique[j][1] for j in index],
                          sum(len(seq) - c for seq, c, _ in unique))

    def _write_slots(self, first: int, p: Prefilled, width: int) -> None:
        """Copy each prefilled row's real KV columns, in order, into slots first, first + 1,
        ... (columns [0, width))."""
        u = p.mask.size(0)
        # stable sort of "is padding": each row's real columns first, in their order
        order = torch.argsort((p.mask == 0).to(torch.uint8), dim=1, stable=True)[:, :width]
        for (keys, values), (k, v) in zip(self._buf, p.kv, strict=True):
            idx = order[:, None, :, None].expand(u, k.size(1), width, k.size(3))
            keys[first:first + u, :, :width] = k.gather(2, idx)
            values[first:first + u, :, :width] = v.gather(2, idx)

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


class SlotCache(DynamicCache):
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
