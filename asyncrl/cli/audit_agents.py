"""I11 from the agent log (`RUN_DIR/agent_calls.jsonl`, `asyncrl.agents.agent_log`):

- no completion the log held was generated again: a call key has one `completion` record, a
  later one only marked `diverged` (the agent asked something else than the log holds: its
  request's hash differs from the logged one's);
- a `diverged` record is one: the log held another request under its key;
- no tool whose result the log held was executed again (a `tool_begun` after its `tool`);
- each launch's `agent_replay` event (what its replay did) agrees with the log: its
  `agent_calls_diverged` are the `diverged` completions that launch wrote, its
  `tool_calls_repeated` the tools it began again whose earlier call has no result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.train.records import iter_jsonl

AGENT_LOG = "agent_calls.jsonl"


def audit_agent_log(
    run_dir: Path,
    violations: list[str],
    strict: bool = False,
    events: list[dict[str, Any]] | None = None,
) -> int | None:
    """Appends I11's violations; returns the calls the log holds (None: no agent log)."""
    path = run_dir / AGENT_LOG
    if not path.exists():
        return None
    problems: list[str] = []
    completions: dict[str, list[dict[str, Any]]] = {}
    results: set[str] = set()
    tools_again: list[str] = []
    begun: set[str] = set()  # tools begun in an earlier launch (or this one)
    diverged: dict[int, int] = {}  # attempt -> diverged completions it wrote
    repeated: dict[int, int] = {}  # attempt -> tools begun again with no earlier result
    for record in iter_jsonl(path, problems, strict):
        kind, key = record.get("kind"), str(record.get("key"))
        attempt = int(record.get("attempt", 0))
        if kind == "completion":
            completions.setdefault(key, []).append(record)
            if record.get("diverged"):
                diverged[attempt] = diverged.get(attempt, 0) + 1
        elif kind == "tool":
            results.add(key)
        elif kind == "tool_begun":
            if key in results:
                tools_again.append(key)
            elif key in begun:
                repeated[attempt] = repeated.get(attempt, 0) + 1
            begun.add(key)
    violations += [f"damaged record: {p}" for p in problems]
    again, fake = [], []
    for key, records in completions.items():
        for i, r in enumerate(records[1:], start=1):
            if not r.get("diverged"):
                again.append(key)
            elif all(p.get("hash") == r.get("hash") for p in records[:i]):
                fake.append(key)
    if again:
        violations.append(
            f"I11: completions the agent log held generated again: {', '.join(sorted(again)[:10])}"
        )
    if fake:
        violations.append(
            "I11: calls marked diverged whose request the log held unchanged: "
            + ", ".join(sorted(fake)[:10])
        )
    if tools_again:
        violations.append(
            "I11: tools executed again although the agent log held their result: "
            + ", ".join(sorted(set(tools_again))[:10])
        )
    for event in events or []:
        if event.get("event") != "agent_replay":
            continue
        attempt = int(event.get("attempt", 0))
        for field, logged in (
            ("agent_calls_diverged", diverged.get(attempt, 0)),
            ("tool_calls_repeated", repeated.get(attempt, 0)),
        ):
            if int(event.get(field, 0)) != logged:
                violations.append(
                    f"I11: attempt {attempt}'s agent_replay says {field}={event.get(field)}, "
                    f"the agent log {logged}"
                )
    return len(completions)
