"""Partial generations: the samples of one in-flight group so far.

A chunked engine (`rollout.chunk_tokens`) hands back at most that many new tokens per sample
per pass; the collector appends each chunk to the group's `Partial`, which the ledger keeps
for its in-flight ordinal. A checkpoint saves it with the ledger, so a `lossless` resume
continues every unfinished sample from its last saved token and never generates a finished
sample again. Every token carries the weights version that sampled it.

Plain tensors, no IO: unit-tested in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from asyncrl.core.episodes import Episode
from asyncrl.core.resume import SavedSample

PADDING = (0, False, 0.0, -1, False)
"""What pads tokens, mask, log-probs, versions and the policy mask past a sample's end."""


@dataclass(frozen=True)
class Partial:
    """Per sample (rows): tokens so far, left-aligned, padded after each sample's end."""

    tokens: torch.Tensor  # [G, T] int64
    mask: torch.Tensor  # [G, T] bool: real tokens (EOS included)
    logprobs: torch.Tensor  # [G, T] float32 behaviour log-probs (0 where masked)
    versions: torch.Tensor  # [G, T] int64 weights version of each token (-1 where masked)
    finished: torch.Tensor  # [G] bool: EOS sampled or max_new_tokens reached
    policy: torch.Tensor | None = None
    """[G, T] bool: the tokens the policy sampled (trained); False on an episode's environment
    tokens. None: every real token is the policy's."""
    limits: torch.Tensor | None = None
    """[G] int64: per sample, the length at which the current turn must stop (episodes)."""
    episodes: tuple[Episode, ...] | None = None
    """Per sample, its episode so far (multi-turn: `env.name`). Between engine passes a sample
    is `finished` only when its episode has ended (`Episode.ended`); right after a pass,
    `finished` also marks a turn that ended and awaits its environment step."""

    @classmethod
    def empty(cls, num_samples: int) -> Partial:
        return cls(
            torch.zeros(num_samples, 0, dtype=torch.int64),
            torch.zeros(num_samples, 0, dtype=torch.bool),
            torch.zeros(num_samples, 0, dtype=torch.float32),
            torch.zeros(num_samples, 0, dtype=torch.int64),
            torch.zeros(num_samples, dtype=torch.bool),
        )

    @classmethod
    def episodes_started(cls, episodes: list[Episode], limit: int) -> Partial:
        """No tokens yet for these episodes, each turn stopping at `limit` tokens."""
        empty = cls.empty(len(episodes))
        return replace(
            empty,
            policy=empty.mask.clone(),
            limits=torch.full((len(episodes),), limit, dtype=torch.int64),
            episodes=tuple(episodes),
        )

    @property
    def policy_mask(self) -> torch.Tensor:
        """[G, T] bool: the policy's tokens (the real tokens, without environment tokens)."""
        return self.mask if self.policy is None else self.policy

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

    def saved_samples(self) -> list[SavedSample]:
        """Each sample as a resume plans from it (`asyncrl.core.resume`)."""
        finished = self.finished.tolist()
        if self.episodes is None:
            return [SavedSample(n, finished=f) for n, f in zip(self.lengths, finished, strict=True)]
        return [
            SavedSample(n, e.num_turns, e.ended, f)
            for n, e, f in zip(self.lengths, self.episodes, finished, strict=True)
        ]

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
        policy = torch.zeros(self.num_samples, width, dtype=torch.bool)
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
            policy[i, :n] = self.policy_mask[i, :n]
            policy[i, n : n + a] = True
        return replace(
            self,
            tokens=out[0],
            mask=out[1],
            logprobs=out[2],
            versions=versions,
            finished=self.finished | finished.bool(),
            policy=None if self.policy is None else policy,
        )

    def with_reply(self, sample: int, ids: list[int], limit: int, episode: Episode) -> Partial:
        """Sample `sample` with the environment's reply `ids` appended (not the policy's: no
        log-prob, version -1), its episode `episode`, and its next turn stopping at `limit`."""
        n, a = self.lengths[sample], len(ids)
        tokens, mask, logprobs, versions, policy = self._grown(n + a)
        tokens[sample, n : n + a] = torch.tensor(ids, dtype=torch.int64)
        mask[sample, n : n + a] = True
        return replace(
            self,
            tokens=tokens,
            mask=mask,
            logprobs=logprobs,
            versions=versions,
            policy=policy,
            finished=self.finished.clone().index_fill_(0, torch.tensor([sample]), False),
            limits=self._limits().index_fill_(0, torch.tensor([sample]), limit),
            episodes=self._with_episode(sample, episode),
        )

    def with_turn(
        self, sample: int, start: int, ids: list[int], logprobs: list[float], versions: list[int]
    ) -> Partial:
        """Sample `sample` with the policy's whole turn `ids` from token `start` (its
        log-probs and weights versions, as sampled), whatever of it the sample held replaced,
        and the turn ended (`finished`): a turn recovered from the steps log."""
        n = start + len(ids)
        tokens, mask, logprob, version, policy = self._grown(n)
        for t, value in zip((tokens, mask, logprob, version, policy), PADDING, strict=True):
            t[sample, start:] = value
        tokens[sample, start:n] = torch.tensor(ids, dtype=torch.int64)
        logprob[sample, start:n] = torch.tensor(logprobs, dtype=torch.float32)
        version[sample, start:n] = torch.tensor(versions, dtype=torch.int64)
        mask[sample, start:n] = True
        policy[sample, start:n] = True
        return replace(
            self,
            tokens=tokens,
            mask=mask,
            logprobs=logprob,
            versions=version,
            policy=None if self.policy is None else policy,
            finished=self.finished.clone().index_fill_(0, torch.tensor([sample]), True),
        )

    def with_episode(self, sample: int, episode: Episode, finished: bool) -> Partial:
        """Sample `sample` with its episode `episode`, finished (its episode done) or not."""
        return replace(
            self,
            finished=self.finished.clone().index_fill_(0, torch.tensor([sample]), finished),
            episodes=self._with_episode(sample, episode),
        )

    def truncated(self, sample: int, length: int, limit: int, episode: Episode) -> Partial:
        """Sample `sample` cut back to its first `length` tokens (an episode started over)."""
        keep = torch.arange(self.tokens.shape[1]) < length
        rows = torch.zeros(self.num_samples, 1, dtype=torch.bool)
        rows[sample] = True
        drop = rows & ~keep
        return replace(
            self,
            tokens=self.tokens.masked_fill(drop, 0),
            mask=self.mask & ~drop,
            logprobs=self.logprobs.masked_fill(drop, 0.0),
            versions=self.versions.masked_fill(drop, -1),
            policy=self.policy_mask & ~drop,
            finished=self.finished.clone().index_fill_(0, torch.tensor([sample]), False),
            limits=self._limits().index_fill_(0, torch.tensor([sample]), limit),
            episodes=self._with_episode(sample, episode),
        )

    def _grown(self, length: int) -> list[torch.Tensor]:
        """Copies of tokens, mask, log-probs, versions and the policy mask, at least `length`
        wide (padded with `PADDING`)."""
        width = max(int(self.tokens.shape[1]), length)
        tensors = (self.tokens, self.mask, self.logprobs, self.versions, self.policy_mask)
        return [
            torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)
            for t, v in zip(tensors, PADDING, strict=True)
        ]

    def _limits(self) -> torch.Tensor:
        if self.limits is None:
            return torch.zeros(self.num_samples, dtype=torch.int64)
        return self.limits.clone()

    def _with_episode(self, sample: int, episode: Episode) -> tuple[Episode, ...]:
        if self.episodes is None:
            raise ValueError("this partial has no episodes")
        episodes = list(self.episodes)
        episodes[sample] = episode
        return tuple(episodes)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "tokens": self.tokens,
            "mask": self.mask,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "finished": self.finished,
        }
        if self.episodes is not None:
            state["policy"] = self.policy_mask
            state["limits"] = self._limits()
            state["episodes"] = [e.state_dict() for e in self.episodes]
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Partial:
        episodes = state.get("episodes")
        finished = torch.as_tensor(state["finished"])
        lengths = [int(n) for n in torch.as_tensor(state["mask"]).sum(dim=1)]
        return cls(
            torch.as_tensor(state["tokens"]),
            torch.as_tensor(state["mask"]),
            torch.as_tensor(state["logprobs"]),
            torch.as_tensor(state["versions"]),
            finished,
            policy=torch.as_tensor(state["policy"]) if "policy" in state else None,
            limits=torch.as_tensor(state["limits"]) if "limits" in state else None,
            episodes=None
            if episodes is None
            else tuple(
                Episode.from_state(e, bool(finished[i]), lengths[i]) for i, e in enumerate(episodes)
            ),
        )
