"""Partial generations: the samples of one in-flight group so far.

A chunked engine (`rollout.chunk_tokens`) hands back at most that many new tokens per sample
per pass; the collector appends each chunk to the group's `Partial`, which the ledger keeps
for its in-flight ordinal. A checkpoint saves it with the ledger, so a `lossless` resume
continues every unfinished sample from its last saved token and never generates a finished
sample again. Every token carries the weights version that sampled it.

Plain tensors, no IO: unit-tested in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Partial:
    """Per sample (rows): tokens so far, left-aligned, padded after each sample's end."""

    tokens: torch.Tensor  # [G, T] int64
    mask: torch.Tensor  # [G, T] bool: real tokens (EOS included)
    logprobs: torch.Tensor  # [G, T] float32 behaviour log-probs (0 where masked)
    versions: torch.Tensor  # [G, T] int64 weights version of each token (-1 where masked)
    finished: torch.Tensor  # [G] bool: EOS sampled or max_new_tokens reached

    @classmethod
    def empty(cls, num_samples: int) -> Partial:
        return cls(
            torch.zeros(num_samples, 0, dtype=torch.int64),
            torch.zeros(num_samples, 0, dtype=torch.bool),
            torch.zeros(num_samples, 0, dtype=torch.float32),
            torch.zeros(num_samples, 0, dtype=torch.int64),
            torch.zeros(num_samples, dtype=torch.bool),
        )

    @property
    def num_samples(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def lengths(self) -> list[int]:
        """Tokens generated so far, per sample."""
        return [int(n) for n in self.mask.sum(dim=1)]

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def prefixes(self) -> tuple[tuple[int, ...], ...]:
        """Each sample's tokens so far, for the engine to continue from."""
        return tuple(
            tuple(int(x) for x in row[m]) for row, m in zip(self.tokens, self.mask, strict=True)
        )

    def extend(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        logprobs: torch.Tensor,
        version: int,
        finished: torch.Tensor,
    ) -> Partial:
        """This partial with one chunk appended: `[G, C]` new tokens per sample (masked rows
        for samples that were already finished), sampled with weights `version`. Each sample's
        new tokens go right after its own last token."""
        if tokens.shape[0] != self.num_samples:
            raise ValueError(f"a chunk of {tokens.shape[0]} samples for {self.num_samples}")
        if bool((mask.any(dim=1) & self.finished).any()):
            raise ValueError("a chunk continues a finished sample")
        lengths = self.mask.sum(dim=1)
        added = mask.sum(dim=1)
        width = int((lengths + added).max()) if self.num_samples else 0
        out = [
            torch.zeros(self.num_samples, width, dtype=t.dtype)
            for t in (self.tokens, self.mask, self.logprobs)
        ]
        versions = torch.full((self.num_samples, width), -1, dtype=torch.int64)
        for i in range(self.num_samples):
            n, a = int(lengths[i]), int(added[i])
            new = mask[i]
            for dst, old, chunk in zip(
                out, (self.tokens, self.mask, self.logprobs), (tokens, mask, logprobs), strict=True
            ):
                dst[i, :n] = old[i, :n]
                dst[i, n : n + a] = chunk[i][new]
            versions[i, :n] = self.versions[i, :n]
            versions[i, n : n + a] = version
        return Partial(out[0], out[1], out[2], versions, self.finished | finished.bool())

    def state_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "mask": self.mask,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "finished": self.finished,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Partial:
        return cls(
            torch.as_tensor(state["tokens"]),
            torch.as_tensor(state["mask"]),
            torch.as_tensor(state["logprobs"]),
            torch.as_tensor(state["versions"]),
            torch.as_tensor(state["finished"]),
        )
