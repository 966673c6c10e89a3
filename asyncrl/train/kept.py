"""The trainer's side of rollouts kept at a preemption notice (`asyncrl.core.kept` holds the
rules, `asyncrl.checkpoint.kept` the file): the groups trained since the newest verified
checkpoint, what each cut holds, the write at a notice whose full checkpoint does not fit, and
the kept rollouts put back on resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.checkpoint.kept import KeptFileError, read_kept, write_kept
from asyncrl.core.buffer import Buffer, group_from_state
from asyncrl.core.kept import KeptAccount, KeptRollout, group_partial, keep, steps_lost
from asyncrl.core.ledger import Ledger
from asyncrl.core.partial import Partial
from asyncrl.core.preemption import seconds
from asyncrl.core.types import Group

if TYPE_CHECKING:
    from asyncrl.train.trainer import Trainer

Held = dict[int, list[int]]
"""Ordinal -> its tokens per sample that a checkpoint holds (buffered or in flight)."""


def held_by(states: dict[str, Any]) -> Held:
    """What a cut's part states (the buffer's and the ledger's) hold, per ordinal."""
    held = {
        int(g["ticket"]["ordinal"]): [int(n) for n in torch.as_tensor(g["completion_mask"]).sum(1)]
        for g in states["buffer"]["groups"]
    }
    for key in ("partial", "kept"):  # kept: put back by a resume, not handed out yet
        for k, p in states["ledger"].get(key, {}).items():
            held[int(k)] = [int(n) for n in torch.as_tensor(p["mask"]).sum(1)]
    return held


class RolloutKeeper:
    """Keeps, until a newer checkpoint is verified, the groups trained since the newest
    verified one and what each cut since holds; at a notice, writes what weights that
    checkpoint holds sampled (`keep_now`)."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.root = root
        self.run_id = run_id
        self._lock = threading.Lock()  # `verified` runs on the checkpoint writer's thread
        self._trained: list[tuple[int, Group]] = []
        self._held: dict[int, Held] = {}
        self.verified_step: int | None = None

    def restored(self, step: int, held: Held) -> None:
        """The launch resumed from checkpoint `step`, which holds `held`."""
        with self._lock:
            self._held = {step: held}
            self.verified_step = step

    def cut(self, step: int, held: Held) -> None:
        """A checkpoint of `step` was cut (not yet verified)."""
        with self._lock:
            self._held[step] = held

    def trained(self, step: int, groups: list[Group]) -> None:
        with self._lock:
            self._trained.extend((step, g) for g in groups)

    def verified(self, step: int) -> None:
        """Checkpoint `step` is durable: nothing trained before it is needed any more."""
        with self._lock:
            self.verified_step = step
            self._trained = [(s, g) for s, g in self._trained if s >= step]
            self._held = {s: h for s, h in self._held.items() if s >= step}

    def keep_now(
        self, step: int, ledger: Ledger, buffer: Buffer, cut: Any
    ) -> tuple[Path, int, KeptAccount, float] | None:
        """Writes the rollouts sampled by weights the newest verified checkpoint holds, beside
        it; returns the file, its bytes, the account and the seconds taken (None: no verified
        checkpoint yet). `cut`: the collector's cut (a context)."""
        start = time.perf_counter()
        with self._lock:
            version = self.verified_step
            if version is None:
                return None
            held = self._held.get(version, {})
            items: list[tuple[int, int, Partial]] = [
                (g.ordinal, g.target_step, group_partial(g)) for _, g in self._trained
            ]
        with cut:
            groups = [group_from_state(g) for g in buffer.state_dict()["groups"]]
            items += [(g.ordinal, g.target_step, group_partial(g)) for g in groups]
            items += [
                (t.ordinal, t.target_step, ledger.partials[t.ordinal])
                for t in ledger.unfinished()
                if t.ordinal in ledger.partials
            ]
            items += [(k, ledger.stream.ticket(k).target_step, p) for k, p in ledger.kept.items()]
        kept, account = keep(items, version, held, step)
        path, nbytes = write_kept(self.root, self.run_id, kept, account)
        return path, nbytes, account, time.perf_counter() - start


def keep_at_notice(trainer: Trainer) -> int | None:
    """Where the notice's checkpoint may not be durable before its deadline (it does not
    fit, nothing is measured, or it must first wait for a write in progress) or none will
    be written (this step's is cut already), first the rollouts sampled by weights the
    newest verified checkpoint holds, written beside it (milliseconds): a kill before the
    checkpoint loses the training since, not them. Returns that checkpoint's step (None:
    nothing written)."""
    plan = trainer.deadlines.plan(trainer.stop)
    if not trainer.keeps or plan is None or plan.left_s is None:
        return None
    if plan.fits and not trainer.writer.busy() and trainer.last_saved_step != trainer.step:
        return None
    notice = trainer.stop.notice
    assert notice is not None
    try:
        kept = trainer.keeper.keep_now(
            trainer.step, trainer.parts.ledger, trainer.parts.buffer, trainer.parts.collector.cut()
        )
    except Exception as err:  # best effort: the full checkpoint is still tried
        print(f"asyncrl: {notice.source}: could not keep the rollouts: {err!r}")
        return None
    if kept is None:
        return None
    path, nbytes, account, took_s = kept
    print(kept_line(notice.source, path, account, took_s), flush=True)
    trainer.logs.events.emit(
        "rollouts_kept",
        source=notice.source,
        **account.fields(),
        bytes=nbytes,
        seconds=took_s,
        path=str(path),
    )
    return account.step


def kept_line(source: str, path: Path, account: KeptAccount, took_s: float) -> str:
    """What the run prints once the kept rollouts are durable."""
    lost = steps_lost(account.step, account.cut_step)
    return (
        f"asyncrl: {source}: kept beside step {account.step}'s checkpoint in {seconds(took_s)} "
        f"s ({path.name}): {account.groups} finished and {account.partial_groups} partial "
        f"groups, {account.tokens} tokens sampled by weights of step {account.step} or older; "
        f"lost if the kill comes first: the training of {lost} and "
        f"{account.lost_tokens} tokens sampled by newer weights"
    )


def put_back(
    root: Path, run_id: str, step: int, ledger: Ledger, buffered: set[int]
) -> tuple[list[KeptRollout], str | None]:
    """The rollouts kept beside checkpoint `step` put back into the restored ledger; and a
    reason where a kept file was found but could not be used (it is then ignored: the
    checkpoint alone stands, as it would without it)."""
    try:
        found = read_kept(root, step, run_id)
    except KeptFileError as err:
        return [], str(err)
    if found is None:
        return [], None
    kept, _ = found
    try:
        return ledger.keep(kept, buffered), None
    except ValueError as err:
        return [], f"{root}: {err}"
