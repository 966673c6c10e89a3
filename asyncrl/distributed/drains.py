"""Ray drains: a node Ray is taking away (`ray drain-node`, Ray's autoscaler preempting a spot
node, KubeRay scaling down), read from Ray's own state every `ray.drain_poll_s` seconds.

    GCS: node -> deadline (ms) ── DrainWatcher (a thread) ── new_drains / plan_drain (pure)
        the trainer's node ──────────▶ a notice (StopRequest.add): checkpoint, exit 75
        a generation worker's node ──▶ RayEngine.retire: its call hands its tokens back,
                                       the worker is replaced on another node

The drain map is the one Ray Serve reads (`GcsClient.get_draining_nodes`: the node's hex id
and its deadline in Unix milliseconds, 0 without one). Ray 2.60 keeps the drain's reason
(`DRAIN_NODE_REASON_PREEMPTION`, `..._IDLE_TERMINATION`) with the request only: the node's
state says DRAINING, not why, so a notice says `ray_drain` and the deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.core.preemption import Drain, Notice, new_drains, plan_drain
from asyncrl.distributed.worker import RayEngine


def draining_nodes() -> dict[str, int]:
    """Ray's map of the nodes being drained: hex node id -> deadline in Unix ms (0: none)."""
    worker: Any = ray._private.worker.global_worker
    gcs = worker.gcs_client  # the client Ray Serve reads drains with
    return {str(node): int(deadline) for node, deadline in gcs.get_draining_nodes().items()}


class DrainWatcher:
    """Reads Ray's drains every `poll_s` seconds on a thread, and answers each new one: a
    notice for the trainer if it runs on the node, a hand-back by the generation workers that
    do."""

    def __init__(
        self,
        engine: RayEngine,
        notify_trainer: Callable[[Notice], None],
        emit: Callable[..., None],
        poll_s: float,
        trainer_node: str | None = None,
        read: Callable[[], dict[str, int]] = draining_nodes,
    ) -> None:
        self.engine = engine
        self.notify_trainer = notify_trainer
        self.emit = emit
        self.poll_s = poll_s
        self.trainer_node = (
            str(ray.get_runtime_context().get_node_id()) if trainer_node is None else trainer_node
        )
        self.read = read
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="asyncrl-drains", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> list[Drain]:
        """One look at Ray's drains; answers the new ones and returns them."""
        try:
            draining = self.read()
        except Exception as err:  # Ray's GCS unreachable for a moment: look again later
            if not self._failed:
                print(f"asyncrl: could not read Ray's drained nodes (will retry): {err!r}")
            self._failed = True
            return []
        self._failed = False
        fresh = new_drains(draining, self.seen)
        for drain in fresh:
            self.answer(drain)
        return fresh

    def answer(self, drain: Drain) -> None:
        received, now_ms = time.monotonic(), time.time() * 1000
        plan = plan_drain(drain, self.trainer_node, self.engine.worker_nodes())
        left = drain.left_s(now_ms)
        fields: dict[str, Any] = {
            "source": "ray_drain",
            "node": drain.node,
            "deadline": drain.deadline_ms / 1000 if drain.deadline_ms else None,
            "deadline_s": left,
        }
        if plan.workers:
            retiring = self.engine.retire(list(plan.workers), drain.node, drain.deadline_ms)
            self.emit("preemption_notice", role="generation", workers=retiring, **fields)
            when = "no deadline" if left is None else f"the deadline is in {left:.1f} s"
            print(
                f"asyncrl: ray_drain: node {drain.node[:8]} is drained ({when}); generation "
                f"worker(s) {', '.join(map(str, retiring))} hand their work back",
                flush=True,
            )
        if plan.trainer:  # announced, with its checkpoint estimate, by the training loop
            self.notify_trainer(drain.notice(received, now_ms))


def watch_drains(
    engine: RayEngine,
    notify_trainer: Callable[[Notice], None],
    emit: Callable[..., None],
    poll_s: float,
) -> Callable[[], None]:
    """Starts watching; returns the function that stops it."""
    watcher = DrainWatcher(engine, notify_trainer, emit, poll_s)
    watcher.start()
    return watcher.stop
