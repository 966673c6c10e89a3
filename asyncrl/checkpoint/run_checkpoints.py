"""The one way to open a run dir's checkpoints, for the trainer's resume and for every command
that reads them (`inspect`, `export`, `eval`): the run id in `run.json`, the store that
verifies a checkpoint against its manifest, the coherence check that decides whether a
verified checkpoint is loadable, a checkpoint named `step_N`, and its model state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from asyncrl.checkpoint.shards import ShardedFile, resolve_tensors
from asyncrl.checkpoint.snapshot import (
    FILES,
    MODEL_FILE,
    MODEL_PART,
    check_cut,
    check_tensor_files,
    decode,
    format_version,
    read_parts,
    read_state,
    tensor_refs,
    unflatten,
)
from asyncrl.checkpoint.store import CheckpointError, CheckpointStore, Verified, step_dir_name
from asyncrl.checkpoint.tensorfile import read_tensors
from asyncrl.config import buffer_capacity


class RunCheckpointsError(CheckpointError):
    """Not a run dir, or no verified checkpoint (of that name); the message says what exists."""


def check_coherent(verified: Verified) -> None:
    """Raises `CheckpointError` unless a verified checkpoint's parts fit together
    (`check_cut`, judged by the checkpoint's own config, not the new one) and its tensor files
    are safetensors holding every tensor its state names. The one check that decides whether
    a checkpoint is loadable: a resume's choice and retention both use it. It reads
    `state.json` and the safetensors headers only, never the tensor data (the manifest's
    hashes already vouch for those bytes)."""
    parts, config = read_parts(verified)
    try:
        saved = config["rollout"]
        n = int(saved["num_prompts_per_step"])
        check_cut(parts, n, buffer_capacity(n, int(saved["max_trajectory_age_steps"])))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{verified.path}: state is malformed ({err!r})") from None
    check_tensor_files(verified, parts)


def run_store(run_dir: Path, run_id: str | None = None) -> CheckpointStore:
    """The store of `run_dir`'s checkpoints, for run `run_id` (default: `run.json`'s), whose
    "verified" includes `check_coherent`: what a resume would skip is never the newest."""
    if run_id is None:
        try:
            run_id = str(json.loads((run_dir / "run.json").read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            raise RunCheckpointsError(f"{run_dir}: not a run dir (no readable run.json)") from None
    return CheckpointStore(run_dir / "checkpoints", run_id, FILES, check_coherent)


def verified_checkpoint(run_dir: Path, name: str | None = None) -> Verified:
    """The run's newest verified checkpoint, or the one named `step_N` (`step_6` and
    `step_000006` both name step 6), verified (its files hashed against the manifest) and
    coherent, as a resume would judge it. Raises `RunCheckpointsError` naming what exists."""
    store = run_store(run_dir)
    if name is not None:
        return _named_checkpoint(run_dir, store, name)
    latest, rejected = store.latest()
    if latest is None:
        why = "".join(f"\n  rejected: {reason}" for reason in rejected)
        raise RunCheckpointsError(f"{run_dir}: no verified checkpoint to export or evaluate{why}")
    return latest


def _verify(store: CheckpointStore, step: int, path: Path) -> Verified:
    verified = store.verify(path, step)
    check_coherent(verified)
    return verified


def _named_checkpoint(run_dir: Path, store: CheckpointStore, name: str) -> Verified:
    match = re.fullmatch(r"step_(\d+)", name)
    if match is None:
        raise RunCheckpointsError(
            f"--checkpoint: got {name!r}, must look like step_N (e.g. step_000006)"
        )
    wanted = int(match.group(1))
    candidates = dict(store.candidates())
    why = "does not exist"
    if wanted in candidates:
        try:
            return _verify(store, wanted, candidates[wanted])
        except CheckpointError as err:
            why = f"is not verified ({err})"
    verified = []
    for step, path in sorted(candidates.items()):
        try:
            verified.append(step_dir_name(_verify(store, step, path).step))
        except CheckpointError:
            continue
    listed = ", ".join(verified) or "none"
    raise RunCheckpointsError(
        f"{run_dir}: checkpoint {step_dir_name(wanted)} {why}; verified checkpoints: {listed}"
    )


def model_state(verified: Verified) -> dict[str, torch.Tensor]:
    """The checkpoint's `model` part (tied weights under each of their names), reading only
    `state.json` and `model.safetensors` (a format-1 checkpoint is decoded whole)."""
    if format_version(verified) == 1:
        state: dict[str, torch.Tensor] = decode(verified).parts[MODEL_PART]
        return state
    parts, _ = read_parts(verified)
    try:
        tensors = verified.read_with(MODEL_FILE, read_tensors)
        num_shards = int(read_state(verified).get("num_shards", 1))
        if num_shards > 1:  # a sharded run's: every rank's rows, whole tensors
            tree = parts[MODEL_PART]
            source = ShardedFile(verified, MODEL_FILE, tensors, num_shards)
            tensors = resolve_tensors(source, tree, tensor_refs(tree), None)
        state = unflatten(parts[MODEL_PART], tensors)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise CheckpointError(f"{verified.path}: model unreadable ({err!r})") from None
    return state
