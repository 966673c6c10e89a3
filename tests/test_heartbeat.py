"""The trainer ranks' heartbeat (asyncrl/distributed/heartbeat.py): the pure judge, then the
threads over a real c10d store. The run-level check — a stopped rank stops a 2-rank run with
RankFailed in seconds — is in tests/test_data_parallel_runs.py."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from asyncrl.distributed.heartbeat import Heartbeat, Liveness, describe


def test_a_rank_is_silent_only_once_its_counter_has_not_moved_for_the_timeout():
    live = Liveness((1, 2), timeout_s=10.0, start=100.0)
    for now in range(100, 130, 2):  # rank 1 beats all along; rank 2 stops after t=106
        live.observe(1, now, float(now))
        if now <= 106:
            live.observe(2, now, float(now))
        assert live.silent(float(now)) == ([(2, now - 106.0)] if now - 106 > 10 else [])
    live.observe(2, 106, 130.0)  # the same counter again is no beat
    assert live.silent(131.0) == [(2, 25.0)]


def test_a_rank_never_heard_from_counts_from_the_start():
    live = Liveness((1,), timeout_s=5.0, start=50.0)
    assert live.silent(54.0) == []
    assert live.silent(56.0) == [(1, 6.0)]


def test_a_watcher_that_was_itself_suspended_judges_nobody_until_the_others_had_the_time():
    live = Liveness((1,), timeout_s=10.0, start=0.0)
    for now in range(0, 10, 2):
        live.observe(1, now, float(now))
        assert live.silent(float(now)) == []
    # the whole process group stopped at t=8 and continued at t=100: no beat seen meanwhile
    assert live.silent(100.0) == []
    assert live.silent(104.0) == [] and live.silent(108.0) == []
    assert live.silent(111.0) == [(1, 11.0)]  # and silent after a timeout of its own
    # negative control: checked all along, the same silence is reported
    steady = Liveness((1,), timeout_s=10.0, start=0.0)
    steady.observe(1, 8, 8.0)
    assert steady.silent(12.0) == [] and steady.silent(16.0) == []
    assert steady.silent(20.0) == [(1, 12.0)]


def test_the_message_names_each_silent_rank():
    assert describe([(1, 31.2), (3, 40.0)]) == (
        "rank 1 sent no heartbeat for 31 s; rank 3 sent no heartbeat for 40 s"
    )


class StuckStore:
    """A store whose calls never return once `stuck` is set (a peer stopped holding the
    FileStore's lock; a TCPStore whose host vanished)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.stuck = threading.Event()
        self.never = threading.Event()

    def add(self, key: str, value: int) -> int:
        if self.stuck.is_set():
            self.never.wait()
        return self.store.add(key, value)


class JudgeClock:
    """The watcher's clock, moved by the test alone: the verdicts depend on it, never on how
    fast this machine runs the threads (they pace themselves in real milliseconds)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


LIMIT_S = 60.0
"""A bound on real time that only stops a hang: each wait below is for a few milliseconds."""


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def tick(watcher: Heartbeat, clock: JudgeClock, seconds: float = 1.0) -> None:
    """One judge-second more, then two watch passes (so one of them read the new time)."""
    passes = watcher.passes
    clock.advance(seconds)
    wait_for(lambda: watcher.passes >= passes + 2 or watcher._stop.is_set(), "no watch pass")


def test_over_a_real_store_a_rank_that_stops_beating_is_reported_once():
    store = dist.HashStore()
    clock = JudgeClock()
    reports: list[list[tuple[int, float]]] = []

    def beating_seen() -> int:
        return int(store.add("asyncrl/heartbeat/1", 0))

    watcher = Heartbeat(store, 0, (1,), 10.0, reports.append, clock=clock, interval_s=0.002)
    beating = Heartbeat(store, 1, (), 10.0, reports.append, clock=clock, interval_s=0.002)
    for _ in range(40):  # four timeouts of judge time, each second after a new beat
        beats = beating_seen()
        wait_for(lambda: beating_seen() > beats + 1, "rank 1 never beat")  # noqa: B023
        tick(watcher, clock)
    assert reports == [], "a beating rank was reported silent"
    beating.stop()
    assert beating.join(LIMIT_S)
    final = beating_seen()

    def last_change() -> tuple[int, float] | None:
        with watcher._lock:
            return watcher.liveness._seen.get(1)

    # the silence counts from the judge time at which the watcher saw the last beat: on a
    # loaded machine that can be a tick before the stop, so the test reads it, never assumes it
    wait_for(lambda: (last_change() or (None,))[0] == final, "the last beat never seen")
    seen = last_change()
    assert seen is not None
    last_seen = seen[1]
    for _ in range(30):
        tick(watcher, clock)
        if reports:
            break
    wait_for(lambda: bool(reports), "never reported")
    assert len(reports) == 1 and reports[0][0][0] == 1, reports
    # judged at the first pass past the timeout (judge time moves in whole seconds), not before
    assert reports[0][0][1] == 11.0, reports
    assert 10.0 < clock() - last_seen <= 12.0, "reported once silent for the timeout, not before"
    for _ in range(5):  # and only once
        clock.advance(1.0)
        time.sleep(0.01)
    assert len(reports) == 1
    watcher.stop()


def test_a_store_call_that_never_returns_is_silence_too():
    shared = dist.HashStore()
    stuck = StuckStore(shared)
    clock = JudgeClock()
    fired: list = []
    # the peer goes on beating into the store; only the watcher's own store calls hang
    peer = Heartbeat(shared, 1, (), 10.0, lambda s: None, clock=clock, interval_s=0.002)
    watcher = Heartbeat(stuck, 0, (1,), 10.0, fired.append, clock=clock, interval_s=0.002)
    for _ in range(30):
        tick(watcher, clock)
    assert fired == []
    stuck.stuck.set()
    for _ in range(30):
        tick(watcher, clock)
        if fired:
            break
    assert fired and fired[0][0][0] == 1, "a hung store call left the watch blind"
    watcher.stop()
    peer.stop()
    stuck.never.set()
