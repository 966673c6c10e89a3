"""PPO's pieces against hand-computed numbers and slow reference loops: GAE (episode ends,
the bootstrap value), the LM advantage pipeline, the clipped value loss, importance weights,
the KL estimators, explained variance, the minibatch shuffle."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.algos.ppo import minibatches
from asyncrl.core.advantages import gae, last_token, ppo_advantages, terminal_rewards, whiten
from asyncrl.core.losses import (
    ClippedPolicyLoss,
    ClippedValueLoss,
    explained_variance,
    kl_estimate,
    truncated_is_weights,
)


def test_gae_matches_a_hand_computed_case_with_episode_ends_and_a_bootstrap_value():
    # gamma 0.9, lam 0.8, so gamma*lam = 0.72.
    # Row 0, one episode ending at t=2 (last_value unused):
    #   d2 = 1 - 0.7 = 0.3                    A2 = 0.3
    #   d1 = 0.9*0.7 - 0.6 = 0.03             A1 = 0.03 + 0.72*0.3 = 0.246
    #   d0 = 0.9*0.6 - 0.5 = 0.04             A0 = 0.04 + 0.72*0.246 = 0.21712
    # Row 1, an episode ending at t=0, then one cut off at T=3 (bootstrapped with V=0.5):
    #   d2 = 0.5 + 0.9*0.5 - 0.3 = 0.65       A2 = 0.65
    #   d1 = 0.9*0.3 - 0.4 = -0.13            A1 = -0.13 + 0.72*0.65 = 0.338
    #   d0 = 1 - 0.2 = 0.8 (episode end)      A0 = 0.8 (nothing carried over the end)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.5]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 0.3]])
    dones = torch.tensor([[0, 0, 1], [1, 0, 0]], dtype=torch.bool)
    last = torch.tensor([123.0, 0.5])
    advantages, returns = gae(rewards, values, dones, last, gamma=0.9, lam=0.8)
    expected = torch.tensor([[0.21712, 0.246, 0.3], [0.8, 0.338, 0.65]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, expected + values, atol=1e-6)


def slow_gae(rewards, values, dones, last, gamma, lam):
    """From the definition, not the recursion: A_t = sum_k (gamma*lam)^k delta_{t+k}, summed
    until the episode ends; plain Python floats."""
    out = []
    for r, v, d, lv in zip(rewards, values, dones, last, strict=True):
        T = len(r)
        deltas = []
        for t in range(T):
            nxt = 0.0 if d[t] else (lv if t == T - 1 else v[t + 1])
            deltas.append(r[t] + gamma * nxt - v[t])
        row = []
        for t in range(T):
            total, k = 0.0, 0
            while t + k < T:
                total += (gamma * lam) ** k * deltas[t + k]
                if d[t + k]:
                    break
                k += 1
            row.append(total)
        out.append(row)
    return out


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.7), (0.99, 0.0), (0.97, 1.0)])
def test_gae_matches_a_slow_reference_loop(gamma, lam):
    g = torch.Generator().manual_seed(7)
    rewards = torch.randn(6, 9, generator=g, dtype=torch.float64)
    values = torch.randn(6, 9, generator=g, dtype=torch.float64)
    dones = torch.rand(6, 9, generator=g) < 0.25
    last = torch.randn(6, generator=g, dtype=torch.float64)
    got, _ = gae(rewards, values, dones, last, gamma, lam)
    want = slow_gae(rewards.tolist(), values.tolist(), dones.tolist(), last.tolist(), gamma, lam)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-10)


def test_gae_extremes_are_td_errors_and_monte_carlo_returns():
    rewards = torch.tensor([[0.5, -1.0, 2.0]])
    values = torch.tensor([[0.1, 0.2, 0.3]])
    dones = torch.tensor([[False, False, True]])
    td, _ = gae(rewards, values, dones, torch.zeros(1), gamma=0.5, lam=0.0)
    assert torch.allclose(td, torch.tensor([[0.5 + 0.1 - 0.1, -1.0 + 0.15 - 0.2, 2.0 - 0.3]]))
    mc, returns = gae(rewards, values, dones, torch.zeros(1), gamma=0.5, lam=1.0)
    discounted = torch.tensor([[0.5 - 0.5 + 0.5, -1.0 + 1.0, 2.0]])  # sum_l 0.5^l r_{t+l}
    assert torch.allclose(returns, discounted, atol=1e-6)
    assert torch.allclose(mc, discounted - values, atol=1e-6)


def test_an_lm_completion_is_one_episode_rewarded_on_its_last_real_token():
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    ends = [[False, True, False], [False, False, True], [False, False, False]]
    assert last_token(mask).tolist() == ends
    assert terminal_rewards(torch.tensor([1.0, 0.5, 9.0]), mask).tolist() == [
        [0.0, 1.0, 0.0],
        [0.0, 0.0, 0.5],
        [0.0, 0.0, 0.0],
    ]
    # gamma = lam = 1: A_t = R - V_t; the garbage value on the padding (9) is ignored
    values = torch.tensor([[0.5, 0.8, 9.0], [0.0, 0.25, 0.5], [1.0, 1.0, 1.0]])
    seq = torch.tensor([1.0, 0.5, 0.0])
    advantages, returns, raw = ppo_advantages(seq, values, mask, 1.0, 1.0, normalize=False)
    assert torch.allclose(raw, torch.tensor([[0.5, 0.2, 0.0], [0.5, 0.25, 0.0], [0, 0, 0.0]]))
    assert torch.equal(advantages, raw)
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0, 0, 0.0]]))
    # a per-token penalty (the KL in the reward) is subtracted where the tokens are real
    penalty = torch.full((3, 3), 0.1)
    _, returns, _ = ppo_advantages(seq, values, mask, 1.0, 1.0, False, penalty)
    assert torch.allclose(returns[0], torch.tensor([0.8, 0.9, 0.0]))
    whitened, _, _ = ppo_advantages(seq, values, mask, 1.0, 1.0, normalize=True)
    real = whitened[mask]
    assert real.mean().abs() < 1e-6 and real.std(unbiased=False) == pytest.approx(1.0, abs=1e-5)
    assert (whitened[~mask] == 0).all()


def test_whiten_uses_only_real_tokens():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    assert torch.allclose(whiten(values, mask), torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6)


def test_clipped_value_loss_matches_hand_computed_values():
    # eps 0.2. Token 1: V=1.0, V_old=0.5, R=2 -> (1-2)^2=1, V_clip=0.7 -> 1.69; max 1.69
    #          Token 2: V=0.0, V_old=0.5, R=0 -> 0,         V_clip=0.3 -> 0.09; max 0.09
    # loss = 0.5 * (1.69 + 0.09) / 2 = 0.445; both tokens took the clipped term
    values = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = ClippedValueLoss(0.2)(values, old, returns, mask)
    assert loss.item() == pytest.approx(0.445) and stats["value_clip_frac"] == 1.0
    plain, stats = ClippedValueLoss(0.0)(values, old, returns, mask)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2) and stats["value_clip_frac"] == 0
    # inside the clip range the loss is plain squared error
    near = torch.tensor([[0.6, 0.45, 0.0]])
    inside, _ = ClippedValueLoss(0.2)(near, old, returns, mask)
    assert inside.item() == pytest.approx(0.5 * ((0.6 - 2) ** 2 + 0.45**2) / 2)


def test_importance_weights_scale_the_surrogate_and_are_truncated():
    # ratio 1 (on-policy w.r.t. the proximal policy), A = 1, weights 0.5 and 2:
    # loss = -(0.5*1 + 2*1) / 2 = -1.25, and the gradient of each token is scaled by its weight
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logprobs.detach().clone()
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = ClippedPolicyLoss(0.2)(logprobs, old, torch.ones(1, 1), mask, weights)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25)
    assert logprobs.grad.tolist() == [[-0.25, -1.0]]
    # TIS: pi_prox / pi_behaviour = e^1, e^0, e^-1; truncated at 2
    proximal = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, 5.0]])
    real = torch.tensor([[True, True, True, False]])
    w, stats = truncated_is_weights(proximal, behaviour, real, cap=2.0)
    assert torch.allclose(w[0, :3], torch.tensor([2.0, 1.0, math.exp(-1)]))
    assert stats["is_ratio_max"] == pytest.approx(math.e)
    assert stats["is_ratio_min"] == pytest.approx(math.exp(-1))
    assert stats["is_truncated_frac"] == pytest.approx(1 / 3)
    w, stats = truncated_is_weights(proximal, behaviour, real, cap=0.0)
    assert w[0, 0].item() == pytest.approx(math.e) and stats["is_truncated_frac"] == 0.0


def test_kl_estimators_match_hand_values_and_the_exact_kl_in_expectation():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1) + 1 - 1)
    # exact KL(p || q) of two categoricals vs both estimators on 200k samples from p
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    exact = float((p * (p / q).log()).sum())
    samples = torch.multinomial(
        p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    lp, lq = p.log()[samples], q.log()[samples]
    for estimator in ("k1", "k3"):
        estimate = kl_estimate(lp, lq, estimator)
        assert float(estimate.mean()) == pytest.approx(exact, rel=0.02)
    assert (kl_estimate(lp, lq, "k3") >= 0).all()


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)
    worse = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # residual var 8/3 vs var 2/3
    assert explained_variance(worse, returns, mask) == pytest.approx(1 - 4.0)


def test_minibatches_partition_the_samples_reproducibly():
    parts = minibatches(10, 3, seed=1, step=4, epoch=0)
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    again = minibatches(10, 3, seed=1, step=4, epoch=0)
    assert all(torch.equal(a, b) for a, b in zip(parts, again, strict=True))
    other = minibatches(10, 3, seed=1, step=4, epoch=1)
    assert not all(torch.equal(a, b) for a, b in zip(parts, other, strict=True))
    assert [p.tolist() for p in minibatches(5, 1, 0, 0, 0)] == [[0, 1, 2, 3, 4]]
    random.seed(0)  # the shuffle draws from no global RNG
    state = torch.get_rng_state()
    minibatches(10, 2, 0, 0, 0)
    assert torch.equal(state, torch.get_rng_state())
