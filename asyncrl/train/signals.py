"""Preemption: a signal is a notice that the machine goes away, with a deadline (SIGTERM after
`checkpoint.grace_s`, Slurm's SIGUSR1 or SIGUSR2 after `checkpoint.signal_warning_s`, SIGINT
without one; `asyncrl.core.preemption`). The run stops at its earliest consistent point with a
verified checkpoint and exits 75. Another kind of signal is one more notice, and the earliest
deadline holds (Slurm's SIGUSR1, then its SIGTERM at the job's end). A Ray drain of the
trainer's node is a notice too, with Ray's deadline (`StopRequest.add`, from
`asyncrl.distributed.drains`). The handler only records: all the work happens in the training
loop, which hears a notice at every moment (an evaluation in progress listens: `listening`).

The same signal again (issue 63; Slurm with torchrun may deliver SIGTERM twice, a person may
press Ctrl-C twice):

- before the notice's checkpoint is verified, the second is noted and the checkpoint goes on;
  the third aborts: `Aborted` is raised in the main thread, so the run's cleanup (`finally`,
  close: its servers, its reward workers, its ranks, its run dir lock) still runs; exit 130,
  the newest verified checkpoint stands;
- once it is verified, a repeat ends the waits left (`hurry`: generation still in flight is
  not waited on at all); the exit is still 75, since the checkpoint is verified;
- a signal while an abort's cleanup runs ends the process at once (`os._exit(130)`): the
  cleanup itself is stuck.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import FrameType

from asyncrl.core.preemption import SIGNALS as SIGNAL_NAMES
from asyncrl.core.preemption import Notice, first_deadline, notice_deadline

EXIT_PREEMPTED = 75
"""Stopped by a notice once a verified checkpoint was written: run the same command to resume."""
EXIT_ABORTED = 130
"""The same signal a third time before the notice's checkpoint was verified: aborted through the
run's cleanup; the previous verified checkpoint stands."""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""What a training process hears as a notice (the other ranks ignore them: rank 0 stops the run)."""
ABORT_AT = 3
"""The same signal this many times before the notice's checkpoint is verified aborts the run."""


class Preempted(Exception):
    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Aborted(BaseException):
    """The same signal `ABORT_AT` times before the notice's checkpoint was verified. A
    BaseException, as KeyboardInterrupt is: nothing on the way catches it, every `finally` runs."""


def _say(line: str) -> None:
    """A line on stderr from a signal handler: one `write`, no buffered stream (the main thread
    may be inside a `print` when the handler runs)."""
    with contextlib.suppress(OSError):
        os.write(2, f"asyncrl: {line}\n".encode())


class StopRequest:
    def __init__(self, grace_s: float = 30.0, signal_warning_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.signal_warning_s = signal_warning_s
        self.notices: list[Notice] = []
        self.reported = 0
        """How many notices the trainer has announced (printed and recorded)."""
        self.repeats: dict[str, int] = {}
        """Per signal, how many times it came after its notice."""
        self.verified = False
        """The notice's checkpoint is verified (`checkpoint_verified`)."""
        self.hurry = threading.Event()
        """Set by a repeated signal once the checkpoint is verified: end the waits left now."""
        self.cut_short_by: str | None = None
        """The signal that set `hurry`."""
        self.aborting = False
        self.abandoned = False
        """Generation was given up while still running (the process then ends with `os._exit`
        after its cleanup: a thread stuck in native code must not meet the interpreter's end)."""
        self._listeners: list[Callable[[], None]] = []

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
        self.add(Notice(source, at, deadline, socket.gethostname()))

    def add(self, notice: Notice) -> None:
        """A notice (a signal's, or a Ray drain of the trainer's node with its own deadline);
        from any thread. The listeners are told."""
        self.notices.append(notice)
        for listener in list(self._listeners):
            listener()

    @contextlib.contextmanager
    def listening(self, listener: Callable[[], None]) -> Iterator[None]:
        """`listener()` is called at each notice while the block runs (from the signal handler
        or the drain watcher's thread: it must only set a flag), and once on entry if a notice
        came before."""
        self._listeners.append(listener)
        try:
            if self.requested:
                listener()
            yield
        finally:
            self._listeners.remove(listener)

    def checkpoint_verified(self) -> None:
        """The notice's checkpoint is verified: from now on a repeated signal ends the waits."""
        self.verified = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.aborting:
            _say(f"{name} again while aborting: ending at once")
            os._exit(EXIT_ABORTED)
        if not any(n.source == name for n in self.notices):
            self.receive(name)
            return
        times = self.repeats[name] = self.repeats.get(name, 0) + 1
        if self.verified:
            self.cut_short_by = self.cut_short_by or name
            self.hurry.set()
            _say(f"{name} again: the checkpoint is verified; not waiting for anything more")
        elif times + 1 < ABORT_AT:
            _say(f"{name} again: the checkpoint goes on; once more aborts it")
        else:
            self.aborting = True
            self.hurry.set()  # an abort waits for nothing: generation, the shutdown
            self.abandoned = True  # what is left running is not joined at exit
            _say(f"{name} a third time: aborting; the newest verified checkpoint stands")
            raise Aborted(name)
