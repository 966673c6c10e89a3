"""Small tensor helpers shared by the engine and the checkpointer."""

from __future__ import annotations

import torch


def clone_state(
    state: dict[str, torch.Tensor],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """A private copy of a state dict, optionally on `device` and with its floating-point
    tensors in `dtype` (one cast copy, no intermediate); tensors that shared memory still
    share it (so tied weights are still stored once)."""
    copies: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
        )
        if key not in copies:
            cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            copies[key] = tensor.detach().to(device=device or tensor.device, dtype=cast, copy=True)
        out[name] = copies[key]
    return out
