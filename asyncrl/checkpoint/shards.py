"""Sharded checkpoints (format 3): every trainer rank writes its own rows, one checkpoint.

With `train.num_processes = P > 1` the policy, PPO's critic and their optimizer moments are
FSDP2 DTensors: each rank holds a contiguous block of every tensor's rows (`shard_range`:
`torch.chunk`'s split, which FSDP2 uses). A checkpoint of such a run is still ONE directory
and one manifest:

    model.safetensors, state.safetensors   rank 0's files as in format 2 (the whole cut), but
                                           a sharded tensor holds only rank 0's rows there
    model.rank_001.safetensors, ...        rank r's rows of every sharded tensor of the model
    state.rank_001.safetensors, ...        part and of the algorithm part, same names
    state.json                             format 2's, plus "num_shards": P; a sharded leaf is
                                           {"__tensor__": NAME, "__global__": SHAPE}
    manifest.json                          every rank's files with their SHA-256, written by
                                           rank 0 last (`CheckpointStore.save(written=...)`)

So a checkpoint torn on any one rank has no manifest, or a file whose hash is not the
manifest's: it is never loaded, exactly like a torn format-2 one.

Reading (`resolve_tensors`) is driven by what the loading rank holds: for each tensor whose
live counterpart is a DTensor, that rank's rows under ITS layout are read from whichever ranks'
files hold them, so a checkpoint of P ranks resumes on any P' (resharding); every other tensor
is read whole (rows concatenated in rank order). Rank files are read whole and hash-checked as
they are read (`Verified.read_with`), never through a path that could change in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from asyncrl.checkpoint.files import CheckpointError, _write_synced
from asyncrl.checkpoint.store import Verified
from asyncrl.checkpoint.tensorfile import read_tensors, tensor_writer
from asyncrl.faults import fault_point

SUFFIX = ".safetensors"


def rank_file(file: str, rank: int) -> str:
    """The file that holds rank `rank`'s rows of `file`'s sharded tensors (rank 0: `file`)."""
    return file if rank == 0 else f"{file.removesuffix(SUFFIX)}.rank_{rank:03d}{SUFFIX}"


def shard_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that rank `rank` of `world_size` holds: `torch.chunk`'s
    split (chunks of ceil(n/P) rows; the last ranks may hold fewer, or none)."""
    size = -(-num_rows // world_size) if num_rows else 0
    start = min(rank * size, num_rows)
    return start, min(start + size, num_rows)


def tensor_leaves(tree: Any, found: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every tensor leaf (`{"__tensor__": NAME, ...}`) of a part's JSON tree, by name."""
    found = {} if found is None else found
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            found[tree["__tensor__"]] = tree
        for value in tree.values():
            tensor_leaves(value, found)
    elif isinstance(tree, list):
        for value in tree:
            tensor_leaves(value, found)
    return found


def sharded_shapes(tree: Any) -> dict[str, list[int]]:
    """The global shape of every sharded tensor a part's JSON tree names."""
    leaves = tensor_leaves(tree).items()
    return {name: list(leaf["__global__"]) for name, leaf in leaves if "__global__" in leaf}


def dtensor_rows(tensor: DTensor) -> tuple[int, int]:
    """The rows of `tensor`'s global dim 0 this rank holds (FSDP2's one-dimensional mesh)."""
    mesh = tensor.device_mesh
    start, stop = shard_range(tensor.shape[0], mesh.get_local_rank(), mesh.size())
    if tensor.to_local().shape[0] != stop - start:
        raise CheckpointError(
            f"a sharded tensor of shape {list(tensor.shape)} holds "
            f"{tensor.to_local().shape[0]} rows on this rank, not torch.chunk's {stop - start}"
        )
    return start, stop


class ShardedFile:
    """One tensor file of a checkpoint (model or state) with its rank files: rows of any of
    its tensors, from whichever ranks wrote them. `main` is the file itself, already read."""

    def __init__(
        self, verified: Verified, file: str, main: Mapping[str, torch.Tensor], num_shards: int
    ) -> None:
        self.verified = verified
        self.file = file
        self.num_shards = num_shards
        self._ranks: dict[int, Mapping[str, torch.Tensor]] = {0: main}

    def _rank(self, rank: int) -> Mapping[str, torch.Tensor]:
        if rank not in self._ranks:
            name = rank_file(self.file, rank)
            try:
                self._ranks[rank] = self.verified.read_with(name, read_tensors)
            except (ValueError, OSError) as err:
                raise CheckpointError(
                    f"{self.verified.path / name}: tensors unreadable ({err})"
                ) from None
        return self._ranks[rank]

    def rows(self, name: str, shape: list[int] | None, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (global `shape`; None: not sharded, whole in
        the main file)."""
        if shape is None or self.num_shards == 1:
            return self._rank(0)[name][start:stop]
        pieces = []
        for rank in range(self.num_shards):
            lo, hi = shard_range(shape[0], rank, self.num_shards)
            if hi <= start or lo >= stop or hi == lo:
                continue
            held = self._rank(rank)[name]
            pieces.append(held[max(start, lo) - lo : min(stop, hi) - lo])
        if not pieces:
            return torch.empty([0, *shape[1:]], dtype=self._rank(0)[name].dtype)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def whole(self, name: str, shape: list[int] | None) -> torch.Tensor:
        if shape is None or self.num_shards == 1:
            return self._rank(0)[name]
        return self.rows(name, shape, 0, shape[0])


def resolve_tensors(
    source: ShardedFile, tree: Any, refs: set[str], live: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The tensors part `tree` names (`refs`) as the loading rank needs them: where `live`
    (the rank's own flattened state of the part) holds a DTensor, a DTensor of this rank's rows
    under its layout; otherwise the whole tensor."""
    shapes = sharded_shapes(tree)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(refs):
        shape = shapes.get(name)
        target = live.get(name) if live is not None else None
        if isinstance(target, DTensor):
            saved = shape or list(source.whole(name, None).shape)
            if saved != list(target.shape):
                raise CheckpointError(
                    f"{source.verified.path}: tensor {name} has shape {saved}, this run's "
                    f"{list(target.shape)}"
                )
            start, stop = dtensor_rows(target)
            rows = source.rows(name, shape, start, stop)
            out[name] = DTensor.from_local(
                rows.to(target.device),
                target.device_mesh,
                target.placements,
                run_check=False,
                shape=target.shape,
                stride=target.stride(),
            )
        else:
            out[name] = source.whole(name, shape)
    return out


def missing_rank_files(
    manifest_files: Mapping[str, Any], files: tuple[str, ...], num_shards: int
) -> list[str]:
    """The rank files a checkpoint of `num_shards` ranks should list but does not."""
    wanted = [rank_file(f, r) for f in files for r in range(1, num_shards)]
    return [name for name in wanted if name not in manifest_files]


def write_rank_files(
    begun: Path, trees: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]], rank: int
) -> dict[str, dict[str, Any]]:
    """A rank > 0's share of a checkpoint: its rows of every sharded tensor of its staged cut
    (`trees`: part -> JSON tree; `tensors`: file -> name -> this rank's rows, as
    `StagingArea.stage` leaves them) written and fsynced into the temp dir `begun`, hashed as
    they are written. Returns their manifest entries. Everything else of the state is the same
    on every rank, and rank 0 writes it."""
    sharded = {name for tree in trees.values() for name in sharded_shapes(tree)}
    entries = {}
    for file, found in tensors.items():
        name = rank_file(file, rank)
        own = {k: t for k, t in found.items() if k in sharded}
        entries[name] = _write_synced(begun / name, tensor_writer(own))
        fault_point("checkpoint.rank_file_written")
    return entries
