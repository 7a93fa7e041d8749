"""Batched sampling with per-request seeds: one step for a whole batch, no per-row Python.

Every row draws one uniform number from a counter-based hash of (its request's seed, the index
of the token it is sampling), and inverts its own CDF with it. A request's tokens therefore
depend on its seed and its logits only, never on which other requests share its batch, and a
whole batch samples with a handful of tensor ops.

The reported log-probability is that of the distribution the token was actually drawn from
(`sampling.logprobs: sampled`, the default): softmax(logits / T) renormalised over the set
top-k / top-p kept,
    logp = log softmax(logits / T)[y] - logsumexp_{v in K} log softmax(logits / T)[v],
which is what off-policy corrections need as the behaviour probability. A row can instead report
the untruncated log softmax(logits / T)[y] (`untruncated`, for parity with servers that report
only that); the trainer recomputes the same kind (`truncated_logprobs`, docs/algorithms.md,
"Sampling truncation"). Without truncation the two are the same number. Greedy rows (T = 0)
take the argmax and report log softmax(logits).
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


def kept_set(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
             max_top_k: int, any_top_p: bool) -> torch.Tensor:
    """[N, V] bool: the tokens each row's top-k / top-p truncation keeps, from its probabilities
    `probs` [N, V] (p = softmax(logits / T)). Top-k keeps the tokens with p >= the row's k-th
    largest p (top_k 0: all); top-p then keeps, among those and by decreasing p, each token whose
    renormalised mass of more likely kept tokens is below top_p (so at least one).
    `max_top_k` (the largest top_k) and `any_top_p` are the caller's Python values, so no call
    reads them back from the device."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    vocab = probs.size(-1)
    if max_top_k > 0:
        kth = torch.topk(probs, min(max_top_k, vocab), dim=-1).values
        idx = top_k.clamp(1, min(max_top_k, vocab)) - 1
        thr = torch.where(top_k > 0, kth.gather(-1, idx[:, None])[:, 0],
                          torch.zeros_like(kth[:, 0]))
        keep = probs >= thr[:, None]
    if any_top_p:  # found in sorted order, mapped back to vocab order
        kept_probs = torch.where(keep, probs, torch.zeros_like(probs))
        sorted_probs, order = torch.sort(kept_probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep_sorted = (before < top_p[:, None] * sorted_probs.sum(-1, keepdim=True)) | (
            top_p[:, None] >= 1)  # float drift must not cut a top_p = 1 row's tail
        keep = keep & torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep


def truncated_logprobs(logp: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor
                       ) -> torch.Tensor:
    """log q(y) of each row's token y under its distribution renormalised over its kept set
    plus y itself: logp[y] - logsumexp_{v in K + {y}} logp[v]. `logp` [N, V] is
    log softmax(logits / T), `keep` [N, V] the kept set K. For a token the row's own truncation
    kept (every token the engine samples) this is exactly the truncated distribution's
    logprob; a token outside K (one another policy's K held) gets a finite, small value
    instead of -inf. Differentiable in `logp`."""
    keep = keep.scatter(-1, tokens[:, None], True)
    norm = torch.logsumexp(logp.masked_fill(~keep, float("-inf")), dim=-1)
    return logp.gather(-1, tokens[:, None])[:, 0] - norm


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
           max_top_k: int = 0, any_top_p: bool = False,
           untruncated: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens int64 [B], logprobs float32 [B]).

    logp = log_softmax(logits / T) per row (T = 1 for greedy rows), p = exp(logp), truncated to
    `kept_set`. The token is the first, in vocabulary order, whose cumulative kept mass exceeds
    u * (kept mass), with u = uniform(seed, step): inverse-CDF sampling. The logprob is
    `truncated_logprobs` (the distribution sampled from), or logp[y] on the rows where
    `untruncated` [B] bool is True (and on rows that truncate nothing, where the two agree).
    `max_top_k` (the largest top_k of the batch) and `any_top_p` are the caller's Python
    values, so no step reads them back from the device."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    probs = logp.exp()
    keep = None
    if max_top_k > 0 or any_top_p:
        keep = kept_set(probs, top_k, top_p, max_top_k=max_top_k, any_top_p=any_top_p)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    tokens = _inverse_cdf(probs, uniform(seeds, steps))
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    lp = logp.gather(-1, tokens[:, None])[:, 0]
    if keep is None:
        return tokens, lp
    truncates = ((top_k > 0) | (top_p < 1)) & ~greedy
    if untruncated is not None:
        truncates = truncates & ~untruncated
    return tokens, torch.where(truncates, truncated_logprobs(logp, tokens, keep), lp)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The first index, in vocabulary order, whose cumulative mass exceeds u * (total mass).

    Two levels keep it exact enough and cheap: block sums cumulated in float64 pick the block,
    then a float32 cumsum of that block's entries picks the token (a float64 cumsum over a
    150k vocabulary costs ten times a float32 one; a float32 one drifts by ~V * 6e-8)."""
    rows, vocab = probs.shape
    pad = -vocab % block
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, block)
    block_cdf = blocks.sum(-1).double().cumsum(-1)
    total = block_cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # (clamped: a row of NaN probabilities, which the engine reports as failed, stays in range)
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.size(1) - 1)
    before = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)),
                         torch.zeros_like(target))
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, block))[:, 0].cumsum(-1)
    inner_total = inner[:, -1:]
    rest = torch.minimum((target - before).float(),
                         torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=block - 1)
    return (b * block + j)[:, 0].clamp_(max=vocab - 1)
