"""The prompt stream: ordinal k -> (epoch, position) -> dataset row.

Ordinal `k` is the k-th prompt this run hands out, counted across epochs. Its row is
`permutation(seed, epoch)[position]`, a pure function of (seed, epoch) that is recomputed,
never saved: the only state of the stream is its cursor, the next ordinal to hand out.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.core.types import PromptTicket


def epoch_permutation(seed: int, epoch: int, num_rows: int) -> list[int]:
    """The order of dataset rows in `epoch`. Seeded by a string so that it is stable across
    processes and Python versions (str seeds hash with SHA-512, not `hash()`)."""
    order = list(range(num_rows))
    random.Random(f"asyncrl-perm:{seed}:{epoch}").shuffle(order)
    return order


class PromptStream:
    """Hands out `PromptTicket`s in ordinal order, endlessly across epochs.

    `num_prompts_per_step` (N) fixes each ticket's target step, `ordinal // N`.
    """

    def __init__(self, num_rows: int, num_prompts_per_step: int, seed: int) -> None:
        if num_rows < 1:
            raise ValueError("the prompt stream needs at least one dataset row")
        self.num_rows = num_rows
        self.num_prompts_per_step = num_prompts_per_step
        self.seed = seed
        self.cursor = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    def ticket(self, ordinal: int) -> PromptTicket:
        """The ticket for any ordinal, past or future, without moving the cursor."""
        epoch, position = divmod(ordinal, self.num_rows)
        if epoch != self._perm_epoch:
            self._perm = epoch_permutation(self.seed, epoch, self.num_rows)
            self._perm_epoch = epoch
        return PromptTicket(
            ordinal=ordinal,
            target_step=ordinal // self.num_prompts_per_step,
            epoch=epoch,
            position=position,
            dataset_index=self._perm[position],
        )

    def peek_target(self) -> int:
        """The target step of the next ticket `take()` would hand out."""
        return self.cursor // self.num_prompts_per_step

    def take(self) -> PromptTicket:
        ticket = self.ticket(self.cursor)
        self.cursor += 1
        return ticket

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
