"""Liveness of the trainer's ranks: a heartbeat through the process group's store, so a rank
that hangs, is stopped, or whose machine vanishes (its connections never close, so no
collective fails) stops the run in seconds, not at a collective's 30-minute timeout.

Every rank bumps its own counter (`asyncrl/heartbeat/R`) in the group's c10d store — the
FileStore of a local launch, torchrun's TCPStore — every `interval_s`, and reads the counters
of the ranks it watches: rank 0 watches all the others, the others watch rank 0. `Liveness`
(pure) notes, on the watcher's own monotonic clock, when each counter last moved, so clocks
of different machines never meet. The store's calls run in one thread and the judging in
another: a store call that never returns (a peer stopped holding the FileStore's lock, a
TCPStore whose host is gone) stops the observations, and the ranks it watches fall silent.

A rank silent for `timeout_s` is reported once to `on_silent` with how long it has been
silent; what to do then is the caller's (`asyncrl.train.ranks`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KEY = "asyncrl/heartbeat/{rank}"


@dataclass
class Liveness:
    """When each watched rank's counter last moved (the watcher's monotonic seconds)."""

    ranks: tuple[int, ...]
    timeout_s: float
    start: float
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    _checked: float | None = None

    def observe(self, rank: int, counter: int, now: float) -> None:
        last = self._seen.get(rank)
        if last is None or counter != last[0]:
            self._seen[rank] = (counter, now)

    def silent(self, now: float) -> list[tuple[int, float]]:
        """(rank, seconds since its counter last moved) of every rank silent for longer than
        `timeout_s`; one never heard from counts from `start`. Called every few seconds: after
        a gap of more than half the timeout since the last call, this process was itself
        stopped or starved (a whole process group suspended and continued), and it judges
        nobody until the others have had the time again."""
        if self._checked is not None and now - self._checked > self.timeout_s / 2:
            self.start = now
            self._seen = {rank: (counter, now) for rank, (counter, _) in self._seen.items()}
        self._checked = now
        found = []
        for rank in self.ranks:
            since = self._seen[rank][1] if rank in self._seen else self.start
            if now - since > self.timeout_s:
                found.append((rank, now - since))
        return found


def describe(silent: list[tuple[int, float]]) -> str:
    """ "rank 1 sent no heartbeat for 31 s" (several ranks joined by "; ")."""
    return "; ".join(f"rank {rank} sent no heartbeat for {s:.0f} s" for rank, s in silent)


class Heartbeat:
    """This rank's heartbeat and its watch over `watched` (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        watched: tuple[int, ...],
        timeout_s: float,
        on_silent: Callable[[list[tuple[int, float]]], None],
        clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.interval_s = min(1.0, timeout_s / 10) if interval_s is None else interval_s
        self.clock = clock
        """The judge's clock (a test drives its own; the pacing between passes is real time)."""
        self.liveness = Liveness(watched, timeout_s, clock())
        self.on_silent = on_silent
        self.passes = 0
        """Watch passes made so far (each judged the ranks once)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="asyncrl-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="asyncrl-heartbeat-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(KEY.format(rank=self.rank), 1)
                for rank in self.liveness.ranks:
                    counter = int(self.store.add(KEY.format(rank=rank), 0))
                    with self._lock:
                        self.liveness.observe(rank, counter, self.clock())
            except Exception:  # the store is gone or failing: that is silence
                pass
            self._stop.wait(self.interval_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                silent = self.liveness.silent(self.clock())
                self.passes += 1
            if silent:
                self._stop.set()
                self.on_silent(silent)
                return

    def stop(self) -> None:
        """Ends both threads (the beat thread after its current store call, if it returns)."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Whether both threads have ended within `timeout_s` (after `stop`)."""
        for thread in self._threads:
            thread.join(timeout_s)
        return not any(thread.is_alive() for thread in self._threads)


def group_store() -> Any:
    """The default process group's c10d store (what `init_process_group` met through)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
