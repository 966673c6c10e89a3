"""Devices and precision: the config's `train.device` / `rollout.device` strings as
`torch.device`s, checked against what this machine has, and mixed-precision autocast."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, MutableMapping

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


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags of /proc/cpuinfo that mean bf16 matrix products in hardware (AVX512-BF16's dot
products, AMX's tiles)."""

ARM_BF16_FEATURES = ("bf16",)
"""The aarch64 feature (Features line of /proc/cpuinfo) for BFDOT/BFMMLA."""


def cpu_bf16(cpuinfo: str) -> tuple[bool, str]:
    """Whether the CPU that `cpuinfo` (the text of /proc/cpuinfo) describes multiplies bf16
    in hardware, and the reason in words: the flag found, or that none of `BF16_FLAGS` is
    there. Read from the flags, not from oneDNN's `_is_mkldnn_bf16_supported()`, which also
    says True on AVX-512 CPUs without bf16 (it emulates bf16 there, about as slowly as AVX2's
    fallback)."""
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    for flag in (*BF16_FLAGS, *ARM_BF16_FEATURES):
        if flag in words:
            return True, f"its flags have {flag}"
    if not words:
        return False, "no CPU flags could be read"
    return False, "its flags have no " + " or ".join(BF16_FLAGS)


ONEDNN_CAP_KEYS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Environment variables by which oneDNN, which runs torch's bf16 products on a CPU, is held to
an older instruction set (the first set wins, as in oneDNN)."""

ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "ALL", "DEFAULT")
"""Caps (and prefixes of caps: `AVX512_CORE_AMX_FP16`, `AVX10_1_512_AMX`) under which oneDNN
still multiplies bf16 natively; `AVX10` caps count too."""


def onednn_cap(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether oneDNN's instruction-set cap in `environ` (`ONEDNN_MAX_CPU_ISA=AVX2`, as one sets
    to try an AVX2-only machine's paths) still leaves it native bf16 products, and the reason
    where it does not. No cap leaves them."""
    for key in ONEDNN_CAP_KEYS:
        value = environ.get(key, "").strip().upper()
        if not value:
            continue
        if value.startswith(ONEDNN_BF16_ISAS) or value.startswith("AVX10"):
            return True, ""
        return False, f"{key}={value} holds oneDNN below AVX512_CORE_BF16"
    return True, ""


ONEDNN_CACHE_KEY = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 128
"""How many oneDNN primitives (a bf16 product's kernel, made for one shape) a process keeps;
oneDNN's own default is 1024. A bf16 pass makes new ones for each micro-batch's token count,
and on a CPU with AMX each held one holds memory: SmolLM2 with LoRA, 64 bf16 passes of 4 rows
(Intel Xeon with amx_bf16, 2026-12-06) ended at 3.48 GB RSS with 1024 and 2.72 GB with 128, in
the same time (124 s and 118 s); 64 cost 7% more time and 0 three times as much. fp32
products (MKL's) make none."""


def bound_onednn_cache(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets oneDNN's primitive cache to `ONEDNN_CACHE_CAPACITY` unless `environ` names one
    already (the user's value wins). oneDNN reads it when it makes its first primitive, so this
    runs before a process's first pass; later calls change nothing."""
    environ.setdefault(ONEDNN_CACHE_KEY, str(ONEDNN_CACHE_CAPACITY))


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text ('' where there is none, as on macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def native_bf16_why(device: torch.device) -> tuple[bool, str]:
    """Whether `device` multiplies bf16 natively, and why: a CUDA GPU that supports it, or a
    CPU whose flags have avx512_bf16, amx_bf16 (x86) or bf16 (aarch64), unless oneDNN is capped
    below them (`onednn_cap`). Elsewhere bf16 matmuls take a slow fallback."""
    if device.type == "cuda":
        ok = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        return ok, "torch.cuda.is_bf16_supported() is " + str(ok)
    if device.type == "cpu":
        native, why = cpu_bf16(read_cpuinfo())
        allowed, cap = onednn_cap(os.environ)
        if native and not allowed:
            return False, f"{why}, but {cap}"
        return native, why
    return False, f"{device.type} is not a cpu or cuda device"


def native_bf16(device: torch.device) -> bool:
    """`native_bf16_why`'s verdict alone."""
    return native_bf16_why(device)[0]


def resolve_train_dtype(dtype: str, device: torch.device) -> str:
    """`train.dtype` as the passes run it: `auto` is `bfloat16` where `device` has native bf16
    (`native_bf16`), `float32` elsewhere; the others as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def dtype_line(dtype: str, device: torch.device) -> str | None:
    """The start line that says what `train.dtype=auto` chose on `device`, and why:
    `asyncrl: train.dtype=auto -> float32 (cpu: its flags have no avx512_bf16 or amx_bf16)`."""
    if dtype != "auto":
        return None
    native, why = native_bf16_why(device)
    chosen = "bfloat16" if native else "float32"
    return f"asyncrl: train.dtype=auto -> {chosen} ({device.type}: {why})"


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
