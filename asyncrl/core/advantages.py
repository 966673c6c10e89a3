"""Advantage estimators. Pure tensor functions."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantage.

    rewards: [N, G], one row per prompt group. Returns [N, G]:
    `(r - mean_g(r)) / (std_g(r) + eps)`, with the population std (divide by G). A group whose
    samples all got the same reward has zero advantage: it carries no learning signal.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)
