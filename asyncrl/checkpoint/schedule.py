"""When the trainer writes a checkpoint: after every `save_period` steps, after `every_s`
seconds of wall time, and never by waiting for the disk.

A checkpoint that falls due while the previous one is still being written is *deferred* (with
`when_busy="defer"`, the default): the trainer trains on, and the checkpoint is written at the
first step boundary after that write ends; a `save_period` boundary passed meanwhile is folded
into it (counted). The trainer's blocked time per checkpoint is then the cut alone, not the
previous write. `when_busy="wait"` blocks instead, so with `every_s` off the checkpoints' steps
are a function of the config alone (crash tests that kill at one checkpoint's step use it). A
stop's emergency checkpoint and the final one always wait: they are not scheduled here.

Pure: the caller passes the clock and whether a write is in progress.

    boundary of step t ──▶ due(t, now)? ── no ──────────────────────────▶ train on
                               │ yes (reason)
                               ▼
                    write in progress and "defer"? ── yes ──▶ defer (one event) ──▶ train on
                               │ no                            (due again at t+1, t+2, ...)
                               ▼
                            save ──▶ saved(now)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Decision = Literal["save", "defer", "none"]


@dataclass
class CheckpointSchedule:
    save_period: int
    every_s: float  # 0: no wall-clock period
    when_busy: Literal["defer", "wait"]
    last_saved_s: float
    """The clock at the last checkpoint, or at the launch (a resume starts from one)."""
    deferred_step: int | None = None
    """The step whose due checkpoint is deferred; None when none is."""
    deferred_reason: str = ""
    folded_periods: int = 0
    """`save_period` boundaries passed while the deferred checkpoint waited: each would have
    been a checkpoint of its own; the one deferred checkpoint stands for them."""

    def due(self, step: int, now_s: float) -> str | None:
        """Why a checkpoint is due at the boundary after `step` steps, else None."""
        if self.deferred_step is not None:
            return self.deferred_reason
        if step % self.save_period == 0:
            return "save_period"
        if self.every_s > 0 and now_s - self.last_saved_s >= self.every_s:
            return "every_s"
        return None

    def decide(self, step: int, now_s: float, writing: bool) -> tuple[Decision, str]:
        """`save`, `defer` (a first deferral: the caller says so once) or `none`, and why the
        checkpoint is due (`save_period` or `every_s`; "" when it is not); `writing`: the
        previous checkpoint is still being written."""
        reason = self.due(step, now_s)
        if reason is None:
            return "none", ""
        if writing and self.when_busy == "defer":
            if self.deferred_step is not None:  # still deferred; said already
                self.folded_periods += step % self.save_period == 0
                return "none", reason
            self.deferred_step, self.deferred_reason = step, reason
            return "defer", reason
        return "save", reason

    def saved(self, now_s: float) -> dict[str, int]:
        """Records a checkpoint cut at `now_s`; returns its event's deferral facts: the step
        it was deferred from and the periods folded into it (none when it was not)."""
        facts = (
            {}
            if self.deferred_step is None
            else {"deferred_from": self.deferred_step, "folded_periods": self.folded_periods}
        )
        self.deferred_step, self.deferred_reason, self.folded_periods = None, "", 0
        self.last_saved_s = now_s
        return facts
