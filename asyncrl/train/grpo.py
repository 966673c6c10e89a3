"""GRPO: group-normalised advantages, the clipped surrogate against the behaviour
log-probs, AdamW. One optimizer step per training step over the step's N*G samples; an
optional KL penalty to the reference policy and entropy bonus in the loss."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from asyncrl.config import AlgoConfig
from asyncrl.core.advantages import group_advantages
from asyncrl.core.losses import ClippedPolicyLoss
from asyncrl.core.types import Group
from asyncrl.train.update import (
    ReferencePolicy,
    batch_logprobs,
    gradient_step,
    regularise,
    stack_groups,
)


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
        logprobs, entropy = batch_logprobs(self.model, batch, self.temperature, self.pad_id)
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
