"""Sampling a benchmark's child process's memory from /proc (benchmarks/scale.py): its RSS
over time, its own peak (VmHWM), the peak RSS of each of its children (the other trainer
ranks), and a kill before the machine runs out of memory."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's, from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return found


def vm_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class OutOfMemory(RuntimeError):
    """The run was killed before it could take the machine's last gigabyte."""


class RssSampler:
    """Samples VmRSS and VmHWM of `pid` from /proc every `period_s` in a thread. SIGKILLs the
    process if the machine's available memory falls below `reserve_bytes` (a size that does
    not fit must not take the machine down with it): `oom` says so."""

    def __init__(self, pid: int, period_s: float = 0.02, reserve_bytes: int = 1 << 30) -> None:
        self.pid, self.period_s, self.reserve_bytes = pid, period_s, reserve_bytes
        self.oom = False
        self.samples: list[tuple[float, int]] = []
        self.hwm_bytes = 0
        self.child_peak_bytes: dict[int, int] = {}
        """Peak VmRSS of each child process (the other trainer ranks)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while not self._stop.is_set():
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
            except (OSError, ValueError):
                break  # the process is gone
            if "VmRSS" in fields:  # a zombie has none
                self.samples.append((time.time(), int(fields["VmRSS"].split()[0]) * 1024))
                self.hwm_bytes = int(fields["VmHWM"].split()[0]) * 1024
            for child in child_pids(self.pid):  # trainer ranks > 0 (train.num_processes)
                rss = vm_rss(child)
                self.child_peak_bytes[child] = max(rss, self.child_peak_bytes.get(child, 0))
            if mem_available_bytes() < self.reserve_bytes:
                self.oom = True
                os.kill(self.pid, signal.SIGKILL)
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
