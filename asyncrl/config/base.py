"""What every config section shares: the error a user must fix, the resume metadata of a field
and the one-line value check. A module of its own so that sections may live in several files
(`asyncrl.config`, `asyncrl.config.data`) without importing each other in a circle."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config file, key or value the user must fix. The message says where and how."""


ON_RESUME = "on_resume"
"""Field metadata: what a resume may do with a key. Keys without it bear semantics: a resume
that changes one is refused, naming it, unless `--force-config`."""
MAY_CHANGE = {ON_RESUME: "may_change"}
"""It does not change what any step trains."""
MAY_CHANGE_UNLESS_DETERMINISTIC = {ON_RESUME: "may_change_unless_deterministic"}
"""It does not change what a step trains, but it changes the bits (batch shapes and thread
counts change floating-point reduction order): a deterministic run may not change it."""
NEVER_CHANGES = {ON_RESUME: "never"}
"""A checkpoint cannot even be loaded with another value (weight shapes, the buffer's layout):
not even `--force-config` changes it."""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raises `ConfigError` naming `key`, its value and what is allowed, unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}: got {value!r}, must be {allowed}")
