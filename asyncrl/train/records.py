"""What a run writes as it goes: JSON-lines files and optional TensorBoard scalars.

Each line is flushed when written, so a killed run leaves every completed record on disk.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Protocol


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLog:
    """Appends one JSON object per line; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return  # a straggling writer after the run ended (e.g. an abandoned batch)
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class EventLog(JsonlLog):
    """`events.jsonl`: each event is `{"event": NAME, "time": unix_s, ...fields}`."""

    def emit(self, event: str, **fields: Any) -> None:
        self.write({"event": event, "time": time.time(), **fields})


class TensorBoardSink:
    """Every numeric field of a step record as a scalar, tagged by name, x = step."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._writer.add_scalar(key, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Reads a JSON-lines file; a torn last line (from a kill mid-write) is ignored."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def latest_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The record that counts for each step: the last one written (a step retrained after a
    resume appears again with a higher attempt), ordered by step."""
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]
