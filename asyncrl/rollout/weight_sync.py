"""The `WeightSync` seam: how the trainer's new weights reach generation.

    Trainer ── publish(version, weights) ─▶ WeightSync ─▶ get(version) ── engine, at its next batch

The sync is picked with the backend: `CopyWeightSync` for `backend=threads` (a private copy in
this process), `asyncrl.distributed.weights.ObjectStoreWeightSync` for `backend=ray` (one
`ray.put` per version, fetched by each worker); NCCL or CUDA-IPC transfers fit behind the
same two calls. A sync keeps the newest `max_versions` versions (deterministic mode pins
target t to version max(0, t-A), and chunked generation finishes a sample on the version it
started with, so both keep A+1) and is a stateful checkpoint part: its state is every kept
version older than the newest, which a resumed run may still have to generate with (the
newest is the trainer's own weights, published again after a resume).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from asyncrl.core.tensors import clone_state


class WeightSource(Protocol):
    """The engine's side of a weight sync."""

    def newest(self) -> int:
        """The newest published version."""
        ...

    def get(self, version: int) -> Any:
        """Weights `version` in the form the engine loads (a state dict here; an object
        reference on Ray). Raises `KeyError` naming the kept versions if it is gone."""
        ...

    def has(self, version: int) -> bool:
        """Whether weights `version` are still kept."""
        ...


def weights_to_load(
    source: WeightSource, version: int | None, loaded: int | None
) -> tuple[int, Any]:
    """The version a batch generates with (`version` if given, else the newest) and its
    weights, or None for them if `loaded` already is that version. A version no longer kept
    is a RuntimeError naming the kept ones: the batch fails and is re-dispatched."""
    wanted = source.newest() if version is None else version
    if wanted == loaded:
        return wanted, None
    try:
        return wanted, source.get(wanted)
    except KeyError as err:
        raise RuntimeError(err.args[0]) from None


class WeightSync(WeightSource, Protocol):
    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Makes `version` available to generation from its next batch on. Never blocks on a
        batch in progress; `weights` are live tensors the sync must not keep references to."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class KeptVersions:
    """The newest `max_versions` published versions, thread-safe; the bookkeeping every sync
    shares. `entry` is whatever the sync hands the engine; `weights` the tensors a checkpoint
    saves (empty when only one version is kept: then nothing older is ever saved)."""

    def __init__(self, max_versions: int) -> None:
        self.max_versions = max_versions
        self._lock = threading.Lock()
        self._entries: dict[int, Any] = {}
        self._weights: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, version: int, entry: Any, weights: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._entries[version] = entry
            self._weights[version] = weights
            for old in sorted(self._entries)[: -self.max_versions]:
                del self._entries[old]
                del self._weights[old]

    def newest(self) -> int:
        with self._lock:
            return max(self._entries)

    def get(self, version: int) -> Any:
        with self._lock:
            if version not in self._entries:
                raise KeyError(
                    f"weights version {version} is no longer kept (have {sorted(self._entries)})"
                )
            return self._entries[version]

    def has(self, version: int) -> bool:
        with self._lock:
            return version in self._entries

    def state_dict(self) -> dict[str, Any]:
        """Every kept version older than the newest: `{"versions": {version: weights}}`."""
        with self._lock:
            newest = max(self._entries, default=-1)
            return {"versions": {v: w for v, w in self._weights.items() if v < newest}}


class CopyWeightSync:
    """`backend=threads`: each version is a private copy (tied tensors stay tied), made
    directly on the engine's device and in its dtype, that the engine in this process takes
    as its weights (`load_state_dict(assign=True)`): the copy a version needs anyway is the
    torch engine's model, so generation holds one set of weights per kept version, not two.
    (vLLM keeps weights of its own, repacked into its layout: with `rollout.engine=vllm`
    there are two copies, the kept versions here and the one loaded in vLLM.)

    A published `nn.Parameter` that does not require grad (a LoRA model's frozen base,
    `asyncrl.models.lora.generation_weights`) never changes: it is shared by every version,
    not copied (cast once if the engine's device or dtype differs), and left out of the
    checkpointed state, which then holds the adapters of the older versions only."""

    def __init__(
        self, max_versions: int = 1, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        self._kept = KeptVersions(max_versions)
        self.device = torch.device(device)
        self.dtype = dtype
        self._frozen: dict[str, torch.Tensor] = {}  # name -> the shared (or cast once) tensor
        self._cast: dict[int, torch.Tensor] = {}

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        changing = {}
        for name, tensor in weights.items():
            if isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad:
                self._frozen[name] = self._shared(tensor)
            else:
                changing[name] = tensor
        copied = clone_state(changing, self.device, self.dtype)
        self._kept.put(version, copied, copied if self._kept.max_versions > 1 else {})

    def _shared(self, tensor: torch.Tensor) -> torch.Tensor:
        """A frozen tensor on the engine's device in its dtype: itself, or one cast copy."""
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
        if tensor.device == self.device and dtype in (None, tensor.dtype):
            return tensor
        if id(tensor) not in self._cast:
            self._cast[id(tensor)] = tensor.detach().to(self.device, dtype or tensor.dtype)
        return self._cast[id(tensor)]

    def newest(self) -> int:
        return self._kept.newest()

    def get(self, version: int) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = self._kept.get(version)
        return {**self._frozen, **weights} if self._frozen else weights

    def has(self, version: int) -> bool:
        return self._kept.has(version)

    def state_dict(self) -> dict[str, Any]:
        return self._kept.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for version in sorted(state["versions"]):
            self.publish(int(version), state["versions"][version])
