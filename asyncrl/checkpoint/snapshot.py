"""What goes into a checkpoint, and back out: tensors in safetensors, everything else in JSON.

Files of a checkpoint directory:
    model.safetensors   policy weights (tied tensors stored once, aliases in state.json)
    state.safetensors   optimizer tensors, replay-buffer tensors, torch RNG state; for PPO
                        the critic's weights and its optimizer's tensors
    state.json          step, weights version, ledger, buffer metadata, optimizer
                        hyperparameters, Python/NumPy RNG state, config
Nothing is a pickle: loading a checkpoint cannot execute code (DESIGN.md I7).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from asyncrl.checkpoint.store import CheckpointError, Verified

GROUP_TENSORS = ("completion_ids", "completion_mask", "behaviour_logprobs", "rewards")
FILES = ("model.safetensors", "state.safetensors", "state.json")
"""Every checkpoint holds exactly these (plus manifest.json)."""


@dataclass
class Snapshot:
    """One consistent cut of a run, in memory."""

    trainer: dict[str, Any]  # step, weights_version, attempt, run_id ...
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # torch optimizer state_dict
    ledger: dict[str, Any]
    buffer: dict[str, Any]  # ReplayBuffer.state_dict()
    rng: dict[str, Any]
    config: dict[str, Any]
    generation: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Deterministic mode: the older weights versions the engine still has to generate with."""
    critic: dict[str, torch.Tensor] = field(default_factory=dict)
    """PPO: the critic's weights (empty for GRPO)."""
    critic_optimizer: dict[str, Any] = field(default_factory=dict)
    """PPO: the critic optimizer's state_dict (empty for GRPO)."""


def capture_rng() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def restore_rng(rng: dict[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stores tensors that share memory (tied embeddings) once; returns {alias: stored name}."""
    kept: dict[tuple[int, int], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if key in kept and tensors[kept[key]].shape == tensor.shape:
            aliases[name] = kept[key]
            continue
        kept[key] = name
        tensors[name] = tensor.detach().contiguous()
    return tensors, aliases


def _encode_optimizer(
    optimizer: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Moves an optimizer state_dict's tensors into `tensors` under `prefix/`; returns the rest
    (JSON)."""
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}/{index}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return {
        "param_groups": optimizer["param_groups"],
        "state_indices": [str(i) for i in optimizer["state"]],
        "scalars": scalars,
    }


def _decode_optimizer(
    meta: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for index in meta["state_indices"]:
        start = f"{prefix}/{index}/"
        entry: dict[str, Any] = {
            k[len(start) :]: v for k, v in tensors.items() if k.startswith(start)
        }
        entry.update(meta["scalars"].get(index, {}))
        state[int(index)] = entry
    param_groups = [
        {**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": param_groups}


def encode(snapshot: Snapshot) -> dict[str, bytes]:
    """The checkpoint files of a snapshot, as bytes."""
    model, aliases = _dedupe(snapshot.model)
    tensors: dict[str, torch.Tensor] = {"rng/torch": snapshot.rng["torch"]}
    optimizer = _encode_optimizer(snapshot.optimizer, "optimizer", tensors)
    critic_optimizer = (
        _encode_optimizer(snapshot.critic_optimizer, "critic_optimizer", tensors)
        if snapshot.critic_optimizer
        else None
    )
    critic, critic_aliases = _dedupe(snapshot.critic)
    tensors.update({f"critic/{k}": v for k, v in critic.items()})
    groups_meta = []
    for group in snapshot.buffer["groups"]:
        ordinal = group["ticket"]["ordinal"]
        for key in GROUP_TENSORS:
            tensors[f"buffer/{ordinal}/{key}"] = group[key].contiguous()
        groups_meta.append({k: v for k, v in group.items() if k not in GROUP_TENSORS})
    generation_aliases = {}
    for version, weights in snapshot.generation.items():
        stored, aliases_v = _dedupe(weights)
        tensors.update({f"generation/{version}/{k}": v for k, v in stored.items()})
        generation_aliases[str(version)] = aliases_v
    numpy_state = snapshot.rng["numpy"]
    state = {
        "trainer": snapshot.trainer,
        "ledger": snapshot.ledger,
        "buffer": {"groups": groups_meta},
        "optimizer": optimizer,
        "critic_optimizer": critic_optimizer,
        "critic_aliases": critic_aliases if snapshot.critic else None,
        "rng": {
            "python": list(snapshot.rng["python"]),
            "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        },
        "model_aliases": aliases,
        "generation_aliases": generation_aliases,
        "config": snapshot.config,
    }
    return {
        "model.safetensors": save_tensors(model),
        "state.safetensors": save_tensors(tensors),
        "state.json": json.dumps(state).encode(),
    }


def read_state(verified: Verified) -> dict[str, Any]:
    """Just `state.json` of a verified checkpoint (for `inspect`: no tensors needed)."""
    try:
        state: dict[str, Any] = json.loads(verified.read_bytes("state.json"))
    except (KeyError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{verified.path / 'state.json'}: unreadable ({err})") from None
    return state


def check_cut(snapshot: Snapshot, num_prompts_per_step: int, capacity: int) -> None:
    """Refuses a snapshot whose parts do not fit together (a checksum only proves the files are
    the ones written, not that what was written is coherent)."""
    step = int(snapshot.trainer["step"])
    cursor = int(snapshot.ledger["stream"]["cursor"])
    buffered = {
        int(g["ticket"]["ordinal"]): int(g["ticket"]["target_step"])
        for g in snapshot.buffer["groups"]
    }
    in_flight = {int(k): int(t) for k, t in snapshot.ledger["in_flight"]}
    problems = []
    if len(buffered) != len(snapshot.buffer["groups"]):
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


def decode(verified: Verified) -> Snapshot:
    """Reads a verified checkpoint back into a Snapshot."""
    state = read_state(verified)
    try:
        model = load_tensors(verified.read_bytes("model.safetensors"))
        tensors = load_tensors(verified.read_bytes("state.safetensors"))
    except (KeyError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"{verified.path}: tensors unreadable ({err})") from None
    try:
        return _assemble(state, model, tensors)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{verified.path}: state does not match its tensors ({err!r})"
        ) from None


def _assemble(
    state: dict[str, Any], model: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
) -> Snapshot:
    for alias, name in state["model_aliases"].items():
        model[alias] = model[name]
    critic: dict[str, torch.Tensor] = {}
    if state.get("critic_aliases") is not None:
        critic = {k[len("critic/") :]: v for k, v in tensors.items() if k.startswith("critic/")}
        for alias, name in state["critic_aliases"].items():
            critic[alias] = critic[name]
    critic_optimizer = (
        _decode_optimizer(state["critic_optimizer"], "critic_optimizer", tensors)
        if state.get("critic_optimizer")
        else {}
    )
    groups = []
    for meta in state["buffer"]["groups"]:
        ordinal = meta["ticket"]["ordinal"]
        groups.append({**meta, **{k: tensors[f"buffer/{ordinal}/{k}"] for k in GROUP_TENSORS}})
    generation: dict[int, dict[str, torch.Tensor]] = {}
    for version, aliases in state.get("generation_aliases", {}).items():
        prefix = f"generation/{version}/"
        weights = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        for alias, name in aliases.items():
            weights[alias] = weights[name]
        generation[int(version)] = weights
    python_rng = state["rng"]["python"]
    return Snapshot(
        trainer=state["trainer"],
        model=model,
        optimizer=_decode_optimizer(state["optimizer"], "optimizer", tensors),
        ledger=state["ledger"],
        buffer={"groups": groups},
        rng={"python": python_rng, "numpy": state["rng"]["numpy"], "torch": tensors["rng/torch"]},
        config=state["config"],
        generation=generation,
        critic=critic,
        critic_optimizer=critic_optimizer,
    )
