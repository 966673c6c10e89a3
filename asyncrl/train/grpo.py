"""GRPO: group-normalised advantages, the clipped surrogate against the behaviour
log-probs, AdamW. One optimizer step per training step over the step's N*G samples."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from asyncrl.config import AlgoConfig
from asyncrl.core.advantages import group_advantages
from asyncrl.core.losses import ClippedPolicyLoss
from asyncrl.core.types import Group
from asyncrl.models.policy import completion_logprobs


class NonFiniteLoss(RuntimeError):
    """The loss or gradient is NaN/inf; the step was not applied."""


def pad_right(tensors: list[torch.Tensor], width: int, value: float | bool) -> torch.Tensor:
    """Pads [G, T_i] tensors on the right to [G, width] and concatenates them along dim 0."""
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors]
    return torch.cat(padded, dim=0)


def stack_groups(groups: list[Group], pad_id: int) -> dict[str, Any]:
    """The step's samples as one batch: prompts (list of B rows), completion ids, mask and
    behaviour log-probs [B, T], rewards [N, G]."""
    width = max(g.completion_ids.shape[1] for g in groups)
    return {
        "prompts": [g.prompt_ids for g in groups for _ in range(g.num_generations)],
        "completion_ids": pad_right([g.completion_ids for g in groups], width, pad_id),
        "completion_mask": pad_right([g.completion_mask for g in groups], width, False),
        "behaviour_logprobs": pad_right([g.behaviour_logprobs for g in groups], width, 0.0),
        "rewards": torch.stack([g.rewards for g in groups]),
    }


class GRPO:
    def __init__(
        self, model: PreTrainedModel, config: AlgoConfig, temperature: float, pad_id: int
    ) -> None:
        self.model = model
        self.config = config
        self.temperature = temperature
        self.pad_id = pad_id
        self.loss_fn = ClippedPolicyLoss(clip_eps=config.clip_eps)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer update on the step's groups; returns its metrics."""
        batch = stack_groups(groups, self.pad_id)
        rewards = batch["rewards"]
        advantages = group_advantages(rewards).reshape(-1, 1)  # [B, 1]
        self.model.train()
        logprobs = completion_logprobs(
            self.model,
            batch["prompts"],
            batch["completion_ids"],
            batch["completion_mask"],
            self.temperature,
            self.pad_id,
        )
        loss, stats = self.loss_fn(
            logprobs, batch["behaviour_logprobs"], advantages, batch["completion_mask"]
        )
        if not torch.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss.item()}; the step was not applied")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = self.config.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLoss(f"gradient norm is {float(grad_norm)}; the step was not applied")
        self.optimizer.step()
        group_std = rewards.std(dim=1, unbiased=False)
        return {
            "loss": loss.item(),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "zero_variance_groups": float((group_std == 0).float().mean()),
            "grad_norm": float(grad_norm),
            "num_tokens": float(batch["completion_mask"].sum()),
            "completion_len": float(batch["completion_mask"].sum(1).float().mean()),
            **stats,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
