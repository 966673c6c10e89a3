"""One trainer rank of tests/test_wire.py: rank 0 broadcasts a step command (groups as
tensors) and every rank all-gathers its stats, through `asyncrl.distributed.wire` (or, with
`objects`, through torch's pickle-based `*_object` collectives: the negative control). Any
unpickling on this rank raises, so a transport that pickles fails here.

    python tests/wire_peer.py OUT_DIR wire|objects

RANK, WORLD_SIZE and ASYNCRL_RENDEZVOUS (a file) describe the group.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from asyncrl.core.buffer import group_from_state, group_state
from asyncrl.core.types import Group, PromptTicket
from asyncrl.distributed import wire
from asyncrl.distributed.ranks import init_ranks


class NoUnpickling:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("a peer's message was unpickled")


def command() -> dict:
    g = torch.Generator().manual_seed(0)
    groups = []
    for k in range(3):
        ticket = PromptTicket(ordinal=k, target_step=1, epoch=0, position=k, dataset_index=7 * k)
        groups.append(
            Group(
                ticket=ticket,
                prompt_ids=[1, 2, 3 + k],
                completion_ids=torch.randint(0, 50, (4, 5), generator=g),
                completion_mask=torch.rand(4, 5, generator=g) > 0.3,
                behaviour_logprobs=torch.randn(4, 5, generator=g),
                rewards=torch.rand(4, generator=g),
                version_min=0,
                version_max=1,
                generation_s=0.25,
                token_versions=torch.ones(4, 5, dtype=torch.int64),
                reward_components={"correct": torch.rand(4, generator=g).to(torch.bfloat16)},
            )
        )
    return {"kind": "step", "step": 1, "groups": [group_state(x) for x in groups]}


def digest(cmd: dict) -> dict:
    """What a rank received, as JSON: every field, tensors as lists with their dtype."""
    groups = [group_from_state(s) for s in cmd["groups"]]
    return {
        "kind": cmd["kind"],
        "step": cmd["step"],
        "groups": [
            {
                "ticket": vars(x.ticket),
                "prompt_ids": x.prompt_ids,
                **{
                    name: [str(t.dtype), t.float().tolist()]
                    for name, t in (
                        ("completion_ids", x.completion_ids),
                        ("completion_mask", x.completion_mask),
                        ("behaviour_logprobs", x.behaviour_logprobs),
                        ("rewards", x.rewards),
                        ("token_versions", x.token_versions),
                        ("correct", x.reward_components["correct"]),
                    )
                },
            }
            for x in groups
        ],
    }


def shares(world_size: int) -> list[dict]:
    """A different value for each rank (what a GRPO step scatters: rows of tensors, prompts,
    scalars)."""
    return [
        {
            "rows": torch.arange(4 * r, 4 * r + 4),
            "mask": torch.tensor([True, r == 1, False]),
            "weights": torch.full((2, 3), 0.5 + r, dtype=torch.bfloat16),
            "prompts": [[1, 2, r]],
            "normaliser": 12.0,
        }
        for r in range(world_size)
    ]


def share_digest(share: dict) -> dict:
    return {
        key: [str(v.dtype), v.float().tolist()] if isinstance(v, torch.Tensor) else v
        for key, v in share.items()
    }


def main() -> None:
    out, transport = Path(sys.argv[1]), sys.argv[2]
    ranks = init_ranks(torch.device("cpu"))
    c10d._unpickler = NoUnpickling  # what broadcast_object_list / all_gather_object call
    stats = [({"loss": 0.5 + ranks.rank, "nan": math.nan}, 3.0 * ranks.rank)]
    if transport == "wire":
        received = ranks.broadcast(command() if ranks.rank == 0 else None)
        gathered = ranks.gather(stats)
    else:
        box = [command() if ranks.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        received, gathered = box[0], [None] * ranks.world_size
        dist.all_gather_object(gathered, stats)
    assert all(isinstance(part, tuple) for parts in gathered for part in parts)  # types kept
    result = {"received": digest(received), "gathered": repr(gathered)}
    if transport == "wire":  # each rank its own rows, point to point
        mine = ranks.scatter(shares(ranks.world_size) if ranks.rank == 0 else None)
        result["scattered"] = share_digest(mine)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(result))
    ranks.close()
    assert wire.DTYPES  # imported for its side: nothing


if __name__ == "__main__":
    main()
