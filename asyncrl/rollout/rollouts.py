"""How a batch's samples are driven: one protocol for every kind (STYLE.md rule 18).

The collector admits tickets and hands each batch to its `Rollout`; the rollout generates the
batch's groups and lands them through the collector's `Landing`, never touching the ledger or
the buffer itself:

    Collector ── generate(tickets, landing) ─▶ Rollout                 (the collector's thread)
                  landing.saved(tickets)    ◀─ the ledger's partials of a resumed/failed batch
                  landing.version_for(...)  ◀─ the weights version a sample asks for
                  landing.land(chunk, progress, groups)  ◀─ after each step of work, under the
                                               collector's lock: timeline row, partials to the
                                               ledger, finished groups to the buffer
                  landing.stopping          ◀─ polled between steps: return, partials kept

Kinds: `SingleTurns` (a completion per sample, scored by the task's reward) and `EpisodeTurns`
(a multi-turn episode per sample, with an environment) share the chunked engine pass loop of
`PassRollout`; an agent run (`asyncrl/agents/`) is a third `Rollout`. A new kind is a new
class here or beside it, never a branch in the collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from asyncrl.core.partial import Partial
from asyncrl.core.seeds import noise_seed
from asyncrl.core.types import Group, PromptTicket
from asyncrl.rollout.engine import GenerationEngine, GenerationOutput, GenerationRequest
from asyncrl.rollout.episodes import EpisodeRunner
from asyncrl.rollout.scorer import Scored


class RolloutFatal(RuntimeError):
    """A failure that retrying cannot mend (an agent that failed `agent.retries` times): the
    collector stops generation at once, with no retry whatever `rollout.max_generation_failures`
    allows, and the trainer raises `GenerationFailed` naming this message. Any other exception
    from `Rollout.generate` fails the batch, which is retried."""


@dataclass(frozen=True)
class Chunk:
    """One engine pass of a batch, for the timeline: which tickets, with which weights, and
    per ticket and sample the index of its first new token and how many it got."""

    start: float  # time.perf_counter()
    seconds: float  # generation and scoring
    version: int
    tickets: list[PromptTicket]
    token_starts: list[list[int]]
    token_counts: list[list[int]]
    landed: list[int] = field(default_factory=list)
    """Ordinals whose groups finished with this chunk and went to the buffer."""
    chunks: int = 1
    """Engine passes this record covers (`merged`: consecutive passes over the same tickets
    with the same weights are one timeline row)."""

    def merged(self, later: Chunk) -> Chunk:
        """This pass and the `later` one over the same tickets and version as one: from this
        start, their seconds and token counts added (a sample's tokens are contiguous)."""
        assert later.version == self.version and later.ordinals == self.ordinals
        counts = [
            [a + b for a, b in zip(x, y, strict=True)]
            for x, y in zip(self.token_counts, later.token_counts, strict=True)
        ]
        return replace(
            self,
            seconds=self.seconds + later.seconds,
            token_counts=counts,
            landed=later.landed,
            chunks=self.chunks + later.chunks,
        )

    @property
    def ordinals(self) -> tuple[int, ...]:
        return tuple(t.ordinal for t in self.tickets)


def make_group(
    ticket: PromptTicket,
    prompt_ids: list[int],
    output: GenerationOutput,
    rewards: torch.Tensor,
    generation_s: float,
    token_versions: torch.Tensor | None = None,
    reward_components: dict[str, torch.Tensor] | None = None,
    loss_mask: torch.Tensor | None = None,
) -> Group:
    """The buffered group; `token_versions` ([G, T], -1 where masked) when its tokens were
    sampled by more than one weights version, else every token is `output.weights_version`;
    `loss_mask` ([G, T]) the policy's tokens of episodes (environment tokens are not)."""
    policy = output.completion_mask if loss_mask is None else loss_mask
    if token_versions is None:
        token_versions = torch.where(policy, output.weights_version, -1)
    used = token_versions[policy]
    versions = used if used.numel() else torch.tensor([output.weights_version])
    mixed = int(versions.min()) != int(versions.max())
    return Group(
        ticket=ticket,
        prompt_ids=prompt_ids,
        completion_ids=output.completion_ids,
        completion_mask=output.completion_mask,
        behaviour_logprobs=output.logprobs,
        rewards=rewards,
        version_min=int(versions.min()),
        version_max=int(versions.max()),
        generation_s=generation_s,
        token_versions=token_versions if mixed else None,
        reward_components=reward_components or {},
        loss_mask=loss_mask,
    )


class Landing(Protocol):
    """The collector as a rollout sees it (`Collector` implements it). Called from the
    collector's generation thread only."""

    @property
    def stopping(self) -> bool:
        """A stop was asked: `generate` returns at its next step boundary."""
        ...

    def saved(self, tickets: list[PromptTicket]) -> dict[int, Partial | None]:
        """By ordinal, the partial the ledger holds for each ticket (a resumed or failed
        batch's samples so far), or None."""
        ...

    def land(self, chunk: Chunk | None, progress: dict[int, Partial], groups: list[Group]) -> None:
        """One consistent step, under the collector's lock: `chunk` (an engine pass; None for
        groups landed without one) becomes a timeline row with `landed` set to `groups`'
        ordinals, each unfinished ticket's partial in `progress` goes to the ledger (a
        checkpoint saves it), each finished group to the buffer, its ordinal completed. After
        the lock, with a chunk: the fault points `collector.group_buffered` (if groups landed)
        and `collector.chunk_done`."""
        ...

    def version_for(self, ticket: PromptTicket, partial: Partial | None) -> int | None:
        """The weights version the ticket's next generation asks for (None: the engine's
        newest): `max(0, target - A)` with pinned versions (`run.deterministic`); else a
        continued sample's (its partial's newest policy token's, while kept); else the
        newest published."""
        ...

    def newest(self) -> int | None:
        """The newest published weights version (None without a weight sync: the engine's)."""
        ...


class Rollout(Protocol):
    """One kind of sample: what the collector drives a batch through."""

    def generate(self, tickets: list[PromptTicket], landing: Landing) -> None:
        """Generates the tickets' groups, landing each as it finishes (`landing.land`).
        Returns when every ticket landed, or at a step boundary once `landing.stopping`: the
        unfinished tickets stay in flight, their partials in the ledger where this kind keeps
        any (else they start again). Raises to fail the batch (it is retried), or
        `RolloutFatal` to stop generation."""
        ...

    def halt(self) -> None:
        """Ends the generation in progress where it can (another thread calls this after a
        stop was asked): the work done so far lands as partials. Does not wait."""
        ...


@dataclass(frozen=True)
class PassOptions:
    """How a `PassRollout` drives its engine."""

    engine: GenerationEngine
    num_generations: int  # G: samples per group
    seed: int  # run.seed: each ordinal's sampling noise (`noise_seed`)
    pad_id: int = 0
    chunk_tokens: int = 0  # at most this many new tokens per sample and pass; 0: one pass
    mid_generation_updates: bool = False  # every pass on the newest published weights


class PassRollout:
    """A batch in engine passes of at most `chunk_tokens` tokens per sample (0: one pass).
    After each pass its unfinished groups' partials go to the ledger and its finished groups,
    scored, to the buffer (`Landing.land`). A stop ends the batch between passes. A batch's
    tickets ask for the same weights version for all their passes (the first pass's) unless
    `mid_generation_updates`; tickets that ask for different versions (pinned) pass
    separately. A kind fills in the hooks: `open`, `prompt`, `score`, and where it needs them
    `before_pass`, `after_pass` and `forget`."""

    def __init__(self, options: PassOptions) -> None:
        self.options = options
        self._scores: dict[int, Scored] = {}  # scored, not yet landed

    # --- the hooks of a kind

    def open(self, ticket: PromptTicket, saved: Partial | None) -> Partial:
        """The ticket's samples so far: its saved partial (a resumed or failed batch's), or
        none yet."""
        raise NotImplementedError

    def prompt(self, ticket: PromptTicket) -> list[int]:
        """The group's prompt tokens."""
        raise NotImplementedError

    def score(self, done: list[tuple[PromptTicket, Partial]]) -> list[Scored]:
        """The finished groups' rewards, in order (called for every pass, `done` maybe
        empty)."""
        raise NotImplementedError

    def before_pass(self) -> None:
        """Right before an engine pass."""

    def after_pass(self, tickets: list[PromptTicket], partials: dict[int, Partial]) -> None:
        """Right after an engine pass over `tickets`, their partials extended (may update
        `partials`)."""

    def forget(self, ordinals: list[int]) -> None:
        """These groups landed."""

    # --- the loop

    def halt(self) -> None:
        """The engine stops after the token it is sampling where it can (`stop_generating`:
        the torch engine)."""
        stop_generating = getattr(self.options.engine, "stop_generating", None)
        if callable(stop_generating):
            stop_generating()

    def generate(self, tickets: list[PromptTicket], landing: Landing) -> None:
        mid = self.options.mid_generation_updates
        self._scores.clear()  # a failed batch's scores are stale
        saved = landing.saved(tickets)
        partials = {t.ordinal: self.open(t, saved[t.ordinal]) for t in tickets}
        self._land_recovered(tickets, partials, landing)
        wanted: dict[int, int | None] = {}
        if not mid:
            wanted = {t.ordinal: landing.version_for(t, partials[t.ordinal]) for t in tickets}
        seconds = dict.fromkeys(partials, 0.0)
        while open_tickets := [t for t in tickets if not partials[t.ordinal].done]:
            if mid:  # every pass on the newest weights, in one call
                wanted = dict.fromkeys(partials, landing.newest())
            by_version: dict[int | None, list[PromptTicket]] = {}
            for t in open_tickets:
                by_version.setdefault(wanted[t.ordinal], []).append(t)
            for version, group in by_version.items():
                chunk = self._chunk(group, partials, version)
                for t in group:
                    seconds[t.ordinal] += chunk.seconds / len(group)
                    if not mid:
                        wanted[t.ordinal] = chunk.version  # the rest of the batch keeps it
                landed = [t for t in group if partials[t.ordinal].done]
                groups = [self._group(t, partials[t.ordinal], seconds[t.ordinal]) for t in landed]
                progress = {
                    t.ordinal: partials[t.ordinal] for t in group if not partials[t.ordinal].done
                }
                landing.land(chunk, progress, groups)  # one pass's results land together
                self.forget([t.ordinal for t in landed])
            if landing.stopping:
                break  # between passes: the partials are in the ledger

    def _land_recovered(
        self, tickets: list[PromptTicket], partials: dict[int, Partial], landing: Landing
    ) -> None:
        """Groups that open finished land without an engine pass: every episode recovered to
        its end by the steps log (`EpisodeRunner.open`), or every sample kept finished at a
        preemption notice (`asyncrl.core.kept`), scored now."""
        done = [t for t in tickets if partials[t.ordinal].done]
        if not done:
            return
        scores = self.score([(t, partials[t.ordinal]) for t in done])
        self._scores.update({t.ordinal: s for t, s in zip(done, scores, strict=True)})
        landing.land(None, {}, [self._group(t, partials[t.ordinal], 0.0) for t in done])
        self.forget([t.ordinal for t in done])

    def _chunk(
        self, tickets: list[PromptTicket], partials: dict[int, Partial], version: int | None
    ) -> Chunk:
        """One engine pass over `tickets`; their partials are extended in `partials`, the
        finished ones scored."""
        options = self.options
        requests = []
        for t in tickets:
            p = partials[t.ordinal]
            started = bool(p.tokens.shape[1])
            requests.append(
                GenerationRequest(
                    prompt_ids=self.prompt(t),
                    num_samples=options.num_generations,
                    noise_seed=noise_seed(options.seed, t.ordinal),
                    prefixes=p.prefixes() if started else (),
                    finished=tuple(bool(f) for f in p.finished) if started else (),
                    limits=() if p.limits is None else tuple(int(n) for n in p.limits),
                )
            )
        self.before_pass()
        start = time.perf_counter()
        outputs = options.engine.generate(requests, version, options.chunk_tokens or None)
        starts, counts = [], []
        for t, out in zip(tickets, outputs, strict=True):
            before = partials[t.ordinal]
            partials[t.ordinal] = before.extend(
                out.completion_ids,
                out.completion_mask,
                out.logprobs,
                out.weights_version,
                out.finished_rows(),
            )
            starts.append(before.lengths)
            counts.append([int(n) for n in out.completion_mask.sum(dim=1)])
        self.after_pass(tickets, partials)
        # scoring is the collector's work, counted in the chunk's seconds; the finished groups
        # of a chunk are scored together (in parallel when rewards have worker processes)
        done = [t for t in tickets if partials[t.ordinal].done]
        scores = self.score([(t, partials[t.ordinal]) for t in done])
        self._scores.update({t.ordinal: s for t, s in zip(done, scores, strict=True)})
        return Chunk(
            start=start,
            seconds=time.perf_counter() - start,
            version=outputs[0].weights_version,
            tickets=tickets,
            token_starts=starts,
            token_counts=counts,
        )

    def output(self, partial: Partial) -> GenerationOutput:
        """A finished partial as one engine output (padding after each sample's end)."""
        tokens = torch.where(partial.mask, partial.tokens, self.options.pad_id)
        used = partial.versions[partial.policy_mask]
        version = int(used.max()) if used.numel() else 0
        return GenerationOutput(tokens, partial.mask, partial.logprobs, version, partial.finished)

    def _group(self, ticket: PromptTicket, partial: Partial, seconds: float) -> Group:
        output = self.output(partial)
        versions = torch.where(partial.policy_mask, partial.versions, -1)
        scored = self._scores.pop(ticket.ordinal)
        return make_group(
            ticket,
            self.prompt(ticket),
            output,
            scored.rewards,
            seconds,
            versions,
            scored.components,
            None if partial.policy is None else partial.policy_mask.clone(),
        )


class SingleTurns(PassRollout):
    """A completion per sample, of the dataset row's prompt, scored by the task's reward."""

    def __init__(
        self,
        options: PassOptions,
        prompts: Sequence[list[int]],
        scorer: Callable[[list[tuple[PromptTicket, GenerationOutput]]], list[Scored]],
    ) -> None:
        super().__init__(options)
        self.prompts = prompts  # by dataset index, encoded
        self.scorer = scorer

    def open(self, ticket: PromptTicket, saved: Partial | None) -> Partial:
        return saved if saved is not None else Partial.empty(self.options.num_generations)

    def prompt(self, ticket: PromptTicket) -> list[int]:
        return list(self.prompts[ticket.dataset_index])

    def score(self, done: list[tuple[PromptTicket, Partial]]) -> list[Scored]:
        return self.scorer([(t, self.output(p)) for t, p in done])


class EpisodeTurns(PassRollout):
    """A multi-turn episode per sample, played with an environment by `runner`: its
    environments are opened (reset, or restored from the partial), every ended turn gets its
    environment's step after a pass (asked in the steps log, made durable first), and an
    episode's reward is its environment's."""

    def __init__(self, options: PassOptions, runner: EpisodeRunner) -> None:
        super().__init__(options)
        self.runner = runner

    def open(self, ticket: PromptTicket, saved: Partial | None) -> Partial:
        return self.runner.open(ticket, saved, self.options.num_generations)

    def prompt(self, ticket: PromptTicket) -> list[int]:
        return self.runner.prompt(ticket)

    def score(self, done: list[tuple[PromptTicket, Partial]]) -> list[Scored]:
        return [self.runner.scores(p) for _, p in done]

    def before_pass(self) -> None:
        self.runner.log.mark()  # the ledger holds every step asked so far

    def after_pass(self, tickets: list[PromptTicket], partials: dict[int, Partial]) -> None:
        stepped = self.runner.advance_all([(t, partials[t.ordinal]) for t in tickets])
        partials.update({t.ordinal: p for t, p in zip(tickets, stepped, strict=True)})

    def forget(self, ordinals: list[int]) -> None:
        for ordinal in ordinals:
            self.runner.forget(ordinal)
