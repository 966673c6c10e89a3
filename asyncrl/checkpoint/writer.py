"""Background checkpoint writes: the trainer is blocked only while it takes the cut.

`submit` hands a staged cut (`asyncrl.checkpoint.staging.Cut`) to one writer thread, which
waits for the cut's background copy, streams the files into the store (hashing them as they
are written), checks the new checkpoint cheaply, applies retention, and releases the staging
buffers. At most one write is in progress; a second `submit` waits for the first
(back-pressure rather than an unbounded queue, and the staging buffers are reused). `wait`
blocks until the writer is idle and re-raises any error it met, so a failed save stops the run
instead of passing silently.

The post-save check (`verify(..., trust_known=True)` and the store's `check`) re-reads the
manifest, stats every file and reads state.json and the safetensors headers; it does not
re-read the tensor data this process has just hashed while writing it. The full re-hash
happens when a resume loads the checkpoint (`CheckpointStore.latest`, then `decode`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from asyncrl.checkpoint.staging import Cut
from asyncrl.checkpoint.store import FORMAT_VERSION, SHARDED_FORMAT_VERSION, CheckpointStore
from asyncrl.faults import fault_facts


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
        self.writing_step: int | None = None
        """The step of the write submitted last (in progress while `busy()`)."""
        self._error: BaseException | None = None

    def submit(self, step: int, cut: Cut, info: dict[str, Any]) -> None:
        """Starts writing `cut` as the checkpoint of `step` in the background."""
        try:
            self.wait()
        except BaseException:
            cut.release()
            raise
        self._thread = threading.Thread(
            target=self._write, args=(step, cut, info), name="asyncrl-ckpt", daemon=True
        )
        self.writing_step = step
        self._thread.start()

    def busy(self) -> bool:
        """Whether a write is still in progress (its error, if it failed, is raised by the
        next `wait` or `submit`)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Blocks until no write is in progress; raises the error of a failed write."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, step: int, cut: Cut, info: dict[str, Any]) -> None:
        with fault_facts(step=step, **cut.facts):
            self._write_facts_stated(step, cut, info)

    def _write_facts_stated(self, step: int, cut: Cut, info: dict[str, Any]) -> None:
        try:
            start = time.perf_counter()
            saved = self.store.save(
                step,
                cut.files(),
                self.config_hash,
                begun=cut.begun,
                written=cut.written,
                format_version=SHARDED_FORMAT_VERSION if cut.num_shards > 1 else FORMAT_VERSION,
            )
            cut.release()
            written_s = time.perf_counter() - start
            self.store.verify_saved(saved.path, step)
            deleted = self.store.retain(self.keep_last)
            job = cut.job
            self.on_saved(
                {
                    **info,
                    "step": step,
                    "seconds": time.perf_counter() - start,
                    "write_s": written_s,
                    "stage_s": job.stage_s if job else 0.0,
                    "hook_wait_s": job.hook_wait_s if job else 0.0,
                    "bytes": saved.num_bytes,
                    "path": str(saved.path),
                    "deleted": [str(p) for p in deleted],
                }
            )
        except BaseException as err:
            self._error = err
        finally:
            cut.release()
