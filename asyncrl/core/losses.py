"""Policy losses. Pure tensor functions and small classes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is true (token-level mean)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class ClippedPolicyLoss:
    """PPO's clipped surrogate against the *behaviour* log-probs.

    The ratio `exp(logp - behaviour_logp)` is both the PPO trust-region ratio and the
    importance-sampling correction for the off-policy lag of async generation: the behaviour
    policy is whatever weights version generated the token. Loss is the token-level mean over
    all real completion tokens of the batch.
    """

    clip_eps: float = 0.2

    def __call__(
        self,
        logprobs: torch.Tensor,  # [B, T] under the current policy
        behaviour_logprobs: torch.Tensor,  # [B, T] recorded at generation
        advantages: torch.Tensor,  # [B, T] or [B, 1]
        mask: torch.Tensor,  # [B, T] bool
    ) -> tuple[torch.Tensor, dict[str, float]]:
        log_ratio = logprobs - behaviour_logprobs
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
        surrogate = torch.minimum(ratio * advantages, clipped * advantages)
        loss = -masked_mean(surrogate, mask)
        with torch.no_grad():
            was_clipped = (ratio * advantages != surrogate).float()
            approx_kl = (ratio - 1.0) - log_ratio  # k3 estimator of KL(behaviour || current)
            real = mask.bool()
            stats = {
                "clip_frac": float(masked_mean(was_clipped, mask)),
                "approx_kl": float(masked_mean(approx_kl, mask)),
                "ratio_mean": float(masked_mean(ratio, mask)),
                "ratio_max": float(ratio[real].max()) if real.any() else 1.0,
            }
        return loss, stats
