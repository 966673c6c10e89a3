"""Reward functions: `f(completion: str, answer: str) -> float`, pure and cheap."""

from __future__ import annotations


def partial_match(completion: str, answer: str) -> float:
    """Fraction of positions where the completion has the answer's character, over the
    longer of the two, so missing and extra characters both cost credit. In [0, 1]."""
    length = max(len(completion), len(answer))
    if length == 0:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return hits / length


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion equals the answer after stripping whitespace, else 0.0."""
    return float(completion.strip() == answer.strip())
