"""The records that flow through the pipeline. Plain dataclasses over tensors: no IO, no
threads, so the core can be unit-tested in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PromptTicket:
    """One prompt handed out by the stream. `ordinal` is its place in this run's stream,
    `target_step = ordinal // N` the only step allowed to train it."""

    ordinal: int
    target_step: int
    epoch: int
    position: int
    dataset_index: int


@dataclass
class Group:
    """One prompt with its G generations, as the replay buffer holds it.

    Tensors are padded to the longest completion in the group; `completion_mask` marks real
    tokens (EOS included, padding after it excluded).
    """

    ticket: PromptTicket
    prompt_ids: list[int]
    completion_ids: torch.Tensor  # [G, T] int64
    completion_mask: torch.Tensor  # [G, T] bool
    behaviour_logprobs: torch.Tensor  # [G, T] float32, log-probs at the sampling temperature
    rewards: torch.Tensor  # [G] float32
    version_min: int  # the oldest weights version among its tokens
    version_max: int
    generation_s: float = 0.0
    token_versions: torch.Tensor | None = None
    """[G, T] int64: the weights version that sampled each token (-1 where masked). None in
    groups restored from checkpoints that predate it: every token was `version_max`'s."""
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named parts of the reward, each [G] float32, when the reward function returns them
    (logged as `reward/NAME`; training uses `rewards` only)."""
    loss_mask: torch.Tensor | None = None
    """[G, T] bool, for multi-turn episodes: the tokens the policy sampled, which are trained;
    the environment's tokens between turns are real (in `completion_mask`, attended to) but
    not. None: every real token is the policy's."""

    @property
    def policy_mask(self) -> torch.Tensor:
        """[G, T] bool: the trained tokens."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def ordinal(self) -> int:
        return self.ticket.ordinal

    @property
    def target_step(self) -> int:
        return self.ticket.target_step

    @property
    def num_generations(self) -> int:
        return int(self.completion_ids.shape[0])
