"""The trainer ranks' heartbeat (asyncrl/distributed/heartbeat.py): the pure judge, then the
threads over a real c10d store. The run-level check — a stopped rank stops a 2-rank run with
RankFailed in seconds — is in tests/test_data_parallel_runs.py."""

from __future__ import annotations

import threading
import time

import pytest
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


@pytest.mark.slow  # 5.3 s of real time: over the fast tier's 5 s budget
def test_over_a_real_store_a_rank_that_stops_beating_is_reported_once():
    store = dist.HashStore()
    reports: list[list[tuple[int, float]]] = []
    fired = threading.Event()

    def on_silent(silent):
        reports.append(silent)
        fired.set()

    watcher = Heartbeat(store, 0, (1,), timeout_s=2.0, on_silent=on_silent)
    beating = Heartbeat(store, 1, (), timeout_s=2.0, on_silent=on_silent)
    time.sleep(3.0)  # a timeout and a half of beats: nobody is silent
    assert not fired.is_set()
    stopped = time.monotonic()
    beating.stop()
    assert fired.wait(30), "the silent rank was never reported"
    assert time.monotonic() - stopped >= 2.0 - watcher.interval_s
    time.sleep(0.3)
    assert len(reports) == 1 and reports[0][0][0] == 1
    watcher.stop()


def test_a_store_call_that_never_returns_is_silence_too():
    shared = dist.HashStore()
    stuck = StuckStore(shared)
    fired = threading.Event()
    # the peer goes on beating into the store; only the watcher's own store calls hang
    peer = Heartbeat(shared, 1, (), timeout_s=2.0, on_silent=lambda s: None)
    watcher = Heartbeat(stuck, 0, (1,), timeout_s=2.0, on_silent=lambda s: fired.set())
    time.sleep(3.0)
    assert not fired.is_set()
    stuck.stuck.set()
    assert fired.wait(30), "a hung store call left the watch blind"
    watcher.stop()
    peer.stop()
