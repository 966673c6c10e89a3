"""The algorithms: `algo.name` -> its class (`asyncrl.algos.base.Algorithm`), imported on first
use. The names and each algorithm's own keys live in `asyncrl/config/algos.py`, torch-free."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from asyncrl.config.algos import ALGORITHMS

if TYPE_CHECKING:
    from asyncrl.algos.base import Algorithm

__all__ = ["ALGORITHMS", "algorithm_class"]


def algorithm_class(name: str) -> type[Algorithm]:
    module, _, attr = ALGORITHMS[name].partition(":")
    cls: type[Algorithm] = getattr(importlib.import_module(module), attr)
    return cls
