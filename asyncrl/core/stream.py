"""The prompt stream: ordinal k -> (epoch, position) -> dataset row, and k -> target step.

Ordinal `k` is the k-th prompt this run hands out, counted across epochs. Its row is
`permutation(seed, epoch)[position]`, a pure function of (seed, epoch) that is recomputed,
never saved. Its target step is `k // N` — unless a lossy resume re-planned the schedule (see
`TargetSchedule`). The stream's state is its cursor (the next ordinal to hand out) and that
schedule, with the identity of the rows it indexes (their count and a digest of their
content): ordinals mean rows only on the same data, so a resume on other data is refused
(DESIGN.md I8) instead of training a different run under the same ordinals.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from asyncrl.core.types import PromptTicket


def epoch_permutation(seed: int, epoch: int, num_rows: int) -> list[int]:
    """The order of dataset rows in `epoch`. Seeded by a string so that it is stable across
    processes and Python versions (str seeds hash with SHA-512, not `hash()`)."""
    order = list(range(num_rows))
    random.Random(f"asyncrl-perm:{seed}:{epoch}").shuffle(order)
    return order


@dataclass
class TargetSchedule:
    """Which step trains each ordinal the stream hands out.

    Lossless runs keep the default, `target(k) = k // N`. A lossy resume policy (which skips
    in-flight ordinals, as NeMo RL does) hands the next ordinals to the targets it left short:
    `fills[i]` is the target of ordinal `fill_start + i`; after them the regular schedule
    restarts, `base_target + (k - base_ordinal) // N`.
    """

    num_prompts_per_step: int
    fill_start: int = 0
    fills: list[int] = field(default_factory=list)
    base_ordinal: int = 0
    base_target: int = 0

    def target(self, ordinal: int) -> int:
        offset = ordinal - self.fill_start
        if 0 <= offset < len(self.fills):
            return self.fills[offset]
        if ordinal < self.base_ordinal:
            raise ValueError(f"ordinal {ordinal} was handed out before the current schedule")
        return self.base_target + (ordinal - self.base_ordinal) // self.num_prompts_per_step

    def refill(self, cursor: int, fills: list[int], next_target: int) -> None:
        """From `cursor` on: first the `fills` targets, then full steps from `next_target`."""
        self.fill_start = cursor
        self.fills = list(fills)
        self.base_ordinal = cursor + len(fills)
        self.base_target = next_target

    def state_dict(self) -> dict[str, Any]:
        return {
            "fill_start": self.fill_start,
            "fills": list(self.fills),
            "base_ordinal": self.base_ordinal,
            "base_target": self.base_target,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fill_start = int(state["fill_start"])
        self.fills = [int(t) for t in state["fills"]]
        self.base_ordinal = int(state["base_ordinal"])
        self.base_target = int(state["base_target"])


class DataChanged(ValueError):
    """A checkpoint's stream was cut on other rows than this run's; the message gives both
    counts and both digests."""


class PromptStream:
    """Hands out `PromptTicket`s in ordinal order, endlessly across epochs. `data_sha256`
    identifies the rows' content (with their count); "" when unknown (it then checks nothing)."""

    def __init__(
        self, num_rows: int, num_prompts_per_step: int, seed: int, data_sha256: str = ""
    ) -> None:
        if num_rows < 1:
            raise ValueError("the prompt stream needs at least one dataset row")
        self.num_rows = num_rows
        self.data_sha256 = data_sha256
        self._other_data_allowed = False
        self.num_prompts_per_step = num_prompts_per_step
        self.seed = seed
        self.cursor = 0
        self.schedule = TargetSchedule(num_prompts_per_step)
        self._perm_epoch = -1
        self._perm: list[int] = []

    def ticket(self, ordinal: int, target_step: int | None = None) -> PromptTicket:
        """The ticket for an ordinal, without moving the cursor. `target_step` defaults to the
        schedule's target for it."""
        epoch, position = divmod(ordinal, self.num_rows)
        if epoch != self._perm_epoch:
            self._perm = epoch_permutation(self.seed, epoch, self.num_rows)
            self._perm_epoch = epoch
        return PromptTicket(
            ordinal=ordinal,
            target_step=self.schedule.target(ordinal) if target_step is None else target_step,
            epoch=epoch,
            position=position,
            dataset_index=self._perm[position],
        )

    def peek_target(self) -> int:
        """The target step of the next ticket `take()` would hand out."""
        return self.schedule.target(self.cursor)

    def take(self) -> PromptTicket:
        ticket = self.ticket(self.cursor)
        self.cursor += 1
        return ticket

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "schedule": self.schedule.state_dict(),
            "num_rows": self.num_rows,
            "data_sha256": self.data_sha256,
        }

    def check_same_data(self, state: dict[str, Any]) -> None:
        """Raises `DataChanged` unless `state` (a saved `state_dict`) was cut on rows of this
        count and digest. A state from before identities were saved, or a side that does not
        know its digest, is not judged."""
        saved_rows, saved_sha = state.get("num_rows"), state.get("data_sha256") or ""
        if saved_rows is None:
            return
        if int(saved_rows) != self.num_rows or (
            saved_sha and self.data_sha256 and saved_sha != self.data_sha256
        ):
            raise DataChanged(
                f"the checkpoint was cut on {int(saved_rows)} examples (sha256 "
                f"{saved_sha[:16] or '?'}), the data now has {self.num_rows} (sha256 "
                f"{self.data_sha256[:16] or '?'})"
            )

    def allow_other_data(self) -> None:
        """The next `load_state_dict` takes a state cut on other rows (`--force-config`)."""
        self._other_data_allowed = True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._other_data_allowed:
            self.check_same_data(state)
        self.cursor = int(state["cursor"])
        self.schedule.load_state_dict(state["schedule"])
