"""Reward functions that fail on purpose, named as `module:function` by the failure tests."""

from __future__ import annotations

import math


def raises_on_7(completion: str, answer: str) -> float:
    if answer == "7":
        raise ValueError("cannot score answer 7")
    return float(completion == answer)


def nan_on_7(completion: str, answer: str) -> float:
    return math.nan if answer == "7" else float(completion == answer)
