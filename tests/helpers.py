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
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
