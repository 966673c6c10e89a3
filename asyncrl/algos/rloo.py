"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics:
Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"; as in TRL
and OpenRLHF).

Each sample's baseline is the mean reward of the *other* G-1 samples of its group, so the
baseline never depends on the sample it judges (an unbiased estimator, unlike a mean that
includes it) and no critic is needed:

    A_i = r_i - (sum_j r_j - r_i) / (G - 1)  =  G / (G - 1) * (r_i - mean_j r_j)

Rewards are not divided by the group's std (the difference from GRPO). Everything else is
GRPO's: the clipped ratio against the behaviour log-probs (which also corrects the off-policy
lag of async generation), the token mean over the step, the optional KL and entropy terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from asyncrl.algos.grpo import GRPO, validate_tis_cap
from asyncrl.config import ConfigError

if TYPE_CHECKING:
    from asyncrl.config import Config


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[N, G] rewards -> [N, G]: each reward minus the mean of the other G-1 of its group."""
    num_samples = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (num_samples - 1)
    return rewards - others_mean


@dataclass
class RLOOOptions:
    """RLOO needs two samples per prompt at least."""

    mismatch_tis_cap: float = 0.0
    """As GRPO's: 0 takes the clipped ratio against the behaviour log-probs; >= 1 corrects the
    engine/trainer mismatch with truncated importance weights (Yao et al. 2025)."""

    def validate(self, config: Config) -> None:
        validate_tis_cap(self.mismatch_tis_cap)
        g = config.rollout.num_generations_per_prompt
        if g < 2:
            raise ConfigError(
                f"rollout.num_generations_per_prompt: got {g}, algo.name=rloo needs >= 2 "
                "(each sample's baseline is the mean of the others)"
            )


class RLOO(GRPO):
    name: ClassVar[str] = "rloo"
    Options: ClassVar[type] = RLOOOptions

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return leave_one_out_advantages(rewards)
