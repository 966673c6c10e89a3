"""What each trainer rank > 0 receives per training step, before and now: the bytes of the
messages `asyncrl.distributed.wire` sends (its codec's JSON header plus tensor bytes: what goes
over the collectives, less a few 8-byte sizes).

- before: the step command carried the step's whole batch to every rank (every group, as
  `group_state`), although each rank trains only its block of rows;
- GRPO / RLOO now: rank 0 sends each rank its share (`asyncrl.algos.parallel.row_shares`: its
  rows' completion ids, mask and behaviour log-probs, their advantages, each distinct prompt
  once) point to point, and nothing else;
- PPO: still the whole batch to every rank (`shared_groups`): its minibatches are drawn from
  all rows, so every rank needs every row.

The groups are synthetic, of the shape given (every completion `--tokens` long, prompts of
`--prompt-tokens`); the shares are built by the code a run uses.

    .venv/bin/python benchmarks/rank_messages.py [--prompts 512 --generations 16 --tokens 4096]

The last line: `rank_messages: before_mb=B grpo_mb=G ratio=R` for the largest rank count.
"""

from __future__ import annotations

import argparse

import torch

from asyncrl.algos.parallel import row_shares
from asyncrl.algos.update import select, stack_groups
from asyncrl.core.advantages import scaled_group_advantages
from asyncrl.core.buffer import group_state
from asyncrl.core.losses import loss_weights
from asyncrl.core.types import Group, PromptTicket
from asyncrl.distributed.wire import pack

MB = 1e6


def groups(n: int, g: int, tokens: int, prompt_tokens: int) -> list[Group]:
    out = []
    for k in range(n):
        ticket = PromptTicket(ordinal=k, target_step=0, epoch=0, position=k, dataset_index=k)
        out.append(
            Group(
                ticket=ticket,
                prompt_ids=[(k * 7 + i) % 49152 for i in range(prompt_tokens)],
                completion_ids=torch.randint(0, 49152, (g, tokens)),
                completion_mask=torch.ones(g, tokens, dtype=torch.bool),
                behaviour_logprobs=torch.randn(g, tokens),
                rewards=torch.rand(g),
                version_min=0,
                version_max=0,
                token_versions=torch.zeros(g, tokens, dtype=torch.int64),
            )
        )
    return out


def message_bytes(value: object) -> int:
    header, tensors = pack(value)
    return len(header) + sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--generations", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    step = groups(args.prompts, args.generations, args.tokens, args.prompt_tokens)
    print(
        f"{args.prompts} prompts x {args.generations} samples x {args.tokens} tokens "
        f"(prompts of {args.prompt_tokens}); bytes each rank > 0 receives per step",
        flush=True,
    )
    before = message_bytes({"kind": "step", "step": 0, "groups": [group_state(x) for x in step]})
    batch = stack_groups(step, 0)
    advantages = scaled_group_advantages(batch["rewards"], "group").reshape(-1, 1)
    weights, normaliser = loss_weights(batch["completion_mask"], "token_mean", args.tokens)
    assert weights is batch["completion_mask"]  # token_mean: the mask, not sent twice
    print(f"{'ranks':>5}  {'before MB':>10}  {'GRPO now MB':>12}  {'ratio':>6}  {'PPO MB':>8}")
    line = ""
    for world_size in args.ranks:
        shares = row_shares(
            select(batch, slice(None)),
            {"advantages": advantages},
            {"normaliser": normaliser, "entropy_coef": 0.0},
            world_size,
        )
        grpo = max(message_bytes(share) for share in shares[1:])
        print(
            f"{world_size:>5}  {before / MB:>10.1f}  {grpo / MB:>12.1f}  {grpo / before:>6.3f}  "
            f"{before / MB:>8.1f}",
            flush=True,
        )
        line = (
            f"rank_messages: before_mb={before / MB:.1f} grpo_mb={grpo / MB:.1f} "
            f"ratio={grpo / before:.3f}"
        )
    print(line)


if __name__ == "__main__":
    main()
