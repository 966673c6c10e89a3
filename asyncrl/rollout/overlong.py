"""DAPO's soft overlong penalty (Yu et al. 2025, "DAPO", section 3.4): a completion that runs
into the last `buffer` tokens before the length limit loses reward in proportion to how far in
it ran, the whole `penalty` at the limit, so the policy learns to finish before it is cut
rather than being paid nothing for a cut answer with no signal why. `rollout.overlong_buffer`,
`rollout.overlong_penalty`; the penalty is a reward component, `reward/overlong`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.core.types import PromptTicket
from asyncrl.rollout.engine import GenerationOutput
from asyncrl.rollout.scorer import Scored

OVERLONG = "overlong"
"""The penalty's reward component (0 or below)."""


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """[G] float32, each 0 or below: 0 for a length up to `max_new_tokens - buffer`, then
    -`penalty` x (length - (max_new_tokens - buffer)) / `buffer`, -`penalty` at
    `max_new_tokens` (EOS included in a length, as the limit counts it)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * excess / buffer


def with_overlong_penalty(
    score: Callable[[list[tuple[PromptTicket, GenerationOutput]]], list[Scored]],
    max_new_tokens: int,
    buffer: int,
    penalty: float,
) -> Callable[[list[tuple[PromptTicket, GenerationOutput]]], list[Scored]]:
    """`score` with each sample's overlong penalty added to its reward and kept as the
    `overlong` component (the task's own components unchanged)."""

    def scored(items: list[tuple[PromptTicket, GenerationOutput]]) -> list[Scored]:
        out = []
        for (_, output), result in zip(items, score(items), strict=True):
            lengths = output.completion_mask.sum(dim=1)
            cut = overlong_penalty(lengths, max_new_tokens, buffer, penalty)
            components = {**result.components, OVERLONG: cut}
            out.append(Scored(result.rewards + cut, components))
        return out

    return scored
