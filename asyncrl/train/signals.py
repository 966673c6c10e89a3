"""Preemption: SIGTERM or SIGINT asks the run to stop at the next step boundary with a
checkpoint (Slurm and spot instances send SIGTERM with a grace period); a second signal aborts
at once. The handler only sets a flag: all the work happens in the training loop."""

from __future__ import annotations

import os
import signal
from types import FrameType

EXIT_PREEMPTED = 75
"""Stopped by a signal with a verified checkpoint written: run the same command to resume."""
EXIT_ABORTED = 130
"""A second signal arrived: stopped at once; the previous verified checkpoint stands."""


class Preempted(Exception):
    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        """Handles SIGTERM and SIGINT in this (main) thread from now on."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            os._exit(EXIT_ABORTED)
        self.signal_name = signal.Signals(signum).name
