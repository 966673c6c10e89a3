"""A dense reward for tests that train a random-init model with a large vocabulary: on
`sort_digits`, partial_match is 0 for nearly every sample of such a model (a group with equal
rewards has no gradient), while the share of digits in a completion varies from sample to
sample."""

from __future__ import annotations


def digit_fraction(completion: str, answer: str) -> float:
    """Share of the completion's characters that are digits; 0 for an empty completion."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
