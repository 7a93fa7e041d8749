"""The KV kept between turns: session entries, shared blocks, verification, LRU budget."""

import random

import torch

from tiller.engine.kv_cache import PrefixCache


def kv_of(tokens, layers=2):
    """Synthetic KV: each position's values are its token id, so slices are checkable."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t.clone(), -t.clone()) for _ in range(layers)]


BYTES_PER_TOKEN = 2 * 2 * 4  # layers * (k, v) * fp32


def test_a_session_reuses_its_whole_previous_turn():
    cache = PrefixCache(1 << 20)
    first = list(range(10, 30))
    cache.put(first, kv_of(first), "s")
    n, kv = cache.lookup(first + [7, 8, 9], "s")
    assert n == 20 and kv[1][0].shape == (1, 1, 20, 1)
    assert kv[0][0].flatten().tolist() == first and kv[0][1].flatten().tolist() == [
        -x for x in first]
    # never the whole prompt: one token must be left to run for the next logits
    assert cache.lookup(first, "s")[0] == 19
    assert (cache.hits, cache.misses) == (2, 0)


def test_other_sessions_reuse_whole_shared_blocks_and_tokens_are_verified():
    cache = PrefixCache(1 << 20, block_size=16)
    system = list(range(100, 140))
    cache.put(system + [1, 2], kv_of(system + [1, 2]), "a")
    assert cache.lookup(system + [5, 6, 7], "b")[0] == 32
    assert cache.lookup(system[:20] + [5] * 30, "b")[0] == 16
    changed = [0] + system[1:]  # differs in the first block: nothing reusable
    assert cache.lookup(changed, "b") == (0, None) and cache.misses == 1


def test_the_byte_budget_evicts_the_least_recently_used_entry():
    cache = PrefixCache(BYTES_PER_TOKEN * 25)
    a, b, c = [1] * 10, [2] * 10, [3] * 10
    cache.put(a, kv_of(a), "a")
    cache.put(b, kv_of(b), "b")
    cache.lookup(a + [0], "a")  # a is now the most recently used
    cache.put(c, kv_of(c), "c")
    assert cache.evictions == 1 and cache.bytes == BYTES_PER_TOKEN * 20
    assert cache.lookup(b + [0], "b")[0] == 0 and cache.lookup(a + [0], "a")[0] == 10
    big = [4] * 30  # larger than the whole budget: not stored, nothing evicted for it
    cache.put(big, kv_of(big), "d")
    assert len(cache) == 2 and cache.evictions == 1


def test_a_sessions_new_entry_replaces_its_old_one_and_flush_empties_everything():
    cache = PrefixCache(1 << 20)
    cache.put([1] * 10, kv_of([1] * 10), "s")
    cache.put([1] * 15, kv_of([1] * 15), "s")
    assert len(cache) == 1 and cache.bytes == BYTES_PER_TOKEN * 15
    assert cache.flush() == 1 and cache.bytes == 0 and cache.lookup([1] * 20, "s")[0] == 0


class CountedToken(int):
    """A token id that counts its comparisons (a tuple compares element by element)."""

    comparisons = 0

    def __eq__(self, other):
        CountedToken.comparisons += 1
        return int(self) == int(other)

    __hash__ = int.__hash__


def test_a_lookup_compares_each_prompt_token_at_most_twice():
    """Linear, not quadratic: a 1024-token prompt whose every block is stored is matched with
    at most one comparison per token for the session entry and one for the blocks (the old
    lookup compared the whole prefix again at every block hit: 33,280 comparisons here)."""
    cache = PrefixCache(1 << 30, block_size=16)
    stored = list(range(1024))
    cache.put([CountedToken(t) for t in stored], kv_of(stored), "a")
    for session in ("a", "b"):  # its own session's entry, and another session's blocks
        prompt = [CountedToken(t) for t in stored + [7] * 16]  # other objects, equal values
        CountedToken.comparisons = 0
        n, kv = cache.lookup(prompt, session)
        assert n == 1024 and kv[0][0].flatten().tolist() == stored
        assert CountedToken.comparisons <= 2 * len(prompt), CountedToken.comparisons


def test_equal_hashes_never_serve_another_blocks_kv():
    """hash(-1) == hash(-2) in CPython, so these blocks collide: the lookup compares tokens."""
    cache = PrefixCache(1 << 20, block_size=4)
    a, b = [-1] * 8, [-2] * 8
    assert hash(tuple(a[:4])) == hash(tuple(b[:4]))
    cache.put(a, kv_of(a), "a")
    assert cache.lookup(b + [5], "b") == (0, None)
    cache.put(b, kv_of(b), "b")
    n, kv = cache.lookup(a[:4] + b[:4] + [5], "c")  # a's first block, then b's
    assert n == 4 and kv[0][0].flatten().tolist() == a[:4]


def brute_force(cache, tokens, session):
    """The length the lookup must find: the session's entry when `tokens` starts with all of
    it, else the longest whole-block prefix of tokens[:-1] some stored entry starts with."""
    toks, b, best = tuple(tokens), cache.block_size, 0
    for eid, e in cache._entries.items():
        if cache._sessions.get((None, session)) == eid and toks[:len(e.tokens)] == e.tokens:
            best = max(best, len(e.tokens))
        pairs = zip(e.tokens, toks[:-1], strict=False)
        common = next((i for i, (x, y) in enumerate(pairs) if x != y),
                      min(len(e.tokens), len(toks) - 1))
        best = max(best, common // b * b)
    return min(best, len(toks) - 1)


def trie_paths(cache):
    """Every block prefix in the tries (one per scope), as token tuples."""
    paths, todo = set(), [((), root) for root in cache._roots.values()]
    while todo:
        path, node = todo.pop()
        for key, child in node.children.items():
            paths.add(path + key)
            todo.append((path + key, child))
    return paths


def test_lookups_match_a_brute_force_reference_on_random_prefixes():
    """Seeded random puts and lookups over sequences that share prefixes of every length (a
    3-letter alphabet, 4-token blocks), with sessions replacing their entries and a byte
    budget that evicts: every lookup finds the reference's length and the KV of exactly those
    tokens, and the trie holds exactly the block prefixes of the stored entries."""
    rng = random.Random(0)
    cache = PrefixCache(BYTES_PER_TOKEN * 400, block_size=4)
    roots = [[rng.randrange(3) for _ in range(60)] for _ in range(3)]

    def sequence():
        root = rng.choice(roots)
        return root[:rng.randrange(1, 60)] + [rng.randrange(3) for _ in range(rng.randrange(8))]

    sessions = [None, "s0", "s1", "s2", "s3"]
    for _ in range(600):
        tokens, session = sequence(), rng.choice(sessions)
        if rng.random() < 0.4:
            cache.put(tokens, kv_of(tokens), session)
            continue
        want = brute_force(cache, tokens, session)
        n, kv = cache.lookup(tokens, session)
        assert n == want, (tokens, session)
        if n:
            assert kv[1][0].flatten().tolist() == tokens[:n]
            assert kv[0][1].flatten().tolist() == [-t for t in tokens[:n]]
        else:
            assert kv is None
    b = cache.block_size
    assert cache.evictions > 0 and len(cache) > 1
    assert trie_paths(cache) == {e.tokens[:k] for e in cache._entries.values()
                                 for k in range(b, len(e.tokens) + 1, b)}
