"""The KV kept between turns: session entries, shared blocks, verification, LRU budget."""

import torch

from tiller.rollout.kv_cache import PrefixCache


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
