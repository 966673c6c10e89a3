"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics:
Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"; as in TRL
and OpenRLHF).

Each sample's baseline is the mean reward of the *other* G-1 samples of its group, so the
baseline never depends on the sample it judges (an unbiased estimator, unlike a mean that
includes it) and no critic is needed:

    A_i = r_i - (sum_j r_j - r_i) / (G - 1)  =  G / (G - 1) * (r_i - mean_j r_j)

Rewards are not divided by the group's std (the difference from GRPO). Everything else is
GRPO's: the clipped ratio against the behaviour log-probs (which also corrects the off-policy
lag of async generation), the token mean over the step, the optional KL term; the entropy
bonus is scaled by the std of the step's advantages (`algo.entropy_scale`).

G is the group's samples, not its rows: a sample with segments (`Group.row_samples`) has one
reward, one advantage, and every one of its rows is trained with it (GRPO's `step`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from asyncrl.algos.grpo import GRPO
from asyncrl.config.algos import RLOOOptions


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[N, G] rewards -> [N, G]: each sample's reward minus the mean of the other G-1 of its
    group."""
    num_samples = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (num_samples - 1)
    return rewards - others_mean


class RLOO(GRPO):
    name: ClassVar[str] = "rloo"
    Options: ClassVar[type] = RLOOOptions

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return leave_one_out_advantages(rewards)

    def entropy_coef(self, advantages: torch.Tensor) -> float:
        """`algo.entropy_coef` times the std of the step's [N, G] advantages, one per sample
        however many rows it has (`algo.entropy_scale`):
        the bonus keeps its proportion to the policy-gradient term, which for RLOO shrinks
        with the rewards' spread (a step whose rewards are all equal gets no bonus)."""
        coef = self.config.entropy_coef
        if coef == 0 or self.config.options.entropy_scale == "none":
            return coef
        return coef * float(advantages.std(unbiased=False))
