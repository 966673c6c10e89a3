"""Shared helpers for the end-to-end tests: small configs and reading a run dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.config import Config, build_config

DIGITS = "0123456789="
"""The alphabet of the built-in sort_digits task."""

SMALL = [
    "run.max_num_steps=6",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "logging.progress=false",
    "logging.plot=false",
]


def small_config(*overrides: str) -> Config:
    return build_config({}, [*SMALL, *overrides])


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a finished JSON-lines file; a line that does not parse fails the test."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_complete_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that a live process may be writing: only lines already
    ended by their newline (the last one may be half written); none if the file is not there
    yet. For polling a run; read finished files with `read_records`."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
