"""A `restorable` environment's state (JSON values and tensors) in the steps log's result
records, written with the checkpoint's own tree codec: a JSON tree whose tensors are
references, and the tensors as a safetensors file (no pickle: DESIGN.md I7). So a logged step
is answered from the log whatever its state holds, its tensors bit for bit.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from asyncrl.checkpoint.snapshot import flatten_part, unflatten

STATE_PART = "env_state"
"""The name a state is flattened under (its tensors' prefix)."""


def encode_state(state: Any) -> tuple[Any, dict[str, Any]]:
    """The state as a result record holds it, and a copy of it the environment no longer
    touches (it may change its own objects at later steps; the copy is what the episode and
    its checkpoint keep). The record: `state`, the JSON tree the checkpoint's codec makes of
    it (`flatten_part`: each tensor a `{"__tensor__": NAME}` reference), and where it has
    tensors, `state_tensors`, their safetensors file as base64; a JSON state is itself. What
    a checkpoint cannot hold raises `TypeError`, `ValueError` or `RecursionError` now."""
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_part(STATE_PART, state, tensors)
    json.dumps(tree)  # checked here, so the error names the step
    owned = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    copy = unflatten(tree, owned)  # new containers throughout, the tensors cloned
    if not tensors:
        return copy, {"state": tree}
    packed = base64.b64encode(save_tensors(owned)).decode()
    return copy, {"state": tree, "state_tensors": packed}


def decode_state(record: dict[str, Any]) -> Any:
    """The state `encode_state` put into a result record, its tensors bit for bit."""
    packed = record.get("state_tensors")
    tensors = load_tensors(base64.b64decode(packed)) if packed else {}
    return unflatten(record["state"], tensors)
