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
    H_K       = -sum_{v in K} q_v log q_v,  q = softmax of logp over K  (0 log 0 := 0).

The rank boundary m_p is found from `torch.topk` of a growing k (256, x4, ...) until some rank
below k reaches the bound; only rows whose nucleus is longer than the largest prefix tried
(the first 256 * 4^i above V / 8) take a topk of the whole row. topk returns exactly the
sorted prefix, and on the CPU cumulative sums of a prefix are those of the whole row, so K is
the set `kept_set` finds (tests/test_truncation.py checks equality on random logits with
ties). (A GPU's parallel scan picks its tree by row
length and row count, so there, as between any two batch shapes, a token within rounding of
the bound can fall on either side.) K is described per row by a cut value c and the count M:
K = {p_v >= c}, or where more than M tokens reach c, {p_v > c} and the first (by vocabulary
index) of those tied at c. So the backward pass rebuilds K from logp without keeping any
[rows, V] tensor: the autograd function saves logp itself (which log_softmax keeps anyway)
and a few numbers per row, and works through the rows CHUNK_ELEMENTS at a time in both
passes. Gradients (K is fixed, not differentiated through):

    d logp_K(y) / d logp_v = 1{v = y} - softmax_{K + {y}}(logp)_v
    d H_K / d logp_v       = -q_v (log q_v + H_K)   for v in K with q_v > 0, 0 elsewhere
                                                    (a -inf logit in K when top_k reaches it).
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
    """(c, M) per row of `p` [C, V]: the kept set is the first M ranks (the module docstring's),
    {p >= c} where that has M tokens, else {p > c} and the first of {p = c} by vocabulary index
    (c = +inf for M = 0)."""
    rows, vocab = p.shape
    m = torch.full((rows,), vocab, dtype=torch.long, device=p.device)
    cut = p.amin(-1)  # M = V: the smallest p
    kept = p
    if top_k > 0:
        cut = torch.topk(p, min(top_k, vocab), dim=-1).values[:, -1]
        above = p >= cut[:, None]
        m = above.sum(-1)
        kept = torch.where(above, p, 0.0)
    if top_p < 1:
        m_p, value = _top_p_rank(kept, top_p)
        inside = m_p < m  # the top-p boundary comes first
        m = torch.where(inside, m_p, m)
        cut = torch.where(inside, value, cut)
    return torch.where(m > 0, cut, float("inf")), m


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
        part = kept if todo.numel() == rows else kept[todo]
        s = torch.topk(part, k, dim=-1).values  # sorted: the first k ranks
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


def kept_mask(p: torch.Tensor, cut: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[C, V] bool: the kept set `kept_cut` described."""
    keep = p >= cut[:, None]
    partial = (keep.sum(-1) > m).nonzero()[:, 0]  # rows that keep only some of their ties
    if partial.numel():
        sub, c = p[partial], cut[partial, None]
        above, at = sub > c, sub == c
        ties = m[partial] - above.sum(-1)  # how many of the tied tokens are kept
        keep[partial] = above | (at & (at.cumsum(-1) <= ties[:, None]))
    return keep


class _Truncated(torch.autograd.Function):
    """`truncated_token_logprobs`, chunk by chunk in both passes (module docstring): the
    normaliser over K + {y} is the one over K when y is in K (on-policy, always: the same
    number the sampler computes), else logaddexp of it and logp_y."""

    @staticmethod
    def forward(ctx: Any, logp: torch.Tensor, ids: torch.Tensor, top_k: int, top_p: float,
                with_entropy: bool, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = logp.size(0)
        out, ent = logp.new_empty(n), logp.new_zeros(n)
        cut, m = logp.new_empty(n), torch.empty(n, dtype=torch.long, device=logp.device)
        norm_y, norm_k = logp.new_empty(n), logp.new_empty(n)
        for a in range(0, n, rows):
            lp, y, b = logp[a:a + rows], ids[a:a + rows, None], slice(a, a + rows)
            p = lp.exp()
            cut[b], m[b] = kept_cut(p, top_k, top_p)
            keep = kept_mask(p, cut[b], m[b])
            drop = ~keep
            norm_k[b] = torch.logsumexp(lp.masked_fill(drop, float("-inf")), -1)
            lp_y = lp.gather(-1, y)[:, 0]
            norm_y[b] = torch.where(keep.gather(-1, y)[:, 0], norm_k[b],
                                    torch.logaddexp(norm_k[b], lp_y))
            out[b] = lp_y - norm_y[b]
            if with_entropy:  # q log q := 0 where q = 0 (a -inf logit kept by top_k)
                logq = lp - norm_k[b, None]
                q = logq.exp()
                ent[b] = -(q * logq).masked_fill_(drop | (q == 0), 0.0).sum(-1)
        ctx.save_for_backward(logp, ids, cut, m, norm_y, norm_k, ent)
        ctx.rows, ctx.with_entropy = rows, with_entropy
        return out, ent

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor, g_ent: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        logp, ids, cut, m, norm_y, norm_k, ent = ctx.saved_tensors
        grad = torch.empty_like(logp)
        rows = ctx.rows
        for a in range(0, logp.size(0), rows):
            lp, y, b = logp[a:a + rows], ids[a:a + rows, None], slice(a, a + rows)
            drop = ~kept_mask(lp.exp(), cut[b], m[b])
            g = torch.sub(lp, norm_y[b, None], out=grad[b]).exp_().masked_fill_(drop, 0.0)
            g.scatter_(-1, y, (lp.gather(-1, y) - norm_y[b, None]).exp())  # softmax on K + {y}
            g.mul_(-g_out[b, None]).scatter_add_(-1, y, g_out[b, None])  # from 1{v = y}
            if ctx.with_entropy and g_ent is not None:
                logq = lp - norm_k[b, None]
                h = logq + ent[b, None]
                q = logq.exp_()  # 0 where logq = -inf: that term is 0, not 0 * -inf
                h.mul_(q).mul_(g_ent[b, None]).masked_fill_(drop | (q == 0), 0.0)
                g.sub_(h)
        return grad, None, None, None, None, None
