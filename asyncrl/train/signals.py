"""Preemption: a signal is a notice that the machine goes away, with a deadline (SIGTERM after
`checkpoint.grace_s`, Slurm's SIGUSR1 or SIGUSR2 after `checkpoint.signal_warning_s`, SIGINT
without one; `asyncrl.core.preemption`). The run stops at its earliest consistent point with a
verified checkpoint and exits 75. The same signal a second time aborts at once (exit 130: Ctrl-C
twice); another kind of signal is one more notice, and the earliest deadline holds (Slurm's
SIGUSR1, then its SIGTERM at the job's end). A Ray drain of the trainer's node is a notice too,
with Ray's deadline (`StopRequest.add`, from `asyncrl.distributed.drains`). The handler only
records the notice: all the work happens in the training loop."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import replace
from types import FrameType

from asyncrl.core.preemption import SIGNALS as SIGNAL_NAMES
from asyncrl.core.preemption import Notice, first_deadline, notice_deadline

EXIT_PREEMPTED = 75
"""Stopped by a signal with a verified checkpoint written: run the same command to resume."""
EXIT_ABORTED = 130
"""The same signal a second time: stopped at once; the previous verified checkpoint stands."""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""What a training process hears as a notice (the other ranks ignore them: rank 0 stops the run)."""


class Preempted(Exception):
    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopRequest:
    def __init__(self, grace_s: float = 30.0, signal_warning_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.signal_warning_s = signal_warning_s
        self.notices: list[Notice] = []
        self.reported = 0
        """How many notices the trainer has announced (printed and recorded)."""

    @property
    def requested(self) -> bool:
        return bool(self.notices)

    @property
    def signal_name(self) -> str | None:
        return self.notices[0].source if self.notices else None

    @property
    def notice(self) -> Notice | None:
        """The notice whose deadline comes first."""
        return first_deadline(self.notices)

    def configure(self, grace_s: float, signal_warning_s: float) -> None:
        """The config's deadlines (`checkpoint.grace_s`, `checkpoint.signal_warning_s`), for
        the notices to come and any received while the config was read."""
        self.grace_s, self.signal_warning_s = grace_s, signal_warning_s
        self.notices = [
            replace(n, deadline_s=notice_deadline(n.source, grace_s, signal_warning_s))
            if n.source in SIGNAL_NAMES
            else n  # a Ray drain's deadline is Ray's
            for n in self.notices
        ]

    def install(self) -> None:
        """Handles the notices' signals in this (main) thread from now on."""
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def receive(self, source: str, now_s: float | None = None) -> None:
        """A notice from `source` (a signal's name) at `now_s` (monotonic; default now)."""
        deadline = notice_deadline(source, self.grace_s, self.signal_warning_s)
        at = time.monotonic() if now_s is None else now_s
        self.notices.append(Notice(source, at, deadline, socket.gethostname()))

    def add(self, notice: Notice) -> None:
        """A notice that is not a signal (a Ray drain of the trainer's node), with its own
        deadline; from any thread."""
        self.notices.append(notice)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if any(n.source == name for n in self.notices):
            os._exit(EXIT_ABORTED)
        self.receive(name)
