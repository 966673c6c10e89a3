"""Agents that misbehave, for tests/test_agent_runs.py: one that raises, one that never calls
the model, one that calls until a limit ends it, one whose second call changes when
`ODD_AGENT_DIVERGE` is set (not deterministic given its seed and answers)."""

from __future__ import annotations

import os


async def raises(client, example, ctx):
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}]
    )
    raise ValueError(f"broken agent (sample {ctx.sample})")


async def silent(client, example, ctx):
    return 1.0


async def greedy(client, example, ctx):
    messages = [{"role": "user", "content": example.prompt}]
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "more"},
        ]


async def wavering(client, example, ctx):
    messages = [{"role": "user", "content": example.prompt}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    second = "changed my mind" if os.environ.get("ODD_AGENT_DIVERGE") else "go on"
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": second},
    ]
    await client.chat.completions.create(model="policy", messages=messages)
    return 0.5


async def named_parts(client, example, ctx):
    """Returns its reward in named parts (`reward/NAME`), the `reward` entry the one trained;
    with `parts` not numbers for sample 1 when ODD_AGENT_BAD_PARTS is set."""
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": example.prompt}]
    )
    if os.environ.get("ODD_AGENT_BAD_PARTS") and ctx.sample == 1:
        return {"reward": 1.0, "correct": "yes"}
    return {"reward": 0.5 + ctx.sample, "correct": float(ctx.sample), "format": 1.0}
