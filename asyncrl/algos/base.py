"""The one seam between the training loop and an RL algorithm (STYLE.md rule 13).

The trainer never branches on the algorithm: it builds the class the registry names for
`algo.name` (`asyncrl/config/algos.py`), calls `step(groups, step)` once per training step,
publishes `policy_weights()` to generation, and checkpoints `state_dict()` as the
`algorithm` part. Everything an algorithm owns — its optimizers, a critic, the hash of its
reference policy — lives inside that state; the trainer knows none of it.

An algorithm's own config keys are a dataclass, `Options`, in `asyncrl/config/algos.py` (so a
config is read without torch): they are `algo.KEY` like the shared keys (`AlgoConfig`), and
setting one under another `algo.name` is refused naming the algorithm it belongs to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from asyncrl.checkpoint.store import CheckpointError
from asyncrl.core.types import Group

if TYPE_CHECKING:
    from asyncrl.algos.parallel import Ranks
    from asyncrl.algos.schedule import StepSchedule
    from asyncrl.algos.update import ReferencePolicy
    from asyncrl.config import Config
    from asyncrl.models.policy import Policy


class Algorithm(Protocol):
    name: ClassVar[str]
    """Its `algo.name`."""
    Options: ClassVar[type]
    """Dataclass of its own `algo.*` keys (`NoOptions` if none); each field's docstring is its
    documentation, as for every config key."""

    def __init__(self, policy: Policy, config: Config, ranks: Ranks = ...) -> None:
        """Built before any checkpoint is loaded, from the policy's *initial* weights (a
        reference policy or a critic copies them). With `train.num_processes` > 1 it is built
        on every trainer rank: it shards its modules with `ranks.shard` (after copying them,
        before building their optimizers), trains its rows (`rank_micro_batches`), and
        `policy_weights` gathers the full weights (a collective: every rank calls it)."""
        ...

    def step(self, groups: list[Group], step: int) -> dict[str, float]:
        """One training step on the step's N groups (ordered by ordinal); returns its metrics,
        `loss` and `reward_mean` among them. With ranks it is called on every rank, with the
        groups on rank 0 only (`[]` elsewhere): what the others train, rank 0 sends them
        through `ranks` (`scatter`: each its rows; `broadcast`: all of them). Raises
        `NonFiniteLoss` before changing a weight if the loss or a gradient is not finite."""
        ...

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights to publish to generation (live tensors; the weight sync
        copies them)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """All the algorithm must get back on resume, as live references (the checkpointer
        copies them): tensors, and JSON-able values."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict()`; raises `CheckpointError` if it was written by another
        algorithm or does not fit this one (a missing critic, another reference policy)."""
        ...


def check_written_by(state: dict[str, Any], name: str) -> None:
    """Refuses an algorithm state written by another algorithm, naming both."""
    if state.get("name") != name:
        raise CheckpointError(
            f"the checkpoint was written by algo.name={state.get('name')!r}, not {name!r}; "
            "algo.name cannot change on resume"
        )


def check_reference(state: dict[str, Any], sha256: str | None) -> None:
    """Refuses to resume against a reference policy other than the one the run trained
    against (it is rebuilt from the config, not saved)."""
    saved = state.get("reference_sha256")
    if sha256 is not None and saved != sha256:
        raise CheckpointError(
            f"the reference policy rebuilt from the config (weights sha256 {sha256}) is not "
            f"the one the checkpoint was trained against ({saved}); did the files under "
            "model.path change?"
        )


def policy_state(
    name: str,
    optimizer: torch.optim.Optimizer,
    schedule: StepSchedule,
    reference: ReferencePolicy | None,
) -> dict[str, Any]:
    """What every algorithm saves of its policy side: its name, the policy's optimizer and lr
    schedule, and the hash of its reference policy (None without a KL penalty)."""
    return {
        "name": name,
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": schedule.state_dict(),
        "reference_sha256": reference.sha256 if reference else None,
    }


def load_policy_state(
    state: dict[str, Any],
    name: str,
    optimizer: torch.optim.Optimizer,
    schedule: StepSchedule,
    reference: ReferencePolicy | None,
) -> None:
    """Restores `policy_state`, refusing another algorithm's state or another reference. A
    checkpoint from before lr schedules has no `lr_scheduler` (see `StepSchedule`)."""
    check_written_by(state, name)
    check_reference(state, reference.sha256 if reference else None)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state.get("lr_scheduler"))
