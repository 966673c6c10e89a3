"""The ledger: where every ordinal is.

    pending ──admit──▶ in_flight ──complete──▶ buffered ──sample──▶ trained
                          (partial)

`pending` is everything at or past the stream's cursor, plus ordinals queued for re-dispatch
after a resume; `buffered` lives in the replay buffer; `trained` is every ordinal of a committed
step. The ledger owns the first two. `admit` checks the window *before* pulling from the
stream, so a pulled ticket is never stranded. An in-flight ordinal generated in chunks has
its samples so far in `partials` (saved in a checkpoint; a `lossless` resume continues them).
Rollouts kept at a preemption notice beside the checkpoint a resume loaded (`asyncrl.core.kept`)
wait in `kept` until the stream hands their ordinals out, then continue as partials do.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from asyncrl.core.kept import KeptRollout
from asyncrl.core.partial import Partial
from asyncrl.core.resume import ResumePlan, SavedLedger
from asyncrl.core.stream import PromptStream
from asyncrl.core.types import PromptTicket
from asyncrl.core.window import is_admissible


class Ledger:
    def __init__(self, stream: PromptStream) -> None:
        self.stream = stream
        self.in_flight: dict[int, PromptTicket] = {}
        self.redispatch: deque[PromptTicket] = deque()
        self.partials: dict[int, Partial] = {}
        """In-flight (or queued) ordinal -> its samples so far, when generated in chunks."""
        self.kept: dict[int, Partial] = {}
        """Ordinal the stream has not handed out yet -> its samples kept at a preemption
        notice (`keep`): its partial once it is handed out."""

    def next_target(self) -> int:
        """The target of the next ticket `admit` would hand out: re-dispatches come first."""
        return self.redispatch[0].target_step if self.redispatch else self.stream.peek_target()

    def admit(
        self, weights_version: int, window: int, max_count: int, end_target: int
    ) -> list[PromptTicket]:
        """Up to `max_count` tickets whose targets are inside the window at `weights_version`
        and before `end_target` (the run's step count: nothing is generated for a step that
        will not train), each becoming in flight. Re-dispatched ordinals go first, in a batch
        of their own: they are what was left of one batch (a failed one, or the one in flight
        at a checkpoint, whose other groups may have landed), and mixing fresh tickets in would
        change the batch compositions a deterministic run repeats."""
        tickets: list[PromptTicket] = []
        redispatching = bool(self.redispatch)
        while (
            len(tickets) < max_count
            and self.next_target() < end_target
            and is_admissible(self.next_target(), weights_version, window)
        ):
            if redispatching and not self.redispatch:
                break  # re-dispatched tickets go out as a batch of their own, as they were
            ticket = self.redispatch.popleft() if self.redispatch else self.stream.take()
            if (kept := self.kept.pop(ticket.ordinal, None)) is not None:
                self.partials[ticket.ordinal] = kept
            self.in_flight[ticket.ordinal] = ticket
            tickets.append(ticket)
        return tickets

    def progress(self, ordinal: int, partial: Partial) -> None:
        """A chunk of the in-flight ordinal's samples was generated: `partial` is all of them
        so far."""
        if ordinal not in self.in_flight:
            raise KeyError(f"ordinal {ordinal} is not in flight")
        self.partials[ordinal] = partial

    def complete(self, ordinal: int) -> None:
        """The ordinal's group is in the buffer now."""
        del self.in_flight[ordinal]
        self.partials.pop(ordinal, None)

    def fail(self, tickets: list[PromptTicket]) -> None:
        """Generation of these tickets was lost: dispatch them again, first, in order."""
        for ticket in sorted(tickets, key=lambda t: t.ordinal, reverse=True):
            self.in_flight.pop(ticket.ordinal, None)
            self.redispatch.appendleft(ticket)

    def unfinished(self) -> list[PromptTicket]:
        """Every ticket handed out but not buffered: in flight or queued for re-dispatch."""
        return sorted([*self.in_flight.values(), *self.redispatch], key=lambda t: t.ordinal)

    def saved(
        self,
        step: int,
        buffered: list[tuple[int, int]],
        buffered_tokens: dict[int, int] | None = None,
    ) -> SavedLedger:
        """What a checkpoint of `step` says about ordinals, read off this restored ledger and
        the restored buffer's (ordinal, target) pairs and tokens per group: the input of a
        resume plan."""
        return SavedLedger(
            step=step,
            num_prompts_per_step=self.stream.num_prompts_per_step,
            cursor=self.stream.cursor,
            in_flight=[(t.ordinal, t.target_step) for t in self.unfinished()],
            buffered=buffered,
            partial_tokens={k: p.num_tokens for k, p in sorted(self.partials.items())},
            partial_samples={k: p.saved_samples() for k, p in sorted(self.partials.items())},
            buffered_tokens=dict(buffered_tokens or {}),
        )

    def apply(self, plan: ResumePlan) -> None:
        """Applies a resume plan to the restored ledger. `lossless` keeps the re-dispatch
        queue (the in-flight ordinals go out again, first); a lossy policy drops it — those
        ordinals are skipped — and re-plans the stream's targets from its cursor (the plan's
        discarded groups are the buffer's to delete)."""
        if plan.policy == "restart_episode":  # single-turn samples start over here; the
            self.partials = {  # episode runner starts episodes over, under new step ids
                k: p for k, p in self.partials.items() if p.episodes is not None
            }  # (it needs their restart counts: EpisodeRunner.resume)
            self.kept.clear()  # single-turn samples kept at a notice start over too
        if plan.policy in ("lossless", "restart_episode"):
            return
        self.redispatch.clear()
        self.partials.clear()
        self.kept.clear()
        self.stream.schedule.refill(self.stream.cursor, plan.fills, plan.next_target)

    def state_dict(self) -> dict[str, Any]:
        """In a checkpoint, in-flight and queued tickets are both saved as in flight: a resume
        dispatches them again (lossless) or skips them (lossy policies), with their partial
        samples (tensors). The stream is a part of its own."""
        state: dict[str, Any] = {
            "in_flight": [[t.ordinal, t.target_step] for t in self.unfinished()],
            "partial": {k: p.state_dict() for k, p in sorted(self.partials.items())},
        }
        if self.kept:  # only after a resume that put kept rollouts back: else as before
            state["kept"] = {k: p.state_dict() for k, p in sorted(self.kept.items())}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_flight = {}
        self.redispatch = deque(
            self.stream.ticket(int(k), target_step=int(t)) for k, t in state["in_flight"]
        )
        queued = {t.ordinal for t in self.redispatch}
        # a checkpoint older than partial generations has none
        self.partials = {
            int(k): Partial.from_state(p)
            for k, p in state.get("partial", {}).items()
            if int(k) in queued
        }
        cursor = self.stream.cursor
        self.kept = {
            int(k): Partial.from_state(p) for k, p in state.get("kept", {}).items()
            if int(k) >= cursor
        }  # fmt: skip

    def recovered(self, ordinal: int, partial: Partial) -> None:
        """The queued ordinal's samples with the turns a resume recovered from the steps log
        past its checkpoint (`EpisodeRunner.recover`)."""
        if all(t.ordinal != ordinal for t in self.redispatch):
            raise KeyError(f"ordinal {ordinal} is not queued for dispatch")
        self.partials[ordinal] = partial

    def keep(self, kept: list[KeptRollout], buffered: set[int]) -> list[KeptRollout]:
        """Puts back the rollouts a preemption notice kept beside the restored checkpoint: a
        queued ordinal continues from its kept samples when it is dispatched again, and one
        the stream has not handed out yet gets them when it is. An ordinal the restored buffer
        holds (`buffered`) or the checkpoint had trained is left alone. Returns those put back.
        A kept ordinal's target differs from the schedule's: `ValueError`."""
        queued = {t.ordinal: t for t in self.redispatch}
        cursor = self.stream.cursor
        wanted = []
        for item in kept:  # every target checked before anything changes
            k = item.ordinal
            if k in buffered or (k < cursor and k not in queued):
                continue
            target = queued[k].target_step if k in queued else self.stream.ticket(k).target_step
            if target != item.target_step:
                raise ValueError(
                    f"kept ordinal {k} has target step {item.target_step}; the schedule "
                    f"gives {target}"
                )
            before = self.partials.get(k)
            if before is None or before.num_tokens < item.partial.num_tokens:
                wanted.append(item)
        for item in wanted:
            if item.ordinal in queued:
                self.partials[item.ordinal] = item.partial
            else:
                self.kept[item.ordinal] = item.partial
        return wanted
