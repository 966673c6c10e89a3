"""One bounded, reused staging copy of a cut, taken partly while the next step runs.

    trainer thread                          copy thread                  writer thread
    --------------                          -----------                  -------------
    stage(states) under the collector's cut:
      every part flattened (JSON copied),
      small parts' tensors copied ─────────▶ big parts' tensors copied
    next step: forward, backward              into the same buffers
    optimizer.step ── waits (pre-hook) ◀──── done ───────────────────────▶ streams the files

A `StagingArea` holds one CPU buffer per tensor name (`buf.copy_(t)`; pinned when the source
is on a GPU): a checkpoint costs one copy of the state, bounded by one cut. Pinned buffers are
reused from save to save (a new one only when the shape or dtype changed); buffers of CPU
tensors are given back once their cut is written (see `StagingArea`). Buffers no longer named
by the newest cut are dropped.

Overlap: the only things that change the `background` parts' tensors (model weights, optimizer
moments, a critic; generation's older weights versions never change) in place are optimizer
steps. So `stage` copies the other parts' tensors at once (the buffer, ledger and stream are
changed by the collector thread, which the cut's lock holds off) and the background parts' in
a copy thread while the trainer computes the next step's forward and backward passes; a
process-wide optimizer step pre-hook makes any optimizer step wait until the copy is done.
The copy is exact, so what is written is the state at the cut, bit for bit.

The buffers are reused, so a cut is valid until the next `stage` of the same area: `stage`
refuses to run while the previous cut is not `release`d (the writer releases it once the
files are written; the trainer waits for the writer before it stages again).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from asyncrl.checkpoint.snapshot import (
    Snapshot,
    checkpoint_files,
    flatten_part,
    local,
    part_file,
    tensor_files,
    unflatten,
)
from asyncrl.checkpoint.store import FileSource


class StagingJob:
    """The background half of one staging: done once every queued tensor is copied. An
    optimizer step that starts before that waits (`wait_from_hook`), and the time it waited is
    counted in `hook_wait_s`."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._copies = copies  # (buffer, source); the sources are dropped once copied
        self._cond = threading.Condition()
        self._done = False
        self._waiters = 0
        self.error: BaseException | None = None
        self.stage_s = 0.0
        """Seconds the copy thread took."""
        self.hook_wait_s = 0.0
        """Seconds optimizer steps waited for the copy, in total."""

    def run(self) -> None:
        """Copies every queued tensor (the copy thread's body); never raises."""
        start = time.perf_counter()
        try:
            _copy_all(self._copies)
        except BaseException as err:  # the writer re-raises it; the hook must not hang
            self.error = err
        finally:
            self._copies = []
            self.stage_s = time.perf_counter() - start
            with self._cond:
                self._done = True
                self._cond.notify_all()
            _unregister(self)

    def wait_from_hook(self) -> None:
        with self._cond:
            if self._done:
                return
            self._waiters += 1
            start = time.perf_counter()
            while not self._done:
                self._cond.wait()
            self.hook_wait_s += time.perf_counter() - start
            self._waiters -= 1
            self._cond.notify_all()

    def wait(self) -> None:
        """Blocks until the copy is done and every optimizer step that waited for it has
        counted its wait; re-raises the copy's error."""
        with self._cond:
            while not self._done or self._waiters:
                self._cond.wait()
        if self.error is not None:
            raise self.error


def _copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`buf.copy_(src)` for each pair; GPU sources asynchronously on a side stream that first
    waits for the work already queued on their devices, then synchronized."""
    streams: dict[torch.device, Any] = {}
    for buf, src in copies:
        if src.is_cuda:
            if src.device not in streams:
                stream = torch.cuda.Stream(src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
                streams[src.device] = stream
            with torch.cuda.stream(streams[src.device]):
                buf.copy_(src, non_blocking=buf.is_pinned())
        else:
            buf.copy_(src)
    for stream in streams.values():
        stream.synchronize()


_ACTIVE: set[StagingJob] = set()
_ACTIVE_LOCK = threading.Lock()
_HOOK: Any = None


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    with _ACTIVE_LOCK:
        jobs = list(_ACTIVE)
    for job in jobs:
        job.wait_from_hook()


def _register(job: StagingJob) -> None:
    """Arms the pre-hook for `job`. The hook is installed once per process and stays: with
    no job in progress it returns at once, and removing a global hook from the copy thread
    while a step iterates over the hooks would break that step."""
    global _HOOK
    with _ACTIVE_LOCK:
        if _HOOK is None:
            _HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)
        _ACTIVE.add(job)


def _unregister(job: StagingJob) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(job)


@dataclass
class Cut:
    """One consistent cut, staged: each part's JSON tree (tensors replaced by
    `{"__tensor__": NAME}`), the config, and each tensor file's tensors in the staging buffers
    (still being filled by `job` until `wait_staged`)."""

    trees: dict[str, Any]
    config: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]] = field(
        default_factory=lambda: {f: {} for f in tensor_files()}
    )
    job: StagingJob | None = None
    area: StagingArea | None = None
    num_shards: int = 1
    """The trainer's ranks: > 1 makes a sharded checkpoint (format 3) whose other ranks write
    their files into `begun` (`asyncrl.checkpoint.shards`)."""
    facts: dict[str, int] = field(default_factory=dict)
    """What the cut holds, in numbers (`asyncrl.faults.CUT_FACTS`): stated to the fault points of
    its write, and recorded in its `checkpoint` event."""
    begun: Path | None = None
    written: Callable[[], dict[str, dict[str, Any]]] | None = None
    """With ranks: waits for the other ranks' files and returns their manifest entries. Called
    exactly once per cut (by the store before the manifest, or by `release`), so that every
    rank's answer pairs with its own checkpoint."""

    @property
    def step(self) -> int:
        return int(self.trees["trainer"]["step"])

    def wait_staged(self) -> None:
        """Blocks until the background copy is done; re-raises its error."""
        if self.job is not None:
            self.job.wait()

    def files(self) -> dict[str, FileSource]:
        """The checkpoint's files (format 4) as `CheckpointStore.save` takes them: the tensor
        files streamed from the staging buffers, state.json as bytes. Waits for the copy."""
        self.wait_staged()
        return checkpoint_files(self.trees, self.config, self.tensors, self.num_shards)

    def snapshot(self) -> Snapshot:
        """The cut as a `Snapshot` whose tensors are the staging buffers (valid until the next
        `stage` of the area). Waits for the copy."""
        self.wait_staged()
        parts = {
            name: unflatten(tree, self.tensors[part_file(name)])
            for name, tree in self.trees.items()
        }
        return Snapshot(parts, self.config)

    def release(self) -> None:
        """The buffers may be reused: called once the files are written (or failed). The cut
        lets go of them (it is not readable after this)."""
        if self.area is not None:
            self.area.release(self)
        self.tensors = {f: {} for f in tensor_files()}
        if self.written is not None:  # a save that failed before its manifest
            with contextlib.suppress(Exception):  # the save's own error is the one to report
                self.written()


ALIGN = 64
"""Byte alignment of each tensor inside the flat staging buffer."""

Layout = tuple[tuple[str, str, tuple[int, ...], torch.dtype], ...]
"""(file, tensor name, shape, dtype) of every staged tensor, in staging order."""


class StagingArea:
    """The staging buffer of one trainer's checkpoints: ONE flat CPU allocation, carved into a
    view per tensor (by file and tensor name).

    One allocation, not one per tensor: a block that large is always its own memory mapping,
    so giving it back really returns the memory to the system (thousands of per-tensor
    buffers of a few MiB land in the allocator's heap, which keeps them: measured, freeing
    them left the RSS where it was).

    `keep_buffers` says whether the buffer is kept from one save to the next. By default
    (None) only a pinned one is kept — one staging GPU tensors: pinned host memory is slow to
    allocate, and it is not the memory training uses. A buffer staging CPU tensors is given
    back after each write: kept, it would be 12 more bytes per parameter (fp32 weights and two
    AdamW moments) for the whole run, in the very RAM the CPU trainer trains in, to save a
    page-fault pass that the background copy hides anyway."""

    def __init__(self, keep_buffers: bool | None = None) -> None:
        self._flat: torch.Tensor | None = None
        self._layout: Layout = ()
        self._views: list[torch.Tensor] = []
        self.in_use: Cut | None = None
        self.keep_buffers = keep_buffers

    @property
    def num_bytes(self) -> int:
        """Bytes the staging buffer holds now (0 when given back)."""
        return 0 if self._flat is None else self._flat.numel()

    def release(self, cut: Cut) -> None:
        """`cut` is written: its buffer is free, and given back unless kept."""
        if self.in_use is cut:
            self.in_use = None
        pinned = self._flat is not None and self._flat.is_pinned()
        if self.keep_buffers is False or (self.keep_buffers is None and not pinned):
            self._flat, self._layout, self._views = None, (), []

    def stage(
        self, states: dict[str, Any], config: dict[str, Any], background: Collection[str] = ()
    ) -> Cut:
        """Stages each part's state (`states`: part name -> live `state_dict()`). The parts
        named in `background` have their tensors copied by a copy thread (see the module
        docstring for what the caller guarantees); the rest before this returns. Raises
        `RuntimeError` while the previous cut is not released."""
        if self.in_use is not None:
            raise RuntimeError("the previous checkpoint still reads the staging buffers")
        cut = Cut(trees={}, config=config, area=self)
        found_all: list[tuple[str, str, str, torch.Tensor]] = []  # part, file, name, source
        for name, state in states.items():
            file = part_file(name)
            found: dict[str, torch.Tensor] = {}
            cut.trees[name] = flatten_part(name, state, found)
            found_all += [(name, file, t, local(source)) for t, source in found.items()]
        layout = tuple((f, t, tuple(src.shape), src.dtype) for _, f, t, src in found_all)
        if layout != self._layout or self._flat is None:
            pin = any(src.is_cuda for *_, src in found_all) and torch.cuda.is_available()
            self._allocate(layout, pin)
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (name, file, tensor_name, source), buf in zip(found_all, self._views, strict=True):
            cut.tensors[file][tensor_name] = buf
            if name in background:
                later.append((buf, source))
            else:
                buf.copy_(source)
        self.in_use = cut
        if later:
            cut.job = StagingJob(later)
            _register(cut.job)
            threading.Thread(target=cut.job.run, name="asyncrl-stage", daemon=True).start()
        return cut

    def _allocate(self, layout: Layout, pin: bool) -> None:
        """One flat byte buffer for `layout`, and a view of it per tensor."""
        self._flat = None  # the old one goes first: never two at once
        offsets, total = [], 0
        for _, _, shape, dtype in layout:
            offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += -(-nbytes // ALIGN) * ALIGN
        flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        views = []
        for (_, _, shape, dtype), offset in zip(layout, offsets, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            views.append(flat[offset : offset + nbytes].view(dtype).view(shape))
        self._flat, self._layout, self._views = flat, layout, views
