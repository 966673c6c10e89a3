"""GRPO's advantage and the clipped surrogate, against hand-computed numbers."""

import math

import pytest
import torch

from asyncrl.core.advantages import group_advantages
from asyncrl.core.losses import ClippedPolicyLoss, masked_mean


def test_group_advantage_matches_a_hand_computed_case():
    # group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> advantages [1, -1, -1, 1]
    # group [0.2, 0.2, 0.2, 0.2]: zero variance -> all zero (no learning signal)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2]])
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(group_advantages(rewards), expected, atol=1e-5)


def test_group_advantage_matches_a_slow_reference_loop():
    rewards = torch.rand(5, 7, generator=torch.Generator().manual_seed(0))
    got = group_advantages(rewards)
    for i in range(5):
        row = rewards[i].tolist()
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / len(row))
        for j in range(7):
            assert got[i, j].item() == pytest.approx((row[j] - mean) / (std + 1e-6), rel=1e-5)


def test_masked_mean_is_a_token_level_mean():
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert masked_mean(values, mask).item() == pytest.approx(16.0 / 4)


def test_clipped_loss_matches_hand_computed_values():
    # Three tokens, clip 0.2:
    #  ratio e^0.5=1.6487, A=+1 -> min(1.6487, 1.2) = 1.2 (clipped)
    #  ratio e^-0.5=0.6065, A=-1 -> min(-0.6065, -0.8) = -0.8 (clipped)
    #  ratio 1.0, A=+2 -> 2.0
    # loss = -(1.2 - 0.8 + 2.0) / 3 = -0.8
    logprobs = torch.tensor([[-1.0, -2.5, -1.0]])
    behaviour = torch.tensor([[-1.5, -2.0, -1.0]])
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ClippedPolicyLoss(clip_eps=0.2)(logprobs, behaviour, advantages, mask)
    assert loss.item() == pytest.approx(-0.8, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)


def test_clipped_loss_ignores_masked_tokens_and_its_gradient_is_the_policy_gradient():
    logprobs = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.0]])
    advantages = torch.tensor([[2.0], [2.0]])[:1]
    mask = torch.tensor([[True, False]])
    loss, _ = ClippedPolicyLoss(0.2)(logprobs, behaviour, advantages, mask)
    loss.backward()
    # on-policy (ratio 1): d(-ratio*A)/d logp = -A on the one real token, 0 on the masked one
    assert logprobs.grad.tolist() == [[-2.0, 0.0]]
    assert loss.item() == pytest.approx(-2.0)
