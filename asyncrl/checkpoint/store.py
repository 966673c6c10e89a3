"""Atomic, verified checkpoint directories.

Write protocol (`save`): every file goes into `checkpoints/.tmp-step_NNNNNN-RUNID-PID` and
is fsynced; `manifest.json` (format version, size and SHA-256 of every file, run id, step, config
hash) is written
and fsynced last; the directory is fsynced, renamed to `checkpoints/step_NNNNNN`, and the parent
directory is fsynced. A kill at any instant leaves either no `step_NNNNNN` or a complete one.
A file is given as bytes or as a writer callback that streams it; either way its SHA-256 and
size are computed from the bytes as they are written, never by reading the file back.

Read protocol (`latest`): candidates newest first; a directory is loadable only if its manifest
parses, is of a format version this asyncrl reads, names this run and its step, every entry is a
plain file name of a regular file directly inside the directory (no path, no symlink: I7) with
the listed size and SHA-256, and the store's `check` (a run dir's: state.json and the tensor
headers fit together) accepts it. The first such one wins; every rejected one is reported with
the reason. A checkpoint of an unknown format version stops the search instead
(`UnsupportedCheckpointFormat`): falling back to an older one would throw away newer work.
`latest` always re-reads and re-hashes every file of the checkpoint it returns, and the reader
(`Verified.open`) hashes again what it loads.

What is trusted without re-hashing: a checkpoint this store wrote, or fully verified, in this
process, as long as its manifest's bytes and each file's inode, size and mtime are unchanged
(`retain` and the writer's post-save check, `verify(..., rehash=False)`, rely on this). A file
changed behind that (same size and mtime, new bytes) is caught when a resume loads it, exactly
as a change after the last retention pass always was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from asyncrl.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    FileSource,
    _check_name,
    _fsync_dir,
    _hash_regular,
    _open_regular,
    _read_regular,
    _stat_key,
    _write_synced,
)
from asyncrl.checkpoint.kept import remove_stale
from asyncrl.faults import fault_point

FORMAT = "asyncrl-checkpoint"
"""The manifest's `format`; it never changes: a new layout bumps `format_version`."""
LEGACY_FORMAT = "asyncrl-checkpoint/1"
"""Manifests written before `format_version` existed: read as version 1."""
FORMAT_VERSION = 4
"""The version `save` writes for a one-process trainer: format 2 with the rollout parts'
tensors (ledger and buffer) in a file of their own (`asyncrl.checkpoint.snapshot`)."""
SHARDED_FORMAT_VERSION = 5
"""The version of a sharded trainer's checkpoints (`train.num_processes` > 1): format 4 plus
every other rank's files (`asyncrl.checkpoint.shards`); format 3 is format 2 plus those."""
ROLLOUT_FILE_VERSIONS = (4, 5)
"""The versions whose ledger and buffer tensors are in `rollout.safetensors`."""
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4, 5)
"""The versions this asyncrl reads (`Verified.format_version` says which one a checkpoint is)."""
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
T = TypeVar("T")


@dataclass(frozen=True)
class Verified:
    path: Path
    step: int
    manifest: dict[str, Any]
    format_version: int = FORMAT_VERSION
    """The checkpoint format version it was written in (one of SUPPORTED_FORMAT_VERSIONS)."""
    manifest_sha256: str = ""
    """The SHA-256 of the manifest file's bytes: with the files verified, it names their
    content."""

    def read_bytes(self, name: str) -> bytes:
        """A file's bytes, re-checked against the manifest (the disk may change after
        verification). Only names the manifest lists: never a path, never a symlink."""

        def whole(f: BinaryIO, num_bytes: int) -> tuple[bytes, str]:
            data = f.read()
            return data, hashlib.sha256(data).hexdigest()

        return self.read_with(name, whole)

    def read_with(self, name: str, parse: Callable[[BinaryIO, int], tuple[T, str]]) -> T:
        """What `parse(file, num_bytes)` makes of a file, re-checked against the manifest: it
        returns its result and the SHA-256 of the bytes it read, and a digest other than the
        manifest's is a `CheckpointError` ("changed after verification"). The file is opened
        once (never a path outside the directory, never a symlink), so the bytes hashed are
        the bytes parsed, whatever happens to the path meanwhile. Only names the manifest
        lists."""
        entry = self.manifest["files"].get(name) if isinstance(name, str) else None
        if entry is None:
            raise CheckpointError(
                f"{self.path / str(name)}: not a file the manifest lists; a checkpoint reads only "
                "its verified files"
            )
        fd, st = _open_regular(self.path / _check_name(self.path, name))
        with os.fdopen(fd, "rb", buffering=0) as f:
            if st.st_size != entry["bytes"]:
                raise CheckpointError(f"{self.path / name}: changed after verification (size)")
            value, digest = parse(f, st.st_size)
        if digest != entry["sha256"]:
            raise CheckpointError(f"{self.path / name}: changed after verification")
        return value


@dataclass(frozen=True)
class Saved:
    path: Path
    step: int
    num_bytes: int
    seconds: float


class UnsupportedCheckpointFormat(CheckpointError):
    """A checkpoint in a format version this asyncrl does not read. Not a damaged checkpoint:
    `latest` raises it instead of falling back to an older one, and nothing sets it aside."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


class CheckpointStore:
    """The checkpoints of one run under `root`.

    `check`, if given, is part of what "verified" means here: it is called on a checkpoint that
    passed `verify` and may raise `CheckpointError` to reject it (a run dir passes: the
    snapshot decodes and its parts fit together). `latest`, `retain` and `_set_aside` all
    apply it, so a checkpoint that loading would skip is never counted as the newest by
    retention, nor kept in the way of a new save of its step."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        required_files: tuple[str, ...] = (),
        check: Callable[[Verified], object] | None = None,
    ) -> None:
        self.root = root
        self.run_id = run_id
        self.required_files = required_files
        self.check = check
        self._judged: dict[tuple[Path, str], str | None] = {}
        """(path, manifest SHA-256) -> None if `check` accepted it, else why not."""
        self._trusted: dict[Path, tuple[str, dict[str, tuple[int, int, int, int]]]] = {}
        """path -> (manifest SHA-256, each file's `_stat_key`) of the checkpoints this store
        wrote or fully verified: `verify(trust_known=True)` does not re-hash those."""

    def begin(self, step: int) -> Path:
        """The empty temp directory the checkpoint of `step` is written into (see the module
        docstring): a sharded trainer's other ranks write their files there before `save`."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        if final.exists():
            self._set_aside(final, step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{self.run_id}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)  # a torn write of ours: named with our run id
        tmp.mkdir()
        return tmp

    def save(
        self,
        step: int,
        files: Mapping[str, FileSource],
        config_hash: str,
        begun: Path | None = None,
        written: Callable[[], Mapping[str, dict[str, Any]]] | None = None,
        format_version: int = FORMAT_VERSION,
    ) -> Saved:
        """Writes `files` as the checkpoint of `step` (see the module docstring). A callback
        source is called once, on this thread, while its file is open. `begun` is a temp dir of
        `begin` into which others write files too (a sharded trainer's other ranks); once
        `files` are written, `written()` waits for those and returns their entries (name ->
        size and SHA-256 as their writers hashed them while writing), which the manifest lists
        too."""
        start = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = begun if begun is not None else self.begin(step)
        try:
            entries: dict[str, dict[str, Any]] = {}
            for name, source in files.items():
                entries[name] = _write_synced(tmp / name, source)
                fault_point("checkpoint.file_written")
            if written is not None:
                entries.update(written())
            manifest = {
                "format": FORMAT,
                "format_version": format_version,
                "run_id": self.run_id,
                "step": step,
                "config_hash": config_hash,
                "created_unix_s": time.time(),
                "files": entries,
            }
            manifest_entry = _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
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
        self._trust(final, manifest_entry["sha256"], entries)
        num_bytes = sum(e["bytes"] for e in entries.values())
        return Saved(final, step, num_bytes, time.perf_counter() - start)

    def _trust(self, path: Path, manifest_sha256: str, files: Mapping[str, Any]) -> None:
        """Remembers a checkpoint whose every file this process has just hashed."""
        try:
            stats = {name: _stat_key(os.lstat(path / name)) for name in files}
        except OSError:
            return  # gone already: nothing to trust
        self._trusted[path] = (manifest_sha256, stats)

    def _is_trusted(self, path: Path, manifest_sha256: str) -> bool:
        """True if `path` is a checkpoint this store wrote or fully verified and neither its
        manifest bytes nor any file's inode, size or mtime changed since."""
        known = self._trusted.get(path)
        if known is None or known[0] != manifest_sha256:
            return False
        try:
            return all(_stat_key(os.lstat(path / name)) == key for name, key in known[1].items())
        except OSError:
            return False

    def _set_aside(self, path: Path, step: int) -> None:
        """A `step_NNNNNN` that is in the way of a new save: a verified one (`verify` and
        `check`) is never replaced; an unverifiable one (torn, corrupt, foreign, incoherent) is
        renamed out of the checkpoint namespace and kept for the user to look at. One of an
        unknown format version is neither: `UnsupportedCheckpointFormat` propagates."""
        try:
            self._judge(self.verify(path, step))
        except UnsupportedCheckpointFormat:
            raise
        except CheckpointError as err:
            aside = path.with_name(f".rejected-{path.name}-{int(time.time())}")
            os.rename(path, aside)
            self._trusted.pop(path, None)
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

    def verify(self, path: Path, step: int, trust_known: bool = False) -> Verified:
        """Checks the manifest and every file (not `check`); raises `CheckpointError` naming
        what is wrong, `UnsupportedCheckpointFormat` for a format version this asyncrl does not
        read. Every file is re-read and hashed, unless `trust_known` and the checkpoint is one
        this store wrote or fully verified and nothing about it changed since (the module
        docstring): then each file is only checked to be a regular file of the listed size."""
        manifest_path = path / MANIFEST
        if path.is_symlink():
            raise CheckpointError(
                f"{path}: a symbolic link, not a checkpoint directory; the checkpoint is unusable "
                "(move it out of checkpoints/)"
            )
        if not os.path.lexists(manifest_path):
            raise CheckpointError(f"{manifest_path}: missing (torn write)")
        raw = _read_regular(manifest_path)
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{manifest_path}: not valid JSON ({err})") from None
        version = self._format_version(manifest_path, manifest)
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
        for name in files:
            _check_name(path, name)  # every entry, before any file is opened
        manifest_sha256 = hashlib.sha256(raw).hexdigest()
        if not (trust_known and self._is_trusted(path, manifest_sha256)):
            # (trusted: the same manifest bytes as when this store hashed every file, and each
            # file still a regular file with that inode, size and mtime: `_is_trusted` stats)
            for name, entry in files.items():
                self._check_file(path / name, entry, step)
            self._trust(path, manifest_sha256, files)
        return Verified(path, step, manifest, version, manifest_sha256=manifest_sha256)

    @staticmethod
    def _check_file(file: Path, entry: dict[str, Any], step: int) -> None:
        try:
            digest, num_bytes, _ = _hash_regular(file)
        except CheckpointError as err:
            raise CheckpointError(f"{err} (step {step})") from None
        CheckpointStore._check_size(file, num_bytes, entry, step)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{file}: SHA-256 {digest}, manifest expects {entry['sha256']} (step {step})"
            )

    @staticmethod
    def _check_size(file: Path, num_bytes: int, entry: dict[str, Any], step: int) -> None:
        if num_bytes != entry["bytes"]:
            raise CheckpointError(
                f"{file}: size {num_bytes} bytes, manifest expects {entry['bytes']} (step {step})"
            )

    @staticmethod
    def _format_version(manifest_path: Path, manifest: object) -> int:
        """The manifest's format version: `format_version`, or 1 for a manifest written before
        that field existed. Raises `UnsupportedCheckpointFormat` for a well-formed version this
        asyncrl does not read."""
        if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, LEGACY_FORMAT):
            raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
        if "format_version" not in manifest and manifest["format"] == LEGACY_FORMAT:
            return 1
        version = manifest.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CheckpointError(f"{manifest_path}: format_version {version!r} is not an integer")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            readable = ", ".join(str(v) for v in SUPPORTED_FORMAT_VERSIONS)
            origin = (
                "was written by a newer asyncrl; upgrade asyncrl to resume it"
                if version > max(SUPPORTED_FORMAT_VERSIONS)
                else "is older than any this asyncrl reads; resume it with the asyncrl that "
                "wrote it"
            )
            raise UnsupportedCheckpointFormat(
                f"{manifest_path}: checkpoint format version {version} (this asyncrl reads "
                f"versions {readable}) {origin}"
            )
        return version

    def _judge(self, verified: Verified) -> None:
        """Applies `check` to a verified checkpoint, remembering the verdict per (path,
        manifest SHA-256): the manifest fixes every file's hash and `verify` has checked them
        (re-hashed, or trusted as unchanged since this store hashed them), so the same key means
        the same bytes and the same verdict."""
        if self.check is None:
            return
        key = (verified.path, verified.manifest_sha256)
        if key not in self._judged:
            try:
                self.check(verified)
                self._judged[key] = None
            except UnsupportedCheckpointFormat:
                raise
            except CheckpointError as err:
                self._judged[key] = str(err)
        reason = self._judged[key]
        if reason is not None:
            raise CheckpointError(reason)

    def verify_saved(self, path: Path, step: int) -> Verified:
        """The cheap check after `save`: `verify(trust_known=True)` (manifest re-read, files
        stat-ed, nothing re-hashed: this store hashed them as it wrote them) and `check`;
        raises `CheckpointError` if either fails."""
        verified = self.verify(path, step, trust_known=True)
        self._judge(verified)
        return verified

    def latest(self) -> tuple[Verified | None, list[str]]:
        """The newest verified checkpoint (or None) and why each newer candidate was rejected;
        "verified" includes the store's `check`. Raises `UnsupportedCheckpointFormat` when a
        candidate is in a format version this asyncrl does not read, rather than fall back
        past it."""
        rejected: list[str] = []
        for step, path in self.candidates():
            try:
                verified = self.verify(path, step)
                self._judge(verified)
                return verified, rejected
            except UnsupportedCheckpointFormat:
                raise
            except CheckpointError as err:
                rejected.append(str(err))
        return None, rejected

    def retain(self, keep_last: int) -> list[Path]:
        """Deletes verified checkpoints of this run beyond the newest `keep_last`, and this
        run's abandoned temp dirs. Never the newest verified one; never a directory whose
        manifest names another run, nor one `verify` or `check` rejects (an incoherent newer
        checkpoint does not count towards `keep_last`, so it cannot push out the one a resume
        would load). Returns what it deleted.

        Cost, on every save: each kept checkpoint's manifest is re-read and its files are
        stat-ed; only a checkpoint this store did not write or fully verify before (or whose
        manifest or files changed since) is re-read and hashed, once. `check` runs once per
        checkpoint in this store's lifetime (its verdict is remembered by manifest hash): with a
        run dir's check, state.json and the safetensors headers, never the tensor data."""
        deleted = []
        verified = []
        for step, path in self.candidates():
            try:
                candidate = self.verify(path, step, trust_known=True)
                self._judge(candidate)
            except CheckpointError:
                continue  # not ours to judge: a torn, foreign, incoherent or newer-format one
            verified.append(candidate)
        for old in verified[max(keep_last, 1) :]:
            # renamed first, so a kill mid-delete leaves a temp dir of ours, not a torn step
            trash = old.path.with_name(f".tmp-trash-{old.path.name}-{self.run_id}")
            os.rename(old.path, trash)
            fault_point("checkpoint.retention_deleted")
            shutil.rmtree(trash)
            deleted.append(old.path)
            self._trusted.pop(old.path, None)
            self._judged = {k: v for k, v in self._judged.items() if k[0] != old.path}
        if verified:  # rollouts kept beside an older checkpoint: the newest holds them
            deleted += remove_stale(self.root, verified[0].step)
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
