"""Checkpoint files on disk, safely: regular files only (no symlink, no path outside the
checkpoint directory: I7), read or hashed in chunks through one open descriptor, and written
with their SHA-256 and size computed from the bytes as they go to disk, then fsynced. The
store (`asyncrl.checkpoint.store`) builds its atomic protocol on these."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

_HASH_CHUNK_BYTES = 16 << 20
MANIFEST = "manifest.json"

FileSource = bytes | Callable[[Any], None]
"""One file of a save: its bytes, or a callback that streams them with `write(data)` calls to
the file object it is given (the store hashes and counts what passes through)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or verified; the message names the file."""


def _check_name(path: Path, name: object) -> str:
    """`name` if it is a plain file name (no directory part, not `.`/`..`, no NUL), else a
    `CheckpointError`: a manifest must never make a reader open a file outside its directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise CheckpointError(
            f"{path / MANIFEST}: entry {name!r} is not a plain file name of the checkpoint "
            "directory; the checkpoint is unusable (move it out of checkpoints/)"
        )
    return name


def _open_regular(file: Path) -> tuple[int, os.stat_result]:
    """An open descriptor of `file` and its stat, refusing a symlink or anything but a regular
    file (opened with O_NOFOLLOW and checked on the open descriptor, so a swap after the check
    cannot redirect the read)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except OSError as err:
        if os.path.islink(file):
            raise CheckpointError(
                f"{file}: a symbolic link, not a file of the checkpoint; the checkpoint is "
                "unusable (move it out of checkpoints/)"
            ) from None
        raise CheckpointError(f"{file}: unreadable ([Errno {err.errno}] {err.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{file}: not a regular file; the checkpoint is unusable")
    return fd, st


def _read_regular(file: Path) -> bytes:
    """The bytes of `file` (a small one: the manifest, state.json), as `_open_regular` opens
    it."""
    fd, _ = _open_regular(file)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _hash_regular(file: Path) -> tuple[str, int, os.stat_result]:
    """SHA-256 and size of `file`, read in chunks (never the whole file in memory), and its
    stat, as `_open_regular` opens it."""
    fd, st = _open_regular(file)
    digest = hashlib.sha256()
    num_bytes = 0
    chunk = memoryview(bytearray(_HASH_CHUNK_BYTES))
    with os.fdopen(fd, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            digest.update(chunk[:n])
            num_bytes += n
    return digest.hexdigest(), num_bytes, st


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    """What must not change for a file this process hashed to stay trusted."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingFile:
    """A file object that hashes and counts what is written through it."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)  # both release the GIL for large chunks
        self.file.write(data)
        self.num_bytes += memoryview(data).nbytes


def _write_synced(path: Path, source: FileSource) -> dict[str, Any]:
    """Writes and fsyncs one file; returns its manifest entry (size and SHA-256 of the bytes
    written)."""
    with path.open("wb", buffering=0) as f:
        out = _HashingFile(f)
        if isinstance(source, bytes):
            out.write(source)
        else:
            source(out)
        os.fsync(f.fileno())
    return {"bytes": out.num_bytes, "sha256": out.sha256.hexdigest()}
