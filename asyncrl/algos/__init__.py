"""The algorithm registry: `algo.name` -> its class (`asyncrl.algos.base.Algorithm`).

Adding an algorithm is one file in this package and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.algos.base import Algorithm

ALGORITHMS: dict[str, str] = {
    "grpo": "asyncrl.algos.grpo:GRPO",
    "ppo": "asyncrl.algos.ppo:PPO",
    "rloo": "asyncrl.algos.rloo:RLOO",
}
"""name -> `module:Class`, imported on first use (so reading a config imports no model code
until it must)."""


def algorithm_class(name: str) -> type[Algorithm]:
    module, _, attr = ALGORITHMS[name].partition(":")
    cls: type[Algorithm] = getattr(importlib.import_module(module), attr)
    return cls
