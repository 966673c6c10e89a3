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
from asyncrl.models.device import DTYPES, resolve_device
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

    def ready(self) -> bool:
        return True


RemoteWorker = ray.remote(GenerationWorker)


class WorkerDied(RuntimeError):
    """A generation worker actor died during a batch; it was replaced. The batch's tickets go
    back to the collector's queue like any failed batch."""


class RayEngine:
    """`GenerationEngine` over `num_workers` actors; weights come from an
    `ObjectStoreWeightSync`, by reference."""

    capabilities: ClassVar[EngineCapabilities]  # the engine's inside the workers

    def __init__(
        self,
        make_worker: Callable[[int, int], Any],
        num_workers: int,
        weights: ObjectStoreWeightSync,
        capabilities: EngineCapabilities,
    ) -> None:
        self._make_worker = make_worker
        self._incarnations = [0] * num_workers
        self.workers = [make_worker(i, 0) for i in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])
        self.weights = weights
        self.capabilities = capabilities  # type: ignore[misc]
        self._lock = threading.Lock()
        self.load_s = 0.0  # worker seconds spent fetching and loading weights
        self.workers_replaced = 0
        self._closed = False
        # each worker's engine metrics as last reported, and those of workers since replaced
        self._engine_metrics: list[dict[str, float]] = [{} for _ in range(num_workers)]
        self._replaced_metrics: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        """Cumulative seconds workers spent fetching and loading weights, workers replaced
        after dying, and the workers' engine metrics summed over workers (replaced ones
        included)."""
        summed = dict(self._replaced_metrics)
        for reported in self._engine_metrics:
            for key, value in reported.items():
                summed[key] = summed.get(key, 0.0) + value
        return {
            **summed,
            "weights_load_s": self.load_s,
            "workers_replaced": self.workers_replaced,
        }

    def generate(
        self,
        requests: list[GenerationRequest],
        version: int | None = None,
        max_tokens: int | None = None,
    ) -> list[GenerationOutput]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the Ray engine is shut down")
        wanted, ref = weights_to_load(self.weights, version, None)
        chunks = [c.tolist() for c in np.array_split(np.arange(len(requests)), len(self.workers))]
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
        outputs: list[GenerationOutput] = []
        dead = []
        for i, call in calls:
            try:
                part, load_s, engine_metrics = ray.get(call)
            except RayActorError as err:
                dead.append((i, err))
                continue
            outputs.extend(part)
            self.load_s += load_s
            self._engine_metrics[i] = engine_metrics
        if dead:
            with self._lock:
                if self._closed:  # the run is ending and killed its workers: replace nothing
                    raise RuntimeError("the Ray engine is shut down")
                for i, _ in dead:
                    self._replace(i)
            index, cause = dead[0]
            raise WorkerDied(
                f"generation worker {index} died during a batch (replaced; the batch is "
                f"re-dispatched): {type(cause).__name__}: {str(cause).splitlines()[0]}"
            ) from cause
        return outputs

    def _replace(self, index: int) -> None:
        ray.kill(self.workers[index], no_restart=True)  # if only its process is gone
        for key, value in self._engine_metrics[index].items():
            self._replaced_metrics[key] = self._replaced_metrics.get(key, 0.0) + value
        self._engine_metrics[index] = {}
        self._incarnations[index] += 1
        self.workers[index] = self._make_worker(index, self._incarnations[index])
        self.workers_replaced += 1

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

    def make_worker(index: int, incarnation: int) -> Any:
        return RemoteWorker.options(
            name=worker_name(index, incarnation),
            num_cpus=config.ray.num_cpus_per_worker,
            max_restarts=0,
        ).remote(
            config.rollout.engine,
            frozen,
            config.kept_weight_versions,
            config.run.torch_threads,
        )

    capabilities = engine_class(config.rollout.engine).capabilities
    return RayEngine(make_worker, config.rollout.num_workers, weights, capabilities)
