"""Background checkpoint writes: the trainer is blocked only while it copies its state.

`submit` hands a snapshot (already a private copy) to one writer thread, which encodes it,
writes it atomically, verifies it and applies retention. At most one write is in progress; a
second `submit` waits for the first (back-pressure rather than an unbounded queue). `wait`
blocks until the writer is idle and re-raises any error it met, so a failed save stops the run
instead of passing silently.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from asyncrl.checkpoint.snapshot import Snapshot, encode
from asyncrl.checkpoint.store import CheckpointStore


class CheckpointWriter:
    def __init__(
        self,
        store: CheckpointStore,
        config_hash: str,
        keep_last: int,
        on_saved: Callable[[dict[str, Any]], None],
    ) -> None:
        self.store = store
        self.config_hash = config_hash
        self.keep_last = keep_last
        self.on_saved = on_saved
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, step: int, snapshot: Snapshot, info: dict[str, Any]) -> None:
        """Starts writing `snapshot` as the checkpoint of `step` in the background."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(step, snapshot, info), name="asyncrl-ckpt", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Blocks until no write is in progress; raises the error of a failed write."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, step: int, snapshot: Snapshot, info: dict[str, Any]) -> None:
        try:
            start = time.perf_counter()
            saved = self.store.save(step, encode(snapshot), self.config_hash)
            self.store.verify(saved.path, step)
            deleted = self.store.retain(self.keep_last)
            self.on_saved(
                {
                    **info,
                    "step": step,
                    "seconds": time.perf_counter() - start,
                    "bytes": saved.num_bytes,
                    "path": str(saved.path),
                    "deleted": [str(p) for p in deleted],
                }
            )
        except BaseException as err:
            self._error = err
