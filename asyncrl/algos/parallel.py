"""The trainer's data-parallel seam, as the algorithms see it: which rows of a step this rank
trains, and the few collectives a step needs (STYLE.md rule 12: a Protocol with an in-process
implementation).

With `train.num_processes = P` every rank holds the step's whole batch (rank 0 sends it; all
of it is needed anyway for the one normaliser and the advantages) and trains a contiguous
block of its rows: rank r gets rows `[r*B//P + min(r, B%P), ...)` of the step's B rows (`N*G`,
or more where samples have segments: a block may cut a group or a sample's segments, each row
carrying its own advantage and `row_samples`), a pure function of (B, P, r), so each step's
groups are split the same way whatever the timing.
Losses are masked sums over the step's global normaliser (rule 14), so the sum of the ranks'
gradients — `torch.distributed` reduces them — is the one-process gradient.

FSDP2 runs a collective in every forward and backward pass of a sharded module, so every rank
must run the same number of passes: `rank_micro_batches` pads a rank's list with stand-ins
(a real row whose loss is multiplied by 0) to the longest rank's count.

`SINGLE` is the one-process implementation: with it an algorithm does exactly what it did
before ranks existed (the same passes in the same order, the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asyncrl.algos.update import micro_batches
from asyncrl.core.buffer import group_from_state, group_state
from asyncrl.core.types import Group


@dataclass(frozen=True)
class MicroBatch:
    rows: slice
    """Row slice of the step's (or PPO minibatch's) batch."""
    real: bool = True
    """False: a stand-in that only keeps this rank's number of passes equal to the others'
    (its loss is multiplied by 0 and its metrics are not counted)."""


def rank_rows(num_rows: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous block of `num_rows` rows: near-equal blocks in rank order, the
    first `num_rows % world_size` ranks one row longer."""
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def rank_micro_batches(
    num_rows: int, micro_batch_size: int, rank: int, world_size: int
) -> list[MicroBatch]:
    """This rank's micro-batches of a batch of `num_rows` rows: its block (`rank_rows`) in
    slices of at most `micro_batch_size` rows (0: the whole block), then stand-ins up to the
    longest block's count. With one rank: exactly `micro_batches(num_rows, micro_batch_size)`."""
    if world_size == 1:
        return [MicroBatch(s) for s in micro_batches(num_rows, micro_batch_size)]
    block = rank_rows(num_rows, rank, world_size)
    longest = -(-num_rows // world_size)
    size = micro_batch_size or longest
    count = max(1, -(-longest // size))
    own = [
        MicroBatch(slice(s.start + block.start, s.stop + block.start))
        for s in micro_batches(block.stop - block.start, size)
    ]
    first = block.start if block.stop > block.start else 0
    return own + [MicroBatch(slice(first, first + 1), real=False)] * (count - len(own))


def share_rows(num_rows: int, rank: int, world_size: int) -> slice:
    """The rows rank `rank` is sent of a batch of `num_rows`: its block (`rank_rows`), or row
    0 alone for a rank with none (its stand-in passes run on it)."""
    block = rank_rows(num_rows, rank, world_size)
    return block if block.stop > block.start else slice(0, 1)


def row_shares(
    rows: dict[str, Any], per_row: dict[str, torch.Tensor], common: dict[str, Any], world_size: int
) -> list[dict[str, Any]]:
    """What each rank needs of a step it trains rows of, rank by rank: its rows
    (`share_rows`) of the per-sample values (`rows`: a `select`ed batch; `per_row`: tensors
    with a row dimension), the values every rank needs whole (`common`: the normaliser, the
    step's coefficients), the batch's row count and where its rows start. With one rank the
    one share holds the batch itself (no copy)."""
    num_rows = len(rows["prompts"])
    if world_size == 1:
        return [{**rows, **per_row, **common, "num_rows": num_rows, "offset": 0}]
    shares = []
    for rank in range(world_size):
        own = share_rows(num_rows, rank, world_size)
        share = {key: value[own] for key, value in {**rows, **per_row}.items()}
        # a group's G rows share one prompt: each distinct prompt goes once
        prompts: list[Any] = []
        index: list[int] = []
        for row in share.pop("prompts"):
            if not prompts or row != prompts[-1]:
                prompts.append(row)
            index.append(len(prompts) - 1)
        shares.append(
            {
                **share,
                **common,
                "distinct_prompts": prompts,
                "prompt_index": index,
                "num_rows": num_rows,
                "offset": own.start,
            }
        )
    return shares


def received_share(share: dict[str, Any]) -> dict[str, Any]:
    """A share as `row_shares` made it, its rows' prompts one per row again."""
    if "prompts" in share:
        return share
    distinct = share.pop("distinct_prompts")
    return {**share, "prompts": [distinct[i] for i in share.pop("prompt_index")]}


def shared_groups(ranks: Ranks, groups: list[Group]) -> list[Group]:
    """The step's groups on every rank: rank 0's, broadcast (an algorithm whose every rank
    needs every row: PPO's minibatches are drawn from all of them)."""
    if ranks.world_size == 1:
        return groups
    states = ranks.broadcast([group_state(g) for g in groups] if ranks.rank == 0 else None)
    return groups if ranks.rank == 0 else [group_from_state(state) for state in states]


class Ranks(Protocol):
    """The data-parallel group one algorithm trains in."""

    rank: int
    world_size: int

    def shard(self, module: torch.nn.Module) -> None:
        """Shards `module`'s parameters over the ranks in place (FSDP2); call it before its
        optimizer is built. One rank: nothing."""
        ...

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (small picklable values between our own ranks:
        metrics, never a checkpoint)."""
        ...

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's `value` on every rank (ignored elsewhere). One rank: `value`."""
        ...

    def scatter(self, values: list[Any] | None = None) -> Any:
        """Rank 0's `values[r]` on rank r, and on no other (`values` is ignored elsewhere).
        One rank: `values[0]`."""
        ...

    def assemble(
        self, pieces: list[tuple[slice, torch.Tensor]], num_rows: int, like: torch.Tensor
    ) -> torch.Tensor:
        """The [num_rows, ...] tensor whose rows the ranks computed between them (`pieces`:
        this rank's row slices and their values, in row order; `like`: a tensor of the rows'
        shape and dtype). One rank: `torch.cat`."""
        ...

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s full (unsharded) state dict on rank 0, gathered a tensor at a time; every
        rank must call it (a collective); the others get an empty dict. One rank: the live
        `state_dict()`."""
        ...


class SingleProcess:
    """One rank: no sharding, no communication."""

    rank = 0
    world_size = 1

    def shard(self, module: torch.nn.Module) -> None:
        return None

    def sum(self, values: list[float]) -> list[float]:
        return values

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def broadcast(self, value: Any = None) -> Any:
        return value

    def scatter(self, values: list[Any] | None = None) -> Any:
        assert values is not None
        return values[0]

    def assemble(
        self, pieces: list[tuple[slice, torch.Tensor]], num_rows: int, like: torch.Tensor
    ) -> torch.Tensor:
        return torch.cat([t for _, t in pieces])

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return module.state_dict()


SINGLE: Ranks = SingleProcess()
