"""What the trainer's ranks send each other, with no pickle (DESIGN.md I7): a value is written
as a checkpoint writes a part (`asyncrl.checkpoint.snapshot`'s tree codec: nested dicts,
lists and tuples of JSON values and tensors become one JSON tree plus its tensors), and goes
over `torch.distributed` as tensors: a length, the JSON's bytes, then each tensor. A peer can
send only data: `torch.distributed`'s `*_object` collectives unpickle whatever arrives, which
under a multi-node torchrun is code execution for anyone who can reach the rendezvous.

`pack` / `unpack` are the pure codec (tested without a process group); `broadcast`,
`scatter` (each rank its own value only, point to point) and `all_gather` are the shells over a
group.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.checkpoint.snapshot import flatten_part, unflatten

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
"""The tensor dtypes a message may hold, by name."""


def pack(value: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`value` as JSON bytes (the tree, and each tensor's name, dtype and shape) and its
    tensors in that order (contiguous, on their own device)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_part("m", value, tensors)
    meta = [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()
    ]
    for _, dtype, _ in meta:
        if dtype not in DTYPES:
            raise TypeError(f"a {dtype} tensor cannot be sent between trainer ranks")
    header = json.dumps({"tree": tree, "tensors": meta}, separators=(",", ":")).encode()
    return header, list(tensors.values())


def buffers(header: bytes, device: torch.device) -> list[torch.Tensor]:
    """Empty tensors to receive the tensors `header` announces into."""
    meta = json.loads(header)["tensors"]
    return [torch.empty(shape, dtype=DTYPES[dtype], device=device) for _, dtype, shape in meta]


def unpack(header: bytes, tensors: list[torch.Tensor]) -> Any:
    """The value `pack` wrote, its tensors the ones given (in `pack`'s order)."""
    message = json.loads(header)
    names = [name for name, _, _ in message["tensors"]]
    if len(names) != len(tensors):
        raise ValueError(f"a message of {len(names)} tensors came with {len(tensors)}")
    return unflatten(message["tree"], dict(zip(names, tensors, strict=True)))


def broadcast(value: Any, rank: int, device: torch.device, group: Any = None) -> Any:
    """Rank 0's `value` on every rank of `group` (`value` is ignored elsewhere). `device` is
    where the collectives' tensors live (the CPU for gloo, the rank's GPU for NCCL). Three
    collectives and one more per dtype: the tensors of a dtype go as one flat buffer."""
    if rank == 0:
        header, tensors = pack(value)
        size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    raw = (
        torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        if rank == 0
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(raw, src=0, group=group)
    if rank != 0:
        header = raw.cpu().numpy().tobytes()
        tensors = buffers(header, torch.device("cpu"))
    received = list(tensors)
    for dtype, indices in _by_dtype(tensors).items():
        if rank == 0:
            flat = torch.cat([tensors[i].reshape(-1).to(device) for i in indices])
        else:
            total = sum(tensors[i].numel() for i in indices)
            flat = torch.empty(total, dtype=dtype, device=device)
        dist.broadcast(flat, src=0, group=group)
        if rank != 0:
            pieces = flat.cpu().split([tensors[i].numel() for i in indices])
            for i, piece in zip(indices, pieces, strict=True):
                received[i] = piece.view(tensors[i].shape)
    return unpack(header, received) if rank != 0 else value


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The indices of `tensors` by dtype, in order: each dtype's tensors go as one buffer."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return by_dtype


def send(value: Any, dst: int, device: torch.device, group: Any = None) -> None:
    """`value` to rank `dst` alone (point to point; `recv` there takes it)."""
    header, tensors = pack(value)
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=device), dst, group)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst, group)
    for indices in _by_dtype(tensors).values():
        dist.send(torch.cat([tensors[i].reshape(-1).to(device) for i in indices]), dst, group)


def recv(src: int, device: torch.device, group: Any = None) -> Any:
    """The value rank `src` sends this rank with `send`."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(raw, src, group)
    header = raw.cpu().numpy().tobytes()
    tensors = buffers(header, torch.device("cpu"))
    for dtype, indices in _by_dtype(tensors).items():
        flat = torch.empty(sum(tensors[i].numel() for i in indices), dtype=dtype, device=device)
        dist.recv(flat, src, group)
        pieces = flat.cpu().split([tensors[i].numel() for i in indices])
        for i, piece in zip(indices, pieces, strict=True):
            tensors[i] = piece.view(tensors[i].shape)
    return unpack(header, tensors)


def scatter(
    values: list[Any] | None, rank: int, world_size: int, device: torch.device, group: Any = None
) -> Any:
    """Rank 0's `values[r]` on rank r, and on no other rank (`values` is ignored elsewhere):
    a rank receives only what is its own."""
    if rank != 0:
        return recv(0, device, group)
    assert values is not None and len(values) == world_size
    for dst in range(1, world_size):
        send(values[dst], dst, device, group)
    return values[0]


def all_gather(value: Any, world_size: int, device: torch.device, group: Any = None) -> list[Any]:
    """Every rank's `value` on every rank, in rank order. Values hold no tensors (stats and
    manifest entries): the JSON bytes, padded to the longest, are the only tensor sent."""
    header, tensors = pack(value)
    if tensors:
        raise TypeError("all_gather sends JSON values only (no tensors)")
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [
        unpack(raw[: int(n.item())].cpu().numpy().tobytes(), [])
        for raw, n in zip(out, sizes, strict=True)
    ]
