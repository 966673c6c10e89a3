"""Opening a run dir: a fresh run, or a resume from its newest verified checkpoint.

`run.json` holds the run id that every checkpoint manifest must carry; `attempt` counts the
launches so far (the `start` events in events.jsonl).
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from asyncrl.checkpoint.snapshot import FILES, Snapshot, check_cut, decode
from asyncrl.checkpoint.store import CheckpointStore, Verified
from asyncrl.config import Config, dump_config, resume_rule, semantic_differences
from asyncrl.train.records import read_jsonl


class RunDirError(RuntimeError):
    """The run dir cannot be used as asked; the message says what to do."""


@dataclass
class RunDir:
    path: Path
    run_id: str
    attempt: int
    latest: Verified | None = None
    snapshot: Snapshot | None = None
    rejected: list[str] = field(default_factory=list)
    lock: IO[str] | None = None
    forced_changes: list[str] = field(default_factory=list)

    @property
    def store(self) -> CheckpointStore:
        return CheckpointStore(self.path / "checkpoints", self.run_id, FILES)


def _lock(path: Path) -> IO[str]:
    """Holds an exclusive lock on the run dir for this process's lifetime (the kernel drops it
    when the process dies, SIGKILL included)."""
    handle = (path / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirError(
            f"{path} is in use by another asyncrl process (pid {holder}); wait for it to stop "
            "or choose another --run-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _write_run_json(path: Path, run_id: str) -> None:
    tmp = path / ".run.json.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.rename(tmp, path / "run.json")


def open_run_dir(
    path: Path, config: Config, restart: bool = False, force_config: bool = False
) -> RunDir:
    """Creates a run dir, or reopens one for a resume. Refuses a resume whose semantics-bearing
    config keys differ from the checkpoint's, naming each `key: checkpoint=X, now=Y` (unless
    `force_config`), and a run dir with history but no verified checkpoint (unless
    `restart`)."""
    run_json = path / "run.json"
    if run_json.is_file():
        run_id = json.loads(run_json.read_text())["run_id"]
    elif (path / "metrics.jsonl").exists() or (path / "events.jsonl").exists():
        raise RunDirError(f"{path} holds files of a run but no run.json: choose a new --run-dir")
    else:
        path.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
    lock = _lock(path)
    if not run_json.is_file():
        _write_run_json(path, run_id)
    CheckpointStore(path / "checkpoints", run_id).clean_temp()  # ours, and we hold the lock
    starts = [e for e in read_jsonl(path / "events.jsonl") if e.get("event") == "start"]
    run = RunDir(path=path, run_id=run_id, attempt=len(starts), lock=lock)
    try:
        _find_checkpoint(run, config, restart, force_config)
    except BaseException:
        lock.close()
        raise
    (path / "config.yaml").write_text(dump_config(config))
    return run


def _find_checkpoint(run: RunDir, config: Config, restart: bool, force_config: bool) -> None:
    path = run.path

    def load(verified: Verified) -> None:
        snapshot = decode(verified)
        saved = snapshot.config["rollout"]  # judged by its own config, not the new one
        n = int(saved["num_prompts_per_step"])
        check_cut(snapshot.parts, n, (int(saved["max_trajectory_age_steps"]) + 1) * n)
        run.snapshot = snapshot

    run.latest, run.rejected = run.store.latest(check=load)
    if run.latest is not None and run.snapshot is not None:
        differences = semantic_differences(run.snapshot.config, config)
        hard = [d for d in differences if resume_rule(d.split(":")[0]) == "never"]
        if differences and (hard or not force_config):
            hint = (
                f"{', '.join(d.split(':')[0] for d in hard)} can never change in a run: "
                "start a new --run-dir."
                if hard
                else "Use the checkpoint's values, pass --force-config to resume anyway (the "
                "changes are recorded in the resume event), or start a new --run-dir."
            )
            raise RunDirError(
                f"{path}: cannot resume step {run.latest.step} with a different config:\n  "
                + "\n  ".join(differences)
                + f"\n{hint}"
            )
        run.forced_changes = differences
    elif run.attempt > 0 or run.rejected:
        rejected = "".join(f"\n  rejected: {reason}" for reason in run.rejected)
        if not restart:
            raise RunDirError(
                f"{path} holds a run (attempt {run.attempt}) but no verified checkpoint to "
                f"resume from.{rejected}\nPass --restart to train again from step 0 (earlier "
                "records stay, with lower attempt numbers), or choose a new --run-dir."
            )
