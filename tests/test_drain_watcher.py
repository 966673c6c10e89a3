"""The drain watcher's answers (`asyncrl.distributed.drains.DrainWatcher`), on a stand-in
engine and a stand-in read of Ray's drain map: what each drain asks of whom, once. The real
thing, on a multi-node Ray cluster with `ray drain-node`, is tests/test_ray_drain.py."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

from asyncrl.core.preemption import RAY_DRAIN, Notice
from asyncrl.distributed.drains import DrainWatcher


class Engine:
    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.retired: list[tuple[list[int], str, int]] = []

    def worker_nodes(self) -> list[str]:
        return list(self.nodes)

    def retire(self, workers: list[int], node: str, deadline_ms: int) -> list[int]:
        self.retired.append((workers, node, deadline_ms))
        return workers


def watcher(draining: dict[str, int], engine: Engine) -> tuple[DrainWatcher, list, list]:
    notices: list[Notice] = []
    events: list[tuple[str, dict]] = []
    made = DrainWatcher(
        engine,  # type: ignore[arg-type]
        notices.append,
        lambda name, **fields: events.append((name, fields)),
        poll_s=1.0,
        trainer_node="head",
        read=lambda: dict(draining),
    )
    return made, notices, events


def test_a_generation_node_drain_retires_its_workers_once_and_says_so():
    engine = Engine(["n1", "n2", "n1"])
    soon = int(time.time() * 1000) + 30_000
    made, notices, events = watcher({"n1": soon}, engine)
    assert [d.node for d in made.poll()] == ["n1"]
    assert made.poll() == []  # still draining: not answered twice
    assert engine.retired == [([0, 2], "n1", soon)]
    assert notices == []  # the trainer runs elsewhere
    ((name, fields),) = events
    assert name == "preemption_notice" and fields["role"] == "generation"
    assert fields["workers"] == [0, 2] and fields["node"] == "n1"
    assert fields["deadline"] == pytest.approx(soon / 1000)
    assert 0 < fields["deadline_s"] <= 30  # Ray's deadline less the seconds since: no clock verdict


def test_a_drain_of_the_trainers_node_is_a_notice_with_rays_deadline():
    engine = Engine(["n1", "head"])  # worker 1 beside the trainer: it finishes its call
    soon = int(time.time() * 1000) + 20_000
    made, notices, events = watcher({"head": soon}, engine)
    made.poll()
    (notice,) = notices
    assert notice.source == RAY_DRAIN and notice.node == "head"
    assert notice.deadline_s is not None and 0 < notice.deadline_s <= 20
    assert engine.retired == [] and events == []  # announced by the training loop


def test_a_failed_read_is_retried_at_the_next_poll(capsys):
    engine = Engine(["n1"])
    calls = []

    def read() -> dict[str, int]:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("GCS unavailable")
        return {"n1": 0}

    made, _, _ = watcher({}, engine)
    made.read = read
    assert made.poll() == []
    assert "could not read Ray's drained nodes" in capsys.readouterr().out
    assert [d.node for d in made.poll()] == ["n1"]
    assert engine.retired == [([0], "n1", 0)]
