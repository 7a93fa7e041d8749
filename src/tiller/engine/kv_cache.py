"""The KV kept between turns: per-session entries and a shared-prefix index, LRU in bytes.

When a request finishes, the engine stores the keys and values of every token it ran through
the model (the prompt and all generated tokens but the last) under the token sequence. The next
turn of the same session (its prompt is that sequence, the last generated token and the
observation) then prefills only what is new. Entries are also indexed by fixed-size blocks of
their tokens, so a request of another episode that starts with the same system prompt and tool
schemas reuses the matching whole blocks.

The block index is a trie: a node per whole block, its children keyed by the next block's token
ids. A lookup walks it once from the root, and each step is one dict lookup whose key is the
block's tuple of ids: Python compares the tuple itself after its hash matches, so every block is
compared once (a lookup costs O(prompt length), not O(length^2 / block)) and a hash collision
cannot serve wrong KV. Every entry through a node starts with exactly the node's blocks.

Entries live under a `scope` (`tiller serve`: one per api key), each with its own trie and
sessions: an entry put under one scope is never matched by another's lookup, so one client
cannot learn from its cache hits what another's prompts begin with.

A miss or an eviction only means more prefill: the outputs are the same either way.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [1, heads, len, dim]


@dataclass(eq=False)
class _Block:
    """A trie node: the whole blocks on the path from the root. `entries` holds the ids of the
    stored entries whose tokens start with them (insertion order: the newest last)."""

    parent: _Block | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)
    entries: dict[int, None] = field(default_factory=dict)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    nbytes: int
    session: str | None
    scope: str | None = None
    blocks: list[_Block] = field(default_factory=list)  # its path in the trie, root excluded


class PrefixCache:
    """Stored KV under a byte budget; least recently used entries are evicted first."""

    def __init__(self, budget_bytes: int, block_size: int = 16):
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.bytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._sessions: dict[tuple[str | None, str], int] = {}  # (scope, session) -> entry
        self._roots: dict[str | None, _Block] = {}  # a trie per scope
        self._ids = itertools.count()
        self.hits = self.misses = self.evictions = 0

    def _deepest(self, tokens: tuple[int, ...], scope: str | None) -> tuple[int, _Block]:
        """(n, node): the longest run of whole blocks of `tokens` some entry of `scope`
        starts with, n tokens long, and its node (the scope's root when none)."""
        b, node, n = self.block_size, self._roots.get(scope) or _Block(None, ()), 0
        for start in range(0, len(tokens) - b + 1, b):
            child = node.children.get(tokens[start:start + b])
            if child is None:
                break
            node, n = child, start + b
        return n, node

    def lookup(self, tokens: list[int], session: str | None, scope: str | None = None
               ) -> tuple[int, KV | None]:
        """(n, kv): the KV of tokens[:n] from the longest stored match of the same `scope`,
        the session's own entry (when `tokens` starts with all of it) or whole blocks of any
        entry, capped at
        len(tokens) - 1 so that at least one token is left to run; (0, None) on a miss. One
        pass over `tokens`: the session entry compared once, then the block trie walked."""
        toks = tuple(tokens)
        best_n, best_id = 0, None
        sid = self._sessions.get((scope, session)) if session is not None else None
        if sid is not None:
            e = self._entries[sid]
            if toks[:len(e.tokens)] == e.tokens:
                best_n, best_id = len(e.tokens), sid
        n, node = self._deepest(toks[:-1], scope)
        if n > best_n:  # whole blocks beat the session entry: the node's newest entry serves
            best_n, best_id = n, next(reversed(node.entries))
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
        entry = _Entry(tuple(tokens), kv, nbytes, session, scope)
        node, b = self._roots.setdefault(scope, _Block(None, ())), self.block_size
        for start in range(0, len(entry.tokens) - b + 1, b):
            block = entry.tokens[start:start + b]
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Block(node, block)
            child.entries[eid] = None
            entry.blocks.append(child)
            node = child
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
        for node in reversed(entry.blocks):  # leaf first: a node no entry passes is dropped
            del node.entries[eid]
            if not node.entries:
                del node.parent.children[node.key]
        root = self._roots.get(entry.scope)
        if root is not None and not root.children:
            del self._roots[entry.scope]

    def flush(self) -> int:
        """Drop every entry (after a weight update they hold the old policy's KV)."""
        n = len(self._entries)
        self._entries.clear()
        self._sessions.clear()
        self._roots.clear()
        self.bytes = 0
        return n

    def __len__(self) -> int:
        return len(self._entries)
