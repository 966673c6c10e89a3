"""What goes into a checkpoint, and back out: a dict of named stateful parts, tensors in
safetensors, everything else in JSON (STYLE.md rule 15, after torchtitan's checkpointer).

A part is anything with `state_dict()` / `load_state_dict()`; the trainer names them (see
`Trainer.stateful_parts`): `trainer` (step, attempt, run id), `model` (the policy's weights),
`algorithm` (whatever the algorithm owns: optimizers, a critic, its reference's hash), `rng`,
`stream` (cursor and target schedule), `ledger` (in-flight ordinals), `buffer` (finished
groups) and `generation` (older weights versions deterministic mode still generates with).
This module knows no part by its contents, and no algorithm.

Files of a checkpoint directory (format 4):
    model.safetensors   the `model` part: tensors under their own names (tied ones stored once)
    rollout.safetensors the `ledger` and `buffer` parts' tensors (partial samples, finished
                        groups): kilobytes that `inspect` reads without the optimizer's moments
    state.safetensors   every other part's tensors, named `PART/PATH/IN/ITS/STATE`
    state.json          {"format_version": 4, "parts": {PART: its state with each tensor
                        replaced by {"__tensor__": NAME}}, "config": the run's config}
Format 5 is a sharded run's (`train.num_processes` > 1): the same files, plus each other
rank's rows of the sharded tensors in its own files (`asyncrl.checkpoint.shards`). Formats 2
and 3 (before rollout.safetensors) are 4 and 5 with the ledger and buffer in the state file.
Nothing is a pickle: loading a checkpoint cannot execute code (DESIGN.md I7). Format 1
checkpoints are read by `asyncrl.checkpoint.legacy`.

Tensor files are streamed both ways (`asyncrl.checkpoint.tensorfile`): written from the
tensors, read into fresh tensors while they are hashed; no whole file is ever one `bytes`.
A run stages its cut with `asyncrl.checkpoint.staging`; `encode` writes a `Snapshot` as is.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from asyncrl.checkpoint.legacy import json_parts_from_v1, parts_from_v1
from asyncrl.checkpoint.shards import (
    ShardedFile,
    missing_rank_files,
    rank_file,
    resolve_tensors,
    shard_range,
    sharded_shapes,
    tensor_leaves,
)
from asyncrl.checkpoint.store import (
    FORMAT_VERSION,
    ROLLOUT_FILE_VERSIONS,
    SHARDED_FORMAT_VERSION,
    CheckpointError,
    FileSource,
    Verified,
)
from asyncrl.checkpoint.tensorfile import read_tensors, tensor_writer

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
ROLLOUT_FILE = "rollout.safetensors"
FILES = (MODEL_FILE, STATE_FILE, "state.json")
"""Every checkpoint holds these (plus manifest.json, and from format 4 `ROLLOUT_FILE`)."""
ROLLOUT_PARTS = ("ledger", "buffer")
"""The parts whose tensors are in `ROLLOUT_FILE` (format 4 on)."""
MODEL_PART = "model"
"""The part stored in model.safetensors under its own tensor names."""


def part_file(name: str, version: int = FORMAT_VERSION) -> str:
    """The tensor file that holds part `name`'s tensors in a checkpoint of format `version`."""
    if name == MODEL_PART:
        return MODEL_FILE
    if name in ROLLOUT_PARTS and version in ROLLOUT_FILE_VERSIONS:
        return ROLLOUT_FILE
    return STATE_FILE


def tensor_files(version: int = FORMAT_VERSION) -> tuple[str, ...]:
    """The tensor files of a checkpoint of format `version` (2 on)."""
    return (MODEL_FILE, STATE_FILE, *((ROLLOUT_FILE,) if version in ROLLOUT_FILE_VERSIONS else ()))


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class Snapshot:
    """One consistent cut of a run, in memory: each part's state, and the config."""

    parts: dict[str, dict[str, Any]]
    config: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.parts["trainer"]["step"])


class RNGState:
    """The global Python, NumPy and torch generators as a stateful part. (Nothing in a run
    draws from them — sampling noise comes from (seed, ordinal) — but they are saved so that
    user code which does is resumed too.)"""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        return {
            "python": [version, list(internal), gauss],
            "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"].clone())  # an owning tensor: it may be a view


# --- the tree codec: nested dicts/lists/tuples of tensors and JSON values <-> JSON + tensors


_SCALARS = (str, int, float, bool, type(None))
"""The exact types a JSON tree holds as they are (a subclass takes the checks below)."""


def _flatten(
    value: Any, path: str, tensors: dict[str, torch.Tensor], seen: dict[tuple[Any, ...], str]
) -> Any:
    if isinstance(value, DTensor):  # this rank's shard: stored as such, with its global shape
        return _flatten_sharded(value, path, tensors, seen)
    if isinstance(value, torch.Tensor):
        key = (
            value.untyped_storage().data_ptr(),
            int(value.storage_offset()),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
        )
        if key not in seen:  # a tensor stored under another name (tied weights) is stored once
            if path in tensors:
                raise ValueError(f"two tensors would be stored as {path!r}")
            seen[key] = path
            tensors[path] = value.detach().contiguous()
        return {"__tensor__": seen[key]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _flatten(v, _join(path, k), tensors, seen) for k, v in value.items()}
        items = [[k, _flatten(v, _join(path, str(k)), tensors, seen)] for k, v in value.items()]
        return {"__items__": items}
    if isinstance(value, tuple):
        return {"__tuple__": _flatten(list(value), path, tensors, seen)}
    if isinstance(value, list):
        if all(type(v) in _SCALARS for v in value):  # the common case, at C speed
            return list(value)
        return [_flatten(v, _join(path, str(i)), tensors, seen) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{path or 'state'}: a {type(value).__name__} cannot go into a checkpoint")


def _flatten_sharded(
    value: DTensor, path: str, tensors: dict[str, torch.Tensor], seen: dict[tuple[Any, ...], str]
) -> Any:
    """A sharded tensor (FSDP2's DTensor, rows split over the ranks): `tensors` gets the
    DTensor itself (`local` gives the shard a file stores); the tree records its global shape.
    Tied shards are stored once, as tied tensors are; an empty shard is never taken for a tie."""
    shard = value.to_local()
    key: tuple[Any, ...] = ("empty", id(value))
    if shard.numel():
        where = (shard.untyped_storage().data_ptr(), int(shard.storage_offset()))
        key = ("dtensor", *where, tuple(shard.shape), tuple(value.shape), shard.dtype)
    if key not in seen:
        if path in tensors:
            raise ValueError(f"two tensors would be stored as {path!r}")
        seen[key] = path
        tensors[path] = value.detach()
    return {"__tensor__": seen[key], "__global__": list(value.shape)}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What a file stores of a tensor: this rank's shard of a DTensor, else the tensor."""
    return tensor.to_local().contiguous() if isinstance(tensor, DTensor) else tensor


def flatten_part(name: str, state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Part `name`'s state as a JSON tree (a new one: nothing of `state` but its tensors is
    shared), adding its tensors to `tensors` (the live ones, not copied) under the names its
    file stores them by: their own for the model part, `PART/PATH` otherwise. A tensor stored
    under two names (tied weights) is added once."""
    return _flatten(state, "" if name == MODEL_PART else name, tensors, {})


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__items__" in tree:
            return {k: unflatten(v, tensors) for k, v in tree["__items__"]}
        if "__tuple__" in tree:
            return tuple(unflatten(v, tensors) for v in tree["__tuple__"])
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    return tree


def encode(snapshot: Snapshot) -> dict[str, FileSource]:
    """The checkpoint files of a snapshot (format 2) as `CheckpointStore.save` takes them:
    tensor files streamed straight from the snapshot's tensors (which must not change until
    they are written), state.json as bytes."""
    tensors: dict[str, dict[str, torch.Tensor]] = {f: {} for f in tensor_files()}
    parts = {
        name: flatten_part(name, state, tensors[part_file(name)])
        for name, state in snapshot.parts.items()
    }
    return checkpoint_files(parts, snapshot.config, tensors)


def checkpoint_files(
    trees: dict[str, Any],
    config: dict[str, Any],
    tensors: dict[str, dict[str, torch.Tensor]],
    num_shards: int = 1,
) -> dict[str, FileSource]:
    """The files of format 4 from the parts' JSON trees and the tensors they name (by tensor
    file): the tensor files as writers that stream them, state.json as bytes. With
    `num_shards` > 1 (a sharded run's rank 0), format 5: the other ranks' files are written by
    those ranks (`asyncrl.checkpoint.shards`)."""
    state_json: dict[str, Any] = {
        "format_version": SHARDED_FORMAT_VERSION if num_shards > 1 else FORMAT_VERSION,
        "parts": trees,
        "config": config,
    }
    if num_shards > 1:
        state_json["num_shards"] = num_shards
    files: dict[str, FileSource] = {
        file: tensor_writer({k: local(t) for k, t in tensors.get(file, {}).items()})
        for file in tensor_files()
    }
    files["state.json"] = json.dumps(state_json).encode()
    return files


def format_version(verified: Verified) -> int:
    return verified.format_version


def read_state(verified: Verified) -> dict[str, Any]:
    """Just `state.json` of a verified checkpoint."""
    try:
        state: dict[str, Any] = json.loads(verified.read_bytes("state.json"))
    except (KeyError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{verified.path / 'state.json'}: unreadable ({err})") from None
    return state


def read_parts(verified: Verified) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parts of a verified checkpoint as JSON (tensors left as `{"__tensor__": NAME}`),
    and its config: all `inspect` and the coherence check need, without loading a tensor."""
    state = read_state(verified)
    try:
        if format_version(verified) == 1:
            return json_parts_from_v1(state), state["config"]
        return state["parts"], state["config"]
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{verified.path / 'state.json'}: malformed ({err!r})") from None


def decode(verified: Verified, templates: dict[str, Any] | None = None) -> Snapshot:
    """Reads a verified checkpoint back into a Snapshot. Each tensor file is read once, in
    chunks, straight into the tensors it holds while the same bytes are hashed
    (`Verified.read_with`): one copy of the state in memory, and a file changed since
    verification is refused.

    A sharded checkpoint (format 3) is read as the loading rank needs it: the parts named in
    `templates` (part -> this rank's live state) get DTensors of this rank's rows wherever the
    live state holds one; every other tensor is read whole, its rows gathered from every rank's
    file (so `inspect`, `export` and `eval` read full weights)."""
    state = read_state(verified)
    version = format_version(verified)
    try:
        read = {f: verified.read_with(f, read_tensors) for f in tensor_files(max(version, 2))}
    except (KeyError, ValueError, OSError) as err:
        raise CheckpointError(f"{verified.path}: tensors unreadable ({err})") from None
    try:
        if version == 1:
            return Snapshot(
                parts_from_v1(state, read[MODEL_FILE], read[STATE_FILE]), state["config"]
            )
        num_shards = int(state.get("num_shards", 1))
        files = {  # the rollout parts are rank 0's alone: never sharded
            f: ShardedFile(verified, f, tensors, num_shards if f != ROLLOUT_FILE else 1)
            for f, tensors in read.items()
        }
        parts = {}
        for name, tree in state["parts"].items():
            file = part_file(name, version)
            found = read[file]
            template = (templates or {}).get(name)
            if num_shards > 1 or template is not None:
                live: dict[str, torch.Tensor] = {}
                if template is not None:
                    flatten_part(name, template, live)
                found = resolve_tensors(files[file], tree, tensor_refs(tree), live)
            parts[name] = unflatten(tree, found)
        return Snapshot(parts, state["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{verified.path}: state does not match its tensors ({err!r})"
        ) from None


def decode_parts(verified: Verified, names: tuple[str, ...]) -> dict[str, Any]:
    """Parts `names` of a verified checkpoint with their tensors, read from the files that
    hold them only (never the model's), holding in memory only the tensors those parts name
    (each file read is still hashed whole against the manifest): what `inspect` needs to count
    tokens. From format 4 the ledger and buffer have a file of their own, so that is kilobytes,
    not the optimizer's moments or a critic."""
    version = format_version(verified)
    if version == 1:
        snapshot = decode(verified)
        return {name: snapshot.parts[name] for name in names}
    state = read_state(verified)
    try:
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted({part_file(name, version) for name in names}):
            wanted = set().union(
                *(tensor_refs(state["parts"][n]) for n in names if part_file(n, version) == file)
            )
            tensors.update(verified.read_with(file, functools.partial(_read_wanted, wanted)))
        return {name: unflatten(state["parts"][name], tensors) for name in names}
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise CheckpointError(f"{verified.path}: state unreadable ({err!r})") from None


def _read_wanted(wanted: set[str], f: Any, size: int) -> Any:
    return read_tensors(f, size, wanted)


def tensor_refs(tree: Any) -> set[str]:
    """The tensor names a part's JSON tree refers to."""
    return set(tensor_leaves(tree))


def check_tensor_files(verified: Verified, parts: dict[str, Any]) -> None:
    """Refuses a checkpoint whose tensor files are not safetensors, or (format 2) lack a tensor
    its state names. Reads only the files' headers."""
    headers: dict[str, set[str]] = {}
    version = format_version(verified)
    for name in tensor_files(max(version, 2)):
        try:
            with safe_open(verified.path / name, "pt") as f:
                headers[name] = set(f.keys())
        except (OSError, SafetensorError, ValueError) as err:
            raise CheckpointError(f"{verified.path / name}: tensors unreadable ({err})") from None
    if version == 1:
        return
    num_shards = int(read_state(verified).get("num_shards", 1))
    missing_files = missing_rank_files(
        verified.manifest["files"], (MODEL_FILE, STATE_FILE), num_shards
    )
    if missing_files:
        raise CheckpointError(
            f"{verified.path}: a checkpoint of {num_shards} ranks without {missing_files[0]}"
        )
    for part, tree in parts.items():
        file = part_file(part, version)
        missing = sorted(tensor_refs(tree) - headers[file])
        if missing:
            raise CheckpointError(
                f"{verified.path / file}: lacks {len(missing)} tensors of part {part!r} "
                f"(first: {missing[0]})"
            )
    if num_shards > 1:
        _check_rank_rows(verified, parts, num_shards)


def _check_rank_rows(verified: Verified, parts: dict[str, Any], num_shards: int) -> None:
    """Every rank's file (rank 0's: the main one) holds each sharded tensor its state names
    with that rank's rows (`shard_range`), so a wrong rank file is judged here, where a resume
    falls back to an older checkpoint, and not first when it is loaded. Headers only."""
    for file in (MODEL_FILE, STATE_FILE):
        try:
            shapes = {
                name: [int(d) for d in shape]
                for part, tree in parts.items()
                if part_file(part, verified.format_version) == file
                for name, shape in sharded_shapes(tree).items()
            }
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{verified.path}: state is malformed ({err!r})") from None
        for rank in range(num_shards):
            path = verified.path / rank_file(file, rank)
            try:
                with safe_open(path, "pt") as f:
                    held = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
            except (OSError, SafetensorError, ValueError) as err:
                raise CheckpointError(f"{path}: tensors unreadable ({err})") from None
            for name, shape in shapes.items():
                lo, hi = shard_range(shape[0] if shape else 0, rank, num_shards)
                want = [hi - lo, *shape[1:]]
                if held.get(name) != want:
                    got = "lacks it" if name not in held else f"holds {held[name]}"
                    raise CheckpointError(
                        f"{path}: rank {rank}'s rows of {name} should be {want}, the file {got}"
                    )


def check_cut(parts: dict[str, Any], num_prompts_per_step: int, capacity: int) -> None:
    """Refuses a cut whose parts do not fit together (a checksum only proves the files are the
    ones written, not that what was written is coherent). Reads only JSON-level values, so it
    works on `read_parts` as well as on a decoded snapshot's parts."""
    step = int(parts["trainer"]["step"])
    cursor = int(parts["stream"]["cursor"])
    groups = parts["buffer"]["groups"]
    buffered = {int(g["ticket"]["ordinal"]): int(g["ticket"]["target_step"]) for g in groups}
    in_flight = {int(k): int(t) for k, t in parts["ledger"]["in_flight"]}
    problems = []
    if len(buffered) != len(groups):
        problems.append("an ordinal is buffered twice")
    if set(buffered) & set(in_flight):
        problems.append(
            f"ordinals both buffered and in flight: {sorted(set(buffered) & set(in_flight))}"
        )
    targets = {**buffered, **in_flight}
    if any(t < step for t in targets.values()):
        problems.append(f"groups for targets before step {step}")
    if any(k >= cursor for k in targets):
        problems.append(f"ordinals at or past the stream cursor {cursor}")
    if len(buffered) > capacity:
        problems.append(f"{len(buffered)} buffered groups, capacity {capacity}")
    counts: dict[int, int] = {}
    for t in targets.values():
        counts[t] = counts.get(t, 0) + 1
    if any(c > num_prompts_per_step for c in counts.values()):
        problems.append(f"more than N={num_prompts_per_step} groups for one target")
    if problems:
        raise CheckpointError(f"incoherent checkpoint of step {step}: " + "; ".join(problems))
