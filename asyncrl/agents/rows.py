"""An agent-run ticket's group: every segment of every run a row (`Group.row_samples` maps
rows to samples), the rows' common opening its prompt. Plain tensors: unit-tested in
milliseconds."""

from __future__ import annotations

import torch

from asyncrl.agents.samples import Segment
from asyncrl.core.types import Group, PromptTicket


class NoOpening(ValueError):
    """The runs of a ticket share no first token (every row needs one to condition on)."""


def group_of(ticket: PromptTicket, segments: list[list[Segment]], rewards: torch.Tensor) -> Group:
    """The group of one ticket from its runs' segments (`segments[sample]`, in order) and
    rewards ([G]); each row keeps at least its first sampled token after the prompt."""
    rows = [(i, seg) for i, runs in enumerate(segments) for seg in runs]
    if not rows or len({i for i, _ in rows}) != len(segments):
        raise NoOpening(f"ordinal {ticket.ordinal}: a run has no tokens")
    cut = min(seg.policy.index(True) if any(seg.policy) else len(seg.tokens) for _, seg in rows)
    first = rows[0][1].tokens
    common = 0
    while common < cut and all(
        common < len(seg.tokens) and seg.tokens[common] == first[common] for _, seg in rows
    ):
        common += 1
    if common == 0:
        raise NoOpening(
            f"the runs of ordinal {ticket.ordinal} share no first token (every row needs one "
            "to condition on)"
        )
    width = max(len(seg.tokens) for _, seg in rows) - common
    n = len(rows)
    ids = torch.zeros(n, width, dtype=torch.int64)
    mask = torch.zeros(n, width, dtype=torch.bool)
    policy = torch.zeros(n, width, dtype=torch.bool)
    logprobs = torch.zeros(n, width, dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.int64)
    for r, (_, seg) in enumerate(rows):
        k = len(seg.tokens) - common
        ids[r, :k] = torch.tensor(seg.tokens[common:], dtype=torch.int64)
        mask[r, :k] = True
        policy[r, :k] = torch.tensor(seg.policy[common:], dtype=torch.bool)
        logprobs[r, :k] = torch.tensor(seg.logprobs[common:], dtype=torch.float32)
        versions[r, :k] = torch.tensor(seg.versions[common:], dtype=torch.int64)
    used = versions[policy]
    segmented = n != len(segments)
    return Group(
        ticket=ticket,
        prompt_ids=list(first[:common]),
        completion_ids=ids,
        completion_mask=mask,
        behaviour_logprobs=logprobs,
        rewards=rewards,
        version_min=int(used.min()) if used.numel() else 0,
        version_max=int(used.max()) if used.numel() else 0,
        token_versions=versions,
        loss_mask=policy,
        row_samples=torch.tensor([i for i, _ in rows], dtype=torch.int64) if segmented else None,
    )
