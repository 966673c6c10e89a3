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
    """One prompt with its G generations (samples), as the replay buffer holds it.

    A sample is one row of the per-token tensors, or, where `row_samples` says so, several
    consecutive rows (its *segments*: an agent that rewrote its history continued the sample
    in a new sequence). R is the number of rows (`num_rows`), G the number of samples
    (`num_samples`, one reward each); R == G without segments. Rewards are per sample, tokens
    per row: every row of a sample is trained with that sample's advantage.

    Tensors are padded to the longest row in the group; `completion_mask` marks real tokens
    (EOS included, padding after it excluded). Building a group whose shapes do not fit
    together raises ValueError.
    """

    ticket: PromptTicket
    prompt_ids: list[int]
    completion_ids: torch.Tensor  # [R, T] int64
    completion_mask: torch.Tensor  # [R, T] bool
    behaviour_logprobs: torch.Tensor  # [R, T] float32, log-probs at the sampling temperature
    rewards: torch.Tensor  # [G] float32, one per sample
    version_min: int  # the oldest weights version among its tokens
    version_max: int
    generation_s: float = 0.0
    token_versions: torch.Tensor | None = None
    """[R, T] int64: the weights version that sampled each token (-1 where masked). None in
    groups restored from checkpoints that predate it: every token was `version_max`'s."""
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named parts of the reward, each [G] float32 (per sample), when the reward function
    returns them (logged as `reward/NAME`; training uses `rewards` only)."""
    loss_mask: torch.Tensor | None = None
    """[R, T] bool, for multi-turn episodes and segments: the tokens the policy sampled, which
    are trained; the environment's tokens between turns (and a segment's own prompt tail) are
    real (in `completion_mask`, attended to) but not. None: every real token is the policy's."""
    row_samples: torch.Tensor | None = None
    """[R] int64: the sample (0..G-1) each row belongs to; nondecreasing, every sample at least
    one row (a sample's segments are consecutive rows, in order). None: row i is sample i
    (R == G), as for every group that has no segments, and every group restored from a
    checkpoint that predates the field."""

    def __post_init__(self) -> None:
        _check_shapes(self)

    @property
    def policy_mask(self) -> torch.Tensor:
        """[R, T] bool: the trained tokens."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def num_samples(self) -> int:
        """G: the group's samples (generations), one reward each."""
        return int(self.rewards.shape[0])

    @property
    def num_rows(self) -> int:
        """R: the rows of its per-token tensors (G, or more where a sample has segments)."""
        return int(self.completion_ids.shape[0])

    @property
    def num_generations(self) -> int:
        """G, as `num_samples` (the samples are the generations of
        `rollout.num_generations_per_prompt`); the rows are `num_rows`."""
        return self.num_samples

    def row_sample_index(self) -> torch.Tensor:
        """[R] int64: the sample of each row (`row_samples`, or `arange(G)` where it is None)."""
        if self.row_samples is not None:
            return self.row_samples
        return torch.arange(self.num_rows)

    @property
    def ordinal(self) -> int:
        return self.ticket.ordinal

    @property
    def target_step(self) -> int:
        return self.ticket.target_step


def _check_shapes(group: Group) -> None:
    """Raises ValueError, naming the ordinal and the field, where a group's tensors do not fit
    together: per-token tensors [R, T] alike, rewards and reward components [G], `row_samples`
    [R] mapping the rows onto every sample 0..G-1 in order (R == G where it is None)."""
    where = f"group of ordinal {group.ticket.ordinal}"
    shape = tuple(group.completion_ids.shape)
    if len(shape) != 2:
        raise ValueError(f"{where}: completion_ids must be [R, T], got {list(shape)}")
    for name in ("completion_mask", "behaviour_logprobs", "token_versions", "loss_mask"):
        value = getattr(group, name)
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(
                f"{where}: {name} is {list(value.shape)}, completion_ids {list(shape)}"
            )
    if group.rewards.dim() != 1:
        raise ValueError(f"{where}: rewards must be [G], got {list(group.rewards.shape)}")
    num_samples = int(group.rewards.shape[0])
    for name, value in group.reward_components.items():
        if tuple(value.shape) != (num_samples,):
            raise ValueError(
                f"{where}: reward component {name!r} is {list(value.shape)}, rewards "
                f"[{num_samples}]"
            )
    rows = group.row_samples
    if rows is None:
        if shape[0] != num_samples:
            raise ValueError(
                f"{where}: {shape[0]} rows and {num_samples} rewards, and no row_samples to "
                "say which sample each row belongs to"
            )
        return
    if rows.dtype != torch.int64 or tuple(rows.shape) != (shape[0],):
        raise ValueError(
            f"{where}: row_samples must be [R]=[{shape[0]}] int64, got "
            f"{list(rows.shape)} {rows.dtype}"
        )
    steps = rows.diff()
    if (
        shape[0] == 0
        or int(rows[0]) != 0
        or int(rows[-1]) != num_samples - 1
        or bool(((steps != 0) & (steps != 1)).any())
    ):
        raise ValueError(
            f"{where}: row_samples {rows.tolist()} must be nondecreasing from 0 to "
            f"G-1={num_samples - 1} in steps of 0 or 1 (every sample at least one row)"
        )
