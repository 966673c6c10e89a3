"""Preemption notices and their deadlines: what a run can make durable before it is killed.

A notice says the machine goes away at a deadline: SIGTERM (Kubernetes, spot instances, Slurm
at the end of a job) after `checkpoint.grace_s`, SIGUSR1 or SIGUSR2 (Slurm's
`--signal=USR1@N`) after `checkpoint.signal_warning_s`; SIGINT (Ctrl-C) has none; a Ray drain
(`ray drain-node`, Ray's autoscaler preempting a node) at the deadline Ray states for the node:
a drained generation node hands its work back (`plan_drain`), the trainer's node is a notice.
The run then cuts its checkpoint at the earliest consistent point (a training step that has
changed no weight yet is given up, its groups back in the buffer) and says at the notice
whether the checkpoint fits before the deadline, from this run's measured checkpoint times.

Pure: no signals and no clock. The trainer's shell passes monotonic times in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

NO_DEADLINE = ("SIGINT",)
"""Notices without a deadline: a person stopping the run."""
RAY_DRAIN = "ray_drain"
"""The source of a notice that Ray drains the trainer's node."""
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
"""The notices that are signals: their deadlines come from the config."""


@dataclass(frozen=True)
class Notice:
    source: str
    """`SIGTERM`, `SIGUSR1`, `SIGUSR2`, `SIGINT`, or `ray_drain`."""
    received_s: float
    """When it arrived (monotonic seconds)."""
    deadline_s: float | None
    """Seconds from its arrival to the kill (None: no deadline)."""
    node: str = ""
    """The machine it concerns (its host name; a Ray drain: the node's id)."""

    @property
    def deadline_at(self) -> float | None:
        return None if self.deadline_s is None else self.received_s + self.deadline_s


def notice_deadline(source: str, grace_s: float, signal_warning_s: float) -> float | None:
    """The deadline a signal announces: `checkpoint.grace_s` for SIGTERM,
    `checkpoint.signal_warning_s` for SIGUSR1 and SIGUSR2, none for SIGINT."""
    if source in NO_DEADLINE:
        return None
    if source in ("SIGUSR1", "SIGUSR2"):
        return signal_warning_s
    return grace_s


def first_deadline(notices: Iterable[Notice]) -> Notice | None:
    """The notice whose deadline comes first (one without a deadline only if none has one)."""
    listed = list(notices)
    timed = [n for n in listed if n.deadline_at is not None]
    if timed:
        return min(timed, key=lambda n: n.deadline_at or 0.0)
    return listed[0] if listed else None


@dataclass(frozen=True)
class Measured:
    """One checkpoint this run wrote: its bytes and the seconds from its cut to verified."""

    bytes: int
    seconds: float

    @property
    def rate(self) -> float:
        """Bytes per second, cut to verified."""
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def estimate_s(measured: Iterable[Measured], nbytes: int | None = None) -> float | None:
    """Seconds a checkpoint of `nbytes` (default: the last one's) takes from its cut to
    verified, at the slowest rate of the checkpoints measured (None: none measured yet)."""
    listed = list(measured)
    if not listed:
        return None
    size = listed[-1].bytes if nbytes is None else nbytes
    return size / min(m.rate for m in listed)


def seconds(value: float) -> str:
    """Seconds for a person: 2 decimals below 10, 1 above."""
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


@dataclass(frozen=True)
class StopPlan:
    left_s: float | None
    """Seconds to the deadline at the notice (None: no deadline)."""
    estimate_s: float | None
    """What the checkpoint should take (None: nothing measured yet)."""
    fits: bool | None
    """Whether it should be durable before the deadline (None: unknown)."""

    def line(self, notice: Notice, step: int, verified_step: int | None) -> str:
        """What the run prints at the notice; `verified_step`: the newest verified checkpoint's
        step (None: none yet)."""
        head = f"asyncrl: {notice.source}: preemption notice; checkpointing step {step} now"
        if self.left_s is None:
            return f"{head} (no deadline)"
        deadline = f"the deadline is in {seconds(self.left_s)} s"
        if self.estimate_s is None:
            return f"{head}; {deadline}; no checkpoint of this run measured yet"
        took = f"a checkpoint takes ~{seconds(self.estimate_s)} s here"
        if self.fits:
            return f"{head}; {deadline}, {took}: it fits"
        stands = "none" if verified_step is None else f"step {verified_step}'s"
        return (
            f"{head}; {deadline}, {took}: it does NOT fit; if the kill comes first, the newest "
            f"verified checkpoint ({stands}) stands"
        )


def plan_stop(notice: Notice, now_s: float, estimate: float | None) -> StopPlan:
    """Whether the checkpoint cut now (`estimate` seconds to verified) is durable before the
    notice's deadline."""
    at = notice.deadline_at
    left = None if at is None else at - now_s
    fits = None if left is None or estimate is None else estimate <= left
    return StopPlan(left, estimate, fits)


def outcome(notice: Notice, durable_s: float) -> dict[str, float | bool | None]:
    """The `preemption_result` event's account: seconds from the notice to the checkpoint
    verified, and whether that was before the deadline."""
    at = notice.deadline_at
    return {
        "notice_to_durable_s": durable_s - notice.received_s,
        "deadline_s": notice.deadline_s,
        "met": None if at is None else durable_s <= at,
    }


@dataclass(frozen=True)
class Drain:
    """Ray drains a node: its hex id, and when it will be killed."""

    node: str
    deadline_ms: int
    """Unix milliseconds of the kill, as Ray states it (0: Ray was given no deadline)."""

    def left_s(self, now_ms: float) -> float | None:
        """Seconds from `now_ms` (Unix milliseconds) to the kill (None: no deadline)."""
        return None if not self.deadline_ms else max(0.0, (self.deadline_ms - now_ms) / 1000)

    def notice(self, received_s: float, now_ms: float) -> Notice:
        """The trainer's notice, received at monotonic `received_s` (Unix ms `now_ms`)."""
        return Notice(RAY_DRAIN, received_s, self.left_s(now_ms), self.node)


def new_drains(draining: Mapping[str, int], seen: set[str]) -> list[Drain]:
    """The nodes Ray drains (node -> deadline in Unix ms, Ray's own map) that were not
    draining at the last look, in node order; `seen` is updated. A node Ray no longer lists
    leaves `seen`, so a second drain of it is a new one."""
    fresh = [Drain(node, int(draining[node])) for node in sorted(draining) if node not in seen]
    seen.intersection_update(draining)
    seen.update(draining)
    return fresh


@dataclass(frozen=True)
class DrainPlan:
    trainer: bool
    """The trainer runs on the node: a notice, answered like a signal's."""
    workers: tuple[int, ...]
    """The generation workers on the node: each hands its work back and is replaced."""


def plan_drain(drain: Drain, trainer_node: str, worker_nodes: Sequence[str]) -> DrainPlan:
    """What a drain asks of this run, from the nodes its trainer and its generation workers
    run on ("" where a worker is not placed yet). The trainer's node is a notice, and the run
    stops: its workers there only finish their call (replacements would be for nothing, and
    where the drained node is the only one, a pass dispatched before the stop would wait for a
    replacement Ray cannot place)."""
    if drain.node == trainer_node:
        return DrainPlan(True, ())
    workers = tuple(i for i, node in enumerate(worker_nodes) if node and node == drain.node)
    return DrainPlan(False, workers)
