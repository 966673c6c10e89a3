"""The ledger: where every ordinal is.

    pending ──admit──▶ in_flight ──complete──▶ buffered ──sample──▶ trained

`pending` is everything at or past the stream's cursor, plus ordinals queued for re-dispatch
after a resume; `buffered` lives in the replay buffer; `trained` is every ordinal of a committed
step. The ledger owns the first two. `admit` checks the window *before* pulling from the
stream, so a pulled ticket is never stranded.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from asyncrl.core.stream import PromptStream
from asyncrl.core.types import PromptTicket
from asyncrl.core.window import is_admissible


class Ledger:
    def __init__(self, stream: PromptStream) -> None:
        self.stream = stream
        self.in_flight: dict[int, PromptTicket] = {}
        self.redispatch: deque[PromptTicket] = deque()

    def next_target(self) -> int:
        """The target of the next ticket `admit` would hand out: re-dispatches come first."""
        return self.redispatch[0].target_step if self.redispatch else self.stream.peek_target()

    def admit(self, weights_version: int, max_age_steps: int, max_count: int) -> list[PromptTicket]:
        """Up to `max_count` tickets whose targets are inside the window at `weights_version`,
        re-dispatched ordinals first; each becomes in flight."""
        tickets: list[PromptTicket] = []
        while len(tickets) < max_count and is_admissible(
            self.next_target(), weights_version, max_age_steps
        ):
            ticket = self.redispatch.popleft() if self.redispatch else self.stream.take()
            self.in_flight[ticket.ordinal] = ticket
            tickets.append(ticket)
        return tickets

    def complete(self, ordinal: int) -> None:
        """The ordinal's group is in the buffer now."""
        del self.in_flight[ordinal]

    def fail(self, tickets: list[PromptTicket]) -> None:
        """Generation of these tickets was lost: dispatch them again, first, in order."""
        for ticket in sorted(tickets, key=lambda t: t.ordinal, reverse=True):
            self.in_flight.pop(ticket.ordinal, None)
            self.redispatch.appendleft(ticket)

    def unfinished(self) -> list[PromptTicket]:
        """Every ticket handed out but not buffered: in flight or queued for re-dispatch."""
        return sorted([*self.in_flight.values(), *self.redispatch], key=lambda t: t.ordinal)

    def state_dict(self) -> dict[str, Any]:
        """In a checkpoint, in-flight and queued tickets are both saved as in flight: a resume
        dispatches them again (lossless) or skips them (lossy policies)."""
        return {
            "stream": self.stream.state_dict(),
            "in_flight": [[t.ordinal, t.target_step] for t in self.unfinished()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.in_flight = {}
        self.redispatch = deque(
            self.stream.ticket(int(k), target_step=int(t)) for k, t in state["in_flight"]
        )
