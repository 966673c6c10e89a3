"""Generation on Ray actors (`rollout.backend=ray`): thin shells over the same core and
rollout code.

    driver process (the trainer drives)                      Ray actors
    -----------------------------------                      ----------
    Trainer: step t, publish version t+1 ── ObjectStoreWeightSync ─ ray.put(weights) once
    Collector thread: ledger, admission ─── RayEngine.generate ─ split ─▶ GenerationWorker x W
                      completion ───────── BufferClient ───────────────▶ ray.remote(ReplayBuffer)

Nothing here decides anything the threads backend does not: the ledger, the window, the cut
and the checkpoint are the same objects and code. A `GenerationWorker` runs whichever engine
`rollout.engine` names (built by `asyncrl.rollout.engine.build_engine`, as on threads) over a
worker-local `CopyWeightSync`; `RayEngine` implements the `GenerationEngine` protocol by
splitting each batch across the workers (every worker generates with the same weights
version) and turns a dead worker into an ordinary failed batch after replacing it, so the
collector re-dispatches the batch's ordinals exactly as it does for a failing engine on
threads.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import ray
from ray.exceptions import RayActorError

from asyncrl.config import Config
from asyncrl.distributed.weights import ObjectStoreWeightSync, from_numpy
from asyncrl.faults import fault_point
from asyncrl.models.device import DTYPES, bound_onednn_cache, resolve_device
from asyncrl.rollout.engine import (
    EngineCapabilities,
    EngineSpec,
    GenerationOutput,
    GenerationRequest,
    build_engine,
    engine_class,
)
from asyncrl.rollout.weight_sync import CopyWeightSync, weights_to_load


class GenerationWorker:
    """One generation actor: an engine plus the weights versions it was sent."""

    def __init__(
        self, engine_name: str, spec: EngineSpec, max_versions: int, torch_threads: int
    ) -> None:
        bound_onednn_cache()  # bf16 generation's products
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        # versions sent to this worker; the architecture's own weights (whatever `spec.model`
        # held) are never used under any version number
        resolve_device("rollout.device", spec.device)
        self.weights = CopyWeightSync(max_versions, spec.device, DTYPES[spec.dtype])
        self.engine = build_engine(engine_name, spec, self.weights)

    def generate(
        self,
        requests: list[GenerationRequest],
        version: int,
        weights: list[Any],
        max_tokens: int | None = None,
    ) -> tuple[list[GenerationOutput], float, dict[str, float]]:
        """Generates with weights `version`, fetching them from the object store first if this
        worker does not have them (`weights` is `[ObjectRef]`, unresolved until needed).
        Returns the outputs, the seconds spent fetching and loading weights, and the engine's
        own cumulative metrics."""
        fault_point("worker.generate")
        start = time.perf_counter()
        if not self.weights.has(version):
            self.weights.publish(version, from_numpy(ray.get(weights[0])))
        load_s = time.perf_counter() - start
        outputs = self.engine.generate(requests, version, max_tokens)
        return outputs, load_s, self.engine.metrics()

    def stop_generating(self) -> None:
        """Its node is drained: the call in progress returns the tokens it has now, and this
        worker generates nothing more (an engine without `stops_early` finishes the call)."""
        stop = getattr(self.engine, "stop_generating", None)
        if stop is not None:
            stop()

    def ready(self) -> tuple[str, int]:
        """The id of the Ray node this worker runs on, and its process id."""
        return str(ray.get_runtime_context().get_node_id()), os.getpid()


RemoteWorker = ray.remote(GenerationWorker)
NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its hex id."""
PLACEMENT_NOTE_S = 30.0
"""How often a batch waiting on a worker Ray has not placed says so."""


@dataclasses.dataclass
class Retiring:
    """A worker whose node Ray drains: it generates nothing new and is replaced once its call
    in progress (if any) has handed back what it has."""

    node: str
    since_s: float  # time.monotonic() of the drain notice
    deadline_ms: int
    busy: bool  # a call was in progress at the notice


class WorkerDied(RuntimeError):
    """A generation worker actor died during a batch; it was replaced. The batch's tickets go
    back to the collector's queue like any failed batch."""


class RayEngine:
    """`GenerationEngine` over `num_workers` actors; weights come from an
    `ObjectStoreWeightSync`, by reference. A worker whose node Ray drains (`retire`) hands its
    call in progress back, its tokens so far kept, and is replaced by an actor Ray places on
    another node."""

    capabilities: ClassVar[EngineCapabilities]  # the engine's inside the workers

    def __init__(
        self,
        make_worker: Callable[[int, int, frozenset[str]], Any],
        num_workers: int,
        weights: ObjectStoreWeightSync,
        capabilities: EngineCapabilities,
        stop_early: bool = True,
    ) -> None:
        self._make_worker = make_worker
        self._incarnations = [0] * num_workers
        self.workers = [make_worker(i, 0, frozenset()) for i in range(num_workers)]
        placed = ray.get([w.ready.remote() for w in self.workers])
        self.nodes: list[str] = [str(node) for node, _ in placed]
        """Each worker's Ray node ("" while a replacement waits to be placed)."""
        self.pids: list[int] = [int(pid) for _, pid in placed]
        """Each worker's process id on its node (0 while a replacement waits)."""
        self._placing: dict[int, Any] = {}  # worker -> its replacement's `ready` call
        self.weights = weights
        self.capabilities = capabilities  # type: ignore[misc]
        self.stop_early = stop_early and capabilities.stops_early
        """A drained worker's call in progress ends at once with what it has (off: it runs to
        its end; deterministic mode, where a cut at another token could change the bits)."""
        self._lock = threading.Lock()
        self.load_s = 0.0  # worker seconds spent fetching and loading weights
        self.workers_replaced = 0
        self.workers_retired = 0
        self._closed = False
        self._busy: set[int] = set()  # workers with a call in progress
        self._retiring: dict[int, Retiring] = {}
        self.drained: set[str] = set()
        """Nodes Ray drains: no replacement is placed on them (Ray's own view of a drain
        reaches its scheduler a moment later than the drain map)."""
        self.on_event: Callable[..., None] | None = None
        """Records the placements and hand-backs (`events.jsonl`); from any thread."""
        # each worker's engine metrics as last reported, and those of workers since replaced
        self._engine_metrics: list[dict[str, float]] = [{} for _ in range(num_workers)]
        self._replaced_metrics: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        """Cumulative seconds workers spent fetching and loading weights, workers replaced
        after dying or retired from drained nodes, and the workers' engine metrics summed over
        workers (replaced ones included)."""
        summed = dict(self._replaced_metrics)
        for reported in self._engine_metrics:
            for key, value in reported.items():
                summed[key] = summed.get(key, 0.0) + value
        return {
            **summed,
            "weights_load_s": self.load_s,
            "workers_replaced": self.workers_replaced,
            "workers_retired": self.workers_retired,
        }

    def record_placements(self, emit: Callable[..., None]) -> None:
        """From now on every worker's placement and hand-back is an event; the placements so
        far are recorded now."""
        with self._lock:
            self.on_event = emit
            for i, node in enumerate(self.nodes):
                if node:
                    self._emit_placement(i)

    def _emit_placement(self, index: int) -> None:
        self._emit("generation_worker", worker=index, incarnation=self._incarnations[index],
                   node=self.nodes[index], pid=self.pids[index])  # fmt: skip

    def _emit(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, **fields)

    def worker_nodes(self) -> list[str]:
        """Each worker's Ray node, "" for a replacement Ray has not placed yet (it is never
        placed on a draining node)."""
        with self._lock:
            return self._placed()

    def _placed(self) -> list[str]:
        for i, ready in list(self._placing.items()):
            done, _ = ray.wait([ready], timeout=0)
            if not done:
                continue
            del self._placing[i]
            try:
                node, pid = ray.get(ready)
            except RayActorError:
                continue  # died before it was placed: its next batch replaces it
            self.nodes[i], self.pids[i] = str(node), int(pid)
            self._emit_placement(i)
        return list(self.nodes)

    def retire(self, workers: list[int], node: str, deadline_ms: int) -> list[int]:
        """Ray drains `node`, where `workers` run: a worker with a call in progress hands it
        back (now with `stop_early`, else when it ends), an idle one is replaced at once.
        Returns the workers newly retiring. From any thread (the drain watcher's)."""
        with self._lock:
            self.drained.add(node)
            fresh = [i for i in workers if i not in self._retiring and not self._closed]
            now = time.monotonic()
            for i in fresh:
                self._retiring[i] = Retiring(node, now, deadline_ms, i in self._busy)
            interrupt = [self.workers[i] for i in fresh if i in self._busy and self.stop_early]
            for i in fresh:
                if i not in self._busy:
                    self._hand_back(i, [])
        for worker in interrupt:
            worker.stop_generating.remote()
        return fresh

    def _hand_back(self, index: int, part: list[GenerationOutput]) -> None:
        """Records what retiring worker `index` handed back (`part`: its last call's outputs),
        and replaces it. Called under `_lock`."""
        retiring = self._retiring.pop(index)
        unfinished = sum(int((~out.finished_rows()).sum()) for out in part)
        tokens = sum(int(out.completion_mask.sum()) for out in part)
        now_ms = time.time() * 1000
        left = None if not retiring.deadline_ms else (retiring.deadline_ms - now_ms) / 1000
        self._emit(
            "drain_handback",
            node=retiring.node,
            worker=index,
            in_call=retiring.busy,
            stopped_early=retiring.busy and self.stop_early,
            requests=len(part),
            unfinished_samples=unfinished,
            tokens=tokens,
            after_s=time.monotonic() - retiring.since_s,
            left_s=left,
        )
        if part:
            print(
                f"asyncrl: ray_drain: generation worker {index} on node {retiring.node[:8]} "
                f"handed back {len(part)} requests ({tokens} tokens kept, {unfinished} samples "
                "to continue on another worker)",
                flush=True,
            )
        self._replace(index)
        self.workers_retired += 1

    def generate(
        self,
        requests: list[GenerationRequest],
        version: int | None = None,
        max_tokens: int | None = None,
    ) -> list[GenerationOutput]:
        wanted, ref = weights_to_load(self.weights, version, None)
        chunks = [c.tolist() for c in np.array_split(np.arange(len(requests)), len(self.workers))]
        with self._lock:
            if self._closed:
                raise RuntimeError("the Ray engine is shut down")
            calls = [
                (
                    i,
                    self.workers[i].generate.remote(
                        [requests[j] for j in chunk], wanted, [ref], max_tokens
                    ),
                )
                for i, chunk in enumerate(chunks)
                if chunk
            ]
            self._busy.update(i for i, _ in calls)
        outputs: list[GenerationOutput] = []
        dead = []
        parts: dict[int, list[GenerationOutput]] = {}
        try:
            for i, call in calls:
                try:
                    part, load_s, engine_metrics = self._result(i, call)
                except RayActorError as err:
                    dead.append((i, err))
                    continue
                parts[i] = part
                outputs.extend(part)
                self.load_s += load_s
                self._engine_metrics[i] = engine_metrics
        finally:
            with self._lock:
                self._busy.clear()
                if not self._closed:
                    for i in [i for i in self._retiring if i in parts]:
                        self._hand_back(i, parts[i])
                self._placed()
        if dead:
            with self._lock:
                if self._closed:  # the run is ending and killed its workers: replace nothing
                    raise RuntimeError("the Ray engine is shut down")
                for i, _ in dead:
                    self._retiring.pop(i, None)
                    self._replace(i)
                    self.workers_replaced += 1
            index, cause = dead[0]
            raise WorkerDied(
                f"generation worker {index} died during a batch (replaced; the batch is "
                f"re-dispatched): {type(cause).__name__}: {str(cause).splitlines()[0]}"
            ) from cause
        return outputs

    def _result(self, index: int, call: Any) -> Any:
        """Worker `index`'s answer; says every `PLACEMENT_NOTE_S` seconds that it waits while
        the worker is a replacement Ray has not placed (no node with its CPUs that is not
        draining: Ray's autoscaler may be adding one)."""
        waited = 0.0
        while not ray.wait([call], timeout=PLACEMENT_NOTE_S)[0]:
            waited += PLACEMENT_NOTE_S
            with self._lock:
                unplaced = not self._placed()[index]
            if unplaced:
                print(
                    f"asyncrl: generation worker {index} has waited {waited:.0f} s for Ray to "
                    "place it: no node with ray.num_cpus_per_worker free CPUs that is not "
                    f"draining (drained: {', '.join(n[:8] for n in sorted(self.drained))})",
                    flush=True,
                )
        return ray.get(call)

    def _replace(self, index: int) -> None:
        """A new actor for worker `index`, which Ray places on a node not known to be
        draining. Called under `_lock`."""
        ray.kill(self.workers[index], no_restart=True)  # if only its process is gone
        for key, value in self._engine_metrics[index].items():
            self._replaced_metrics[key] = self._replaced_metrics.get(key, 0.0) + value
        self._engine_metrics[index] = {}
        self._incarnations[index] += 1
        self.workers[index] = self._make_worker(
            index, self._incarnations[index], frozenset(self.drained)
        )
        self.nodes[index], self.pids[index] = "", 0
        self._placing[index] = self.workers[index].ready.remote()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        for worker in self.workers:
            ray.kill(worker, no_restart=True)


def worker_name(index: int, incarnation: int, driver_pid: int | None = None) -> str:
    """The actor name of generation worker `index` of the run driven by `driver_pid` (default:
    this process); tests kill workers by name."""
    return f"asyncrl-{driver_pid or os.getpid()}-generation-{index}.{incarnation}"


def build_ray_engine(config: Config, spec: EngineSpec, weights: ObjectStoreWeightSync) -> RayEngine:
    """`rollout.num_workers` actors running `rollout.engine`, each reserving
    `ray.num_cpus_per_worker` CPUs."""
    # the architecture every worker (and every replacement) starts from, put once; its weights
    # are never generated with: each version is fetched by reference
    frozen = ray.put(dataclasses.replace(spec, model=copy.deepcopy(spec.model)))

    def make_worker(index: int, incarnation: int, avoid: frozenset[str]) -> Any:
        placement: dict[str, Any] = {}
        if avoid:  # drained nodes, by Ray's own node-id label
            placement["label_selector"] = {NODE_ID_LABEL: f"!in({', '.join(sorted(avoid))})"}
        return RemoteWorker.options(
            name=worker_name(index, incarnation),
            num_cpus=config.ray.num_cpus_per_worker,
            max_restarts=0,
            max_concurrency=2,  # `stop_generating` runs beside `generate`
            **placement,
        ).remote(
            config.rollout.engine,
            frozen,
            config.kept_weight_versions,
            config.run.torch_threads,
        )

    capabilities = engine_class(config.rollout.engine).capabilities
    return RayEngine(
        make_worker,
        config.rollout.num_workers,
        weights,
        capabilities,
        stop_early=not config.run.deterministic,
    )
