"""Rollouts kept at a preemption notice whose full checkpoint cannot be durable in time (I10).

At a notice the run cuts a full checkpoint (weights, optimizer, rollouts). Where that cannot
be verified before the deadline, the newest verified checkpoint S is what a resume loads, and
everything since S would be lost: the training of steps S, S+1, ... and every token generated
since. The training is lost (its weights are not on disk), but the rollouts need not be: a
token that weights version v <= S sampled is one the run resumed from S could have sampled
itself, so it is kept, in a small file beside checkpoint S, written first (milliseconds).

What is kept, per ordinal, is each sample's tokens up to the first one a newer version sampled
(its prefix: a sample's versions never decrease), with their log-probs and versions; a sample
cut short is unfinished again. Only what S does not already hold counts. A resume from S puts
each kept ordinal back where the ledger would have it: continued from its kept tokens when it
is dispatched (re-dispatched, or handed out by the stream), and a group whose every sample was
kept finished is landed in the buffer without an engine pass.

In deterministic mode every token of a batch has the version its target pins, so a batch is
kept whole or not at all, and its kept groups are the ones the resumed run would generate.

Pure: plain tensors, no IO; the file is `asyncrl.checkpoint.kept`'s, the trainer's side
`asyncrl.train.kept`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from asyncrl.core.partial import Partial
from asyncrl.core.types import Group


def up_to_version(partial: Partial, version: int) -> Partial:
    """Each sample's tokens up to the first one a version newer than `version` sampled (a
    single-turn partial); a sample that lost a token is unfinished."""
    if partial.episodes is not None:
        raise ValueError("a multi-turn partial is kept by the steps log, not by version")
    ok = (partial.versions <= version) | ~partial.mask
    keep = ok.to(torch.int64).cumprod(dim=1).bool() & partial.mask
    width = int(keep.sum(dim=1).max()) if keep.numel() else 0
    whole = (keep == partial.mask).all(dim=1)
    return Partial(
        partial.tokens.masked_fill(~keep, 0)[:, :width],
        keep[:, :width],
        partial.logprobs.masked_fill(~keep, 0.0)[:, :width],
        partial.versions.masked_fill(~keep, -1)[:, :width],
        partial.finished & whole,
    )


def group_partial(group: Group) -> Partial:
    """A finished single-turn group as the partial it was before it landed."""
    if group.loss_mask is not None or group.row_samples is not None:
        raise ValueError(f"ordinal {group.ordinal} is a multi-turn or agent group")
    mask = group.completion_mask
    versions = group.token_versions
    if versions is None:  # a group restored from a checkpoint older than token versions
        versions = torch.where(mask, group.version_max, -1)
    return Partial(
        group.completion_ids.masked_fill(~mask, 0),
        mask.clone(),
        group.behaviour_logprobs.masked_fill(~mask, 0.0),
        versions.clone(),
        torch.ones(mask.shape[0], dtype=torch.bool),
    )


@dataclass(frozen=True)
class KeptRollout:
    ordinal: int
    target_step: int
    partial: Partial


@dataclass
class KeptAccount:
    """What a notice keeps beside checkpoint `step`, and what it cannot."""

    step: int
    """The verified checkpoint the kept rollouts belong to (version `step` and older)."""
    cut_step: int
    """The step the run had reached: steps `step` .. `cut_step - 1` trained, not kept."""
    groups: int = 0
    """Groups kept finished (landed without an engine pass on resume)."""
    partial_groups: int = 0
    """Groups kept with some samples unfinished (continued from their kept tokens)."""
    tokens: int = 0
    """Tokens kept that checkpoint `step` does not hold."""
    lost_tokens: int = 0
    """Tokens generated since checkpoint `step` by newer weights: generated again."""
    ordinals: list[int] = field(default_factory=list)

    @property
    def lost_steps(self) -> int:
        return self.cut_step - self.step

    def fields(self) -> dict[str, Any]:
        """The account as the `rollouts_kept` event records it."""
        return {**asdict(self), "lost_steps": self.lost_steps}


def steps_lost(step: int, cut_step: int) -> str:
    """The trained steps a kill after the notice loses: `step` .. `cut_step` - 1."""
    if cut_step - step <= 1:
        return f"step {step}"
    return f"steps {step}-{cut_step - 1}"


def new_tokens(lengths: list[int], held: list[int]) -> int:
    """Tokens of samples of `lengths` that a checkpoint holding `held` of them lacks."""
    return sum(max(0, a - b) for a, b in zip(lengths, held, strict=True))


def keep(
    items: Iterable[tuple[int, int, Partial]],
    version: int,
    held: Mapping[int, list[int]],
    cut_step: int,
) -> tuple[list[KeptRollout], KeptAccount]:
    """Of `items` (ordinal, target, its samples so far: finished groups and partial ones), what
    weights `version` and older sampled, less what checkpoint `version` holds already
    (`held`: ordinal -> its tokens per sample there; a group buffered there holds them all)."""
    kept: list[KeptRollout] = []
    account = KeptAccount(version, cut_step)
    for ordinal, target, partial in sorted(items, key=lambda item: item[0]):
        before = held.get(ordinal, [0] * partial.num_samples)
        prefix = up_to_version(partial, version)
        new = new_tokens(prefix.lengths, before)
        account.lost_tokens += partial.num_tokens - prefix.num_tokens
        if new == 0:
            continue  # nothing the checkpoint does not have
        kept.append(KeptRollout(ordinal, target, prefix))
        account.tokens += new
        account.ordinals.append(ordinal)
        if prefix.done:
            account.groups += 1
        else:
            account.partial_groups += 1
    return kept, account
