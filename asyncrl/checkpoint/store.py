"""Atomic, verified checkpoint directories.

Write protocol (`save`): every file goes into `checkpoints/.tmp-step_NNNNNN-RUNID-PID` and
is fsynced; `manifest.json` (size and SHA-256 of every file, run id, step, config hash) is written
and fsynced last; the directory is fsynced, renamed to `checkpoints/step_NNNNNN`, and the parent
directory is fsynced. A kill at any instant leaves either no `step_NNNNNN` or a complete one.

Read protocol (`latest`): candidates newest first; a directory is loadable only if its manifest
parses, names this run and its step, and every listed file has the listed size and SHA-256.
The first verified one wins; every rejected one is reported with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.faults import fault_point

FORMAT = "asyncrl-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or verified; the message names the file."""


@dataclass(frozen=True)
class Verified:
    path: Path
    step: int
    manifest: dict[str, Any]

    def read_bytes(self, name: str) -> bytes:
        """A file's bytes, re-checked against the manifest (the disk may change after
        verification)."""
        data = (self.path / name).read_bytes()
        expected = self.manifest["files"][name]["sha256"]
        if hashlib.sha256(data).hexdigest() != expected:
            raise CheckpointError(f"{self.path / name}: changed after verification")
        return data


@dataclass(frozen=True)
class Saved:
    path: Path
    step: int
    num_bytes: int
    seconds: float


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointStore:
    def __init__(self, root: Path, run_id: str, required_files: tuple[str, ...] = ()) -> None:
        self.root = root
        self.run_id = run_id
        self.required_files = required_files

    def save(self, step: int, files: dict[str, bytes], config_hash: str) -> Saved:
        """Writes `files` as the checkpoint of `step` (see the module docstring)."""
        start = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        if final.exists():
            self._set_aside(final, step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{self.run_id}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)  # a torn write of ours: named with our run id
        tmp.mkdir()
        try:
            entries: dict[str, dict[str, Any]] = {}
            for name, data in files.items():
                _write_synced(tmp / name, data)
                entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                fault_point("checkpoint.file_written")
            manifest = {
                "format": FORMAT,
                "format_version": 2,
                "run_id": self.run_id,
                "step": step,
                "config_hash": config_hash,
                "created_unix_s": time.time(),
                "files": entries,
            }
            _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            fault_point("checkpoint.manifest_written")
            os.rename(tmp, final)
            fault_point("checkpoint.renamed")
            _fsync_dir(self.root)
            fault_point("checkpoint.parent_fsynced")
        except OSError as err:  # disk full, I/O error: nothing of this save stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"{err.filename or tmp}: writing the checkpoint of step {step} failed: "
                f"[Errno {err.errno}] {err.strerror}; removed {tmp}, the previous checkpoint is "
                "untouched"
            ) from err
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        num_bytes = sum(e["bytes"] for e in entries.values())
        return Saved(final, step, num_bytes, time.perf_counter() - start)

    def _set_aside(self, path: Path, step: int) -> None:
        """A `step_NNNNNN` that is in the way of a new save: a verified one is never replaced;
        an unverifiable one (torn, corrupt, foreign) is renamed out of the checkpoint namespace
        and kept for the user to look at."""
        try:
            self.verify(path, step)
        except CheckpointError as err:
            aside = path.with_name(f".rejected-{path.name}-{int(time.time())}")
            os.rename(path, aside)
            print(f"asyncrl: moved unverifiable checkpoint aside to {aside}: {err}")
            return
        raise CheckpointError(f"{path}: a verified checkpoint already exists; not overwriting it")

    def candidates(self) -> list[tuple[int, Path]]:
        """`step_NNNNNN` directories, newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def verify(self, path: Path, step: int) -> Verified:
        """Checks the manifest and every file; raises `CheckpointError` naming what is wrong."""
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{manifest_path}: missing (torn write)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{manifest_path}: not valid JSON ({err})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
        if manifest.get("run_id") != self.run_id:
            raise CheckpointError(
                f"{manifest_path}: belongs to run {manifest.get('run_id')!r}, not {self.run_id!r}"
            )
        if manifest.get("step") != step:
            raise CheckpointError(
                f"{manifest_path}: says step {manifest.get('step')}, directory says step {step}"
            )
        files = manifest.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(e, dict)
            and isinstance(e.get("bytes"), int)
            and isinstance(e.get("sha256"), str)
            for e in files.values()
        ):
            raise CheckpointError(f"{manifest_path}: malformed file list")
        missing = sorted(set(self.required_files) - set(files))
        if missing:
            raise CheckpointError(f"{manifest_path}: does not list {', '.join(missing)}")
        for name, entry in files.items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (step {step})")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(
                    f"{file}: size {size} bytes, manifest expects {entry['bytes']} (step {step})"
                )
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            if digest != entry["sha256"]:
                raise CheckpointError(
                    f"{file}: SHA-256 {digest}, manifest expects {entry['sha256']} (step {step})"
                )
        return Verified(path, step, manifest)

    def latest(
        self, check: Callable[[Verified], object] | None = None
    ) -> tuple[Verified | None, list[str]]:
        """The newest verified checkpoint (or None) and why each newer candidate was rejected.
        `check` may load the candidate further and raise `CheckpointError` to reject it too."""
        rejected: list[str] = []
        for step, path in self.candidates():
            try:
                verified = self.verify(path, step)
                if check is not None:
                    check(verified)
                return verified, rejected
            except CheckpointError as err:
                rejected.append(str(err))
        return None, rejected

    def retain(self, keep_last: int) -> list[Path]:
        """Deletes verified checkpoints of this run beyond the newest `keep_last`, and this
        run's abandoned temp dirs. Never the newest verified one; never a directory whose
        manifest names another run. Returns what it deleted."""
        deleted = []
        verified = []
        for step, path in self.candidates():
            try:
                verified.append(self.verify(path, step))
            except CheckpointError:
                continue  # not ours to judge: a torn or foreign directory stays
        for old in verified[max(keep_last, 1) :]:
            # renamed first, so a kill mid-delete leaves a temp dir of ours, not a torn step
            trash = old.path.with_name(f".tmp-trash-{old.path.name}-{self.run_id}")
            os.rename(old.path, trash)
            fault_point("checkpoint.retention_deleted")
            shutil.rmtree(trash)
            deleted.append(old.path)
        return deleted + self.clean_temp()

    def clean_temp(self) -> list[Path]:
        """Removes this run's temp dirs: torn writes and interrupted deletes. Only safe while
        no save of this run is in progress (the run dir lock guarantees it)."""
        if not self.root.is_dir():
            return []
        removed = sorted(self.root.glob(f".tmp-*-{self.run_id}*"))
        for tmp in removed:
            shutil.rmtree(tmp, ignore_errors=True)
        return removed
