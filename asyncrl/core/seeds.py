"""Every seed the run derives, in one place: each is SHA-256 of a tag and integers, so the same
inputs give the same 63-bit seed in any process on any machine (never Python's salted `hash`),
and seeds with different tags never coincide by construction of their inputs."""

from __future__ import annotations

import hashlib


def derived_seed(tag: str, *values: int) -> int:
    """The seed of `tag:v1:v2:...`: the first 8 bytes of its SHA-256, little-endian, 63 bits."""
    text = ":".join([tag, *(str(v) for v in values)])
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def noise_seed(seed: int, ordinal: int) -> int:
    """The sampling seed of one group: a function of (run seed, ordinal) only, so a group
    regenerated after a resume draws the same noise."""
    return derived_seed("asyncrl-noise", seed, ordinal)


def eval_seed(seed: int, index: int) -> int:
    """The noise seed of evaluation prompt `index`: apart from every training group's."""
    return derived_seed("asyncrl-eval", seed, index)


def continued_seed(noise_seed: int, sample: int, done: int) -> int:
    """The seed of sample `sample` continued after `done` tokens (vLLM continuations): a
    function of the group's seed and the cut, so a continued sample draws the same noise
    wherever it is resumed."""
    return derived_seed("asyncrl-continued", noise_seed, sample, done)
