"""The KV kept between turns: per-session entries and a shared-prefix index, LRU in bytes.

When a request finishes, the engine stores the keys and values of every token it ran through
the model (the prompt and all generated tokens but the last) under the token sequence. The next
turn of the same session (its prompt is that sequence, the last generated token and the
observation) then prefills only what is new. Entries are also indexed by fixed-size blocks of
their tokens (a hash chain), so a request of another episode that starts with the same system
prompt and tool schemas reuses the matching whole blocks.

A lookup always verifies the token ids it would reuse (a hash collision cannot serve wrong KV),
and a miss or an eviction only means more prefill: the outputs are the same either way.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [1, heads, len, dim]


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    nbytes: int
    session: str | None
    block_keys: list[int] = field(default_factory=list)
    scope: str | None = None


class PrefixCache:
    """Stored KV under a byte budget; least recently used entries are evicted first."""

    def __init__(self, budget_bytes: int, block_size: int = 16):
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.bytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._sessions: dict[tuple[str | None, str], int] = {}  # (scope, session) -> entry
        self._blocks: dict[int, int] = {}  # hash of tokens[: k * block_size] -> entry id
        self._ids = itertools.count()
        self.hits = self.misses = self.evictions = 0

    def _block_hashes(self, tokens: tuple[int, ...], scope: str | None) -> list[int]:
        h, out, b = hash(scope), [], self.block_size
        for k in range(len(tokens) // b):
            h = hash((h, tokens[k * b:(k + 1) * b]))
            out.append(h)
        return out

    def lookup(self, tokens: list[int], session: str | None, scope: str | None = None
               ) -> tuple[int, KV | None]:
        """(n, kv): the KV of tokens[:n] from the best stored match of the same `scope`, n <
        len(tokens) so that at least one token is left to run; (0, None) on a miss. Entries
        put under another scope are never matched (`tiller serve`: one scope per api key, so
        one client cannot learn from its cache hits what another's prompts begin with)."""
        toks = tuple(tokens)
        best_n, best_id = 0, None
        sid = self._sessions.get((scope, session)) if session is not None else None
        if sid is not None:
            e = self._entries[sid]
            if toks[:len(e.tokens)] == e.tokens:
                best_n, best_id = len(e.tokens), sid
        if best_n < len(toks) - self.block_size:  # whole blocks may beat the session entry
            for k, h in enumerate(self._block_hashes(toks[:-1], scope), start=1):
                eid = self._blocks.get(h)
                if eid is None:
                    break
                n = k * self.block_size
                e = self._entries[eid]
                if n > best_n and e.scope == scope and e.tokens[:n] == toks[:n]:
                    best_n, best_id = n, eid
        best_n = min(best_n, len(toks) - 1)
        if best_id is None or best_n <= 0:
            self.misses += 1
            return 0, None
        self.hits += 1
        self._entries.move_to_end(best_id)
        return best_n, [(k[:, :, :best_n], v[:, :, :best_n])
                        for k, v in self._entries[best_id].kv]

    def put(self, tokens: list[int], kv: KV, session: str | None, scope: str | None = None
            ) -> None:
        """Store `kv` (the KV of exactly `tokens`) under `scope`; it replaces the session's
        older entry."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                     for k, v in kv)
        key = (scope, session)
        if session is not None and key in self._sessions:
            self._remove(self._sessions[key])
        if nbytes > self.budget_bytes:
            return
        while self.bytes + nbytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1
        eid = next(self._ids)
        entry = _Entry(tuple(tokens), kv, nbytes, session, scope=scope)
        entry.block_keys = self._block_hashes(entry.tokens, scope)
        for h in entry.block_keys:  # the newest entry serves a shared block
            self._blocks[h] = eid
        self._entries[eid] = entry
        self.bytes += nbytes
        if session is not None:
            self._sessions[key] = eid

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        self.bytes -= entry.nbytes
        key = (entry.scope, entry.session)
        if entry.session is not None and self._sessions.get(key) == eid:
            del self._sessions[key]
        for h in entry.block_keys:
            if self._blocks.get(h) == eid:
                del self._blocks[h]

    def flush(self) -> int:
        """Drop every entry (after a weight update they hold the old policy's KV)."""
        n = len(self._entries)
        self._entries.clear()
        self._sessions.clear()
        self._blocks.clear()
        self.bytes = 0
        return n

    def __len__(self) -> int:
        return len(self._entries)
