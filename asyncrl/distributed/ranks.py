"""The trainer's ranks on `torch.distributed`: FSDP2 sharding and the few collectives a step
needs (`asyncrl.algos.parallel.Ranks`), `gloo` on CPU and `nccl` on GPUs.

Every rank trains; rank 0 also owns the collector, ledger, buffer and run dir and tells the
others what to do (`asyncrl.distributed.rank_worker`). Sharding: each decoder block (the
classes in the model's `_no_split_modules`, as transformers names them) is one FSDP2 unit, the
rest (embeddings, final norm, head) the root's; parameters, gradients and AdamW moments are
1/P per rank. Gradients are reduce-scattered as sums (no division by P): the losses are already
divided by the step's one global normaliser.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from asyncrl.distributed import wire

TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective may wait for a slow rank before it fails (a dead rank's closed
connection fails it at once)."""


class TorchRanks:
    """This process's place in the trainer's `torch.distributed` group (already initialised
    by `init_ranks`)."""

    def __init__(self, device: torch.device) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device
        self.mesh: DeviceMesh = init_device_mesh(device.type, (self.world_size,))
        self.side = dist.new_group(backend="gloo")
        """A second group for checkpoint bookkeeping, used from writer threads while the
        trainer threads' collectives go on in the default group."""

    def shard(self, module: torch.nn.Module) -> None:
        blocks = set(getattr(module, "_no_split_modules", None) or ())
        units = [m for m in module.modules() if type(m).__name__ in blocks and m is not module]
        for unit in units:
            fully_shard(unit, mesh=self.mesh)
        fully_shard(module, mesh=self.mesh)
        for unit in [*units, module]:
            assert isinstance(unit, FSDPModule)
            unit.set_gradient_divide_factor(1.0)  # sums: the losses are globally normalised
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.cpu()]

    def agree(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set, on every rank (a collective: every rank calls it
        at the same place; rank 0's preemption notice, the others' False)."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def gather(self, value: Any) -> list[Any]:
        return wire.all_gather(value, self.world_size, self._comm_device)

    def assemble(
        self, pieces: list[tuple[slice, torch.Tensor]], num_rows: int, like: torch.Tensor
    ) -> torch.Tensor:
        full = torch.zeros((num_rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
        for rows, values in pieces:
            full[rows] = values
        dist.all_reduce(full)  # every row is one rank's, the others add zeros: exact
        return full

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {
            name: value
            for name, value in get_model_state_dict(module, options=options).items()
            if isinstance(value, torch.Tensor)
        }
        tied: dict[int, list[str]] = {}  # gathered one by one, tied weights come back apart
        for name, param in module.named_parameters(remove_duplicate=False):
            tied.setdefault(id(param), []).append(name)
        for first, *others in tied.values():
            for name in others:
                if first in full and name in full:
                    full[name] = full[first]  # one tensor again, as in the live model
        return full

    def gather_side(self, value: Any) -> list[Any]:
        """Every rank's `value` on every rank, over the side group (writer threads; gloo)."""
        return wire.all_gather(value, self.world_size, torch.device("cpu"), group=self.side)

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's `value` on every rank (a command and its data: small values and the
        step's groups as tensors; `asyncrl.distributed.wire`, no pickle)."""
        return wire.broadcast(value, self.rank, self._comm_device)

    def scatter(self, values: list[Any] | None = None) -> Any:
        """Rank 0's `values[r]` on rank r only (a step's rows: `wire.scatter`)."""
        return wire.scatter(values, self.rank, self.world_size, self._comm_device)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


LOCAL_RENDEZVOUS = "ASYNCRL_RENDEZVOUS"
"""Environment variable naming the rendezvous file of a local launch (`asyncrl train` starting
its own ranks): set for the ranks it starts."""


def init_ranks(
    device: torch.device, rank: int | None = None, world_size: int = 1, rendezvous: str = ""
) -> TorchRanks:
    """Joins the trainer's process group. A local launch (`rendezvous`, a file path, with
    `rank` and `world_size`; or the ranks it started, which find all three in their
    environment) meets through that file — a FileStore: no server socket at all — and runs
    gloo over loopback. Otherwise the group is torchrun's (`RANK`, `WORLD_SIZE`,
    `MASTER_ADDR`, `MASTER_PORT`). On GPUs rank r of a node uses `cuda:LOCAL_RANK`."""
    if not rendezvous and LOCAL_RENDEZVOUS in os.environ:
        rendezvous = os.environ[LOCAL_RENDEZVOUS]
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.type == "cuda":
        local_rank = rank if rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _fixed_mmap_threshold()
    if not rendezvous:
        dist.init_process_group(backend, timeout=TIMEOUT)
        return TorchRanks(device)
    # gloo picks its interface when each group is made (the side group too): loopback
    with _environ(GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")):
        dist.init_process_group(
            backend,
            init_method=f"file://{rendezvous}",
            rank=rank if rank is not None else 0,
            world_size=world_size,
            timeout=TIMEOUT,
        )
        return TorchRanks(device)


MMAP_THRESHOLD_BYTES = 1 << 20


def _fixed_mmap_threshold() -> None:
    """Every allocation of 1 MiB or more in its own memory mapping, given back when freed.
    FSDP2 allocates and frees each block's unsharded weights and gradients in every pass;
    glibc's dynamic threshold moves such blocks into the heap after the first free, where the
    freed memory stays (measured on a 20M-parameter model, one of 2 ranks: RSS 820-905 MB
    after 3 steps, 522 MB with the threshold fixed). A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """`os.environ` with `values` set inside the block only."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
