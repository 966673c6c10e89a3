"""The steps log of multi-turn runs (`RUN_DIR/env_steps.jsonl`) as a write-ahead log: each
environment step's request (the turn's tokens, log-probs, versions, text hash) is appended and
fsynced before the environment is asked (one fsync for a pass's requests), its result after;
a resume reads it from its checkpoint's offset and the episode runner recovers the turns past
the cut from it (docs/environments.md). The file and this launch's index of it; no
environment, no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.checkpoint.torn import end_torn_line
from asyncrl.core.episodes import parse_step_id


class StepsLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        """`RUN_DIR/env_steps.jsonl` (None: nothing written, the index alone)."""
        self.attempt = 0  # the trainer sets its own
        self._opened = False
        self._size = 0
        self._unsynced = False
        self.num_syncs = 0
        """fsyncs made (`sync`), for the tests and the cost: one or two a pass that stepped."""
        self.log_mark = 0
        """The log's size when the collector's state last held every step asked (`mark`):
        a checkpoint cut taken now saves it, and its resume reads the log from there."""
        self.requests: dict[str, dict[str, Any]] = {}  # step id -> its first request record
        self.results: dict[str, dict[str, Any]] = {}  # step id -> its result record
        self.restored: set[int] = set()  # ordinals the loaded log holds, not yet landed
        self._restored_offset = 0

    def append(self, record: dict[str, Any]) -> None:
        """Appends a record to the steps log, flushed (a SIGKILL loses at most a torn line,
        which the first append of the next launch cuts off, as `JsonlLog` does the records'),
        and to this launch's index of what it asked since the collector's last consistent
        point (`mark`). Durable against a host crash only after `sync`."""
        self._index(record)
        if self.path is None:
            return
        if not self._opened:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            end_torn_line(self.path)
            self._opened = True
        with open(self.path, "a") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._size = f.tell()
        self._unsynced = True

    def sync(self) -> None:
        """Makes every record appended so far durable (fsync): the episode runner calls it
        once for all the requests of a pass before it asks any environment (a group commit),
        so a step an environment acted on is in the log after a host crash too, and its
        journal is never ahead of the log (one id, one request, one text)."""
        if self.path is None or not self._unsynced:
            return
        with open(self.path, "rb") as f:
            os.fsync(f.fileno())
        self._unsynced = False
        self.num_syncs += 1

    def _index(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "request":
            self.requests.setdefault(str(record["step_id"]), record)
        elif kind == "result":
            self.results.setdefault(str(record["step_id"]), record)

    def mark(self) -> None:
        """The collector's state holds every step asked so far (its ledger and buffer were
        updated under its lock): a checkpoint cut from here on needs the steps log only from
        this point (`log_mark`), or from where a resume loaded it while an ordinal it holds
        has not been reopened; the rest of the index is no longer needed."""
        if self.restored:
            self.log_mark = self._restored_offset
            keep = self.restored
            for index in (self.requests, self.results):
                for sid in [k for k in index if parse_step_id(k)[0] not in keep]:
                    del index[sid]
            return
        self.log_mark = self._size
        self.requests.clear()
        self.results.clear()

    def load(self, offset: int, reopened: Callable[[int], bool]) -> None:
        """A resume's index of requests and results: the steps log from byte `offset` (its
        checkpoint's `log_mark`: the steps its cut may not hold), of the ordinals a run will
        open again (`reopened`: re-dispatched, or not yet handed out at the checkpoint). A
        torn last line (a kill mid-write) is no record."""
        self.requests.clear()
        self.results.clear()
        self.restored = set()
        if self.path is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(min(offset, size))
            data = f.read()
        pieces = data.split(b"\n")
        # the last piece: empty, or a torn line that this launch's first append cuts off
        self._size = size - len(pieces[-1])
        for line in pieces[:-1]:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a kill and ended by a later launch's first append
            if isinstance(record, dict) and reopened(parse_step_id(str(record["step_id"]))[0]):
                self._index(record)
        self.restored = {parse_step_id(k)[0] for k in self.requests}
        self._restored_offset = offset
        self.log_mark = offset if self.restored else self._size

    def restarts(self, ordinal: int, sample: int, at_least: int) -> int:
        """A restart count for an episode started over, at least `at_least`, past every one
        the loaded log asked steps under (its ids are new)."""
        logged = [
            r for o, s, _, r in map(parse_step_id, self.requests) if (o, s) == (ordinal, sample)
        ]
        return max([at_least, *(r + 1 for r in logged)])
