"""Reading checkpoints of format 1 (asyncrl before checkpoints were a dict of named parts).

Format 1 kept fixed fields — model, optimizer, ledger (with the stream inside), buffer, rng,
and for PPO `critic`/`critic_optimizer`, for deterministic mode `generation` — in the same
three files format 2 uses. `parts_from_v1` maps them onto today's named parts, so a run dir
written then resumes today (tests/test_checkpoint_compat.py holds such run dirs).
"""

from __future__ import annotations

from typing import Any

import torch

GROUP_TENSORS = ("completion_ids", "completion_mask", "behaviour_logprobs", "rewards")


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


def parts_from_v1(
    state: dict[str, Any], model: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The named parts of a format-1 checkpoint: its `state.json`, `model.safetensors` and
    `state.safetensors` contents."""
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
    trainer = dict(state["trainer"])
    algorithm: dict[str, Any] = {
        "name": state["config"]["algo"]["name"],
        "optimizer": _decode_optimizer(state["optimizer"], "optimizer", tensors),
        "reference_sha256": trainer.pop("reference_sha256", None),
    }
    if state.get("critic_aliases") is not None:
        algorithm["critic"] = critic
        algorithm["critic_optimizer"] = critic_optimizer
    rng = {"python": state["rng"]["python"], "numpy": state["rng"]["numpy"]}
    return {
        "trainer": trainer,
        "model": model,
        "algorithm": algorithm,
        "rng": {**rng, "torch": tensors["rng/torch"]},
        "stream": state["ledger"]["stream"],
        "ledger": {"in_flight": state["ledger"]["in_flight"]},
        "buffer": {"groups": groups},
        "generation": {"versions": generation},
    }


def json_parts_from_v1(state: dict[str, Any]) -> dict[str, Any]:
    """The JSON-only view of a format-1 checkpoint's parts (no tensors): what `inspect` and
    the coherence check read."""
    trainer = dict(state["trainer"])
    algorithm: dict[str, Any] = {
        "name": state["config"]["algo"]["name"],
        "reference_sha256": trainer.pop("reference_sha256", None),
    }
    if state.get("critic_aliases") is not None:
        algorithm["critic"] = {}
    return {
        "trainer": trainer,
        "algorithm": algorithm,
        "stream": state["ledger"]["stream"],
        "ledger": {"in_flight": state["ledger"]["in_flight"]},
        "buffer": {"groups": state["buffer"]["groups"]},
    }
