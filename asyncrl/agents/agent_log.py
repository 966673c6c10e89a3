"""The agent log (`RUN_DIR/agent_calls.jsonl`): the write-ahead log of agent runs (DESIGN.md
I11). Per model call served live, a `begun` record before its engine pass and a `completion`
record (the request's hash, the tokens, log-probs, weights version) made durable before the
agent receives it (one fsync a pass: a group commit). Per tool called through `ctx.tool`, a
`tool_begun` record before it runs and a `tool` record (its result) after, each durable.

A resume reads the log from its checkpoint's offset (`mark`) for the ordinals it will open
again; their runs start over with the same seeds, and each call the log holds is answered from
it. Keys: `ORDINAL:SAMPLE:TRY:CALL` for model calls, `ORDINAL:SAMPLE:TRY:tN` for tools. A later
record of a key stands for it (a run that diverged from the log wrote it again, marked). No
torch, no agents: plain records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from asyncrl.checkpoint.torn import end_torn_line

AGENT_LOG = "agent_calls.jsonl"


def call_key(ordinal: int, sample: int, attempt: int, call: int) -> str:
    return f"{ordinal}:{sample}:{attempt}:{call}"


def tool_key(ordinal: int, sample: int, attempt: int, call: int) -> str:
    return f"{ordinal}:{sample}:{attempt}:t{call}"


def ordinal_of(key: str) -> int:
    return int(key.split(":", 1)[0])


class AgentLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        """`RUN_DIR/agent_calls.jsonl` (None: nothing written, the index alone)."""
        self.attempt = 0  # the launch (the trainer sets its own), on every record
        self._file: IO[str] | None = None
        self._unsynced = False
        self.num_syncs = 0
        self._size = 0
        self._first: dict[int, int] = {}
        """Per ordinal not yet landed, where its first record of this launch (or of the loaded
        log) starts: a checkpoint cut needs the log from the smallest on."""
        self.completions: dict[str, dict[str, Any]] = {}  # key -> its last completion record
        self.begun: set[str] = set()  # call keys begun in the loaded log
        self.tools: dict[str, dict[str, Any]] = {}  # tool key -> its result record
        self.tools_begun: set[str] = set()

    # -- writing ---------------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> None:
        """Appends a record, flushed (a SIGKILL loses at most a torn line, which the next
        launch's first append ends); durable only after `sync`."""
        record = {**record, "attempt": self.attempt}
        ordinal = ordinal_of(str(record["key"]))
        self._index(record)
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            end_torn_line(self.path)
            self._file = open(self.path, "a")  # noqa: SIM115 - kept open: one write a record
            self._size = self._file.tell()
        self._first.setdefault(ordinal, self._size)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self._size = self._file.tell()
        self._unsynced = True

    def sync(self) -> None:
        """Makes every record appended so far durable (fsync)."""
        if self._file is None or not self._unsynced:
            return
        os.fsync(self._file.fileno())
        self._unsynced = False
        self.num_syncs += 1

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None

    def landed(self, ordinal: int) -> None:
        """The ordinal's group is in the buffer: a checkpoint from now on holds it."""
        self._first.pop(ordinal, None)

    def mark(self) -> int:
        """Where a resume from a cut taken now reads the log from: the first record of an
        ordinal not yet landed, else the log's end."""
        return min(self._first.values(), default=self._size)

    # -- reading ---------------------------------------------------------------------------

    def _index(self, record: dict[str, Any]) -> None:
        kind, key = record.get("kind"), str(record.get("key"))
        if kind == "completion":
            self.completions[key] = record
        elif kind == "begun":
            self.begun.add(key)
        elif kind == "tool":
            self.tools[key] = record
        elif kind == "tool_begun":
            self.tools_begun.add(key)

    def load(self, offset: int, reopened: Callable[[int], bool]) -> None:
        """A resume's index: the log from byte `offset` (its checkpoint's `mark`), of the
        ordinals the run will open again. A torn last line is no record."""
        self.completions.clear()
        self.begun.clear()
        self.tools.clear()
        self.tools_begun.clear()
        self._first.clear()
        if self.path is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(min(offset, size))
            data = f.read()
        position = min(offset, size)
        for line in data.split(b"\n")[:-1]:
            start, position = position, position + len(line) + 1
            try:
                record = json.loads(line)
                ordinal = ordinal_of(str(record["key"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill, ended by a later launch's first append
            if reopened(ordinal):
                self._index(record)
                self._first.setdefault(ordinal, start)
        self._size = size

    def forget(self, ordinal: int) -> None:
        """Drops the index entries of a landed ordinal (memory stays bounded by what is in
        flight)."""
        prefix = f"{ordinal}:"
        for index in (self.completions, self.tools):
            for key in [k for k in index if k.startswith(prefix)]:
                del index[key]
        for keys in (self.begun, self.tools_begun):
            keys.difference_update({k for k in keys if k.startswith(prefix)})

    def pending(self) -> dict[str, int]:
        """What the loaded log says a resume will cost: calls it can answer (`replayable`),
        calls begun but never logged (`regenerated`), tools begun without a recorded result
        (`tools_repeated`)."""
        return {
            "replayable": len(self.completions),
            "regenerated": len(self.begun - set(self.completions)),
            "tools_repeated": len(self.tools_begun - set(self.tools)),
        }
