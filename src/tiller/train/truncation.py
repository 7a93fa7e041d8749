"""The trainer's log-probabilities and entropies under the sampler's top-k / top-p truncation,
in memory bounded by a chunk of rows and without sorting every row's vocabulary.

For a position with log-probabilities logp = log softmax(z / T) [V], p = exp(logp), the kept
set K is `sampling.kept_set`'s: the first M ranks of p sorted decreasingly (ties by vocabulary
index), M = min(m_k, m_p), where

    m_k = #{v : p_v >= the top_k-th largest p}          (top_k > 0; else V)
    m_p = the first rank j with S_j - s_j >= top_p * P  (top_p < 1; else V)

with s the top-k-kept p sorted decreasingly, S its cumulative sum and P = sum_v of the kept p.
Then

    logp_K(y) = logp_y - logsumexp_{v in K + {y}} logp_v
    H_K       = -sum_{v in K} q_v log q_v,  q = softmax of logp over K.

The rank boundary m_p is found from `torch.topk` of a growing k (256, x4, ...) until some rank
below k reaches the bound; only rows whose nucleus spans most of the vocabulary fall back to a
whole sort. topk returns exactly the sorted prefix, and cumulative sums of a prefix are those
of the whole row, so K is the set `kept_set` finds (tests/test_truncation.py checks equality on
random logits with ties). K is described per row by a cut value c and a count s of ties kept,
K = {p_v > c} + the first s (by index) of {p_v = c}, so the backward pass rebuilds it from
logp without keeping any [rows, V] tensor: the autograd function saves logp itself (which
log_softmax keeps anyway) and a few numbers per row, and works through the rows CHUNK_ELEMENTS
at a time in both passes. Gradients (K is fixed, not differentiated through):

    d logp_K(y) / d logp_v = 1{v = y} - softmax_{K + {y}}(logp)_v
    d H_K / d logp_v       = -q_v (log q_v + H_K)   for v in K, 0 elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ELEMENTS = 1 << 23  # rows x vocabulary per chunk: 32 MiB per float32 temporary
FIRST_K = 256  # the first topk tried for the top-p boundary; then x4, then the whole row


def truncated_token_logprobs(logp: torch.Tensor, ids: torch.Tensor, top_k: int,
                             top_p: float, with_entropy: bool,
                             chunk_elements: int = CHUNK_ELEMENTS
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_K(ids) [N], H_K [N] or None) for `logp` [N, V] (log softmax(z / T)) and `ids`
    [N] under top_k (0: off) and top_p (1: off): the module docstring's formulas,
    differentiable in `logp`."""
    rows = max(1, chunk_elements // logp.size(-1))
    out, ent = _Truncated.apply(logp, ids, top_k, top_p, with_entropy, rows)
    return out, ent if with_entropy else None


def kept_cut(p: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, s) per row of `p` [C, V]: the kept set is {p > c} plus the first s, by vocabulary
    index, of {p = c} (the module docstring's M ranks; c = +inf and s = 0 for M = 0)."""
    rows, vocab = p.shape
    m = torch.full((rows,), vocab, dtype=torch.long, device=p.device)
    cut = p.amin(-1)  # M = V: the smallest p
    kept = p
    if top_k > 0:
        cut = torch.topk(p, min(top_k, vocab), dim=-1).values[:, -1]
        above = p >= cut[:, None]
        m = above.sum(-1)
        kept = torch.where(above, p, torch.zeros_like(p))
    if top_p < 1:
        m_p, value = _top_p_rank(kept, top_p)
        inside = m_p < m  # the top-p boundary comes first
        m = torch.where(inside, m_p, m)
        cut = torch.where(inside, value, cut)
    cut = torch.where(m > 0, cut, torch.full_like(cut, float("inf")))
    ties = m - (p > cut[:, None]).sum(-1)
    return cut, ties


def _top_p_rank(kept: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_p, the kept p at rank m_p - 1) per row of `kept` [C, V] (top-k-dropped entries 0):
    m_p is the first rank j with S_j - s_j >= top_p * P (V if none), found in topk prefixes of
    growing length."""
    rows, vocab = kept.shape
    bound = torch.tensor(top_p, dtype=kept.dtype, device=kept.device) * kept.sum(-1)
    m_p = torch.empty(rows, dtype=torch.long, device=kept.device)
    value = torch.empty(rows, dtype=kept.dtype, device=kept.device)
    todo = torch.arange(rows, device=kept.device)
    k = min(FIRST_K, vocab)
    while todo.numel():
        s = torch.topk(kept[todo], k, dim=-1).values  # sorted: the first k ranks
        reached = (s.cumsum(-1) - s) >= bound[todo, None]
        found = reached.any(-1) | (k == vocab)
        first = torch.where(reached.any(-1), reached.int().argmax(-1),
                            torch.full_like(todo, vocab))
        done = todo[found]
        m_p[done] = first[found]
        value[done] = s[found].gather(-1, (first[found] - 1).clamp(min=0)[:, None])[:, 0]
        todo = todo[~found]
        k = vocab if 4 * k > vocab // 2 else 4 * k
    return m_p, value


def kept_mask(p: torch.Tensor, cut: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """[C, V] bool: the kept set `kept_cut` described."""
    above, at = p > cut[:, None], p == cut[:, None]
    keep = above | at
    partial = (at.sum(-1) > ties).nonzero()[:, 0]  # rows that keep only some of their ties
    if partial.numel():
        first = at[partial].cumsum(-1) <= ties[partial, None]
        keep[partial] = above[partial] | (at[partial] & first)
    return keep


class _Truncated(torch.autograd.Function):
    """`truncated_token_logprobs`, chunk by chunk in both passes (module docstring)."""

    @staticmethod
    def forward(ctx: Any, logp: torch.Tensor, ids: torch.Tensor, top_k: int, top_p: float,
                with_entropy: bool, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = logp.size(0)
        out, ent = logp.new_empty(n), logp.new_zeros(n)
        cut, ties = logp.new_empty(n), torch.empty(n, dtype=torch.long, device=logp.device)
        norm_y, norm_k = logp.new_empty(n), logp.new_empty(n)
        for a in range(0, n, rows):
            lp, y = logp[a:a + rows], ids[a:a + rows, None]
            p = lp.exp()
            cut[a:a + rows], ties[a:a + rows] = kept_cut(p, top_k, top_p)
            keep = kept_mask(p, cut[a:a + rows], ties[a:a + rows])
            norm_y[a:a + rows] = torch.logsumexp(
                lp.masked_fill(~keep.scatter(-1, y, True), float("-inf")), dim=-1)
            out[a:a + rows] = lp.gather(-1, y)[:, 0] - norm_y[a:a + rows]
            if with_entropy:
                norm_k[a:a + rows] = torch.logsumexp(lp.masked_fill(~keep, float("-inf")), -1)
                logq = lp - norm_k[a:a + rows, None]
                ent[a:a + rows] = -torch.where(keep, logq.exp() * logq,
                                               torch.zeros_like(logq)).sum(-1)
        ctx.save_for_backward(logp, ids, cut, ties, norm_y, norm_k, ent)
        ctx.rows, ctx.with_entropy = rows, with_entropy
        return out, ent

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor, g_ent: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        logp, ids, cut, ties, norm_y, norm_k, ent = ctx.saved_tensors
        grad = torch.empty_like(logp)
        rows = ctx.rows
        for a in range(0, logp.size(0), rows):
            lp, y, b = logp[a:a + rows], ids[a:a + rows, None], slice(a, a + rows)
            keep = kept_mask(lp.exp(), cut[b], ties[b])
            q_y = torch.where(keep.scatter(-1, y, True), (lp - norm_y[b, None]).exp(),
                              torch.zeros_like(lp))
            g = -g_out[b, None] * q_y
            g.scatter_add_(-1, y, g_out[b, None])
            if ctx.with_entropy and g_ent is not None:
                logq = lp - norm_k[b, None]
                g -= torch.where(keep, g_ent[b, None] * logq.exp() * (logq + ent[b, None]),
                                 torch.zeros_like(lp))
            grad[b] = g
        return grad, None, None, None, None, None
