"""The trainer's side of a preemption notice (`asyncrl.core.preemption` holds the rules): this
run's measured checkpoint times, the notice announced when the training loop first sees it
(printed, and a `preemption_notice` event), and the result once the checkpoint is verified
(a `preemption_result` event: seconds from the notice, deadline met or not)."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.core.preemption import Measured, StopPlan, estimate_s, outcome, plan_stop, seconds
from asyncrl.train.signals import StopRequest

TAIL_BYTES = 64 << 10
"""How much of `events.jsonl` a launch reads back for the previous launches' checkpoint times
(and `inspect` for the last preemption): its end only, so the cost does not grow with the run."""
KEEP = 3
"""Checkpoints whose times an estimate uses: the newest, at the slowest rate among them."""


def tail_events(path: Path, nbytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The whole records among the last `nbytes` of an events file (a torn line is skipped)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - nbytes))
        data = f.read()
    lines = data.split(b"\n")
    if size > nbytes:
        lines = lines[1:]  # the first is most likely a piece of a line
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def measured_of(event: dict[str, Any]) -> Measured:
    """A checkpoint event's bytes and seconds from its cut to verified."""
    return Measured(int(event["bytes"]), float(event.get("pause_s", 0.0)) + float(event["seconds"]))


class Deadlines:
    def __init__(self, events_path: Path) -> None:
        saved = [e for e in tail_events(events_path) if e.get("event") == "checkpoint"]
        self.measured: deque[Measured] = deque(
            (measured_of(e) for e in saved[-KEEP:] if "bytes" in e), maxlen=KEEP
        )
        self.verified_step: int | None = int(saved[-1]["step"]) if saved else None

    def saved(self, fields: dict[str, Any]) -> None:
        """A checkpoint was verified (its event's fields)."""
        self.measured.append(measured_of(fields))
        self.verified_step = int(fields["step"])

    def plan(self, stop: StopRequest) -> StopPlan | None:
        """The plan for the notice whose deadline comes first, now (None: no notice)."""
        notice = stop.notice
        if notice is None:
            return None
        return plan_stop(notice, time.monotonic(), estimate_s(self.measured))

    def announce(self, stop: StopRequest, step: int, emit: Callable[..., None]) -> None:
        """Prints and records each notice not yet announced: its deadline, and whether the
        checkpoint cut now should be verified before it."""
        now = time.monotonic()
        estimate = estimate_s(self.measured)
        for notice in stop.notices[stop.reported :]:
            plan = plan_stop(notice, now, estimate)
            print(plan.line(notice, step, self.verified_step), flush=True)
            emit(
                "preemption_notice",
                source=notice.source,
                deadline=None if plan.left_s is None else time.time() + plan.left_s,
                deadline_s=notice.deadline_s,
                node=notice.node,
                step=step,
                seen_after_s=now - notice.received_s,
                left_s=plan.left_s,
                checkpoint_estimate_s=plan.estimate_s,
                fits=plan.fits,
            )
        stop.reported = len(stop.notices)

    def finish(
        self, stop: StopRequest, step: int, abandoned: bool, emit: Callable[..., None]
    ) -> str:
        """Records the result against the earliest deadline; returns the line to print."""
        notice = stop.notice
        assert notice is not None
        result = outcome(notice, time.monotonic())
        emit("preemption_result", source=notice.source, step=step, abandoned_step=abandoned,
             **result)  # fmt: skip
        took_s = float(result["notice_to_durable_s"] or 0.0)
        took = f"verified {seconds(took_s)} s after the notice"
        if result["met"] is None:
            when = ""
        elif result["met"]:
            when = f", {seconds((notice.deadline_s or 0.0) - took_s)} s before the deadline"
        else:
            when = f", AFTER the deadline of {notice.deadline_s:g} s"
        given_up = f" (step {step}'s training given up: it changed no weight)" if abandoned else ""
        return (
            f"asyncrl: {notice.source}: checkpoint of step {step} {took}{when}{given_up}; run "
            "the same command again to resume"
        )
