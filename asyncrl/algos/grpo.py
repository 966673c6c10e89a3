"""GRPO: group-normalised advantages, the clipped surrogate against the behaviour
log-probs, AdamW at the step's scheduled learning rate (`algo.lr_schedule`). One optimizer
step per training step over the step's N*G samples; an
optional KL penalty to the reference policy and entropy bonus in the loss.

Advantages are per sample ([N, G]); a sample with segments (`Group.row_samples`) trains each
of its rows with its one advantage, and the loss is a token-level masked sum over every row
of the step (segments included) over the step's one normaliser: with `token_mean` the trained
tokens of all its rows (a segment's prompt tail is not trained, so not counted); with
`sequence_mean` and `constant`, which count sequences, each row counts as one.

The class is the template for critic-free algorithms: one that differs only in how it turns a
group's rewards into advantages overrides `advantages` (RLOO does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from asyncrl.algos.base import load_policy_state, policy_state
from asyncrl.algos.parallel import (
    SINGLE,
    Ranks,
    rank_micro_batches,
    received_share,
    row_shares,
)
from asyncrl.algos.schedule import StepSchedule
from asyncrl.algos.update import (
    FrozenCasts,
    ReferencePolicy,
    StepStats,
    adamw,
    apply_gradients,
    backward,
    batch_logprobs,
    per_row,
    reference_dtype,
    regularise,
    row_groups,
    select,
    shortest_first,
    stack_groups,
    to_device,
    token_mask,
)
from asyncrl.config.algos import GRPOOptions
from asyncrl.core.advantages import scaled_group_advantages
from asyncrl.core.losses import (
    ClippedPolicyLoss,
    loss_weights,
    mismatch_stats,
    truncated_is_weights,
)
from asyncrl.core.types import Group
from asyncrl.models.device import autocast, model_device, resolve_train_dtype
from asyncrl.models.lora import (
    adapters_in_engine,
    generation_weights,
    is_lora,
    trainable_parameters,
)

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.models.policy import Policy


def varied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[N] bool of the [N, G] `rewards` (one per sample): the groups whose rewards are not
    all equal, those `algo.skip_zero_variance_groups` trains (every row of them)."""
    return rewards.std(dim=1, unbiased=False) > 0


class GRPO:
    name: ClassVar[str] = "grpo"
    Options: ClassVar[type] = GRPOOptions

    def __init__(self, policy: Policy, config: Config, ranks: Ranks = SINGLE) -> None:
        self.model = policy.model
        self.ranks = ranks
        self.config = config.algo
        self.temperature = config.rollout.temperature
        self.merge_adapters = not adapters_in_engine(config)  # LoRA: what generation loads
        self.pad_id = policy.pad_id
        self.device = model_device(policy.model)
        self.dtype = resolve_train_dtype(config.train.dtype, self.device)
        self.micro_batch_size = config.train.micro_batch_size
        self.shared_prompts = config.train.shared_prompts
        # built before any checkpoint is loaded: a copy of the policy's initial weights
        self.reference = (
            ReferencePolicy(
                policy, self.shared_prompts, reference_dtype(self.dtype, ranks.world_size)
            )
            if config.algo.kl_coef > 0
            else None
        )
        self.loss_fn = ClippedPolicyLoss(clip_eps=config.algo.clip_eps)
        self._entropy_coef = config.algo.entropy_coef  # the step's: `entropy_coef(advantages)`
        self.max_new_tokens = config.generated_tokens
        # LoRA: the frozen base's linear weights in bf16 for the passes, cast once a step
        self.frozen_casts = FrozenCasts([self.model], reference_dtype(self.dtype, ranks.world_size))
        ranks.shard(self.model)  # after the reference copied the full initial weights
        if self.reference is not None:
            ranks.shard(self.reference.model)
        self.optimizer = adamw(trainable_parameters(self.model), config.algo.lr, config.algo)
        self.schedule = StepSchedule(self.optimizer, config.algo, config.run.max_num_steps)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[N, G] rewards -> [N, G] advantages, one per sample: `(r - mean) / (std + 1e-6)`
        per group, the std as `algo.scale_rewards` says."""
        return scaled_group_advantages(rewards, self.config.options.scale_rewards)

    def entropy_coef(self, advantages: torch.Tensor) -> float:
        """The step's entropy-bonus weight from its [N, G] per-sample `advantages`:
        `algo.entropy_coef` (RLOO scales it)."""
        return self.config.entropy_coef

    def step(self, groups: list[Group], step: int) -> dict[str, float]:
        """One optimizer update on the step's groups, accumulated over micro-batches of
        `train.micro_batch_size` sequences; returns its metrics. With ranks, rank 0 computes
        the advantages and the normaliser, which need the whole batch, and sends each rank
        its rows alone (`row_shares`); the others' `groups` are ignored. Each row is trained
        with its sample's advantage (`per_row`: a sample's segments all with the same)."""
        ranks = self.ranks
        batch: dict[str, Any] = {}
        shares = None
        if ranks.rank == 0:
            batch = to_device(stack_groups(groups, self.pad_id), self.device)
            sample_advantages = self.advantages(batch["rewards"])  # [N, G]
            advantages = per_row(sample_advantages, batch).unsqueeze(1)  # [B, 1]
            # every micro-batch's loss is a weighted sum over the step's one normaliser
            weights, normaliser = loss_weights(
                batch["completion_mask"], self.config.loss_aggregation, self.max_new_tokens
            )
            trained = self._trained_rows(batch)
            if self.micro_batch_size:  # passes cut from a group: its rows of like widths
                trained = shortest_first(
                    torch.arange(len(batch["prompts"]), device=self.device)[trained],
                    token_mask(batch),
                    row_groups(batch),
                )
            row_values = {"advantages": advantages[trained]}
            if weights is not batch["completion_mask"]:  # token_mean and constant: the mask
                row_values["weights"] = weights[trained]
            shares = row_shares(
                select(batch, trained),
                row_values,
                {"normaliser": normaliser, "entropy_coef": self.entropy_coef(sample_advantages)},
                ranks.world_size,
            )
        share = to_device(received_share(ranks.scatter(shares)), self.device)
        self._entropy_coef = share["entropy_coef"]  # one weight for the whole step
        num_rows, offset = share["num_rows"], share["offset"]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.schedule.start(step)
        if num_rows == 0:  # every group uniform and left out: no update, the step counts
            self.schedule.advance()
            if ranks.rank != 0:
                return {"loss": 0.0}
            return self._metrics(batch, step, 0.0, 0.0, lr, StepStats(), None, trained)
        loss_total, stats = 0.0, StepStats()
        trainer_logprobs: list[tuple[slice, torch.Tensor]] = []
        check = ranks.world_size == 1
        with self.frozen_casts:  # the passes only: publishes read the fp32 base
            for micro in rank_micro_batches(
                num_rows, self.micro_batch_size, ranks.rank, ranks.world_size
            ):
                rows, own = micro.rows, slice(micro.rows.start - offset, micro.rows.stop - offset)
                part = select(share, own)
                weights = share.get("weights", share["completion_mask"])[own]
                loss, logprobs, part_stats = self._micro_loss(
                    part, share["advantages"][own], weights, share["normaliser"]
                )
                if not micro.real:  # a stand-in: the passes' collectives, no gradient
                    backward(loss * 0.0, check=check)
                    continue
                trainer_logprobs.append((rows, logprobs.detach()))
                loss_total += backward(loss, check=check)
                stats.add(part_stats, float(part["completion_mask"].sum()))
        (loss_total,) = ranks.sum([loss_total])
        stats = stats.gathered(ranks.gather(stats.parts))
        all_logprobs = ranks.assemble(trainer_logprobs, num_rows, share["behaviour_logprobs"])
        grad_norm = apply_gradients(
            self.optimizer, self.model.parameters(), self.config.max_grad_norm
        )
        self.schedule.advance()
        if ranks.rank != 0:
            return {"loss": loss_total}  # the step's metrics are rank 0's to record
        return self._metrics(batch, step, loss_total, grad_norm, lr, stats, all_logprobs, trained)

    def _trained_rows(self, batch: dict[str, Any]) -> torch.Tensor | slice:
        """The rows of the stacked `batch` that the step's passes train: all of them, or with
        `algo.skip_zero_variance_groups` every row (segments included) of the groups whose
        [N, G] rewards are not all equal (ascending indices, so a group's rows stay together;
        `step` then orders each group's rows by width, `shortest_first`)."""
        if not getattr(self.config.options, "skip_zero_variance_groups", False):
            return slice(None)
        return varied_groups(batch["rewards"])[row_groups(batch)].nonzero().flatten()

    def _metrics(
        self,
        batch: dict[str, Any],
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        stats: StepStats,
        trainer_logprobs: torch.Tensor | None,
        trained: torch.Tensor | slice,
    ) -> dict[str, float]:
        """The step's metrics (rank 0's): rewards (`reward_*`, `zero_variance_groups`) over
        every sample, one value each whatever its rows; token counts and lengths
        (`num_tokens`, `completion_len`: trained tokens per row) over every row, a sample's
        segments each a row; the loss statistics and the engine/trainer mismatch over the
        trained rows' tokens (`trained_rows` counts rows)."""
        rewards, mask = batch["rewards"], batch["completion_mask"]
        group_std = rewards.std(dim=1, unbiased=False)
        trained_mask = mask[trained]
        metrics = {
            "loss": loss,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "zero_variance_groups": float((group_std == 0).float().mean()),
            "grad_norm": grad_norm,
            "lr": lr,
            "num_tokens": float(mask.sum()),
            "completion_len": float(mask.sum(1).float().mean()),
            **stats.result(),
        }
        if isinstance(trained, torch.Tensor):
            metrics["trained_rows"] = float(len(trained))
        if trainer_logprobs is not None:
            metrics.update(
                mismatch_stats(
                    trainer_logprobs,
                    batch["behaviour_logprobs"][trained],
                    trained_mask,
                    batch["token_versions"][trained] == step,  # the trainer holds `step`
                )
            )
        return metrics

    def _micro_loss(
        self,
        part: dict[str, Any],
        advantages: torch.Tensor,
        token_weights: torch.Tensor,
        normaliser: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One micro-batch's loss: the clipped surrogate (against the trainer's own log-probs,
        with truncated importance weights, when `mismatch_tis_cap` is set), plus the KL and
        entropy terms; with its log-probs and its statistics."""
        part_mask = part["completion_mask"]
        tis_cap = getattr(self.config.options, "mismatch_tis_cap", 0.0)
        with autocast(self.device, self.dtype):
            ref_logprobs = (
                self.reference.logprobs(part, self.temperature, self.pad_id)
                if self.reference is not None
                else None
            )
            logprobs, entropy = batch_logprobs(
                self.model,
                part,
                self.temperature,
                self.pad_id,
                entropy_grad=self.config.entropy_coef > 0,
                shared_prompts=self.shared_prompts,
            )
        anchor, is_weights = part["behaviour_logprobs"], None
        is_stats: dict[str, float] = {}
        if tis_cap > 0:  # the weights are those before the step until apply_gradients
            anchor = logprobs.detach()
            is_weights, is_stats = truncated_is_weights(
                anchor, part["behaviour_logprobs"], part_mask, tis_cap
            )
        loss, loss_stats = self.loss_fn(
            logprobs,
            anchor,
            advantages,
            part_mask,
            is_weights,
            normaliser=normaliser,
            token_weights=token_weights,
        )
        loss, extra = regularise(
            loss,
            logprobs,
            entropy,
            ref_logprobs,
            part_mask,
            self.config,
            normaliser,
            token_weights,
            self._entropy_coef,
        )
        return loss, logprobs, {**loss_stats, **is_stats, **extra}

    def policy_weights(self) -> dict[str, torch.Tensor]:
        if is_lora(self.model):
            return generation_weights(self.model, merged=self.merge_adapters)
        return self.ranks.full_weights(self.model)

    def state_dict(self) -> dict[str, Any]:
        return policy_state(self.name, self.optimizer, self.schedule, self.reference)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.name, self.optimizer, self.schedule, self.reference)
