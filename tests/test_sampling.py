"""Batched sampling with per-request seeds, against hand-computed distributions."""

import math

import pytest
import torch

from tiller.engine.sampling import kept_set, sample, truncated_logprobs, uniform


def rows(n, **over):
    base = {"temperature": torch.ones(n), "top_k": torch.zeros(n, dtype=torch.long),
            "top_p": torch.ones(n), "seeds": torch.arange(n), "steps": torch.zeros(n,
                                                                                  dtype=torch.long)}
    return {**base, **over}


def draw(logits, **over):
    n = logits.size(0)
    r = rows(n, **over)
    return sample(logits, r["temperature"], r["top_k"], r["top_p"], r["seeds"], r["steps"],
                  max_top_k=int(r["top_k"].max()), any_top_p=bool((r["top_p"] < 1).any()))


def test_uniform_is_a_function_of_seed_and_step_and_looks_uniform():
    seeds = torch.arange(200_000, dtype=torch.long) * 7919 + 2**62
    u = uniform(seeds, torch.full_like(seeds, 3))
    assert torch.equal(u, uniform(seeds.clone(), torch.full_like(seeds, 3)))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.003
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 beyond 43.8
    other_step = uniform(seeds, torch.full_like(seeds, 4))
    assert abs(float(torch.corrcoef(torch.stack([u, other_step]))[0, 1])) < 0.01


def test_sampled_frequencies_match_the_tempered_softmax():
    n = 40_000
    logits = torch.tensor([[0.0, math.log(2), math.log(5), -1.0]]).repeat(n, 1)
    for t in (1.0, 0.5):
        tokens, logp = draw(logits, temperature=torch.full((n,), t))
        expected = torch.softmax(logits[0] / t, -1)
        freq = torch.bincount(tokens, minlength=4).double() / n
        assert torch.allclose(freq, expected.double(), atol=0.01)
        # the logprob is exactly log softmax(logits / T) of the sampled token
        assert torch.allclose(logp, torch.log_softmax(logits / t, -1).gather(
            -1, tokens[:, None])[:, 0])


def test_top_k_and_top_p_keep_the_hand_computed_sets():
    n = 20_000
    # probabilities 0.5, 0.3, 0.2 (in a shuffled vocab order)
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]])).repeat(n, 1)
    tokens, logp = draw(logits, top_k=torch.full((n,), 2, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=3).double() / n
    assert freq[0] == 0 and abs(float(freq[1]) - 0.5 / 0.8) < 0.012
    # top_p 0.6: mass before rank 1 is 0.5 < 0.6 (kept), before rank 2 it is 0.8 (dropped)
    tokens, _ = draw(logits, top_p=torch.full((n,), 0.6))
    assert set(tokens.tolist()) == {1, 2}


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0]])
    tokens, logp = draw(logits, temperature=torch.tensor([0.0, 0.0]))
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_a_rows_token_does_not_depend_on_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone = [draw(logits[i:i + 1], seeds=torch.tensor([100 + i]))[0].item() for i in range(6)]
    # the same rows in one batch, where other rows truncate and run greedy
    batch, _ = draw(torch.cat([logits, torch.randn(3, 50)]),
                    seeds=torch.tensor([100, 101, 102, 103, 104, 105, 1, 2, 3]),
                    top_k=torch.tensor([0] * 6 + [3, 0, 0]),
                    top_p=torch.tensor([1.0] * 6 + [1.0, 0.5, 1.0]),
                    temperature=torch.tensor([1.0] * 6 + [1.0, 1.0, 0.0]))
    assert batch[:6].tolist() == alone


@pytest.mark.parametrize("k", [1, 2])
def test_top_k_one_is_greedy_and_top_k_never_exceeds_k(k):
    torch.manual_seed(1)
    logits = torch.randn(1, 30).repeat(500, 1)
    tokens, _ = draw(logits, top_k=torch.full((500,), k, dtype=torch.long))
    top = torch.topk(logits[0], k).indices.tolist()
    assert set(tokens.tolist()) <= set(top) and len(set(tokens.tolist())) == k


def test_top_p_applies_to_the_renormalised_top_k_set():
    n = 20_000
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(n, 1)
    # top_k 3 keeps 4/9, 3/9, 2/9; top_p 0.5: mass before rank 1 is 4/9 < 0.5, before rank 2
    # it is 7/9: the kept set is {0, 1}, drawn 4/7 and 3/7 of the time
    tokens, _ = draw(logits, top_k=torch.full((n,), 3, dtype=torch.long),
                     top_p=torch.full((n,), 0.5))
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[2] == freq[3] == 0 and abs(float(freq[0]) - 4 / 7) < 0.012


def test_zero_probability_tokens_are_never_drawn_across_blocks():
    n, vocab = 30_000, 700  # three 256-blocks, the last one partial
    probs = torch.zeros(vocab)
    probs[[0, 255, 256, 511, 699]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    logits = torch.log(probs).repeat(n, 1)  # -inf elsewhere
    tokens, _ = draw(logits)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    assert set(tokens.tolist()) == {0, 255, 256, 511, 699}
    assert torch.allclose(freq[[0, 255, 256, 511, 699]],
                          torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64),
                          atol=0.01)


# p = [0.1, 0.5, 0.15, 0.25]. top_k 2 keeps {1, 3} (mass 0.75): the sampled distribution is
# 2/3, 1/3. top_p 0.5 keeps {1} (the mass before rank 2 is 0.5, not below 0.5): logprob 0.
P = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
TOP_K_2 = {1: math.log(2 / 3), 3: math.log(1 / 3)}  # -0.405465, -1.098612
UNTRUNCATED = {1: math.log(0.5), 3: math.log(0.25)}  # today's convention: -0.693147, -1.386294


def test_the_logprob_is_of_the_distribution_sampled_from():
    n = 400
    logits = torch.log(P).repeat(n, 1)
    tokens, logp = draw(logits, top_k=torch.full((n,), 2, dtype=torch.long),
                        seeds=torch.arange(n))
    assert set(tokens.tolist()) == {1, 3}
    assert torch.allclose(logp, torch.tensor([TOP_K_2[t] for t in tokens.tolist()]), atol=1e-6)
    tokens, logp = draw(logits, top_p=torch.full((n,), 0.5), seeds=torch.arange(n))
    assert set(tokens.tolist()) == {1} and torch.allclose(logp, torch.zeros(n), atol=1e-6)
    # T = 0.5: p^2 renormalised is [0.01, 0.25, 0.0225, 0.0625] / 0.345; top_k 2 keeps
    # 0.25 / 0.3125 = 0.8 and 0.0625 / 0.3125 = 0.2
    tokens, logp = draw(logits, top_k=torch.full((n,), 2, dtype=torch.long),
                        temperature=torch.full((n,), 0.5), seeds=torch.arange(n))
    hand = {1: math.log(0.8), 3: math.log(0.2)}
    assert set(tokens.tolist()) == {1, 3}
    assert torch.allclose(logp, torch.tensor([hand[t] for t in tokens.tolist()]), atol=1e-6)


def test_untruncated_rows_keep_the_logprob_before_truncation():
    logits = torch.log(P).repeat(200, 1)
    untruncated = torch.arange(200) % 2 == 0  # every other row: today's convention
    r = rows(200, top_k=torch.full((200,), 2, dtype=torch.long))
    tokens, logp = sample(logits, r["temperature"], r["top_k"], r["top_p"], r["seeds"],
                          r["steps"], max_top_k=2, untruncated=untruncated)
    hand = torch.tensor([(UNTRUNCATED if u else TOP_K_2)[t]
                         for t, u in zip(tokens.tolist(), untruncated.tolist(), strict=True)])
    assert set(tokens.tolist()) == {1, 3} and torch.allclose(logp, hand, atol=1e-6)
    # the tokens do not depend on what is reported
    assert torch.equal(tokens, draw(logits, top_k=r["top_k"])[0])


def test_kept_set_and_truncated_logprobs_hand_computed():
    logp = torch.log(P).repeat(3, 1)
    keep = kept_set(logp.exp(), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 1.0]),
                    max_top_k=2, any_top_p=True)
    assert keep.tolist() == [[False, True, False, True], [False, True, False, False],
                             [True, True, True, True]]
    got = truncated_logprobs(logp, torch.tensor([3, 1, 2]), keep)
    assert torch.allclose(got, torch.tensor([math.log(1 / 3), 0.0, math.log(0.15)]), atol=1e-6)
    # a token outside the kept set (another policy's): renormalised over K + {y}, finite:
    # top_p 0.5 keeps {1}; token 3 gets log(0.25 / (0.5 + 0.25)) = log(1/3)
    out = truncated_logprobs(logp[1:2], torch.tensor([3]), keep[1:2])
    assert torch.allclose(out, torch.tensor([math.log(1 / 3)]), atol=1e-6)
