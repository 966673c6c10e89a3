"""Opening a run dir: a fresh run, or a resume from its newest verified checkpoint.

`run.json` holds the run id that every checkpoint manifest must carry; `attempt` counts the
launches so far (the `start` events in events.jsonl).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.checkpoint.snapshot import read_state
from asyncrl.checkpoint.store import CheckpointStore, Verified
from asyncrl.config import Config, dump_config, semantic_differences
from asyncrl.train.records import read_jsonl


class RunDirError(RuntimeError):
    """The run dir cannot be used as asked; the message says what to do."""


@dataclass
class RunDir:
    path: Path
    run_id: str
    attempt: int
    latest: Verified | None = None
    rejected: list[str] = field(default_factory=list)

    @property
    def store(self) -> CheckpointStore:
        return CheckpointStore(self.path / "checkpoints", self.run_id)


def _write_run_json(path: Path, run_id: str) -> None:
    tmp = path / ".run.json.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.rename(tmp, path / "run.json")


def open_run_dir(path: Path, config: Config) -> RunDir:
    """Creates a run dir, or reopens one for a resume. Refuses a resume whose semantics-bearing
    config keys differ from the checkpoint's, naming each `key: checkpoint=X, now=Y`."""
    run_json = path / "run.json"
    if run_json.is_file():
        run_id = json.loads(run_json.read_text())["run_id"]
    elif (path / "metrics.jsonl").exists() or (path / "events.jsonl").exists():
        raise RunDirError(f"{path} holds files of a run but no run.json: choose a new --run-dir")
    else:
        path.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
        _write_run_json(path, run_id)
    starts = [e for e in read_jsonl(path / "events.jsonl") if e.get("event") == "start"]
    run = RunDir(path=path, run_id=run_id, attempt=len(starts))
    run.latest, run.rejected = run.store.latest()
    if run.latest is not None:
        saved = read_state(run.latest)["config"]
        differences = semantic_differences(saved, config)
        if differences:
            raise RunDirError(
                f"{path}: cannot resume step {run.latest.step} with a different config:\n  "
                + "\n  ".join(differences)
                + "\nUse the checkpoint's values, or start a new --run-dir."
            )
    (path / "config.yaml").write_text(dump_config(config))
    return run
