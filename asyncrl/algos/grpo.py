"""GRPO: group-normalised advantages, the clipped surrogate against the behaviour
log-probs, AdamW. One optimizer step per training step over the step's N*G samples; an
optional KL penalty to the reference policy and entropy bonus in the loss.

The class is the template for critic-free algorithms: one that differs only in how it turns a
group's rewards into advantages overrides `advantages` (RLOO does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from asyncrl.algos.base import NoOptions, load_policy_state, policy_state
from asyncrl.algos.update import (
    ReferencePolicy,
    batch_logprobs,
    gradient_step,
    regularise,
    stack_groups,
)
from asyncrl.core.advantages import group_advantages
from asyncrl.core.losses import ClippedPolicyLoss
from asyncrl.core.types import Group

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.models.policy import Policy


class GRPO:
    name: ClassVar[str] = "grpo"
    Options: ClassVar[type] = NoOptions

    def __init__(self, policy: Policy, config: Config) -> None:
        self.model = policy.model
        self.config = config.algo
        self.temperature = config.rollout.temperature
        self.pad_id = policy.pad_id
        # built before any checkpoint is loaded: a copy of the policy's initial weights
        self.reference = ReferencePolicy(policy.model) if config.algo.kl_coef > 0 else None
        self.loss_fn = ClippedPolicyLoss(clip_eps=config.algo.clip_eps)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.algo.lr, weight_decay=config.algo.weight_decay
        )

    @staticmethod
    def advantages(rewards: torch.Tensor) -> torch.Tensor:
        """[N, G] rewards -> [N, G] advantages: `(r - mean) / (std + 1e-6)` per group."""
        return group_advantages(rewards)

    def step(self, groups: list[Group], step: int) -> dict[str, float]:
        """One optimizer update on the step's groups; returns its metrics."""
        batch = stack_groups(groups, self.pad_id)
        rewards, mask = batch["rewards"], batch["completion_mask"]
        advantages = self.advantages(rewards).reshape(-1, 1)  # [B, 1]
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

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return policy_state(self.name, self.optimizer, self.reference)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.name, self.optimizer, self.reference)
