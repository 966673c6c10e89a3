"""Policy and value losses, and the estimators they use. Pure tensor functions and small
classes, shared by GRPO and PPO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KLEstimator = Literal["k1", "k3"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is true (token-level mean)."""
    return masked_sum(values, mask) / normaliser_of(mask)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` over the positions where `mask` is true."""
    return (values * mask.to(values.dtype)).sum()


def normaliser_of(mask: torch.Tensor) -> torch.Tensor:
    """The real tokens of `mask` (at least 1), as a float scalar: the token-mean's divisor.

    Every loss is `masked_sum(per-token loss over a micro-batch) / normaliser` with the
    normaliser of the whole optimizer step (STYLE.md rule 14), so the micro-batches' losses
    add up to the step's token mean and their gradients to its gradient, however the step is
    split. Computed exactly as `masked_mean` divides, so one micro-batch is bit-identical to
    the plain mean."""
    return mask.to(torch.float32).sum().clamp(min=1.0)


LossAggregation = Literal["token_mean", "sequence_mean", "constant"]


def loss_weights(
    mask: torch.Tensor, aggregation: LossAggregation, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights [B, T] and the step's normaliser for `algo.loss_aggregation`: the
    loss is `masked_sum(per-token loss, weights) / normaliser`, whatever micro-batches the
    rows are split into.

    - `token_mean`: weights = mask, normaliser = the step's real tokens (every token counts
      the same; DAPO). Bit-identical to `masked_sum(x, mask) / normaliser_of(mask)`.
    - `sequence_mean`: weights = 1 / (the row's real tokens), normaliser = rows with a real
      token (every sequence counts the same; the original GRPO).
    - `constant`: weights = mask, normaliser = rows x `max_new_tokens` (Dr. GRPO: no length
      normalisation at all, so a long wrong answer is not penalised less per token)."""
    if aggregation == "token_mean":
        return mask, normaliser_of(mask)
    real = mask.to(torch.float32)
    if aggregation == "constant":
        return mask, real.new_tensor(float(max(len(mask), 1) * max_new_tokens))
    if aggregation == "sequence_mean":
        lengths = real.sum(dim=1, keepdim=True)
        return real / lengths.clamp(min=1.0), (lengths > 0).sum().to(torch.float32).clamp(min=1.0)
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def normalise(
    total: torch.Tensor, mask: torch.Tensor, normaliser: torch.Tensor | None
) -> torch.Tensor:
    """A masked sum over the step's `normaliser`, or (None) over `mask`'s own real tokens."""
    return total / (normaliser_of(mask) if normaliser is None else normaliser)


@dataclass
class ClippedPolicyLoss:
    """PPO's clipped surrogate, `-mean(w * min(r * A, clip(r, 1-eps, 1+eps) * A))` over real
    tokens, with `r = exp(logp - old_logp)`.

    GRPO passes the *behaviour* log-probs as `old_logprobs` (and no weights): the ratio is then
    both the trust-region ratio and the importance-sampling correction for the off-policy lag
    of async generation. PPO passes its own log-probs from the start of the step (the proximal
    policy) and corrects the lag with separate, truncated weights `w` (see
    `truncated_is_weights`), so its clip stays a trust region across epochs and minibatches.
    """

    clip_eps: float = 0.2

    def __call__(
        self,
        logprobs: torch.Tensor,  # [B, T] under the current policy
        old_logprobs: torch.Tensor,  # [B, T] the clip's anchor
        advantages: torch.Tensor,  # [B, T] or [B, 1]
        mask: torch.Tensor,  # [B, T] bool
        is_weights: torch.Tensor | None = None,  # [B, T], no gradient
        normaliser: torch.Tensor | None = None,  # the step's real tokens; default: mask's
        token_weights: torch.Tensor | None = None,  # [B, T] from `loss_weights`; default: mask
    ) -> tuple[torch.Tensor, dict[str, float]]:
        log_ratio = logprobs - old_logprobs
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
        unweighted = torch.minimum(ratio * advantages, clipped * advantages)
        surrogate = unweighted if is_weights is None else is_weights * unweighted
        weights = mask if token_weights is None else token_weights
        loss = -normalise(masked_sum(surrogate, weights), mask, normaliser)
        with torch.no_grad():
            was_clipped = (ratio * advantages != unweighted).float()
            approx_kl = (ratio - 1.0) - log_ratio  # k3 estimator of KL(old || current)
            real = mask.bool()
            stats = {
                "clip_frac": float(masked_mean(was_clipped, mask)),
                "approx_kl": float(masked_mean(approx_kl, mask)),
                "ratio_mean": float(masked_mean(ratio, mask)),
                "ratio_max": float(ratio[real].max()) if real.any() else 1.0,
            }
        return loss, stats


@dataclass
class ClippedValueLoss:
    """The critic's clipped regression to the returns (PPO2):
    `0.5 * mean(max((V - R)^2, (V_clip - R)^2))` over real tokens, with
    `V_clip = V_old + clip(V - V_old, -eps, eps)`; `clip_eps = 0` is plain squared error."""

    clip_eps: float = 0.2

    def __call__(
        self,
        values: torch.Tensor,  # [B, T] under the current critic
        old_values: torch.Tensor,  # [B, T] at the start of the step
        returns: torch.Tensor,  # [B, T]
        mask: torch.Tensor,  # [B, T] bool
        normaliser: torch.Tensor | None = None,  # the step's real tokens; default: mask's
    ) -> tuple[torch.Tensor, dict[str, float]]:
        error = (values - returns) ** 2
        if self.clip_eps > 0:
            clipped = old_values + (values - old_values).clamp(-self.clip_eps, self.clip_eps)
            clipped_error = (clipped - returns) ** 2
            loss_per_token = torch.maximum(error, clipped_error)
            clip_frac = float(masked_mean((clipped_error > error).float(), mask))
        else:
            loss_per_token, clip_frac = error, 0.0
        loss = 0.5 * normalise(masked_sum(loss_per_token, mask), mask, normaliser)
        return loss, {"value_clip_frac": clip_frac}


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator
) -> torch.Tensor:
    """Per-token estimate of KL(current || reference) from tokens sampled by the policy
    (Schulman, "Approximating KL divergence"): `k1 = logp - ref_logp` (unbiased, can be
    negative), `k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1` (unbiased, never negative,
    lower variance)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def truncated_is_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level importance weights `pi_prox / pi_behaviour` for tokens generated by older
    weights (or by a different engine), truncated at `cap` as in TIS (Yao et al. 2025); `cap
    = 0` leaves them untruncated. Detached: they scale the gradient, they are not optimised."""
    with torch.no_grad():
        weights = torch.exp(proximal_logprobs - behaviour_logprobs)
        real = mask.bool()
        raw = weights[real] if real.any() else weights.new_ones(1)
        stats = {
            "is_ratio_mean": float(raw.mean()),
            "is_ratio_max": float(raw.max()),
            "is_ratio_min": float(raw.min()),
            "is_truncated_frac": float((raw > cap).float().mean()) if cap > 0 else 0.0,
        }
        if cap > 0:
            weights = weights.clamp(max=cap)
    return weights, stats


def mismatch_stats(
    trainer_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    same_weights: torch.Tensor,
) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's, per step.

    `offpolicy_kl`: KL(behaviour || trainer now) over every real token, estimated with k3 from
    the behaviour samples (what the importance weights correct: the engine/trainer mismatch
    and the weights lag of async generation together). `mismatch_kl` and
    `mismatch_max_abs_diff` (the largest |Δ log-prob|): the same over the tokens sampled with
    the very weights the trainer holds (`same_weights`), where only the engine differs; absent
    when the step has none (with A >= 1, most tokens come from older weights)."""
    with torch.no_grad():
        delta = (trainer_logprobs - behaviour_logprobs).float()
        k3 = torch.exp(delta) - delta - 1.0
        real = mask.bool()
        stats = {"offpolicy_kl": float(masked_mean(k3, real))}
        same = real & same_weights
        stats["mismatch_tokens"] = float(same.sum())
        if bool(same.any()):
            stats["mismatch_kl"] = float(k3[same].mean())
            stats["mismatch_max_abs_diff"] = float(delta[same].abs().max())
    return stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """`1 - Var(R - V) / Var(R)` over real tokens: 1 is a perfect critic, 0 one no better than
    the mean return, negative one worse than that."""
    real = mask.bool()
    r, v = returns[real], values[real]
    if r.numel() < 2:
        return 0.0
    var_r = float(r.var(unbiased=False))
    return 1.0 - float((r - v).var(unbiased=False)) / max(var_r, 1e-12)
