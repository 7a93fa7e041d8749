"""The trainer's chunked logprobs under top-k / top-p (train/truncation.py): the same kept set as
the engine's sampler (`sampling.kept_set`), the same values and gradients as plain autograd
through a masked logsumexp, hand-computed cases, and the engine's reported logprob."""

import math

import pytest
import torch

from tiller.engine.sampling import kept_set, sample, truncated_logprobs
from tiller.train.truncation import FIRST_K, kept_cut, kept_mask, truncated_token_logprobs

V = 3000  # FIRST_K = 256 ranks, then 1024, then the whole row (4 x 1024 > V / 2)


def logits(kind: str, n: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[n, vocab] seeded logits: `peaked` (nuclei of ~50-280 tokens at top_p 0.9), `wide`
    (~580-770: a second topk), `flat` (~2700 of 3000 at top_p 0.95: the whole row), `ties`
    (rounded to integers, so many tokens share each probability) and `few` (only 3 values)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=dtype)
    return {"peaked": lambda: z * 3.0, "wide": lambda: z * 2.0, "flat": lambda: z * 0.3,
            "ties": lambda: (z * 2.0).round(), "few": lambda: z.clamp(-1, 1).round()}[kind]()


def engine_set(p: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The sampler's kept set, with the trainer's single top_k / top_p on every row."""
    n = p.size(0)
    return kept_set(p, torch.full((n,), top_k), torch.full((n,), top_p, dtype=p.dtype),
                    max_top_k=top_k, any_top_p=top_p < 1)


SETTINGS = [(0, 0.9), (0, 0.95), (0, 0.5), (7, 1.0), (40, 0.8), (1, 0.5), (0, 1.0),
            (V, 0.9), (V + 5, 1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["peaked", "wide", "flat", "ties", "few"])
@pytest.mark.parametrize("top_k, top_p", SETTINGS)
def test_kept_set_equals_the_samplers(kind, dtype, top_k, top_p):
    p = torch.softmax(logits(kind, 24, V, dtype), -1)
    cut, count = kept_cut(p, top_k, top_p)
    assert torch.equal(kept_mask(p, cut, count), engine_set(p, top_k, top_p))


def test_the_cases_reach_every_branch():
    """The settings above cover a topk of FIRST_K, a second one, the whole row, and rows that
    keep only some of the tokens tied at their cut (where the order of ties decides)."""
    sizes = {kind: engine_set(torch.softmax(logits(kind, 24, V, torch.float64), -1), 0, top_p)
             .sum(-1) for kind, top_p in [("peaked", 0.9), ("wide", 0.9), ("flat", 0.95)]}
    assert int(sizes["peaked"].min()) < FIRST_K < int(sizes["peaked"].max())
    assert int(sizes["wide"].min()) > FIRST_K and int(sizes["wide"].max()) < 4 * FIRST_K
    assert int(sizes["flat"].min()) > 4 * FIRST_K  # past the second topk: the whole row
    for kind, top_k, top_p in [("ties", 0, 0.9), ("few", 0, 0.5), ("few", 40, 0.8)]:
        p = torch.softmax(logits(kind, 24, V, torch.float64), -1)
        cut, count = kept_cut(p, top_k, top_p)
        assert int(((p >= cut[:, None]).sum(-1) > count).sum()) >= 12  # partial ties


def naive(logp: torch.Tensor, ids: torch.Tensor, top_k: int, top_p: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the sampler's kept set on whole rows, plain autograd through the masked
    logsumexps (the trainer's code before the chunked function)."""
    keep = engine_set(logp.detach().exp(), top_k, top_p)
    logq = logp - torch.logsumexp(logp.masked_fill(~keep, float("-inf")), -1, keepdim=True)
    ent = -torch.where(keep, logq.exp() * logq, torch.zeros_like(logq)).sum(-1)
    return truncated_logprobs(logp, ids, keep), ent


def rows_and_tokens(n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-probabilities of n rows, half of them with ties, and a token per row: the
    most likely one (always kept) on even rows, a uniform one (mostly outside K) on odd rows."""
    z = torch.cat([logits("peaked", n - n // 2, vocab, torch.float64, seed=1) / 2,
                   logits("ties", n // 2, vocab, torch.float64, seed=2)])
    logp = torch.log_softmax(z, -1)
    g = torch.Generator().manual_seed(3)
    ids = torch.where(torch.arange(n) % 2 == 0, logp.argmax(-1),
                      torch.randint(0, vocab, (n,), generator=g))
    return logp, ids


@pytest.mark.parametrize("chunk_elements", [1, 3 * 50, 8 * 50 + 7, 10**9])  # rows 1, 3, 8, all
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (6, 1.0), (10, 0.7), (50, 0.3)])
def test_values_and_gradients_equal_plain_autograd(chunk_elements, with_entropy, top_k, top_p):
    n, vocab = 37, 50
    logp, ids = rows_and_tokens(n, vocab)
    g = torch.Generator().manual_seed(4)
    w_out, w_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(
        n, generator=g, dtype=torch.float64)
    leaf = logp.clone().requires_grad_()
    out, ent = truncated_token_logprobs(leaf, ids, top_k, top_p, with_entropy, chunk_elements)
    ref_leaf = logp.clone().requires_grad_()
    ref_out, ref_ent = naive(ref_leaf, ids, top_k, top_p)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12)
    if with_entropy:
        assert torch.allclose(ent, ref_ent, rtol=0, atol=1e-12)
        loss = (w_out * out + w_ent * ent).sum()
        ref_loss = (w_out * ref_out + w_ent * ref_ent).sum()
    else:
        assert ent is None
        loss, ref_loss = (w_out * out).sum(), (w_out * ref_out).sum()
    grad, = torch.autograd.grad(loss, leaf)
    ref_grad, = torch.autograd.grad(ref_loss, ref_leaf)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)
    assert float(grad.abs().sum()) > 1.0  # not vacuous


@pytest.mark.parametrize("top_k, top_p", [(8, 1.0), (10, 1.0), (9, 0.999999)])  # last: K stops
def test_minus_inf_logits_in_the_kept_set_give_finite_entropy_and_gradients(top_k, top_p):
    """A masked vocabulary (-inf logits) with top_k at or above the finite count keeps the
    -inf entries in K: q log q was 0 * -inf = NaN in the entropy and its gradient. With
    0 log 0 := 0 both equal plain autograd over the 6 finite entries alone."""
    n, vocab, finite = 5, 10, torch.tensor([0, 2, 3, 5, 6, 9])
    z = torch.full((n, vocab), float("-inf"), dtype=torch.float64)
    z[:, finite] = torch.randn(n, finite.numel(), generator=torch.Generator().manual_seed(5),
                               dtype=torch.float64)
    logp = torch.log_softmax(z, -1)
    ids = finite[torch.arange(n) % finite.numel()]
    w = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    leaf = logp.clone().requires_grad_()
    out, ent = truncated_token_logprobs(leaf, ids, top_k, top_p, True)
    grad, = torch.autograd.grad((w * out + ent).sum(), leaf)
    ref_leaf = logp[:, finite].clone().requires_grad_()  # the kept set: every finite entry
    logq = ref_leaf - torch.logsumexp(ref_leaf, -1, keepdim=True)
    ref_ent = -(logq.exp() * logq).sum(-1)
    ref_out = logq.gather(-1, torch.searchsorted(finite, ids)[:, None])[:, 0]
    ref_grad, = torch.autograd.grad((w * ref_out + ref_ent).sum(), ref_leaf)
    assert torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert torch.allclose(ent, ref_ent, rtol=0, atol=1e-12) and float(ent.detach().min()) > 0.1
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12)
    assert torch.allclose(grad[:, finite], ref_grad, rtol=0, atol=1e-12)
    assert grad[:, [1, 4, 7, 8]].eq(0).all()


def test_gradcheck_against_finite_differences():
    logp, ids = rows_and_tokens(6, 9)
    logp = logp[:3].clone().requires_grad_()  # the untied rows: a step of 1e-6 keeps K
    assert torch.autograd.gradcheck(
        lambda lp: truncated_token_logprobs(lp, ids[:3], 4, 0.8, True, chunk_elements=9),
        (logp,), eps=1e-6, atol=1e-8)


P = [0.1, 0.5, 0.15, 0.25]


@pytest.mark.parametrize("probs, top_k, top_p, ids, expected, entropy", [
    # top-k 2 keeps {1, 3} (mass 0.75); top-p 0.5 of it (0.375) is reached after token 1: K = {1}
    (P, 2, 0.5, [1, 3], [0.0, -1.0986122887], 0.0),  # token 3 outside: log(0.25 / 0.75)
    # top-k 3 keeps {1, 3, 2} (mass 0.9, bound 0.72): 0.5, then 0.75 >= 0.72: K = {1, 3}
    (P, 3, 0.8, [3, 2], [-1.0986122887, -1.7917594692], 0.6365141683),  # log(1/3), log(1/6)
    # four tied tokens, top-p 0.5: the first two by index are kept (0.25, then 0.5 >= 0.5)
    ([0.25] * 4, 0, 0.5, [1, 2], [-0.6931471806, -1.0986122887], 0.6931471806),
])
def test_hand_computed(probs, top_k, top_p, ids, expected, entropy):
    logp = torch.log(torch.tensor([probs, probs], dtype=torch.float64)).requires_grad_()
    out, ent = truncated_token_logprobs(logp, torch.tensor(ids), top_k, top_p, True)
    assert out.tolist() == pytest.approx(expected, abs=1e-9)
    assert ent.tolist() == pytest.approx([entropy, entropy], abs=1e-9)


def test_hand_computed_gradient():
    """d logp_K(y) / d logp_v = 1{v = y} - softmax over K + {y}: K = {1, 3} (as above), y = 3
    gives (0, -2/3, 0, 1 - 1/3); d H_K / d logp_v = -q_v (log q_v + H_K) on K."""
    logp = torch.log(torch.tensor([P], dtype=torch.float64)).requires_grad_()
    out, ent = truncated_token_logprobs(logp, torch.tensor([3]), 3, 0.8, True)
    grad, = torch.autograd.grad(out.sum(), logp, retain_graph=True)
    assert grad[0].tolist() == pytest.approx([0.0, -2 / 3, 0.0, 2 / 3], abs=1e-12)
    grad, = torch.autograd.grad(ent.sum(), logp)
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert grad[0].tolist() == pytest.approx(
        [0.0, -2 / 3 * (math.log(2 / 3) + h), 0.0, -1 / 3 * (math.log(1 / 3) + h)], abs=1e-12)


@pytest.mark.parametrize("kind", ["peaked", "ties", "flat"])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (40, 0.7)])
def test_the_samplers_reported_logprob_is_recomputed(kind, top_k, top_p):
    """On-policy: the logprob `sampling.sample` reports for the token it drew (float32, as the
    engine runs) is what the trainer's function computes from the same logits."""
    n = 64
    z = logits(kind, n, V, torch.float32, seed=5)
    tokens, reported = sample(z, torch.full((n,), 0.7), torch.full((n,), top_k),
                              torch.full((n,), top_p), torch.arange(n), torch.zeros(n).long(),
                              max_top_k=top_k, any_top_p=top_p < 1)
    logp = torch.log_softmax(z / 0.7, -1)
    out, _ = truncated_token_logprobs(logp, tokens, top_k, top_p, False, chunk_elements=5 * V)
    assert torch.allclose(out, reported, rtol=0, atol=1e-6)
    assert float((out - logp.gather(-1, tokens[:, None])[:, 0]).max()) > 1e-2  # truncated
