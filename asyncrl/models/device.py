"""Devices and precision: the config's `train.device` / `rollout.device` strings as
`torch.device`s, checked against what this machine has, and mixed-precision autocast."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from asyncrl.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(key: str, name: str) -> torch.device:
    """`name` (`cpu`, `cuda`, `cuda:N`) as a device this process can use; a `ConfigError`
    naming `key` if it cannot (a CPU-only torch, or fewer GPUs than N+1)."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{key}: got {name!r}, but torch.cuda.is_available() is False here (torch "
                f"{torch.__version__}); use cpu, or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{key}: got {name!r}, but this machine has {count} CUDA devices")
    return device


@contextlib.contextmanager
def autocast(device: torch.device, dtype: str) -> Iterator[None]:
    """Mixed precision for forward passes: bf16 compute over fp32 weights under
    `torch.autocast` when `dtype` is `bfloat16`; nothing at all for `float32` (so an fp32 run
    is bit-identical to one that never heard of autocast)."""
    if dtype == "float32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=DTYPES[dtype]):
        yield


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (where its inputs must go)."""
    return next(model.parameters()).device


def place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Moves a module (a Hugging Face model included) to `device`, and `dtype` if given."""
    module.to(device=device, dtype=dtype)
