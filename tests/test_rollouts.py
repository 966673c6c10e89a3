"""The collector drives every kind of sample through one protocol (`asyncrl.rollout.rollouts`):
a fake `Rollout` with no engine lands what it likes through the collector's `Landing`, and the
collector keeps its promises for it: each step lands whole under the lock a checkpoint's cut
takes, a failed batch is retried, a `RolloutFatal` stops generation at once. The collector
itself names no kind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncrl.core.buffer import ReplayBuffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.partial import Partial
from asyncrl.core.stream import PromptStream
from asyncrl.core.types import Group, PromptTicket
from asyncrl.rollout import collector as collector_module
from asyncrl.rollout.collector import Collector, GenerationFailed
from asyncrl.rollout.engine import GenerationOutput
from asyncrl.rollout.rollouts import Chunk, Landing, RolloutFatal, make_group

G, N = 2, 2


def partial_of(ticket: PromptTicket) -> Partial:
    """One token per sample so far, none finished."""
    ids = torch.full((G, 1), 3 + ticket.ordinal)
    return Partial.empty(G).extend(
        ids, torch.ones(G, 1, dtype=torch.bool), torch.zeros(G, 1), 0, torch.zeros(G, dtype=bool)
    )


def group_of(ticket: PromptTicket) -> Group:
    ids = torch.tensor([[5, 6], [7, 0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = GenerationOutput(ids, mask, torch.zeros(G, 2), 0)
    return make_group(ticket, [1, 2], out, torch.tensor([1.0, 0.0]), 0.0)


def chunk_of(tickets: list[PromptTicket]) -> Chunk:
    return Chunk(0.0, 0.01, 0, tickets, [[0] * G for _ in tickets], [[1] * G for _ in tickets])


class TwoSteps:
    """A kind that lands each batch in two steps: every ticket's partial, then (unless a stop
    was asked in between) every group. `failures` are raised by the first calls, in order."""

    def __init__(self, failures: list[BaseException] | None = None) -> None:
        self.failures = list(failures or [])
        self.batches: list[list[int]] = []
        self.between: Callable[[], None] = lambda: None
        self.halted = 0

    def generate(self, tickets: list[PromptTicket], landing: Landing) -> None:
        self.batches.append([t.ordinal for t in tickets])
        if self.failures:
            raise self.failures.pop(0)
        assert landing.saved(tickets) == dict.fromkeys([t.ordinal for t in tickets])
        landing.land(chunk_of(tickets), {t.ordinal: partial_of(t) for t in tickets}, [])
        self.between()
        if landing.stopping:
            return
        landing.land(chunk_of(tickets), {}, [group_of(t) for t in tickets])

    def halt(self) -> None:
        self.halted += 1


def collector_for(rollout, buffer=None, max_failures: int = 3, rows=None) -> Collector:
    ledger = Ledger(PromptStream(10, N, seed=0))
    buffer = ReplayBuffer(N, 8) if buffer is None else buffer  # (an empty buffer is falsy)
    return Collector(
        ledger, buffer, rollout, window=3, groups_per_batch=N, end_target=3,
        on_batch=None if rows is None else rows.append, max_failures=max_failures,
    )  # fmt: skip


def held_elsewhere(lock: threading.Condition) -> bool:
    """Whether another thread holds `lock` (this thread may hold it: it is re-entrant)."""
    got: list[bool] = []

    def take() -> None:
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return not got[0]


class WatchedBuffer(ReplayBuffer):
    """Records, for each group added, whether the collector's lock was held meanwhile."""

    def __init__(self) -> None:
        super().__init__(N, 8)
        self.collector: Collector | None = None
        self.under_lock: list[bool] = []

    def add(self, group: Group) -> None:
        assert self.collector is not None
        self.under_lock.append(held_elsewhere(self.collector._cond))
        super().add(group)


def test_what_a_rollout_lands_reaches_the_ledger_and_the_buffer_as_one_cut_sees_it():
    buffer, rows = WatchedBuffer(), []
    collector = collector_for(TwoSteps(), buffer, rows=rows)
    buffer.collector = collector
    seen: list[tuple[set[int], set[int], set[int]]] = []
    done = threading.Event()

    def cuts() -> None:  # a checkpoint's reads, as often as it can
        while not done.is_set():
            with collector.cut():
                buffered = {k for k, _ in buffer.ordinals_and_targets()}
                seen.append(
                    (buffered, set(collector.ledger.in_flight), set(collector.ledger.partials))
                )
            time.sleep(0.001)

    watcher = threading.Thread(target=cuts)
    watcher.start()
    collector.start()
    groups = [g for t in range(3) for g in buffer.sample(t, check=collector.check)]
    collector.stop()
    done.set()
    watcher.join()
    assert sorted(g.ordinal for g in groups) == list(range(6))
    assert buffer.under_lock == [True] * 6
    assert collector.ledger.in_flight == {} and collector.ledger.partials == {}
    for buffered, in_flight, partials in seen:  # every ordinal in exactly one place
        assert not buffered & in_flight and partials <= in_flight
    # each step on the timeline (a cut writes the pending row: passes merge between cuts)
    assert sum(r.chunks for r in rows) == 6
    assert [r.landed for r in rows if r.landed] == [[0, 1], [2, 3], [4, 5]]


def test_a_stop_between_steps_leaves_the_batch_in_flight_with_its_partials():
    rollout = TwoSteps()
    collector = collector_for(rollout)
    rollout.between = collector._ask_stop  # as `stop()` asks, without joining from inside
    collector.start()
    assert collector.join(30)
    assert rollout.batches == [[0, 1]] and len(collector.buffer) == 0
    assert set(collector.ledger.in_flight) == {0, 1} == set(collector.ledger.partials)
    assert collector.ledger.partials[1].tokens[0, 0] == 4


def test_halt_asks_the_rollout_to_end_what_it_generates():
    rollout = TwoSteps()
    collector_for(rollout).halt()
    assert rollout.halted == 1


def test_a_failed_batch_is_retried_and_lands():
    rollout = TwoSteps([RuntimeError("the engine hiccupped")])
    collector = collector_for(rollout)
    collector.start()
    groups = collector.buffer.sample(0, check=collector.check)
    collector.stop()
    assert rollout.batches[:2] == [[0, 1], [0, 1]]  # the same tickets again, first
    assert sorted(g.ordinal for g in groups) == [0, 1] and collector.num_failures == 1


def test_a_batch_that_fails_max_failures_times_in_a_row_stops_generation():  # the baseline
    rollout = TwoSteps([RuntimeError(f"failure {i}") for i in range(5)])
    collector = collector_for(rollout, max_failures=3)
    collector.start()
    assert collector.join(30)
    assert len(rollout.batches) == 3
    with pytest.raises(GenerationFailed, match="3 times in a row; last: failure 2"):
        collector.check()


def test_a_rollout_fatal_stops_generation_at_once_without_a_retry():
    fatal = RolloutFatal("agent run of ordinal 1 failed 2 times (agent.retries): timeout")
    rollout = TwoSteps([fatal, RuntimeError("never reached")])
    collector = collector_for(rollout, max_failures=3)
    collector.start()
    assert collector.join(30)
    assert rollout.batches == [[0, 1]] and collector.num_failures == 1
    with pytest.raises(GenerationFailed, match="ordinal 1 failed 2 times") as raised:
        collector.check()
    assert raised.value.__cause__ is fatal
    unfinished = [t.ordinal for t in collector.ledger.unfinished()]
    assert len(collector.buffer) == 0 and unfinished == [0, 1]  # queued again: nothing lost


def test_the_landing_pins_versions_in_deterministic_mode_and_else_asks_the_newest():
    collector = collector_for(TwoSteps())
    ticket = PromptTicket(ordinal=6, target_step=3, epoch=0, position=6, dataset_index=6)
    assert collector.version_for(ticket, None) is None  # no weight sync: the engine's newest
    collector.pin_versions = True
    assert collector.version_for(ticket, None) == 0  # max(0, 3 - A), A = 3


def test_the_collector_names_no_kind_of_sample():
    """STYLE.md rule 18: single turns, episodes and agent runs are `Rollout`s; the collector
    has no branch on a mode (it had eight on `self.episodes`)."""
    source = Path(collector_module.__file__).read_text()
    for name in (
        "episodes",
        "EpisodeRunner",
        "EpisodeTurns",
        "SingleTurns",
        "scorer",
        "self.prompts",
    ):
        assert name not in source, name
