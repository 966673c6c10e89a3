"""Opening a run dir: a fresh run, or a resume from its newest verified checkpoint.

`run.json` holds the run id that every checkpoint manifest must carry; `attempt` counts the
launches so far (the `start` events in events.jsonl).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from asyncrl.checkpoint.restore import ShapeMismatch
from asyncrl.checkpoint.run_checkpoints import run_store
from asyncrl.checkpoint.snapshot import read_parts
from asyncrl.checkpoint.store import (
    CheckpointStore,
    UnsupportedCheckpointFormat,
    Verified,
)
from asyncrl.config import Config, ModelConfig
from asyncrl.config.keys import dump_config, resume_rule, semantic_differences
from asyncrl.core.stream import DataChanged, PromptStream
from asyncrl.train.records import iter_jsonl

SCRATCH_DIR = ".scratch"
"""Files a launch writes for itself only (vLLM's copy of the model, the ranks' rendezvous):
under the run dir, emptied under its lock at the next launch, so a SIGKILL leaks nothing."""


class RunDirError(RuntimeError):
    """The run dir cannot be used as asked; the message says what to do."""


@dataclass
class RunDir:
    path: Path
    run_id: str
    attempt: int
    latest: Verified | None = None
    """The newest verified checkpoint; `Trainer.resume` decodes it (once)."""
    rejected: list[str] = field(default_factory=list)
    lock: IO[str] | None = None
    forced_changes: list[str] = field(default_factory=list)
    notes: dict[str, list[Any]] = field(default_factory=dict)
    """Changes a resume allowed without `--force-config`, for its event's `config_changes`."""
    force_config: bool = False

    @functools.cached_property
    def store(self) -> CheckpointStore:
        """The run's checkpoints; "verified" includes `check_coherent`, so what a resume would
        skip is never counted as the newest by retention nor kept in the way of a save. One
        store per run dir: it remembers which checkpoints it has already judged."""
        return run_store(self.path, self.run_id)


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


def _write_atomically(path: Path, text: str) -> None:
    """`path` holds the old text or the new, never a torn one: a temp file fsynced, renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.rename(tmp, path)


RECORDS_VERSION = 2
"""`run.json`'s `records`: how this version keeps the run's JSON-lines records. 2: every
writer cuts a torn last line before it appends (`JsonlLog`), so only a file's last line can be
torn and `audit` counts a torn line anywhere else as damage. Absent: a run dir created by an
older version, whose relaunches may have left torn lines mid-file (tolerated there)."""


def _write_run_json(
    path: Path, run_id: str, launches: int = 0, records: int | None = RECORDS_VERSION
) -> None:
    record: dict[str, Any] = {"run_id": run_id, "launches": launches}
    if records is not None:
        record["records"] = records
    _write_atomically(path / "run.json", json.dumps(record) + "\n")


def read_run_id(path: Path) -> str:
    """The run's id from `PATH/run.json` ("" where there is none or it is unreadable: a folder
    of a test, or of an older version)."""
    try:
        return str(json.loads((path / "run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def records_version(path: Path) -> int | None:
    """`run.json`'s `records` (see `RECORDS_VERSION`); None for a run dir of an older version
    or without a readable run.json."""
    try:
        value = json.loads((path / "run.json").read_text()).get("records")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def _launches(path: Path) -> int:
    """Launches that started training so far (the next one's `attempt`): `run.json` keeps the
    count, so a launch reads no record file; a run dir from before counts its `start` events."""
    launches = json.loads((path / "run.json").read_text()).get("launches")
    if launches is not None:
        return int(launches)
    return sum(1 for e in iter_jsonl(path / "events.jsonl") if e.get("event") == "start")


def record_launch(run: RunDir) -> None:
    """Counts this launch in `run.json`, just before its `start` event (keeping its `records`:
    a run dir an older version created stays one)."""
    _write_run_json(run.path, run.run_id, run.attempt + 1, records_version(run.path))


def open_run_dir(
    path: Path, config: Config, restart: bool = False, force_config: bool = False
) -> RunDir:
    """Creates a run dir, or reopens one for a resume. Refuses a resume whose semantics-bearing
    config keys differ from the checkpoint's, naming each `key: checkpoint=X, now=Y` (unless
    `force_config`), and a run dir with history but no verified checkpoint (unless
    `restart`)."""
    try:
        run_id, lock = _claim(path)
    except OSError as err:
        raise _os_error(path, "cannot create the run dir or write in it", err) from None
    try:
        run = RunDir(path, run_id, _launches(path), lock=lock, force_config=force_config)
        _find_checkpoint(run, config, restart, force_config)
        _write_atomically(path / "config.yaml", dump_config(config))  # the last launch's
    except OSError as err:
        lock.close()
        raise _os_error(path, "cannot read or write the run dir", err) from None
    except BaseException:
        lock.close()
        raise
    return run


def _os_error(path: Path, what: str, err: OSError) -> RunDirError:
    """One line: the run dir, what failed, the OS's reason and the file it names."""
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
    return RunDirError(
        f"{path}: {what}: [Errno {err.errno}] {err.strerror}{where}; fix that or choose another "
        "--run-dir"
    )


def _claim(path: Path) -> tuple[str, IO[str]]:
    """Creates the run dir if needed, locks it and makes sure it has a run.json; returns the
    run id and the lock. Raises `OSError` where the file system refuses."""
    run_json = path / "run.json"
    if run_json.is_file():
        try:
            run_id = json.loads(run_json.read_text())["run_id"]
        except (ValueError, KeyError, TypeError) as err:
            raise RunDirError(
                f"{run_json}: unreadable ({err!r}); it names the run its checkpoints belong to: "
                "restore it, or choose a new --run-dir"
            ) from None
    elif (path / "metrics.jsonl").exists() or (path / "events.jsonl").exists():
        raise RunDirError(f"{path} holds files of a run but no run.json: choose a new --run-dir")
    else:
        path.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
    lock = _lock(path)
    try:
        if not run_json.is_file():
            _write_run_json(path, run_id)
        CheckpointStore(path / "checkpoints", run_id).clean_temp()  # ours, and we hold the lock
        shutil.rmtree(path / SCRATCH_DIR, ignore_errors=True)  # an earlier launch's, killed
    except BaseException:
        lock.close()
        raise
    return run_id, lock


def _find_checkpoint(run: RunDir, config: Config, restart: bool, force_config: bool) -> None:
    path = run.path
    try:
        run.latest, run.rejected = run.store.latest()
    except UnsupportedCheckpointFormat as err:  # never fall back past newer work
        raise RunDirError(str(err)) from None
    if run.latest is not None:  # the config comparison needs state.json only
        differences = semantic_differences(read_parts(run.latest)[1], config)
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


def refuse_other_data(
    run: RunDir, stream: PromptStream, trainer: dict[str, Any], config: Config
) -> None:
    """I8: a checkpoint's ordinals index the rows it was cut on; a resume on other rows (their
    count or content changed) is refused naming the data key, before any tensor is read, unless
    `--force-config` (then the change is recorded with the other forced ones). Other evaluation
    prompts (`trainer["eval_data"]`, this launch's trainer state) are refused the same way in
    deterministic mode, where the eval figures are part of the run; otherwise they are noted
    in the resume event's `config_changes` as `eval data`."""
    assert run.latest is not None
    parts = read_parts(run.latest)[0]
    try:
        stream.check_same_data(parts["stream"])
    except DataChanged as err:
        key = (
            f"data.path={config.data.path}" if config.data.path else f"data.task={config.data.task}"
        )
        _other_data(run, "data", key, str(err), "the same ordinals then index other prompts")
        stream.allow_other_data()
    saved, now = parts["trainer"].get("eval_data"), trainer.get("eval_data")
    if saved and now and saved != now:
        change = (
            f"the checkpoint was cut evaluating {saved['num_rows']} examples (sha256 "
            f"{saved['data_sha256'][:16]}), the evaluation data now has {now['num_rows']} "
            f"(sha256 {now['data_sha256'][:16]})"
        )
        if config.run.deterministic:
            key = f"eval.path={config.eval.path}" if config.eval.path else "eval.*"
            _other_data(run, "eval data", key, change, "its eval figures then change mid-run")
        else:
            run.notes["eval data"] = [saved, now]
            print(f"asyncrl: note: the evaluation prompts changed: {change}")


def _other_data(run: RunDir, what: str, key: str, change: str, consequence: str) -> None:
    """Refuses the resume on changed `what`, or with `--force-config` records and allows it."""
    assert run.latest is not None
    if run.force_config:
        run.forced_changes.append(f"{what}: {change}")
        print(f"asyncrl: resuming on other {what} ({key}), as --force-config asks: {change}")
        return
    raise RunDirError(
        f"{run.path}: cannot resume step {run.latest.step} on other {what} ({key}): {change}. "
        f"Restore the {what} the run was started on, pass --force-config to train the "
        f"remaining steps on the new rows ({consequence}), or start a new --run-dir."
    ) from None


def other_shapes(run: RunDir, err: ShapeMismatch, model: ModelConfig) -> RunDirError:
    """I6: a checkpoint whose model has other shapes than the one this launch built (another
    `model.*` config, or with the `tiny` preset a vocabulary of other characters) is refused
    with its tensors' shapes, not a traceback from `load_state_dict`."""
    why = (
        "the tiny preset's vocabulary is the data's characters, so the data has characters "
        "the checkpoint's run did not have (or lacks some it had)"
        if not model.path and err.part == "model"
        else f"this launch built its {err.part} from another config"
    )
    return RunDirError(
        f"{run.path}: cannot resume: {err}: {why}. Resume with the model and data the run was "
        "started on, or start a new --run-dir."
    )
