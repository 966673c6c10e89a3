"""The trainer's side of a preemption notice (`asyncrl.core.preemption` holds the rules): this
run's measured checkpoint times, the notice announced when the training loop first sees it
(printed, and a `preemption_notice` event), and the result once the checkpoint is verified
(a `preemption_result` event: seconds from the notice, deadline met or not, and what became of
an evaluation); then generation stopped, never waited on past the deadline (a
`generation_stopped` event). Exit 75 means the notice's checkpoint is verified."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.checkpoint.store import CheckpointError
from asyncrl.core.ledger import Ledger
from asyncrl.core.preemption import Measured, StopPlan, estimate_s, outcome, plan_stop, seconds
from asyncrl.train.kept import keep_at_notice
from asyncrl.train.signals import Preempted, StopRequest

if TYPE_CHECKING:
    from asyncrl.train.trainer import Trainer

TAIL_BYTES = 64 << 10
"""How much of `events.jsonl` a launch reads back for the previous launches' checkpoint times
(and `inspect` for the last preemption): its end only, so the cost does not grow with the run."""
KEEP = 3
"""Checkpoints whose times an estimate uses: the newest, at the slowest rate among them."""
EXIT_RESERVE_S = 1.0
"""Of the time left to a notice's deadline once its checkpoint is verified, what generation may
not take: the rest of the exit (reward workers, Ray, ranks, logs, the process's end)."""
POLL_S = 0.1
"""How often a wait for generation looks whether a repeated signal asks it to end."""


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

    def left_s(self, stop: StopRequest) -> float | None:
        """Seconds to the earliest deadline now (None: no notice has one)."""
        notice = stop.notice
        at = None if notice is None else notice.deadline_at
        return None if at is None else at - time.monotonic()

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
        self,
        stop: StopRequest,
        step: int,
        abandoned: bool,
        emit: Callable[..., None],
        evaluation: dict[str, Any] | None = None,
    ) -> str:
        """Records the result against the earliest deadline (and `evaluation`: what the notice
        did to an evaluation, `Trainer.evaluation_at_notice`); returns the line to print."""
        notice = stop.notice
        assert notice is not None
        result = outcome(notice, time.monotonic())
        emit("preemption_result", source=notice.source, step=step, abandoned_step=abandoned,
             **result, **(evaluation or {"evaluation": None}))  # fmt: skip
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


def answer_notice(trainer: Trainer, stop: Preempted) -> None:
    """The emergency checkpoint, first: the cut needs no pause of generation, and a preempted
    machine's grace period is short. The notice is announced (does the checkpoint fit before
    its deadline?), generation halted once the cut is taken (nothing it samples after counts),
    and the result recorded against the notice once the checkpoint is verified. Raises the
    write's error where it fails: exit 75 is only for a verified checkpoint."""
    emit = trainer.logs.events.emit
    trainer.deadlines.announce(trainer.stop, trainer.step, emit)
    emit("signal", signal=stop.signal_name, step=trainer.step)
    kept_beside = keep_at_notice(trainer)
    try:
        trainer.writer.wait()
    except CheckpointError as err:  # an earlier periodic save failed: still try this one
        print(f"asyncrl: an earlier checkpoint write failed: {err}")
        trainer.last_saved_step = -1  # it may have been this step's: write it again
    if kept_beside is not None and trainer.keeper.verified_step != kept_beside:
        # the write in progress was verified (its retain deleted the file beside the
        # older checkpoint): keep beside the newer one
        keep_at_notice(trainer)
    if trainer.last_saved_step != trainer.step:
        trainer.checkpoint(reason="stop")  # cut and handed to the writer
    trainer.parts.collector.halt()  # the cut is taken: the engine's time goes to the write
    trainer.writer.wait()
    trainer.stop.checkpoint_verified()
    trainer.deadlines.announce(trainer.stop, trainer.step, emit)  # one that came meanwhile
    abandoned = trainer.abandoned_step == trainer.step
    line = trainer.deadlines.finish(
        trainer.stop, trainer.step, abandoned, emit, trainer.evaluation_at_notice
    )
    print(line, flush=True)


def stop_generation_by_deadline(trainer: Trainer) -> None:
    """After a notice (its checkpoint verified, or the run failing or aborting): generation is
    halted and its thread waited for, at most until the earliest deadline less
    `EXIT_RESERVE_S` (a notice without one: until it ends), and not at all once a repeated
    signal says so (`StopRequest.hurry`). A call still running then (a wedged server, a reward
    that never returns) is given up: its ordinals are counted, in flight in the checkpoint,
    generated again on resume (from their saved tokens where chunked). A `generation_stopped`
    event says which."""
    stop, collector = trainer.stop, trainer.parts.collector
    start = time.monotonic()
    collector.halt()
    trainer.parts.scorer.pool.close()  # a reward call in a worker process fails at once
    ended = collector.join(0.0)
    while not ended and not stop.hurry.is_set():
        left = trainer.deadlines.left_s(stop)
        budget = POLL_S if left is None else min(POLL_S, left - EXIT_RESERVE_S)
        if budget <= 0:
            break
        ended = collector.join(budget)
    if not ended:
        collector.abandon()
        stop.abandoned = True
    in_flight = _unfinished(trainer.parts.ledger)
    trainer.logs.events.emit(
        "generation_stopped",
        waited_s=time.monotonic() - start,
        abandoned=not ended,
        in_flight=in_flight,
        cut_short_by=stop.cut_short_by,
    )
    if not ended:
        print(
            f"asyncrl: generation still running at the deadline given up; ordinals {in_flight} "
            "are in flight in the checkpoint and are generated again on resume",
            flush=True,
        )


def _unfinished(ledger: Ledger) -> list[int]:
    """The ordinals handed out and not buffered, in flight or queued again (a halted batch's
    go back to the queue): what a resume generates again. Read without the collector's lock,
    which a thread given up may hold; a read that meets a change is tried again."""
    for _ in range(3):
        try:
            return [t.ordinal for t in ledger.unfinished()]
        except RuntimeError:  # the queue changed while it was read
            continue
    return sorted(dict(ledger.in_flight))


SHUTDOWN_RESERVE_S = 0.5
"""Of the time left to a notice's deadline when the run's shutdown starts, what it may not
take: the process's own end."""


def shutdown_by_deadline(trainer: Trainer) -> None:
    """Releases what the run started (`Components.shutdown`: Ray actors and a local Ray, vLLM
    servers launched or attached, reward workers). After a notice with a deadline it runs in a
    thread waited for at most until the deadline less `SHUTDOWN_RESERVE_S`, and not at all
    once a repeated signal says so: a release still running then (an attached server that does
    not answer, a Ray that takes its time) is given up, and the process ends with its exit
    code; launched servers and scratch copies are ended by their lifeline
    (`asyncrl.rollout.lifeline`), whatever the process's end."""
    stop = trainer.stop
    left = trainer.deadlines.left_s(stop) if stop.requested else None
    if left is None:
        trainer.parts.shutdown()
        return
    start = time.monotonic()
    thread = threading.Thread(target=trainer.parts.shutdown, name="asyncrl-shutdown", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.hurry.is_set():
        budget = min(POLL_S, left - SHUTDOWN_RESERVE_S - (time.monotonic() - start))
        if budget <= 0:
            break
        thread.join(budget)
    if thread.is_alive():
        stop.abandoned = True  # the CLI ends the process without joining what is left
        print(
            f"asyncrl: shutdown still running {time.monotonic() - start:.1f} s after it began "
            "given up at the notice's deadline (launched vLLM servers are ended by their "
            "lifeline)",
            flush=True,
        )
