"""Safetensors files streamed: written straight from tensors to a file object, read straight
from a file descriptor into fresh tensors, never a whole file as one `bytes` in memory.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header `{NAME: {"dtype", "shape", "data_offsets": [begin, end]}}` padded with
spaces to a multiple of 8, then every tensor's raw little-endian bytes, back to back in offset
order. `write_tensors` lays a file out as `safetensors.torch.save` 0.8 does (widest dtypes
first, then by name; compact JSON in offset order), so its bytes are the library's for the
same tensors (tests/test_tensorfile.py checks both that and that the library loads them).

`read_tensors` parses what it reads as it reads it, and hashes those same bytes: a file that is
swapped or rewritten while it is read cannot hand over bytes other than the ones hashed. It
accepts only what the library accepts (known dtypes, offsets that tile the data exactly);
anything else is a `ValueError` naming the problem. No pickle anywhere (DESIGN.md I7).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any, BinaryIO, Protocol

import torch

CHUNK_BYTES = 32 << 20
"""Bytes per `write`/`readinto`: large enough for full disk speed, small enough to bound the
temporary memory of a view (there is none: chunks are views of the tensor's storage)."""

_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
"""torch dtype -> safetensors name, in the order of the library's `Dtype` enum (its files put
the greatest first, which also keeps every tensor aligned to its element size)."""
_RANK = {name: rank for rank, name in enumerate(_DTYPES.values())}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER_BYTES = 100_000_000
"""The library's own limit on the JSON header."""

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships on
    raise ImportError("asyncrl's safetensors streaming assumes a little-endian machine")


class Writable(Protocol):
    def write(self, data: bytes | memoryview, /) -> Any: ...


FileWriter = Callable[[Writable], None]
"""Writes one file's bytes to a file object (the store wraps it to hash and count them)."""


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, as a view of its storage (no copy when contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)  # reshape: a 0-d tensor cannot be viewed
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    """The padded header (with its 8-byte length) and the names in data order."""
    names = sorted(tensors, key=lambda n: (-_RANK[_dtype_name(tensors[n], n)], n))
    header: dict[str, Any] = {}
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, names


def _dtype_name(tensor: torch.Tensor, name: str) -> str:
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {tensor.dtype} cannot go into a safetensors file")
    return _DTYPES[tensor.dtype]


def tensor_writer(tensors: Mapping[str, torch.Tensor]) -> FileWriter:
    """A `FileWriter` of `tensors` as one safetensors file. The tensors must be on the CPU and
    stay unchanged until it has run; nothing is copied, chunks are views of their storage."""
    header, names = layout(tensors)  # now: a bad dtype fails before any file is opened

    def write(out: Writable) -> None:
        out.write(header)
        for name in names:
            data = _raw_bytes(tensors[name])
            for start in range(0, len(data), CHUNK_BYTES):
                out.write(data[start : start + CHUNK_BYTES])

    return write


def write_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The file as bytes (for tests and small files)."""
    chunks: list[bytes] = []
    tensor_writer(tensors)(_Collect(chunks))
    return b"".join(chunks)


class _Collect:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def write(self, data: bytes | memoryview) -> None:
        self.chunks.append(bytes(data))


SKIP_CHUNK_BYTES = 1 << 20
"""The one buffer a selective read hashes the tensors it does not keep through."""


def _read_exact(f: BinaryIO, view: memoryview, digest: Any) -> None:
    """Fills `view` from `f`, hashing what it reads; `ValueError` if the file ends first."""
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled : min(len(view), filled + CHUNK_BYTES)])  # type: ignore[attr-defined]
        if not n:
            raise ValueError("the file ends inside its data")
        digest.update(view[filled : filled + n])
        filled += n


def read_tensors(
    f: BinaryIO, file_bytes: int, wanted: Collection[str] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of a safetensors file of `file_bytes` bytes open as `f`, each in fresh
    memory (only those named in `wanted`, if given: the others are hashed through one reused
    chunk and dropped, so memory holds what was asked for), and the SHA-256 of the bytes read
    (the whole file, always). Raises `ValueError` if it is not a well-formed safetensors file
    of that size; the caller compares the digest."""
    digest = hashlib.sha256()
    head = bytearray(8)
    _read_exact(f, memoryview(head), digest)
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > min(_MAX_HEADER_BYTES, file_bytes - 8):
        raise ValueError(f"header length {header_bytes} does not fit a {file_bytes}-byte file")
    text = bytearray(header_bytes)
    _read_exact(f, memoryview(text), digest)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"header is not JSON ({err})") from None
    entries = _entries(header, file_bytes - 8 - header_bytes)
    tensors: dict[str, torch.Tensor] = {}
    scratch = memoryview(bytearray(0))
    for name, dtype, shape in entries:
        if wanted is not None and name not in wanted:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if len(scratch) < min(size, SKIP_CHUNK_BYTES):
                scratch = memoryview(bytearray(min(size, SKIP_CHUNK_BYTES)))
            while size:
                n = min(size, len(scratch))
                _read_exact(f, scratch[:n], digest)
                size -= n
            continue
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel():
            _read_exact(f, _raw_bytes(tensor), digest)
        tensors[name] = tensor
    if f.read(1):
        raise ValueError("the file is longer than its data")
    return tensors, digest.hexdigest()


def _entries(header: object, data_bytes: int) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) in data order; checks that the offsets tile the data exactly."""
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _TORCH[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"tensor {name!r}: malformed entry ({err!r})") from None
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or end - begin != size:
            raise ValueError(f"tensor {name!r}: shape {shape} does not fit [{begin}, {end})")
        entries.append((begin, end, name, dtype, shape))
    entries.sort(key=lambda e: (e[0], e[1]))
    offset = 0
    for begin, end, name, _, _ in entries:
        if begin != offset:
            raise ValueError(f"tensor {name!r}: data at {begin}, expected {offset}")
        offset = end
    if offset != data_bytes:
        raise ValueError(f"the tensors cover {offset} data bytes, the file holds {data_bytes}")
    return [(name, dtype, shape) for _, _, name, dtype, shape in entries]
