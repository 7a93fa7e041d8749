"""The algorithm library against numbers computed by hand from ALGORITHMS.md."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial

import pytest
import torch
from pydantic import ValidationError

from tiller.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY,
    POLICY_LOSSES,
)
from tiller.algorithms.advantages import (
    gae_advantages,
    last_token_rewards,
    overlong_penalty,
    value_loss,
    whiten,
)
from tiller.algorithms.credit import (
    apply_key_steps,
    broadcast_turns,
    turn_advantages,
    turn_returns,
)
from tiller.algorithms.kl import kl_beta_at, kl_in_reward
from tiller.algorithms.losses import entropy_bonus
from tiller.algorithms.offpolicy import (
    correction_stats,
    mismatch_stats,
    staleness,
    staleness_stats,
)
from tiller.algorithms.passk import mean_pass_at_k, pass_at_k
from tiller.config import AlgorithmConfig, ConfigError, RLConfig, load_config
from tiller.train.batch import Batch, minibatches
from tiller.train.trainer import Trainer, compute_advantages


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    expected_t = torch.tensor(expected, dtype=actual.dtype)
    assert torch.allclose(actual, expected_t, atol=atol), f"{actual} != {expected_t}"


def test_registries():
    assert sorted(ADVANTAGES) == ["dr_grpo", "gae", "grpo", "reinforce_pp", "rloo"]
    assert sorted(POLICY_LOSSES) == ["cispo", "gspo", "ppo_clip", "sapo"]
    assert sorted(KL_ESTIMATORS) == ["abs", "k1", "k1+", "k2", "k3", "k3+"]
    assert sorted(AGGREGATIONS) == [
        "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean",
        "token-sum"
    ]
    assert sorted(OFF_POLICY) == [
        "decoupled", "decoupled_tis", "mis", "mis_mask", "none", "seq_is", "tis"
    ]
    with pytest.raises(KeyError, match="unknown advantage estimator"):
        ADVANTAGES["nope"]
    with pytest.raises(KeyError, match="unknown off-policy correction 'icepop'; choose one of: "
                       "decoupled, decoupled_tis, mis, mis_mask, none, seq_is, tis"):
        OFF_POLICY["icepop"]


# ---------------------------------------------------------------- outcome advantages
# group 0: [1, 0, 0, 1] (mean 0.5); group 1: a group of one; group 2: all-equal [0.5, 0.5];
# group 3 (not contiguous): [3, 0, 0] (mean 1).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 3.0, 0.5, 0.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 2, 3, 2, 3, 3])


def test_grpo():
    # group 0: var = 4 * 0.5^2 / 3 = 1/3, std = 0.577350; A = +-0.5 / 0.577350 = +-0.866025
    # group 3: var = (2^2 + 1 + 1) / 2 = 3, std = 1.732051; A = 2/1.732051 = 1.154701, -0.577350
    close(ADVANTAGES["grpo"](REWARDS, GROUPS),
          [0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 1.154701, 0.0, -0.577350, -0.577350])


def test_dr_grpo():
    # r - mean: group 0 +-0.5, group of one 0, all-equal 0, group 3: 3-1 = 2, 0-1 = -1
    close(ADVANTAGES["dr_grpo"](REWARDS, GROUPS),
          [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 2.0, 0.0, -1.0, -1.0])


def test_rloo():
    # group 0: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3   (= 4/3 * +-0.5)
    # group 3: 3 - mean(0, 0) = 3; 0 - mean(3, 0) = -1.5          (= 3/2 * (2, -1))
    close(ADVANTAGES["rloo"](REWARDS, GROUPS),
          [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 3.0, 0.0, -1.5, -1.5])


def test_reinforce_pp_whitens_token_weighted():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    tokens = torch.tensor([1, 1, 2, 0])
    # a = r - group mean = [0.5, -0.5, 1, -1]; N_tok = 4
    # mu = (0.5 - 0.5 + 2*1 + 0*(-1)) / 4 = 0.5; a - mu = [0, -1, 0.5, -1.5]
    # var = (1*0 + 1*1 + 2*0.25 + 0*2.25) / (4 - 1) = 0.5, std = 0.707107
    # A = [0, -1.414214, 0.707107, -2.121320]
    adv = ADVANTAGES["reinforce_pp"](rewards, groups, tokens=tokens)
    close(adv, [0.0, -1.414214, 0.707107, -2.121320])
    # the same as whitening the advantages broadcast to every generated token
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    a = torch.tensor([0.5, -0.5, 1.0, -1.0])[:, None].expand(4, 2)
    assert torch.allclose(whiten(a, mask)[:, 0] * mask[:, 0], adv * mask[:, 0], atol=1e-6)
    with pytest.raises(TypeError):
        ADVANTAGES["reinforce_pp"](rewards, groups)


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # masked values 1, 2, 3: mean 2, var = (1 + 0 + 1) / 2 = 1 -> -1, 0, 1; off-mask -> 0
    close(whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(whiten(x, torch.zeros_like(x)), torch.zeros_like(x))  # no NaN


# ---------------------------------------------------------------- GAE and the critic
def test_gae_skips_tool_span_and_empty_row():
    # row 0: generated, generated, tool output, tool output, generated (last), padding
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [0.0] * 6])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.8, 7.0], [3.0] * 6])
    rewards = torch.tensor([[0.0, 0.0, 5.0, 0.0, 1.0, 0.0], [1.0] * 6])  # off-mask: ignored
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    # t=4: delta = 1 + 0.9*0 - 0.8 = 0.2                          A4 = 0.2
    # t=1: next masked-in token is t=4 (tool span skipped, not terminal):
    #      delta = 0 + 0.9*0.8 - 0.4 = 0.32                       A1 = 0.32 + 0.45*0.2 = 0.41
    # t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14                      A0 = -0.14 + 0.45*0.41 = 0.0445
    close(adv, [[0.0445, 0.41, 0.0, 0.0, 0.2, 0.0], [0.0] * 6])
    # returns = A + V: 0.0445 + 0.5, 0.41 + 0.4, 0.2 + 0.8
    close(ret, [[0.5445, 0.81, 0.0, 0.0, 1.0, 0.0], [0.0] * 6])
    white, ret2 = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(white, whiten(adv, mask)) and torch.equal(ret, ret2)
    assert torch.isfinite(white).all()


def test_last_token_rewards():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [0.0] * 5, [1.0, 0.0, 0.0, 0.0, 0.0]])
    # reward on the last masked-in token; a row with no generated token gets nothing
    close(last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask),
          [[0.0, 0.0, 0.0, 1.0, 0.0], [0.0] * 5, [3.0, 0.0, 0.0, 0.0, 0.0]])


def test_value_loss_clipped():
    values = torch.tensor([[1.0, 0.0, 1.0, 5.0]])
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    # t0: V_clip = 0.5 + 0.2 = 0.7; sq = (1-2)^2 = 1, sq_clip = (0.7-2)^2 = 1.69 -> 0.845
    # t1: V_clip = 0.5 - 0.2 = 0.3; sq = 0, sq_clip = 0.09 -> 0.045
    # t2: V_clip = 0.7; sq = 0.25, sq_clip = 0.04 -> 0.5 * 0.25 = 0.125 (unclipped)
    # t3: masked out -> 0
    close(loss, [[0.845, 0.045, 0.125, 0.0]])
    close(stats["clipped"], [[1.0, 1.0, 0.0, 0.0]])


def test_overlong_penalty():
    # L_max = 10, L_cache = 4 -> free up to 6; 7: (6-7)/4 = -0.25; 8: -0.5; 10: -1; 11: -1
    close(overlong_penalty(torch.tensor([5, 6, 7, 8, 10, 11]), l_max=10, l_cache=4),
          [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


# ---------------------------------------------------------------- policy losses
def _logp(ratios: list[float]) -> torch.Tensor:
    return torch.tensor([ratios]).log().requires_grad_()


def test_ppo_clip_higher():
    logp = _logp([1.0, 1.5, 0.5, 1.5, 0.5, 1.25, 3.0])
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # rho=1,   A=+1: -min(1, 1)                       = -1
    # rho=1.5, A=+1: -min(1.5, 1.28)                  = -1.28  clipped high
    # rho=0.5, A=+1: -min(0.5, 0.8)                   = -0.5
    # rho=1.5, A=-1: -min(-1.5, -1.28)                = 1.5    (unbounded without dual clip)
    # rho=0.5, A=-1: -min(-0.5, -0.8)                 = 0.8    clipped low
    # rho=1.25,A=+1: 1.25 < 1.28, not clipped         = -1.25
    # masked-out token                                = 0
    close(loss, [[-1.0, -1.28, -0.5, 1.5, 0.8, -1.25, 0.0]])
    close(stats["clipped_high"], [[0, 1, 0, 0, 0, 0, 0]])
    close(stats["clipped_low"], [[0, 0, 0, 0, 1, 0, 0]])
    close(stats["clipped"], [[0, 1, 0, 0, 1, 0, 0]])
    close(stats["dual_clipped"], [[0] * 7])
    # d/dlogp of -rho*A is -rho*A on unclipped tokens, 0 where the clipped branch is taken
    loss.sum().backward()
    close(logp.grad, [[-1.0, 0.0, -0.5, 1.5, 0.0, -1.25, 0.0]])
    # symmetric PPO clips the rho=1.25 token at 1.2
    sym, sym_stats = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask)
    assert sym[0, 5].item() == pytest.approx(-1.2) and sym_stats["clipped_high"][0, 5] == 1


def test_ppo_dual_clip():
    logp = _logp([4.0, 1.5, 4.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = POLICY_LOSSES["ppo_clip"](
        logp, torch.zeros_like(logp), adv, mask, eps_high=0.28, clip_ratio_c=3.0
    )
    # rho=4,   A=-1: L = -min(-4, -1.28) = 4 -> min(4, -3*(-1)) = 3   dual clipped
    # rho=1.5, A=-1: L = 1.5 < 3, unchanged
    # rho=4,   A=+1: L = -min(4, 1.28) = -1.28 (dual clip only for A < 0)
    close(loss, [[3.0, 1.5, -1.28]])
    close(stats["dual_clipped"], [[1.0, 0.0, 0.0]])
    close(stats["clipped"], [[1.0, 0.0, 1.0]])
    loss.sum().backward()
    close(logp.grad, [[0.0, 1.5, 0.0]])  # the cap -c*A has no gradient
    with pytest.raises(ValueError):
        POLICY_LOSSES["ppo_clip"](logp, logp, adv, mask, clip_ratio_c=1.0)


def test_gspo_hand_values_and_per_token_gradient():
    logp_old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    # row 0: masked diffs 0.1, 0.3 (the masked-out 5.0 is ignored) -> s = exp(0.2) = 1.221403
    # row 1: no generated token -> s = exp(0 / 1) = 1, loss 0
    logp = (logp_old + torch.tensor([[0.1, 0.3, 5.0], [0.0, 0.0, 0.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[2.0], [1.0]])
    loss, _ = POLICY_LOSSES["gspo"](logp, logp_old, adv, mask, eps_low=0.3, eps_high=0.3)
    # s = 1.221403 < 1.3, unclipped: L = -2 * 1.221403 = -2.442806 on both generated tokens
    close(loss, [[-2.442806, -2.442806, 0.0], [0.0, 0.0, 0.0]])
    loss.sum().backward()
    # token form: d s_{i,t} / d logp_{i,t} = sg[s_i] * 1 -> grad = -A * s_i on EACH token
    # (the sequence-level form would give -A * s_i / |o_i| = -1.221403)
    close(logp.grad, [[-2.442806, -2.442806, 0.0], [0.0, 0.0, 0.0]])
    assert torch.isfinite(logp.grad).all()


def test_gspo_default_tiny_clip():
    logp_old = torch.zeros(2, 2)
    logp = torch.tensor([[0.3, 0.3], [-0.3, -0.3]])
    adv = torch.tensor([[1.0], [-1.0]])
    loss, stats = POLICY_LOSSES["gspo"](logp, logp_old, adv, torch.ones(2, 2))
    # row 0: s = e^0.3 = 1.35, A=+1 -> clipped at 1 + 4e-4: L = -1.0004
    # row 1: s = e^-0.3 = 0.74, A=-1 -> -min(-0.7408, -(1 - 3e-4)) = 0.9997
    close(loss, [[-1.0004, -1.0004], [0.9997, 0.9997]], atol=1e-6)
    close(stats["clipped_high"], [[1.0, 1.0], [0.0, 0.0]])
    close(stats["clipped_low"], [[0.0, 0.0], [1.0, 1.0]])


def test_gspo_equals_ppo_at_ratio_one():
    torch.manual_seed(0)
    logp_old = -torch.rand(3, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0] * 4])
    adv = torch.tensor([[0.7], [-1.3], [2.0]]) * mask
    grads, losses = [], []
    for name in ("ppo_clip", "gspo"):
        logp = logp_old.clone().requires_grad_()
        loss, _ = POLICY_LOSSES[name](logp, logp_old, adv, mask)
        loss.sum().backward()
        losses.append(loss.detach())
        grads.append(logp.grad)
    # rho = s = 1: L = -A and dL/dlogp_t = -A on every generated token, for both
    assert torch.allclose(losses[0], -adv) and torch.allclose(losses[1], -adv)
    assert torch.allclose(grads[0], -adv) and torch.allclose(grads[1], -adv)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    logp = _logp([1.0, 1.5, 0.5, 1.5, 0.5, 1.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = POLICY_LOSSES["cispo"](logp, torch.zeros_like(logp), adv, mask,
                                         eps_low=0.2, eps_high=0.28)
    # w = sg[clip(rho, 0.8, 1.28)] = [1, 1.28, 0.8, 1.28, 0.8]; L = -w A logp,
    # logp = [0, log 1.5 = 0.405465, log 0.5 = -0.693147, 0.405465, -0.693147]
    # t0: -1 * 1 * 0 = 0;              t1: -1.28 * 1 * 0.405465 = -0.518995
    # t2: -0.8 * -1 * -0.693147 = -0.554518;  t3: -1.28 * -1 * 0.405465 = 0.518995
    # t4: -0.8 * 1 * -0.693147 = 0.554518;    t5 masked: 0
    close(loss, [[0.0, -0.518995, -0.554518, 0.518995, 0.554518, 0.0]])
    close(stats["clipped_high"], [[0, 1, 0, 1, 0, 0]])  # weight truncated, whatever A's sign
    close(stats["clipped_low"], [[0, 0, 1, 0, 1, 0]])
    close(stats["clipped"], [[0, 1, 1, 1, 1, 0]])
    close(stats["dual_clipped"], [[0] * 6])
    loss.sum().backward()
    # the weight is stop-gradient: dL/dlogp = -w * A on EVERY token, clipped ones included
    # (ppo_clip gives 0 on t1 and t2, where its clipped branch is taken)
    close(logp.grad, [[-1.0, -1.28, 0.8, 1.28, -0.8, 0.0]])
    # defaults: eps_low = 1 leaves the lower bound open (0), eps_high = 0.28
    logp = _logp([0.1, 3.0])
    loss, stats = POLICY_LOSSES["cispo"](logp, torch.zeros_like(logp), torch.ones(1, 2),
                                         torch.ones(1, 2))
    loss.sum().backward()
    close(logp.grad, [[-0.1, -1.28]])  # w = 0.1 (not clipped), 1.28
    close(stats["clipped"], [[0.0, 1.0]])


def test_sapo_soft_gate_values_and_gradients():
    logp = _logp([1.0, 1.5, 1.5, 0.5, 1.0, 2.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, stats = POLICY_LOSSES["sapo"](logp, torch.zeros_like(logp), adv, mask,
                                        tau_pos=1.0, tau_neg=2.0)
    # s = sigmoid(tau (rho - 1)), L = -(4 / tau) s A; tau = 1 where A > 0, 2 where A < 0
    # t0: rho 1,   A +1, s = 0.5                 -> L = -4 * 0.5 = -2
    # t1: rho 1.5, A +1, s = sigmoid(0.5) = 0.622459 -> L = -4 * 0.622459 = -2.489837
    # t2: rho 1.5, A -1, s = sigmoid(1) = 0.731059   -> L = 2 * 0.731059 = 1.462117
    # t3: rho 0.5, A -1, s = sigmoid(-1) = 0.268941  -> L = 2 * 0.268941 = 0.537883
    # t4: rho 1,   A -1, s = 0.5                 -> L = 2 * 0.5 = 1;  t5 masked: 0
    close(loss, [[-2.0, -2.489837, 1.462117, 0.537883, 1.0, 0.0]])
    assert all(float(v.sum()) == 0.0 for v in stats.values())  # no hard clip anywhere
    loss.sum().backward()
    # dL/dlogp = -4 s (1 - s) rho A: -A at rho = 1 for either tau (t0, t4), damped elsewhere
    # t1: -4 * 0.622459 * 0.377541 * 1.5 = -1.410022
    # t2: 4 * 0.731059 * 0.268941 * 1.5 = 1.179672;  t3: 4 * 0.268941 * 0.731059 * 0.5 = 0.393224
    close(logp.grad, [[-1.0, -1.410022, 1.179672, 0.393224, 1.0, 0.0]])
    # the defaults are tau_pos = 1, tau_neg = 1.05: t2 becomes (4 / 1.05) sigmoid(0.525)
    default, _ = POLICY_LOSSES["sapo"](logp, torch.zeros_like(logp), adv, mask)
    expected = 4 / 1.05 / (1 + math.exp(-0.525))
    assert default[0, 2].item() == pytest.approx(expected, abs=1e-5)


def test_losses_take_exactly_their_declared_knobs():
    logp = torch.zeros(1, 2)
    args = (logp, logp, torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(TypeError):  # a misspelled knob is an error, not silently ignored
        POLICY_LOSSES["ppo_clip"](*args, eps_hgh=0.3)
    with pytest.raises(TypeError):  # GSPO has no dual clip
        POLICY_LOSSES["gspo"](*args, clip_ratio_c=3.0)
    with pytest.raises(TypeError):  # aggregations too
        AGGREGATIONS["token-mean"](logp, logp, total_token=1.0, total_seqs=1, l_max=1)
    assert POLICY_LOSSES.knobs == {
        "ppo_clip": ("eps_low", "eps_high", "clip_ratio_c"), "gspo": ("eps_low", "eps_high"),
        "cispo": ("eps_low", "eps_high"), "sapo": ("tau_pos", "tau_neg"),
    }
    # every declared knob and input is a parameter of the function, and every keyword
    # parameter of a policy loss is a declared knob (what it reads is what it declares)
    for registry in (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, OFF_POLICY):
        for name, fn in registry.items():
            params = inspect.signature(fn).parameters
            wanted = {k.rsplit(".", 1)[-1] for k in registry.knobs[name]} | set(
                registry.inputs[name])
            assert wanted <= set(params), (registry.kind, name)
    for name, fn in POLICY_LOSSES.items():
        params = list(inspect.signature(fn).parameters)
        assert params[4:] == list(POLICY_LOSSES.knobs[name]), name


@pytest.mark.parametrize(
    "settings, knob, why",
    [
        ({"policy_loss": "sapo", "eps_high": 0.3}, "eps_high",
         "read only by policy_loss 'cispo', 'gspo', 'ppo_clip'"),
        ({"tau_pos": 2.0}, "tau_pos", "read only by policy_loss 'sapo'"),
        ({"policy_loss": "cispo", "clip_ratio_c": 3.0}, "clip_ratio_c",
         "read only by policy_loss 'ppo_clip'"),
        ({"critic": {"lam": 0.9}}, "critic.lam", "read only by advantage 'gae'"),
        ({"aggregation": "token-sum", "l_max": 64}, "l_max",
         "read only by aggregation 'seq-mean-token-sum-norm' and overlong.mode 'soft'"),
        ({"is_cap": 3.0}, "is_cap",
         "read only by off_policy 'decoupled', 'decoupled_tis', 'seq_is', 'tis'"),
        ({"off_policy": "tis", "mis_high": 4.0}, "mis_high",
         "read only by off_policy 'mis', 'mis_mask'"),
        ({"off_policy": "mis", "is_cap": 2.0}, "is_cap",
         "read only by off_policy 'decoupled', 'decoupled_tis', 'seq_is', 'tis'"),
        ({"off_policy": "tis", "allow_uncorrected_off_policy": True},
         "allow_uncorrected_off_policy", "used only with off_policy: none (a correction is on)"),
    ],
)
def test_declared_knobs_drive_the_ignored_knob_rule(settings, knob, why):
    with pytest.raises(ConfigError) as e:
        AlgorithmConfig(**settings)
    assert str(e.value).startswith(f"config field rl.algorithm.{knob}: got ")
    assert str(e.value).endswith(f"the algorithm ignores it: {why}")


def test_new_losses_resolve_their_own_defaults():
    a = AlgorithmConfig(policy_loss="cispo", eps_high=2.0)
    assert (a.eps_low, a.eps_high, a.tau_pos, a.clip_ratio_c) == (1.0, 2.0, None, None)
    a = AlgorithmConfig(preset="dapo", policy_loss="sapo")  # the preset's clip range is dropped
    assert (a.eps_low, a.eps_high, a.tau_pos, a.tau_neg) == (None, None, 1.0, 1.05)
    with pytest.raises(ValidationError, match="greater than 0"):
        AlgorithmConfig(policy_loss="sapo", tau_neg=0.0)


def test_trainer_passes_the_declared_knobs():
    alg = AlgorithmConfig(policy_loss="sapo", tau_neg=2.0)
    assert POLICY_LOSSES.knob_values("sapo", alg) == {"tau_pos": 1.0, "tau_neg": 2.0}
    alg = AlgorithmConfig(preset="ppo")
    assert POLICY_LOSSES.knob_values("ppo_clip", alg) == {
        "eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": None}
    # dotted knobs read the section, keyed by the last part
    assert ADVANTAGES.knob_values("gae", alg) == {"gamma": 1.0, "lam": 0.95, "whiten": True}
    with pytest.raises(ValueError, match="advantage estimator 'gae' needs values"):
        ADVANTAGES.call("gae", alg, token_rewards=torch.zeros(1, 2), mask=torch.ones(1, 2),
                        eps=1e-6, values=None)


def test_new_losses_train_through_the_trainer(calc_model_dir):
    # On-policy with one mini-batch, rho = 1 on every token, so cispo's weight is 1 and sapo's
    # gate weight 4 s (1 - s) is 1: both give ppo_clip's gradient -A per token, hence the same
    # SGD update, through the trainer's real knob passing (sapo gets tau_pos / tau_neg).
    from tiller.models import load_model

    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    batch = Batch(torch.tensor([[3, 7, 8, 9], [3, 10, 11, 0]]),
                  torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), mask, torch.zeros(2, 4),
                  torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))

    def update(mini_batches: int = 1, rewards: tuple[float, float] = (1.0, 0.0), **alg
               ) -> torch.Tensor:
        batch.rewards = torch.tensor(rewards)
        model = load_model(calc_model_dir)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        trainer = Trainer(model)
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # delta = -gradient
        cfg = RLConfig(micro_batch_size=2, max_grad_norm=1e9, mini_batches=mini_batches,
                       algorithm={"advantage": "dr_grpo", **alg})
        trainer.rl_step(batch, cfg, l_max=4)
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - before

    ppo = update(policy_loss="ppo_clip")
    assert ppo.abs().max() > 1e-6
    assert torch.allclose(update(policy_loss="cispo"), ppo, atol=1e-6, rtol=1e-4)
    assert torch.allclose(update(policy_loss="sapo"), ppo, atol=1e-6, rtol=1e-4)
    # with two optimizer steps the second mini-batch (row 1) is off-policy (rho != 1), and
    # there the knobs reach the loss: a sharper gate or a tighter weight bound changes the
    # update. Row 1's advantage is +0.5 with rewards (0, 1), -0.5 with (1, 0).
    for loss, knob, values, rewards in [("sapo", "tau_pos", (1.0, 8.0), (0.0, 1.0)),
                                        ("sapo", "tau_neg", (1.05, 8.0), (1.0, 0.0)),
                                        ("cispo", "eps_low", (1.0, 1e-3), (1.0, 0.0)),
                                        ("cispo", "eps_high", (0.28, 1e-3), (1.0, 0.0))]:
        a, b = (update(2, rewards, policy_loss=loss, **{knob: v}) for v in values)
        assert (a - b).abs().max() > 1e-6, knob


def test_entropy_bonus():
    # L - 0.1 * H: 1 - 0.05, 2 - 0.1
    close(entropy_bonus(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 1.0]), 0.1), [0.95, 1.9])


# ---------------------------------------------------------------- KL
def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.7])
    ref = torch.tensor([-1.5, -1.0, -0.7])
    # d = ref - logp = [-0.5, 1.0, 0]
    close(KL_ESTIMATORS["k1"](logp, ref), [0.5, -1.0, 0.0])  # -d
    close(KL_ESTIMATORS["k2"](logp, ref), [0.125, 0.5, 0.0])  # d^2 / 2
    # exp(-0.5) + 0.5 - 1 = 0.106531; e - 1 - 1 = 0.718282; 1 - 0 - 1 = 0
    close(KL_ESTIMATORS["k3"](logp, ref), [0.106531, 0.718282, 0.0])


def test_kl_abs_and_straight_through_values_and_gradients():
    ref = torch.tensor([-1.5, -1.0, -0.7])
    # d = ref - logp = [-0.5, 1.0, 0]
    grads = {}
    for name in ("abs", "k1+", "k3+", "k1", "k2", "k3"):
        logp = torch.tensor([-1.0, -2.0, -0.7], requires_grad=True)
        value = KL_ESTIMATORS[name](logp, ref)
        value.sum().backward()
        grads[name] = logp.grad
        if name == "abs":
            close(value, [0.5, 1.0, 0.0])  # |d|
        if name == "k1+":
            close(value, [0.5, -1.0, 0.0])  # k1's value, -d
        if name == "k3+":
            close(value, [0.106531, 0.718282, 0.0])  # k3's value, exp(d) - d - 1
    close(grads["abs"], [1.0, -1.0, 0.0])  # sign(logp - ref)
    # k2's gradient d(0.5 d^2)/dlogp = -d = logp - ref = [0.5, -1, 0] ...
    close(grads["k2"], [0.5, -1.0, 0.0])
    # ... is the straight-through variants' gradient, not their own estimator's:
    # k1's is 1 everywhere, k3's is 1 - exp(d) = [0.393469, -1.718282, 0]
    close(grads["k1+"], [0.5, -1.0, 0.0])
    close(grads["k3+"], [0.5, -1.0, 0.0])
    close(grads["k1"], [1.0, 1.0, 1.0])
    close(grads["k3"], [0.393469, -1.718282, 0.0])


def test_kl_in_reward_and_schedule():
    rewards = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_in_reward(rewards, logp, ref, 0.1, mask)
    # k1 = [0.5, -1, -3]: 0 - 0.05, 1 + 0.1, masked token unchanged
    close(out, [[-0.05, 1.1, 1.0]])
    assert not out.requires_grad
    assert kl_beta_at(4, 0.1, off_after=5) == 0.1
    assert kl_beta_at(5, 0.1, off_after=5) == 0.0
    assert kl_beta_at(10_000, 0.1) == 0.1


# ---------------------------------------------------------------- aggregation
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 empty
AGG_NORM = {"total_tokens": 4.0, "total_seqs": 2, "l_max": 4}  # the empty row is no sequence


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 3.0),  # (1 + 2 + 4 + 5) / 4
        ("seq-mean-token-mean", 3.0),  # (3/2 + 9/2 + 0) / 2
        ("seq-mean-token-sum", 6.0),  # (3 + 9 + 0) / 2
        ("seq-mean-token-sum-norm", 1.5),  # 12 / (2 * 4)
        ("token-sum", 12.0),  # 1 + 2 + 4 + 5, no normalizer
    ],
)
def test_aggregation_values(mode: str, expected: float):
    assert AGGREGATIONS[mode](AGG_LOSS, AGG_MASK, **AGG_NORM).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_gradient_accumulation_equals_full_batch(mode: str):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    x = torch.randn(5, 6, 3)
    generated = [5, 2, 0, 3, 1]  # one prompt token, then the generated ones; a row with none
    mask = torch.zeros(5, 6)
    for i, n in enumerate(generated):
        mask[i, 1 : 1 + n] = 1.0
    mask[0, 3] = 0.0  # a tool-output token in the middle of row 0
    norm = {"total_tokens": float(mask.sum()), "total_seqs": 4, "l_max": 6}  # row 2 is empty

    def per_token_loss(rows: slice, width: int) -> torch.Tensor:
        return layer(x[rows, :width]).squeeze(-1) ** 2

    full = AGGREGATIONS[mode](per_token_loss(slice(0, 5), 6), mask, **norm)
    full.backward()
    full_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    total = 0.0
    # micro-batches trimmed to their longest row, as the trainer does
    for rows, width in [(slice(0, 2), 6), (slice(2, 4), 4), (slice(4, 5), 2)]:
        part = AGGREGATIONS[mode](per_token_loss(rows, width), mask[rows, :width], **norm)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-5)
    for p, g in zip(layer.parameters(), full_grads, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-6)


def _batch(mask: list[list[float]]) -> Batch:
    """A batch with this loss mask (ids, logprobs and rewards do not matter here)."""
    m = torch.tensor(mask)
    n = m.size(0)
    return Batch(torch.zeros_like(m, dtype=torch.long), torch.ones_like(m, dtype=torch.long), m,
                 torch.zeros_like(m), torch.zeros(n), torch.zeros(n, dtype=torch.long))


def test_empty_rows_do_not_count_as_sequences():
    # rows 0 and 1 have loss tokens; row 2 was masked out entirely (e.g. overlong: mask)
    mask = [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    [(_, _, totals)] = minibatches(_batch(mask), 1, 8, l_max=4)
    assert totals == {"total_tokens": 3.0, "total_seqs": 2, "l_max": 4}
    # so a seq-mean loss is the same with or without the masked row:
    # ((1 + 3) / 2 + 5 / 1) / 2 = 3.5, not (2 + 5) / 3 = 2.333
    loss = torch.tensor([[9.0, 1.0, 3.0], [9.0, 5.0, 9.0], [9.0, 9.0, 9.0]])
    with_empty = AGGREGATIONS["seq-mean-token-mean"](loss, torch.tensor(mask), **totals)
    [(_, _, totals2)] = minibatches(_batch(mask[:2]), 1, 8, l_max=4)
    without = AGGREGATIONS["seq-mean-token-mean"](loss[:2], torch.tensor(mask[:2]), **totals2)
    assert with_empty.item() == pytest.approx(3.5) and without.item() == pytest.approx(3.5)
    # per optimizer step: the strided mini-batches are rows {0, 2} and {1}: one sequence each
    steps = minibatches(_batch(mask), 2, 8, l_max=4)
    assert [t["total_seqs"] for _, _, t in steps] == [1, 1]


# ---------------------------------------------------------------- off-policy
# logp_old - logp_rollout on the masked tokens: row 0 [0.5, -1, 1], row 1 [-0.5, 2, -3]; the
# last column is off the mask (and must never count)
OLD = torch.tensor([[0.0, -1.0, 0.0, -2.0], [-0.5, 0.0, -3.0, 0.0]])
ROLLOUT = torch.tensor([[-0.5, 0.0, -1.0, -2.0], [0.0, -2.0, 0.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])


def test_off_policy_corrections_hand_computed():
    old = OLD.clone().requires_grad_(True)
    # rho = exp(delta): row 0 [1.648721, 0.367879, 2.718282], row 1 [0.606531, 7.389056, 0.049787]
    w, stats = OFF_POLICY["tis"](old, ROLLOUT, MASK, is_cap=2.0)  # 2.718 and 7.389 capped at 2
    close(w[:, :3], [[1.648721, 0.367879, 2.0], [0.606531, 2.0, 0.049787]])
    close(stats["truncated"], [[0, 0, 1, 0], [0, 1, 0, 0]])
    close(stats["masked"], [[0, 0, 0, 0], [0, 0, 0, 0]])
    assert not w.requires_grad
    # decoupled_tis: tis's weight with logp_prox as logp_old, logp_behaviour as logp_rollout
    prox, _ = OFF_POLICY["decoupled_tis"](old, ROLLOUT, MASK, is_cap=2.0)
    assert torch.equal(prox, w) and not prox.requires_grad
    # seq_is: sum of masked deltas row 0 = 0.5 -> exp = 1.648721, capped at 1.5;
    # row 1 = -1.5 -> exp(-1.5) = 0.223130; one weight broadcast to the row
    w, stats = OFF_POLICY["seq_is"](old, ROLLOUT, MASK, is_cap=1.5)
    close(w, [[1.5] * 4, [0.223130] * 4])
    close(stats["truncated"], [[1, 1, 1, 0], [0, 0, 0, 0]])
    w, stats = OFF_POLICY["none"](old, ROLLOUT, MASK)
    close(w, [[1.0] * 4, [1.0] * 4])


def test_mis_keeps_the_ratio_inside_the_band_and_removes_the_rest():
    # IcePop / Yao et al.: w = rho inside [0.5, 5], 0 outside. 0.367879 (row 0) and 7.389056,
    # 0.049787 (row 1) leave the band; the others keep their ratio, NOT 1
    w, stats = OFF_POLICY["mis"](OLD.clone().requires_grad_(True), ROLLOUT, MASK,
                                 mis_low=0.5, mis_high=5.0)
    close(w[:, :3], [[1.648721, 0, 2.718282], [0.606531, 0, 0]])
    close(stats["masked"], [[0, 1, 0, 0], [0, 1, 1, 0]])  # 3 of 6 masked tokens removed
    close(stats["truncated"], [[0, 0, 0, 0], [0, 0, 0, 0]])
    assert not w.requires_grad
    # the band is closed: rho exactly at a bound is kept (rho = 2 with mis_high 2)
    w, _ = OFF_POLICY["mis"](torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1),
                             torch.ones(1, 1), mis_low=0.5, mis_high=2.0)
    close(w, [[2.0]])
    # mis_low = 0: the one-sided masked IS w = rho * 1{rho <= C}, C = 2: 0.049787 stays
    w, _ = OFF_POLICY["mis"](OLD, ROLLOUT, MASK, mis_low=0.0, mis_high=2.0)
    close(w[:, :3], [[1.648721, 0.367879, 0], [0.606531, 0, 0.049787]])
    # mis_mask (tiller's mis before issue 19): the same band, but 1 inside it
    w, stats = OFF_POLICY["mis_mask"](OLD, ROLLOUT, MASK, mis_low=0.5, mis_high=5.0)
    close(w[:, :3], [[1, 0, 1], [1, 0, 0]])
    close(stats["masked"], [[0, 1, 0, 0], [0, 1, 1, 0]])


def test_decoupled_zeroes_tokens_above_the_cap_as_areal_does():
    # AReaL: w = rho = exp(logp_prox - logp_behaviour) where rho <= C, 0 above (not clamped to C)
    w, stats = OFF_POLICY["decoupled"](OLD.clone().requires_grad_(True), ROLLOUT, MASK,
                                       is_cap=2.0)
    close(w[:, :3], [[1.648721, 0.367879, 0], [0.606531, 0, 0.049787]])
    close(stats["masked"], [[0, 0, 1, 0], [0, 1, 0, 0]])  # 2.718 and 7.389 filtered out
    close(stats["truncated"], [[0, 0, 0, 0], [0, 0, 0, 0]])
    assert not w.requires_grad
    # its own default cap is 5 (AReaL's example configs): only 7.389 goes
    w, _ = OFF_POLICY["decoupled"](OLD, ROLLOUT, MASK)
    close(w[:, :3], [[1.648721, 0.367879, 2.718282], [0.606531, 0, 0.049787]])
    # rho exactly at the cap is kept
    w, _ = OFF_POLICY["decoupled"](torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1),
                                   torch.ones(1, 1), is_cap=2.0)
    close(w, [[2.0]])


def test_correction_stats_hand_computed():
    # tis C = 2 on the masked tokens: mean (1.648721 + 0.367879 + 2 + 0.606531 + 2 + 0.049787)
    # / 6 = 1.112153, max 2, truncated 2 of 6
    stats = correction_stats(*OFF_POLICY["tis"](OLD, ROLLOUT, MASK, is_cap=2.0), MASK)
    assert stats == pytest.approx({"is_weight_mean": 1.112153, "is_weight_max": 2.0,
                                   "is_truncated_frac": 1 / 3, "is_masked_frac": 0.0}, abs=1e-6)
    # mis [0.5, 5]: (1.648721 + 0 + 2.718282 + 0.606531 + 0 + 0) / 6 = 0.828922, half removed
    stats = correction_stats(*OFF_POLICY["mis"](OLD, ROLLOUT, MASK), MASK)  # defaults 0.5, 5
    assert stats == pytest.approx({"is_weight_mean": 0.828922, "is_weight_max": 2.718282,
                                   "is_masked_frac": 0.5, "is_truncated_frac": 0.0}, abs=1e-6)
    stats = correction_stats(*OFF_POLICY["mis_mask"](OLD, ROLLOUT, MASK), MASK)
    assert stats == {"is_weight_mean": 0.5, "is_weight_max": 1.0, "is_masked_frac": 0.5,
                     "is_truncated_frac": 0.0}
    empty = correction_stats(*OFF_POLICY["mis"](OLD, ROLLOUT, MASK * 0), MASK * 0)
    assert empty == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_masked_frac": 0.0,
                     "is_truncated_frac": 0.0}


def test_staleness_weighted_mismatch_hand_computed():
    # |delta| per masked token: row 0 [0.5, 1, 1], row 1 [0.5, 2, 3], row 2 [0.2, 0.2],
    # row 3 [4] (version unknown: left out); staleness 1, 3, 0, -1
    old = torch.cat([OLD, torch.tensor([[0.2, 0.2, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0]])])
    rollout = torch.cat([ROLLOUT, torch.zeros(2, 4)])
    mask = torch.cat([MASK, torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])])
    stats = staleness_stats(rollout, old, mask, torch.tensor([1, 3, 0, -1]))
    # weighted: (1 * 2.5 + 3 * 5.5) / (1 * 3 + 3 * 3) = 19 / 12; stale rows: 8 / 6; fresh: 0.2
    assert stats == pytest.approx({"staleness_weighted_mismatch": 19 / 12,
                                   "mismatch_stale": 8 / 6, "mismatch_fresh": 0.2}, abs=1e-6)
    # nothing stale: the weighted mismatch is 0 and mismatch_stale is absent
    fresh = staleness_stats(rollout, old, mask, torch.tensor([0, 0, 0, -1]))
    assert fresh == pytest.approx({"staleness_weighted_mismatch": 0.0,
                                   "mismatch_fresh": (2.5 + 5.5 + 0.4) / 8}, abs=1e-6)
    assert staleness_stats(rollout, old, mask, torch.full((4,), -1)) == {
        "staleness_weighted_mismatch": 0.0}


def test_off_policy_config_resolves_validates_and_replaces_tis_c():
    a = AlgorithmConfig(off_policy="mis")
    assert (a.mis_low, a.mis_high, a.is_cap) == (0.5, 5.0, None)  # the function's defaults
    assert AlgorithmConfig(off_policy="seq_is").is_cap == 2.0
    assert AlgorithmConfig(off_policy="decoupled_tis").is_cap == 2.0
    assert AlgorithmConfig(off_policy="decoupled").is_cap == 5.0  # AReaL's
    assert AlgorithmConfig(off_policy="decoupled", is_cap=3.0).is_cap == 3.0
    assert AlgorithmConfig().off_policy == "none" and AlgorithmConfig().is_cap is None
    assert OFF_POLICY.knob_values("mis", AlgorithmConfig(off_policy="mis", mis_low=0.25)) == {
        "mis_low": 0.25, "mis_high": 5.0}
    assert AlgorithmConfig(off_policy="mis", mis_low=0.0).mis_low == 0.0  # one-sided
    with pytest.raises(ValidationError, match="less than 1"):  # 0 <= lo < 1 < hi
        AlgorithmConfig(off_policy="mis", mis_low=1.0)
    with pytest.raises(ValidationError, match="greater than 1"):
        AlgorithmConfig(off_policy="mis_mask", mis_high=0.9)
    with pytest.raises(ValidationError, match="expected one of: decoupled, decoupled_tis, mis, "
                       "mis_mask, none, seq_is, tis"):
        AlgorithmConfig(off_policy="icepop")
    with pytest.raises(ConfigError) as e:
        load_config("configs/calculator.yaml", ["rl.algorithm.tis_c=2.0"])
    assert str(e.value) == ("config field rl.algorithm.tis_c: got 2.0; it was replaced by "
                            "off_policy: tis with is_cap: C (the same weight "
                            "min(exp(logp_old - logp_rollout), C)); for tis_c: null, remove it "
                            "(off_policy: none is the default)")
    with pytest.raises(ConfigError, match="got None; it was replaced by off_policy: tis"):
        AlgorithmConfig(tis_c=None)  # a config saved before the change
    with pytest.raises(ConfigError, match="config field rl.algorithm.off_policy: got 'icepop'; "
                       "expected one of: decoupled, decoupled_tis, mis, mis_mask, none, "
                       "seq_is, tis"):
        load_config("configs/calculator.yaml", ["rl.algorithm.off_policy=icepop"])


def test_mismatch_stats():
    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0]])
    stats = mismatch_stats(rollout, old, torch.tensor([[1.0, 1.0, 0.0]]))
    # |diff| on masked tokens: 0.5, 1.0 -> mean 0.75, max 1.0
    # weights exp(-0.5) = 0.606531, exp(1) = 2.718282 -> mean 1.662406
    assert stats["logp_mismatch_mean"] == pytest.approx(0.75)
    assert stats["logp_mismatch_max"] == pytest.approx(1.0)
    assert stats["importance_weight_mean"] == pytest.approx(1.662406, abs=1e-6)
    assert stats["importance_weight_max"] == pytest.approx(2.718282, abs=1e-6)
    empty = mismatch_stats(rollout, old, torch.zeros(1, 3))
    assert empty == {"logp_mismatch_mean": 0.0, "logp_mismatch_max": 0.0,
                     "importance_weight_mean": 0.0, "importance_weight_max": 0.0}


def test_staleness_counts_oldest_version():
    assert staleness(7, [5, 6, 7]) == 2  # a partial rollout spanning versions 5..7
    assert staleness(3, (3,)) == 0


# ---------------------------------------------------------------- turn-level credit
def test_turn_returns():
    # gamma = 0.5: R2 = 2; R1 = 0 + 0.5*2 = 1; R0 = 1 + 0.5*1 = 1.5
    close(turn_returns(torch.tensor([[1.0, 0.0, 2.0]]), 0.5), [[1.5, 1.0, 2.0]])


TURN_R = torch.tensor([[1.5, 1.0, 2.0], [0.5, 0.0, 0.0], [3.0, 0.0, 0.0]])
TURN_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
TURN_GROUPS = torch.tensor([0, 0, 1])  # rows 0, 1 share a task; row 2 is a group of one


def estimator(name: str) -> Callable[..., torch.Tensor]:
    """The outcome estimator as the trainer binds it: exactly its declared inputs (no knobs)."""
    return partial(ADVANTAGES.call, name, None, eps=1e-6)


TURN_TOKENS = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 0.0], [3.0, 0.0, 0.0]])


def test_turn_advantages_per_turn():
    adv = turn_advantages(TURN_R, TURN_MASK, TURN_TOKENS, TURN_GROUPS, estimator("dr_grpo"))
    # turn 0 of group 0: {1.5, 0.5}, mean 1 -> +-0.5; turn 1: {1, 0}, mean 0.5 -> +-0.5
    # turn 2: only row 0 has it -> 0; row 2 is alone -> 0; padded turns -> 0
    close(adv, [[0.5, 0.5, 0.0], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
    adv = turn_advantages(TURN_R, TURN_MASK, TURN_TOKENS, TURN_GROUPS, estimator("grpo"))
    # std of two values 0.5 apart from their mean: sqrt(2 * 0.25 / 1) = 0.707107
    # -> 0.5 / 0.707107 = 0.707107
    close(adv, [[0.707107, 0.707107, 0.0], [-0.707107, -0.707107, 0.0], [0.0, 0.0, 0.0]])


def test_turn_advantages_pooled():
    adv = turn_advantages(TURN_R, TURN_MASK, TURN_TOKENS, TURN_GROUPS, estimator("dr_grpo"),
                          baseline="pooled")
    # group 0's real turns {1.5, 1, 2, 0.5, 0}: mean 1 -> [0.5, 0, 1], [-0.5, -1, pad 0]
    close(adv, [[0.5, 0.0, 1.0], [-0.5, -1.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError):
        turn_advantages(TURN_R, TURN_MASK, TURN_TOKENS, TURN_GROUPS, estimator("grpo"),
                        baseline="per_token")


def test_broadcast_turns_and_key_steps():
    # turn 0 spans tokens [1, 3), turn 1 spans [5, 6); prompt and tool output get 0
    out = broadcast_turns(torch.tensor([[0.5, -1.0]]), [[(1, 3), (5, 6)]], width=7)
    close(out, [[0.0, 0.5, 0.5, 0.0, 0.0, -1.0, 0.0]])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    close(apply_key_steps(mask, torch.tensor([1.0, 0.0, 1.0, 1.0])), [1.0, 0.0, 0.0, 1.0])


# ---------------------------------------------------------------- compute_advantages
def _turn_batch() -> Batch:
    """Row 0: turns [1, 3) and [4, 5) (token 3 is tool output), per-turn rewards [0.5, 0],
    outcome 1. Row 1: one turn [1, 2), per-turn reward 0.2, outcome 0. One group."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    return Batch(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), mask,
                 torch.zeros(2, 6), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                 (((1, 3), (4, 5)), ((1, 2),)), torch.tensor([[0.5, 0.0], [0.2, 0.0]]))


def test_turn_credit_wraps_reinforce_pp():
    # turn rewards + outcome on the last turn: row 0 [0.5, 1], row 1 [0.2]; gamma_turn 1:
    # R = [1.5, 1], [0.2]. Per-turn group mean: turn 0 {1.5, 0.2} -> a = +-0.65; turn 1 -> 0.
    # Whitened over tokens (turn weights 2, 1 and 1 loss tokens, N_tok = 4):
    # mu = (2 * 0.65 + 0 - 0.65) / 4 = 0.1625; deviations 0.4875, -0.1625, -0.8125;
    # var = (2 * 0.4875^2 + 0.1625^2 + 0.8125^2) / 3 = 0.387292, std = 0.622328
    # A = 0.783351, -0.261117, -1.305585 on each turn's tokens
    adv, returns = compute_advantages(_turn_batch(), AlgorithmConfig(advantage="reinforce_pp"))
    close(adv, [[0.0, 0.783351, 0.783351, 0.0, -0.261117, 0.0],
                [0.0, -1.305585, 0.0, 0.0, 0.0, 0.0]])
    assert returns is None
    # the same as whitening dr_grpo's turn advantages broadcast to the tokens
    dr, _ = compute_advantages(_turn_batch(), AlgorithmConfig(advantage="dr_grpo"))
    mask = _turn_batch().loss_mask
    assert torch.allclose(adv, whiten(dr, mask), atol=1e-6)


def test_a_new_estimator_needs_no_trainer_change():
    # registered with the inputs it takes, it is chosen by config and wrapped in turn credit
    # by what it declares (no branch on its name): A = 2 r, no baseline
    @ADVANTAGES.register("test_double", inputs=("rewards",))
    def double(rewards: torch.Tensor) -> torch.Tensor:
        return 2 * rewards

    try:
        alg = AlgorithmConfig(advantage="test_double")
        assert alg.credit.gamma_turn == 1.0  # outcome estimators get the turn-credit defaults
        # turn credit: R = [1.5, 1] and [0.2] -> 2 R on each turn's tokens
        adv, _ = compute_advantages(_turn_batch(), alg)
        close(adv, [[0.0, 3.0, 3.0, 0.0, 2.0, 0.0], [0.0, 0.4, 0.0, 0.0, 0.0, 0.0]])
        # outcome rewards [1, 0] when the verifier gives no turn rewards
        batch = _turn_batch()
        batch.turn_rewards = None
        adv, _ = compute_advantages(batch, alg)
        close(adv, [[0.0, 2.0, 2.0, 0.0, 2.0, 0.0], [0.0] * 6])
    finally:
        del ADVANTAGES["test_double"]


# ---------------------------------------------------------------- pass@k
def test_pass_at_k():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every k-subset has a correct one
    assert pass_at_k(4, 0, 2) == 0.0
    exact = 1 - math.comb(100, 100) / math.comb(200, 100)
    assert pass_at_k(200, 100, 100) == pytest.approx(exact)  # no overflow for large n
    assert mean_pass_at_k([(5, 2), (4, 0)], 2) == pytest.approx(0.35)  # (0.7 + 0) / 2
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
