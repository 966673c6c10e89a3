"""`ObjectStoreWeightSync`: the `WeightSync` of `rollout.backend=ray`. Each version is put in
Ray's object store once (as NumPy arrays, which the store moves without pickling and workers
read zero-copy); a worker fetches a version by reference at its first batch that needs it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import torch

from asyncrl.core.tensors import clone_state
from asyncrl.rollout.weight_sync import KeptVersions


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


class ObjectStoreWeightSync:
    """Keeps the newest `max_versions` object references (deterministic mode pins older ones),
    and, when it keeps more than one, their tensors for checkpoints."""

    def __init__(self, max_versions: int) -> None:
        self._kept = KeptVersions(max_versions)

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        ref = ray.put(to_numpy(dict(weights)))
        tensors = clone_state(dict(weights)) if self._kept.max_versions > 1 else {}
        self._kept.put(version, ref, tensors)

    def newest(self) -> int:
        return self._kept.newest()

    def get(self, version: int) -> Any:
        return self._kept.get(version)

    def has(self, version: int) -> bool:
        return self._kept.has(version)

    def state_dict(self) -> dict[str, Any]:
        return self._kept.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for version in sorted(state["versions"]):
            self.publish(int(version), state["versions"][version])
