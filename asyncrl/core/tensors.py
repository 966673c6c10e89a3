"""Small tensor helpers shared by the engine and the checkpointer."""

from __future__ import annotations

import torch


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A private copy of a state dict; tensors that shared memory still share it (so tied
    weights are still stored once)."""
    copies: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
        )
        if key not in copies:
            copies[key] = tensor.detach().clone()
        out[name] = copies[key]
    return out
