"""Batched sampling with per-request seeds: one step for a whole batch, no per-row Python.

Every row draws one uniform number from a counter-based hash of (its request's seed, the index
of the token it is sampling), and inverts its own CDF with it. A request's tokens therefore
depend on its seed and its logits only, never on which other requests share its batch, and a
whole batch samples with a handful of tensor ops.

Log-probabilities are of the sampled token under the temperature-scaled distribution
softmax(logits / T) *before* top-k / top-p truncation: that is the distribution the trainer
recomputes from the same weights, so engine and trainer agree. With truncation on, the tokens
come from the truncated (renormalised) distribution and the reported logprob is not the
probability they were drawn with; see docs/engine.md. Greedy rows (T = 0) take the argmax and
report log softmax(logits).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values below
    2^32; the multipliers are below 2^31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """u_i in [0, 1) as a function of (seeds[i], steps[i]) only, with 53 random bits (float64).

    seeds: int64 [B], non-negative; steps: int64 [B], the index of the token being sampled."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    a = _mix32(lo ^ _mix32(hi ^ _mix32(steps & _M32)))
    b = _mix32(a ^ 0x2545F491)
    return ((a >> 5) * 67108864 + (b >> 6)).double() / 9007199254740992.0  # 2^26, 2^53


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
           truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens int64 [B], logprobs float32 [B]).

    logp = log_softmax(logits / T) per row (T = 1 for greedy rows). With `truncate` (some row
    has top_k > 0 or top_p < 1), a row keeps the token of rank r (by probability) when
    r < top_k (0: all) and the mass of the tokens ranked before r is below top_p (so at least
    one token). The token is the first, in vocabulary order, whose cumulative kept mass
    exceeds u * (kept mass), with u = uniform(seed, step): inverse-CDF sampling."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    probs = logp.exp()
    vocab = logp.size(-1)
    if truncate:  # the kept set is found in sorted order and mapped back to vocab order
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        keep_sorted = (rank[None, :] < k[:, None]) & (
            (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None])
        keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    # always in vocab order, so a row samples the same token whatever its batch truncates
    cdf = probs.double().cumsum(-1)
    u = uniform(seeds, steps) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=vocab - 1)[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
