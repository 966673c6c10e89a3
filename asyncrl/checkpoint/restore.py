"""Loading a snapshot's parts into a run's stateful parts (rank 0's trainer and every other
trainer rank alike), with the test-only hook that leaves pieces of state unrestored."""

from __future__ import annotations

import os
import re

from asyncrl.checkpoint.snapshot import Snapshot, Stateful
from asyncrl.checkpoint.store import CheckpointError

SKIP_RESTORE = frozenset(filter(None, os.environ.get("ASYNCRL_TEST_SKIP_RESTORE", "").split(",")))
"""Test-only: pieces of state a resume deliberately does not restore, so the determinism tests
can prove they would notice: a part (`rng`, `buffer`), `PART.KEY` of a part's state (kept at
its freshly built value), or an alias below. Read once."""
SKIP_ALIASES = {
    "optimizer": ("algorithm.optimizer",),
    "critic": ("algorithm.critic", "algorithm.critic_optimizer"),
    "cursor": ("stream", "ledger"),
}


def _skipped(name: str) -> set[str]:
    """The keys of part `name` a resume must not restore (`"*"`: the whole part)."""
    pieces = {p for s in SKIP_RESTORE for p in SKIP_ALIASES.get(s, (s,))}
    return {"*" if p == name else p.partition(".")[2] for p in pieces if p.split(".")[0] == name}


def load_parts(parts: dict[str, Stateful], snapshot: Snapshot) -> None:
    """Loads each of `parts` from the snapshot (less what `ASYNCRL_TEST_SKIP_RESTORE` names);
    refuses a snapshot without one of them."""
    missing = sorted(set(parts) - set(snapshot.parts))
    if missing:
        raise CheckpointError(
            f"the checkpoint of step {snapshot.step} has no {', '.join(missing)} part"
        )
    for name, part in parts.items():
        state, skip = snapshot.parts[name], _skipped(name)  # skip: empty in real use
        if "*" in skip:
            continue
        if skip:
            fresh = part.state_dict()
            state = {k: fresh[k] if k in skip else v for k, v in state.items()}
        try:
            part.load_state_dict(state)
        except CheckpointError as err:
            raise CheckpointError(f"the checkpoint of step {snapshot.step}: {err}") from None
        except RuntimeError as err:  # torch's load_state_dict: tensors of another shape
            mismatches = re.findall(
                r"size mismatch for (\S+): copying a param with shape "
                r"torch.Size\((\[.*?\])\) from checkpoint, the shape in "
                r"current model is torch.Size\((\[.*?\])\)",
                str(err),
            )
            if not mismatches:
                raise
            raise ShapeMismatch(name, snapshot.step, mismatches) from None


class ShapeMismatch(CheckpointError):
    """A part's tensors in the checkpoint have other shapes than this run's (a model built
    from another config or vocabulary): a mistake in the launch, not a damaged checkpoint."""

    def __init__(self, part: str, step: int, mismatches: list[tuple[str, str, str]]) -> None:
        self.part = part
        shown = "; ".join(
            f"{key} is {saved} there, {now} here" for key, saved, now in mismatches[:3]
        )
        more = f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else ""
        super().__init__(
            f"the checkpoint of step {step} holds a {part} of other shapes: {shown}{more}"
        )
