"""GRPO: group-normalised advantages, the clipped surrogate against the behaviour
log-probs, AdamW. One optimizer step per training step over the step's N*G samples; an
optional KL penalty to the reference policy and entropy bonus in the loss."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from asyncrl.config import AlgoConfig
from asyncrl.core.advantages import group_advantages
from asyncrl.core.losses import ClippedPolicyLoss, kl_estimate, masked_mean
from asyncrl.core.types import Group
from asyncrl.models.policy import completion_logprobs
from asyncrl.train.update import ReferencePolicy, gradient_step, stack_groups


def regularise(
    loss: torch.Tensor,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    config: AlgoConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Adds the KL penalty to the reference (when `ref_logprobs` is given) and subtracts the
    entropy bonus; terms with a zero coefficient are not added at all (the loss stays
    bit-identical to the bare surrogate)."""
    stats = {}
    mean_entropy = masked_mean(entropy, mask)
    stats["entropy"] = float(mean_entropy.detach())
    if ref_logprobs is not None:
        kl = masked_mean(kl_estimate(logprobs, ref_logprobs, config.kl_estimator), mask)
        stats["kl_ref"] = float(kl.detach())
        loss = loss + config.kl_coef * kl
    if config.entropy_coef > 0:
        loss = loss - config.entropy_coef * mean_entropy
    return loss, stats


class GRPO:
    critic: PreTrainedModel | None = None
    critic_optimizer: torch.optim.Optimizer | None = None

    def __init__(
        self,
        model: PreTrainedModel,
        config: AlgoConfig,
        temperature: float,
        pad_id: int,
        reference: ReferencePolicy | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.temperature = temperature
        self.pad_id = pad_id
        self.reference = reference
        self.loss_fn = ClippedPolicyLoss(clip_eps=config.clip_eps)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step(self, groups: list[Group], step: int = 0) -> dict[str, float]:
        """One optimizer update on the step's groups; returns its metrics."""
        batch = stack_groups(groups, self.pad_id)
        rewards, mask = batch["rewards"], batch["completion_mask"]
        advantages = group_advantages(rewards).reshape(-1, 1)  # [B, 1]
        ref_logprobs = (
            self.reference.logprobs(batch, self.temperature, self.pad_id)
            if self.reference is not None
            else None
        )
        self.model.train()
        logprobs, entropy = completion_logprobs(
            self.model,
            batch["prompts"],
            batch["completion_ids"],
            mask,
            self.temperature,
            self.pad_id,
            with_entropy=True,
        )
        assert entropy is not None
        loss, stats = self.loss_fn(logprobs, batch["behaviour_logprobs"], advantages, mask)
        loss, extra = regularise(loss, logprobs, entropy, ref_logprobs, mask, self.config)
        grad_norm = gradient_step(
            loss, self.optimizer, self.model.parameters(), self.config.max_grad_norm
        )
        group_std = rewards.std(dim=1, unbiased=False)
        return {
            "loss": loss.item(),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "zero_variance_groups": float((group_std == 0).float().mean()),
            "grad_norm": grad_norm,
            "num_tokens": float(mask.sum()),
            "completion_len": float(mask.sum(1).float().mean()),
            **stats,
            **extra,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
