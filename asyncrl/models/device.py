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


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA GPU that supports it, or a CPU with
    avx512_bf16 / AMX (oneDNN's check). Elsewhere bf16 matmuls take a slow fallback."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_train_dtype(dtype: str, device: torch.device) -> str:
    """`train.dtype` as the passes run it: `auto` is `bfloat16` where `device` has native bf16
    (`native_bf16`), `float32` elsewhere; the others as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def dtype_line(dtype: str, device: torch.device) -> str | None:
    """The start line that says what `train.dtype=auto` chose on `device`, and why."""
    if dtype != "auto":
        return None
    chosen = resolve_train_dtype(dtype, device)
    has = "has" if chosen == "bfloat16" else "has no"
    return f"asyncrl: train.dtype=auto -> {chosen} ({device.type} {has} native bf16 matmuls)"


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
