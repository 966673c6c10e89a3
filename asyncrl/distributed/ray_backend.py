"""The Ray backend (`rollout.backend=ray`): thin shells over the same core and rollout code.

    driver process (the trainer drives)                      Ray actors
    -----------------------------------                      ----------
    Trainer: step t, publish version t+1 ── RayEngine ─ ray.put(weights) once per version
    Collector thread: ledger, admission ─── RayEngine.generate ─ split ─▶ GenerationWorker x W
                      completion ───────── BufferClient ───────────────▶ ray.remote(ReplayBuffer)

Nothing here decides anything the threads backend does not: the ledger, the window, the cut
and the checkpoint are the same objects and code. `GenerationWorker` is a
`TorchGenerationEngine` in an actor; `ReplayBuffer` runs unchanged as `ray.remote(...)`;
`RayEngine` implements the `GenerationEngine` protocol by splitting each batch across the
workers (every worker generates with the same weights version) and turns a dead worker into
an ordinary failed batch after replacing it, so the collector re-dispatches the batch's
ordinals exactly as it does for a failing engine on threads.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError
from transformers import PreTrainedModel

from asyncrl.config import Config
from asyncrl.core.buffer import ReplayBuffer
from asyncrl.core.tensors import clone_state
from asyncrl.core.types import Group
from asyncrl.faults import fault_point
from asyncrl.rollout.engine import GenerationOutput, GenerationRequest, TorchGenerationEngine

NAMESPACE = "asyncrl"


def start_ray(config: Config) -> bool:
    """Connects to `ray.address`, or starts a local Ray on this machine (node address
    127.0.0.1, no dashboard, quiet; Ray's own servers still listen on all interfaces, see
    docs/ray.md). Returns whether this call started it (then the run shuts it down)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls home
    common: dict[str, Any] = {
        "namespace": NAMESPACE,
        "log_to_driver": True,
        "logging_level": logging.ERROR,
        "include_dashboard": False,
    }
    if config.ray.address:
        ray.init(address=config.ray.address, **common)
    else:
        ray.init(num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1", **common)
    return True


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Weights as NumPy arrays where the dtype allows (the object store moves those without
    pickling, and workers read them zero-copy); other dtypes (bfloat16) stay tensors."""
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        t = tensor.detach().cpu()
        out[name] = t.numpy() if t.dtype != torch.bfloat16 else t.clone()
    return out


def from_numpy(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


class GenerationWorker:
    """One generation actor: a `TorchGenerationEngine` plus the weights versions it was sent."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_id: int,
        pad_id: int,
        max_new_tokens: int,
        temperature: float,
        max_versions: int,
        torch_threads: int,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.engine = TorchGenerationEngine(
            model, eos_id, pad_id, max_new_tokens, temperature, max_versions=max_versions
        )
        self.fetched: set[int] = set()  # versions sent to this worker; the model's own
        # weights (whatever `model` held) are never used under any version number

    def generate(
        self, requests: list[GenerationRequest], version: int, weights: list[Any]
    ) -> tuple[list[GenerationOutput], float]:
        """Generates with weights `version`, fetching them from the object store first if this
        worker does not have them (`weights` is `[ObjectRef]`, unresolved until needed).
        Returns the outputs and the seconds spent fetching and loading weights."""
        fault_point("worker.generate")
        start = time.perf_counter()
        if version not in self.fetched:
            self.engine.update_weights(from_numpy(ray.get(weights[0])), version)
            self.fetched = set(self.engine.published_versions()) & (self.fetched | {version})
        load_s = time.perf_counter() - start
        return self.engine.generate(requests, version), load_s

    def ready(self) -> bool:
        return True


RemoteWorker = ray.remote(GenerationWorker)
RemoteReplayBuffer = ray.remote(ReplayBuffer)


class WorkerDied(RuntimeError):
    """A generation worker actor died during a batch; it was replaced. The batch's tickets go
    back to the collector's queue like any failed batch."""


class RayEngine:
    """`GenerationEngine` over `num_workers` actors. `update_weights` puts a version in the
    object store once; a worker fetches it at its next batch. Keeps the newest `max_versions`
    (deterministic mode pins older ones) in the store, and as tensors for checkpoints."""

    def __init__(
        self,
        make_worker: Callable[[int, int], Any],
        num_workers: int,
        initial: dict[str, torch.Tensor],
        max_versions: int,
    ) -> None:
        self._make_worker = make_worker
        self._incarnations = [0] * num_workers
        self.workers = [make_worker(i, 0) for i in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])
        self.max_versions = max_versions
        self._lock = threading.Lock()
        self._refs: dict[int, Any] = {}
        self._tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.load_s = 0.0  # worker seconds spent fetching and loading weights
        self.workers_replaced = 0
        self._closed = False
        self.update_weights(initial, 0)

    @property
    def weights_version(self) -> int:
        with self._lock:
            return max(self._refs)

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        ref = ray.put(to_numpy(state))
        tensors = clone_state(state) if self.max_versions > 1 else {}
        with self._lock:
            self._refs[version] = ref
            self._tensors[version] = tensors
            for old in sorted(self._refs)[: -self.max_versions]:
                del self._refs[old]
                del self._tensors[old]

    def published_versions(self) -> dict[int, dict[str, torch.Tensor]]:
        with self._lock:
            return dict(self._tensors)

    def generate(
        self, requests: list[GenerationRequest], version: int | None = None
    ) -> list[GenerationOutput]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the Ray engine is shut down")
            wanted = max(self._refs) if version is None else version
            if wanted not in self._refs:
                raise RuntimeError(
                    f"weights version {wanted} is no longer kept (have {sorted(self._refs)})"
                )
            ref = self._refs[wanted]
        chunks = [c.tolist() for c in np.array_split(np.arange(len(requests)), len(self.workers))]
        calls = [
            (i, self.workers[i].generate.remote([requests[j] for j in chunk], wanted, [ref]))
            for i, chunk in enumerate(chunks)
            if chunk
        ]
        outputs: list[GenerationOutput] = []
        dead = []
        for i, call in calls:
            try:
                part, load_s = ray.get(call)
            except RayActorError as err:
                dead.append((i, err))
                continue
            outputs.extend(part)
            self.load_s += load_s
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


def build_ray_engine(
    config: Config, model: PreTrainedModel, eos_id: int, pad_id: int, max_versions: int
) -> RayEngine:
    rollout = config.rollout
    # the architecture every worker (and every replacement) starts from, put once; its weights
    # are never generated with: each version is fetched by reference
    architecture = ray.put(copy.deepcopy(model))

    def make_worker(index: int, incarnation: int) -> Any:
        return RemoteWorker.options(
            name=worker_name(index, incarnation),
            num_cpus=config.ray.num_cpus_per_worker,
            max_restarts=0,
        ).remote(
            architecture,
            eos_id,
            pad_id,
            rollout.max_new_tokens,
            rollout.temperature,
            max_versions,
            config.run.torch_threads,
        )

    return RayEngine(make_worker, rollout.num_workers, model.state_dict(), max_versions)


class BufferClient:
    """The `ReplayBuffer` interface the collector and trainer use, forwarded to a
    `ray.remote(ReplayBuffer)` actor. No logic: every call is the core method, remotely."""

    def __init__(self, num_prompts_per_step: int, max_age_steps: int) -> None:
        self.actor: Any = RemoteReplayBuffer.options(max_concurrency=4, num_cpus=0).remote(
            num_prompts_per_step, max_age_steps
        )
        self.num_prompts_per_step = num_prompts_per_step
        self.capacity = (max_age_steps + 1) * num_prompts_per_step

    def __len__(self) -> int:
        return int(ray.get(self.actor.size.remote()))

    def add(self, group: Group) -> None:
        ray.get(self.actor.add.remote(group))

    def sample(
        self, target_step: int, check: Callable[[], None] | None = None, poll_s: float = 0.05
    ) -> list[Group]:
        while (groups := ray.get(self.actor.try_sample.remote(target_step, poll_s))) is None:
            if check is not None:
                check()
        return list(groups)

    def counts_by_target(self) -> dict[int, int]:
        return dict(ray.get(self.actor.counts_by_target.remote()))

    def ordinals_and_targets(self) -> list[tuple[int, int]]:
        return [tuple(x) for x in ray.get(self.actor.ordinals_and_targets.remote())]

    def discard(self, ordinals: list[int]) -> None:
        ray.get(self.actor.discard.remote(ordinals))

    def state_dict(self) -> dict[str, Any]:
        return dict(ray.get(self.actor.state_dict.remote()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ray.get(self.actor.load_state_dict.remote(state))

    def shutdown(self) -> None:
        ray.kill(self.actor, no_restart=True)
