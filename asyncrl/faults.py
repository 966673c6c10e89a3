"""Fault injection for crash tests: the process SIGKILLs itself at a named point.

`ASYNCRL_FAULT=POINT` or `POINT:N` (kill on the N-th pass, default 1) is read once, at import.
Unset — the default — every `fault_point` call is a dictionary lookup and nothing else. The
points mark where durable or shared state changes; `POINTS` lists them all.
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "checkpoint.file_written",  # one checkpoint file written and fsynced (temp dir)
    "checkpoint.manifest_written",  # manifest written, before the rename
    "checkpoint.renamed",  # temp dir renamed to step_NNNNNN, before the parent fsync
    "checkpoint.parent_fsynced",  # the checkpoint is durable
    "checkpoint.retention_deleted",  # one old checkpoint deleted
    "train.optimizer_step",  # optimizer updated, weights not yet published
    "train.weights_published",  # new version handed to the engine
    "collector.group_buffered",  # one group moved from in flight to the buffer
    "collector.chunk_done",  # one chunk of a batch appended to its partial generations
    "engine.decode_step",  # the torch engine is about to sample one more token of a batch
)
WORKER_POINTS = (
    "worker.generate",  # a Ray generation worker actor received a batch (kills the actor)
)
"""Points in Ray worker processes. The pass count is per process, so a replaced worker
counts again from zero."""
RANK_POINTS = (
    "rank.step_done",  # a trainer rank > 0 finished its share of a step (train.num_processes)
    "checkpoint.rank_file_written",  # a trainer rank > 0 wrote one of its checkpoint files
)
"""Points in the trainer's other ranks (`train.num_processes` > 1; every such rank counts its
own passes): rank 0 sees the rank die (tests/test_data_parallel_runs.py)."""


def _parse(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    point, _, count = spec.partition(":")
    if point not in POINTS + WORKER_POINTS + RANK_POINTS:
        known = ", ".join(POINTS + WORKER_POINTS + RANK_POINTS)
        raise ValueError(f"ASYNCRL_FAULT: unknown point {point!r}; known: {known}")
    return point, int(count or 1)


_TARGET = _parse(os.environ.get("ASYNCRL_FAULT", ""))
_passes: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(name: str) -> None:
    """Marks a crash point; kills this process with SIGKILL if `ASYNCRL_FAULT` names it."""
    if _TARGET is None or _TARGET[0] != name:
        return
    with _lock:
        _passes[name] = _passes.get(name, 0) + 1
        if _passes[name] == _TARGET[1]:
            os.kill(os.getpid(), signal.SIGKILL)
