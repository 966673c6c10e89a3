"""A plain `openai` loop agent from outside the package, for the crash tests: three calls,
each answer run through a journaled tool (`ctx.tool`) that records every execution in its
own journal (`AGENT_TOOL_JOURNAL`), and a history it rewrites before its last call (so the
sample has a second segment)."""

from __future__ import annotations

import os


def record_execution(idempotency_key: str) -> None:
    """A tool's own journal (`AGENT_TOOL_JOURNAL`): one line per execution, keyed as the run
    keys the call."""
    journal = os.environ.get("AGENT_TOOL_JOURNAL")
    if journal:
        with open(journal, "a") as f:
            f.write(idempotency_key + "\n")
            f.flush()
            os.fsync(f.fileno())


def count_letters(text: str, idempotency_key: str = "") -> int:
    """The tool: every execution journaled."""
    record_execution(idempotency_key)
    return sum(c.isalpha() for c in text)


async def run(client, example, ctx):
    messages = (
        [dict(m) for m in example.messages]
        if example.messages
        else [{"role": "user", "content": example.prompt}]
    )
    total = 0
    for turn in range(3):
        if turn == 2:  # rewrite the history: keep the question and the last exchange only
            messages = [messages[0], *messages[-2:]]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        letters = await ctx.tool("count_letters", count_letters, text)
        total += letters
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"{letters} letters. Again."},
        ]
    return float(total % 3 == 0)
