"""The file of rollouts kept beside a verified checkpoint at a preemption notice
(`asyncrl.core.kept` says what is kept and why): `checkpoints/kept_step_NNNNNN.safetensors`.

One safetensors file: each kept ordinal's partial samples as tensors (`ORDINAL.tokens`,
`.mask`, `.logprobs`, `.versions`, `.finished`), and in its metadata the format, the run, the
checkpoint's step, each ordinal's target step, the notice's account and a SHA-256 over every
tensor. Written to a temp name, fsynced, renamed, the directory fsynced: a kill leaves the
whole file or none under its name, and a resume loads it only after the checksum, the run and
the step match (I4). No code is ever loaded from it (I7). A later verified checkpoint makes it
stale (`remove_stale`, on every retain): that checkpoint holds whatever of it was kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from asyncrl.core.kept import KeptAccount, KeptRollout
from asyncrl.core.partial import Partial

KEPT_FORMAT = "asyncrl-kept-rollouts/1"
_KEPT_FILE = re.compile(r"^kept_step_(\d{6,})\.safetensors$")
_WRITER = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
"""Ends this process's temp file names: a pid alone is reused (a container's first processes
get the same few), and a temp file an earlier process with our pid left would pass for a write
in progress here and never be cleaned."""
_FIELDS = ("tokens", "mask", "logprobs", "versions", "finished")


class KeptFileError(ValueError):
    """A kept-rollouts file that is not whole, not this run's, or not this checkpoint's."""


def kept_path(root: Path, step: int) -> Path:
    return root / f"kept_step_{step:06d}.safetensors"


_SIGNED = ("format", "run_id", "step", "targets", "account")
"""The metadata the checksum covers, with every tensor."""


def _digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    sha = hashlib.sha256()
    for key in _SIGNED:
        sha.update(f"{key}={metadata.get(key)}|".encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        sha.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        sha.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sha.hexdigest()


def write_kept(
    root: Path, run_id: str, kept: list[KeptRollout], account: KeptAccount
) -> tuple[Path, int]:
    """Writes the kept rollouts beside checkpoint `account.step`, durably, then deletes those
    kept beside older checkpoints (`remove_stale`); returns the path and its bytes."""
    tensors: dict[str, torch.Tensor] = {}
    for item in kept:
        state = item.partial.state_dict()
        for name in _FIELDS:
            tensors[f"{item.ordinal}.{name}"] = state[name].contiguous()
    metadata = {
        "format": KEPT_FORMAT,
        "run_id": run_id,
        "step": str(account.step),
        "targets": json.dumps({str(k.ordinal): k.target_step for k in kept}),
        "account": json.dumps(
            {
                "cut_step": account.cut_step,
                "groups": account.groups,
                "partial_groups": account.partial_groups,
                "tokens": account.tokens,
                "lost_tokens": account.lost_tokens,
            }
        ),
    }
    metadata["sha256"] = _digest(tensors, metadata)
    data = save(tensors, metadata)
    path = kept_path(root, account.step)
    tmp = root / f".kept-tmp-{account.step}-{run_id}-{_WRITER}"
    root.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    # a keep beside an older checkpoint may end after the newer one's retain looked (a notice
    # while that write was in flight): the newest kept file holds what it held
    remove_stale(root, account.step)
    return path, len(data)


def read_kept(
    root: Path, step: int, run_id: str
) -> tuple[list[KeptRollout], dict[str, Any]] | None:
    """The rollouts kept beside checkpoint `step`, verified, with the notice's account; None
    when there is no such file. A file that fails a check: `KeptFileError`, naming it."""
    path = kept_path(root, step)
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as err:  # a torn or foreign file: safetensors says what
        raise KeptFileError(f"{path}: not a whole safetensors file ({err})") from None
    if metadata.get("format") != KEPT_FORMAT:
        raise KeptFileError(f"{path}: format {metadata.get('format')!r}, not {KEPT_FORMAT!r}")
    if metadata.get("run_id") != run_id or metadata.get("step") != str(step):
        raise KeptFileError(
            f"{path}: kept for run {metadata.get('run_id')} step {metadata.get('step')}, not "
            f"this run's step {step}"
        )
    if _digest(tensors, metadata) != metadata.get("sha256"):
        raise KeptFileError(f"{path}: its tensors or metadata do not match its SHA-256")
    try:
        targets = {int(k): int(t) for k, t in json.loads(metadata["targets"]).items()}
        kept = []
        for ordinal, target in sorted(targets.items()):
            state = {name: tensors[f"{ordinal}.{name}"] for name in _FIELDS}
            kept.append(KeptRollout(ordinal, target, Partial.from_state(state)))
        return kept, dict(json.loads(metadata["account"]))
    except (KeyError, ValueError, TypeError, AttributeError) as err:  # written by no asyncrl
        raise KeptFileError(f"{path}: not a kept-rollouts file asyncrl wrote ({err!r})") from None


def remove_stale(root: Path, newest_step: int) -> list[Path]:
    """Deletes kept-rollouts files of checkpoints older than the newest verified one (and
    temp files of interrupted writes); returns what it deleted."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        match = _KEPT_FILE.match(path.name)
        stale = match is not None and int(match.group(1)) < newest_step
        torn = path.name.startswith(".kept-tmp-") and not path.name.endswith(f"-{_WRITER}")
        if stale or torn:  # (a temp file of this process is a write in progress)
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
