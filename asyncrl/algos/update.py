"""What GRPO and PPO share: the step's samples as one batch, its log-probs, one guarded
optimizer update, the KL penalty and entropy bonus, and the frozen reference policy."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PreTrainedModel

from asyncrl.config import AlgoConfig
from asyncrl.core.losses import kl_estimate, masked_mean
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


def batch_logprobs(
    model: PreTrainedModel, batch: dict[str, Any], temperature: float, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, T] of a stacked batch's completion tokens under `model`."""
    logprobs, entropy = completion_logprobs(
        model,
        batch["prompts"],
        batch["completion_ids"],
        batch["completion_mask"],
        temperature,
        pad_id,
        with_entropy=True,
    )
    assert entropy is not None
    return logprobs, entropy


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


def gradient_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.nn.Parameter],
    max_grad_norm: float,
    what: str = "loss",
) -> float:
    """backward, clip to `max_grad_norm` (0: no clipping), step; returns the gradient norm.
    Raises `NonFiniteLoss` before changing any weight if the loss or the gradient is not
    finite."""
    if not torch.isfinite(loss):
        raise NonFiniteLoss(f"{what} is {loss.item()}; the step was not applied")
    params = list(parameters)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if not torch.isfinite(grad_norm):
        raise NonFiniteLoss(
            f"gradient norm of the {what} is {float(grad_norm)}; the step was not applied"
        )
    optimizer.step()
    return float(grad_norm)


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of a model's weights, tensor by tensor in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class ReferencePolicy:
    """The frozen policy the KL penalty pulls towards: a copy of the policy's *initial* weights.

    It is not checkpointed: every launch rebuilds the policy from its config (the preset and
    `run.seed`, or `model.path`) before loading a checkpoint, so this copy is the same each
    time. `sha256` lets a resume prove it (a `model.path` whose files changed would not be)."""

    def __init__(self, initial_policy: PreTrainedModel) -> None:
        self.model = copy.deepcopy(initial_policy)
        self.model.eval()
        self.model.requires_grad_(False)
        self.sha256 = weights_sha256(self.model)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any], temperature: float, pad_id: int) -> torch.Tensor:
        logprobs, _ = completion_logprobs(
            self.model,
            batch["prompts"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature,
            pad_id,
        )  # no entropy: the reference only needs the chosen tokens' log-probs
        return logprobs
