"""`asyncrl export DIR [--checkpoint step_N] OUT`: a verified checkpoint's policy as a
`save_pretrained` directory that transformers (`AutoModelForCausalLM`, `AutoTokenizer`) and
vLLM load: model safetensors, config, generation config, and the tokenizer with its chat
template when it has one.

The policy is rebuilt as the run built it, from the config the checkpoint was written with
(the one that trained it; `DIR/config.yaml` is the last launch's): the preset over the task's
alphabet, seeded, or `model.path`. The checkpoint's `model` part is loaded into it: the
trainer's weights at that step, in the dtype it trained them in.
Only the checkpoint's `state.json` and `model.safetensors` are read, both checked against
its manifest; nothing from the run dir is executed (DESIGN.md I7; a `data.reward_fn` is not
imported). OUT is written under a temporary name next to it and renamed into place, so an
interrupted export leaves no OUT that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from asyncrl.checkpoint.shards import ShardedFile, resolve_tensors
from asyncrl.checkpoint.snapshot import (
    FILES,
    MODEL_FILE,
    MODEL_PART,
    decode,
    format_version,
    read_parts,
    read_state,
    tensor_refs,
    unflatten,
)
from asyncrl.checkpoint.store import CheckpointError, CheckpointStore, Verified, step_dir_name
from asyncrl.checkpoint.tensorfile import read_tensors
from asyncrl.config import Config, DataConfig
from asyncrl.config.keys import build_config
from asyncrl.models.policy import Policy, load_policy
from asyncrl.tasks.source import alphabet, task_examples
from asyncrl.train.rundir import check_coherent


class ExportError(RuntimeError):
    """Nothing was exported; the message says why and what to do."""


@dataclass
class Exported:
    step: int
    checkpoint: Path
    out: Path
    files: list[tuple[str, int]]
    """Each file written under `out` (relative name) and its size in bytes."""


def verified_checkpoint(run_dir: Path, name: str | None = None) -> Verified:
    """The run's newest verified checkpoint, or the one named `step_N` (`step_6` and
    `step_000006` both name step 6), verified (its files hashed against the manifest) and
    coherent, as a resume would judge it. Raises `ExportError` naming what exists."""
    try:
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(f"{run_dir}: not a run dir (no readable run.json)") from None
    store = CheckpointStore(run_dir / "checkpoints", run_id, FILES, check_coherent)
    if name is not None:
        return _named_checkpoint(run_dir, store, name)
    latest, rejected = store.latest()
    if latest is None:
        why = "".join(f"\n  rejected: {reason}" for reason in rejected)
        raise ExportError(f"{run_dir}: no verified checkpoint to export{why}")
    return latest


def _verify(store: CheckpointStore, step: int, path: Path) -> Verified:
    verified = store.verify(path, step)
    check_coherent(verified)
    return verified


def _named_checkpoint(run_dir: Path, store: CheckpointStore, name: str) -> Verified:
    match = re.fullmatch(r"step_(\d+)", name)
    if match is None:
        raise ExportError(f"--checkpoint: got {name!r}, must look like step_N (e.g. step_000006)")
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
    raise ExportError(
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


def _alphabet(data: DataConfig) -> set[str]:
    """The task's characters (the `tiny` preset's vocabulary), read as `load_task` reads them
    but without resolving the reward function (export runs no code of the run's)."""
    return alphabet(task_examples(data))


def checkpoint_policy(verified: Verified) -> tuple[Policy, Config]:
    """The policy as the run built it, with the checkpoint's weights loaded (strictly)."""
    _, saved = read_parts(verified)
    # the sections the policy is built from; the others may hold keys this asyncrl no longer
    # accepts (a format-1 config lists every algorithm's keys)
    config = build_config({k: v for k, v in saved.items() if k in ("run", "model", "data")})
    alphabet: set[str] = set() if config.model.path else _alphabet(config.data)
    policy = load_policy(config.model, config.run.seed, alphabet)
    policy.model.load_state_dict(model_state(verified))
    return policy, config


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory; choose another OUT")


def export_checkpoint(run_dir: Path, out: Path, checkpoint: str | None = None) -> Exported:
    """Writes checkpoint `checkpoint` (default: the newest verified) of `run_dir` to `out`."""
    _check_out(out)
    verified = verified_checkpoint(run_dir, checkpoint)
    policy, _ = checkpoint_policy(verified)
    transformers.utils.logging.disable_progress_bar()  # a CLI that prints what it wrote
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier export by this pid
    tmp.mkdir()
    try:
        policy.model.save_pretrained(tmp)  # safetensors, config.json, generation_config.json
        policy.tokenizer.save_pretrained(tmp)  # with its chat template, if it has one
        _check_out(out)  # still free: nothing of someone else's is replaced
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(
        (str(p.relative_to(out)), p.stat().st_size) for p in out.rglob("*") if p.is_file()
    )
    return Exported(verified.step, verified.path, out, files)


def describe(exported: Exported) -> str:
    lines = [f"asyncrl: exported step {exported.step} ({exported.checkpoint}) to {exported.out}"]
    lines += [f"  {name}  {num_bytes} bytes" for name, num_bytes in exported.files]
    return "\n".join(lines)
