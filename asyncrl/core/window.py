"""The look-ahead window: which target steps generation may work on.

A group for target step t may be generated with weights version v only if v >= t - A, so
that when step t trains it, every token came from versions in [t - A, t] (DESIGN.md I2).
Versions only grow, so checking at admission (before pulling from the stream) is enough.
A = 0 admits target t only once version t exists: exactly synchronous training.
"""

from __future__ import annotations


def is_admissible(target_step: int, weights_version: int, window: int) -> bool:
    """True if a group for `target_step` may start generating at `weights_version`."""
    return target_step <= weights_version + window


def staleness(train_step: int, generation_version: int) -> int:
    """Steps between the weights that generated a token and the step that trains it."""
    return train_step - generation_version
