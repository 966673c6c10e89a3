"""A `restorable` environment's state (JSON values and tensors) in the steps log's result
records, written with the checkpoint's own tree codec: a JSON tree whose tensors are
references, and the tensors as a safetensors file (no pickle: DESIGN.md I7). So a logged step
is answered from the log whatever its state holds, its tensors bit for bit.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from asyncrl.checkpoint.snapshot import flatten_part, unflatten

STATE_PART = "env_state"
"""The name a state is flattened under (its tensors' prefix)."""


def checked_state(state: Any) -> Any:
    """A copy of `state` (the environment may change its own objects at later steps) once
    checked that a checkpoint can hold it: a `TypeError`, `ValueError` or `RecursionError`
    where it cannot."""
    json.dumps(flatten_part(STATE_PART, state, {}))
    return copy.deepcopy(state)


def encode_state(state: Any) -> dict[str, Any]:
    """The state as a result record holds it: `state`, the JSON tree the checkpoint's codec
    makes of it (`flatten_part`: each tensor a `{"__tensor__": NAME}` reference), and where it
    has tensors, `state_tensors`, their safetensors file as base64. A JSON state is itself."""
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_part(STATE_PART, state, tensors)
    if not tensors:
        return {"state": tree}
    owned = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return {"state": tree, "state_tensors": base64.b64encode(save_tensors(owned)).decode()}


def decode_state(record: dict[str, Any]) -> Any:
    """The state `encode_state` put into a result record, its tensors bit for bit."""
    packed = record.get("state_tensors")
    tensors = load_tensors(base64.b64decode(packed)) if packed else {}
    return unflatten(record["state"], tensors)
