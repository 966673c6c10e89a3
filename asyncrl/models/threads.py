"""The machine's cores handed to whichever side of the run is busy (`run.share_cores`).

Generation (the collector's thread) and training (the trainer's) each run torch's intra-op
threads. Each side gets `run.torch_threads` while both are busy; a side that runs alone (the
trainer waiting for rollouts, the generator waiting for weights) gets the other side's too.
Measured on a 2-core Xeon (2026-12-05): SmolLM2's decode of 32 samples took 12.0 s on one
thread and 6.4 s on two, and the trainer waits for rollouts about half of each step.

A thread's count is set where its passes begin (a forward pre-hook on each model the run
runs: every decode step, every micro-batch), by `torch.set_num_threads` in that thread:
with OpenMP and MKL the count is the calling thread's own. That call is also what makes a
thread's MKL products keep to its share at all: a new thread's first MKL product otherwise
takes every core, whatever the main thread set.

`threads_for` is the rule, plain arithmetic; `CoreShare` keeps which threads are busy.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch


def threads_for(busy: int, per_side: int, sides: int, cores: int) -> int:
    """Threads for a busy side when `busy` sides are busy: `per_side` each while all share,
    up to `per_side * sides` (at most `cores`) for a side alone; never fewer than 1."""
    if busy <= 1:
        return max(1, min(per_side * sides, cores))
    return max(1, per_side)


def available_cores() -> int:
    """The cores this process may run on (its affinity: `taskset` narrows it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class CoreShare:
    """Which of the run's threads are busy, and each one's torch thread count.

    `busy()` marks the calling thread busy for a block, `idle()` not busy for a block within
    it (a wait); `apply()` sets the calling thread's count for what is busy now. A thread never
    marked busy is left alone, and so is every thread with `per_side` 0 (torch's default).
    With `sharing` false each busy thread keeps `per_side` (deterministic runs: a product's
    bits may follow its thread count, and a shared count would follow timing)."""

    def __init__(self, per_side: int, sharing: bool = True, sides: int = 2,
                 cores: int | None = None) -> None:  # fmt: skip
        self.per_side = per_side
        self.sharing = sharing
        self.sides = sides
        self.cores = available_cores() if cores is None else cores
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._set = threading.local()  # the count this thread last set

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            self._busy.add(me)
        try:
            self.apply()
            yield
        finally:
            with self._lock:
                self._busy.discard(me)

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            was = me in self._busy
            self._busy.discard(me)
        try:
            yield
        finally:
            if was:
                with self._lock:
                    self._busy.add(me)

    def _threads(self) -> int:
        """The count for a busy thread now (0: torch's default, left alone); under `_lock`."""
        if not self.sharing or self.per_side == 0:
            return self.per_side
        return threads_for(len(self._busy), self.per_side, self.sides, self.cores)

    def apply(self) -> None:
        """Sets the calling thread's torch threads to its share, if it is busy and the share
        changed since it last set it."""
        with self._lock:
            if threading.get_ident() not in self._busy:
                return
            count = self._threads()
            if count == 0 or getattr(self._set, "count", None) == count:
                return
        torch.set_num_threads(count)
        self._set.count = count

    def watch(self, module: torch.nn.Module) -> None:
        """Applies the calling thread's share before every forward pass of `module` (and of
        every copy made of it later in this process: a deep copy keeps the hook)."""
        module.register_forward_pre_hook(_ApplyShare(self))


class _ApplyShare:
    """The forward pre-hook of `CoreShare.watch`. A deep copy keeps the same share (a copy in
    this process runs on its threads); a pickled one, sent to another process (a Ray worker's
    engine spec), does nothing there: that process's threads are its own."""

    def __init__(self, share: CoreShare | None) -> None:
        self.share = share

    def __call__(self, _module: torch.nn.Module, _args: object) -> None:
        if self.share is not None:
            self.share.apply()

    def __deepcopy__(self, memo: dict[int, object]) -> _ApplyShare:
        return self

    def __getstate__(self) -> dict[str, object]:
        return {"share": None}
