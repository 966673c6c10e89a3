"""The collector: a background worker that keeps generation ahead of the trainer.

    loop:
      admit tickets from the stream while their target is inside the window  (before pulling)
      generate their groups in one batch with the newest published weights,
        in chunks of `chunk_tokens` tokens per sample if set: after each chunk the unfinished
        groups' partial samples go to the ledger, the finished groups on
      score each sample, stamp the group (ordinal, target, versions), add it to the buffer
      if nothing is admissible: wait for the trainer to publish a new weights version

Admission is checked against the newest *published* version, which the engine uses from its
next batch on, so every group trained at step t was generated with versions >= t - A (with
mid-generation updates a group's later chunks use newer versions; its oldest token still
obeys the bound).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from asyncrl.core.buffer import Buffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.partial import Partial
from asyncrl.core.seeds import noise_seed
from asyncrl.core.types import Group, PromptTicket
from asyncrl.faults import fault_point
from asyncrl.models.threads import CoreShare
from asyncrl.rollout.engine import GenerationEngine, GenerationOutput, GenerationRequest
from asyncrl.rollout.episodes import EpisodeRunner
from asyncrl.rollout.scorer import Scored
from asyncrl.rollout.weight_sync import WeightSource


class GenerationFailed(RuntimeError):
    """Generation failed `rollout.max_generation_failures` times in a row, or can never complete
    a step; the cause is chained."""


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


MAX_MERGED = 32
MAX_MERGED_S = 10.0
"""A timeline row covers at most this many engine passes, or about this many seconds."""


class Collector:
    """Runs generation on a background thread until `stop()`.

    One lock (`_cond`) guards admission (ledger.admit) and completion (a whole batch's
    buffer.add together with ledger.complete), so `snapshot()` under the same lock always sees
    every ordinal in exactly one place: pending, in flight or buffered. Generation itself runs
    outside the lock.
    """

    def __init__(
        self,
        ledger: Ledger,
        buffer: Buffer,
        engine: GenerationEngine,
        prompts: Sequence[list[int]],
        scorer: Callable[[list[tuple[PromptTicket, GenerationOutput]]], list[Scored]],
        num_generations: int,
        window: int,
        seed: int,
        groups_per_batch: int,
        end_target: int,
        on_batch: Callable[[Chunk], None] | None = None,
        pin_versions: bool = False,
        max_failures: int = 3,
        pad_id: int = 0,
        chunk_tokens: int = 0,
        mid_generation_updates: bool = False,
        weights: WeightSource | None = None,
        episodes: EpisodeRunner | None = None,
        cores: CoreShare | None = None,
    ) -> None:
        self.ledger = ledger
        self.buffer = buffer
        self.engine = engine
        self.prompts = prompts
        self.scorer = scorer
        self.num_generations = num_generations
        self.window = window
        self.seed = seed
        self.groups_per_batch = groups_per_batch
        self.end_target = end_target  # run.max_num_steps: no group for a step that never trains
        self.on_batch = on_batch
        self.pin_versions = pin_versions
        self.max_failures = max_failures
        self.pad_id = pad_id
        self.chunk_tokens = chunk_tokens  # 0: each batch in one engine pass
        self.mid_generation_updates = mid_generation_updates
        self.weights = weights  # the engine's weights versions, to pin a continued sample's
        self.episodes = episodes  # multi-turn: each sample an episode with an environment
        self.cores = cores or CoreShare(0)  # this thread's torch threads while it generates
        self._scores: dict[int, Scored] = {}  # scored, not yet buffered
        self.num_failures = 0  # every failed batch, for the metrics
        self._consecutive_failures = 0
        self._version = 0  # the newest published version; the trainer publishes on resume
        self._cond = threading.Condition()
        self._stop = False
        self._abandoned = False
        self._error: BaseException | None = None
        self._died: BaseException | None = None  # what ended the generation thread last
        self._spans: dict[tuple[int, tuple[int, ...]], Chunk] = {}
        """The engine passes not yet recorded (`on_batch`): at most one row, by its version
        and tickets; guarded by `_cond`. Written when groups land, at a cut, when another
        run of passes starts, when the batch ends and past `MAX_MERGED`."""
        self._thread = threading.Thread(target=self._run, name="asyncrl-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stops admitting and waits for the engine call in progress (a batch, or one chunk of
        it: a chunked batch stops between chunks, its partials in the ledger) to end (at most
        `timeout_s`, if given; one still running then is abandoned, its ordinals in flight in
        the ledger)."""
        self._ask_stop()
        if self._thread.is_alive() and not self._abandoned:
            self._thread.join(timeout_s)

    def halt(self) -> None:
        """Stops admitting, and ends the engine call in progress where the engine can
        (`stops_early`: the torch engine after the token it is sampling; the batch's tokens go
        to the ledger as partials, in flight). For a run that is stopping: the engine
        generates nothing more. Does not wait (`join`)."""
        self._ask_stop()
        stop_generating = getattr(self.engine, "stop_generating", None)
        if callable(stop_generating):
            stop_generating()

    def _ask_stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout_s: float) -> bool:
        """Waits at most `timeout_s` for the generation thread to end; whether it has."""
        self._thread.join(max(0.0, timeout_s))
        return not self._thread.is_alive()

    def abandon(self) -> None:
        """Gives up a generation thread still stuck in a call (a wedged server, a reward that
        never returns): `stop` no longer waits for it. Its ordinals stay in flight, as the
        checkpoint holds them."""
        self._abandoned = True

    def publish_version(self, version: int) -> None:
        """Tells the collector that weights `version` were handed to the engine."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def check(self) -> None:
        """Raises `GenerationFailed` if generation gave up; restarts a dead worker thread. The
        trainer calls this while it waits."""
        if self._error is not None:
            raise GenerationFailed(
                f"generation failed {self.max_failures} times in a row; last: {self._error}"
            ) from self._error
        self.ensure_running()

    def check_step_can_complete(self, target_step: int, num_prompts_per_step: int) -> None:
        """Raises if `target_step` can never get its N groups: fewer are buffered, in flight or
        still to come from the stream than it needs (a deadlock guard: the trainer would
        otherwise wait forever)."""
        with self._cond:
            counts = self.buffer.counts_by_target().get(target_step, 0)
            counts += sum(1 for t in self.ledger.unfinished() if t.target_step == target_step)
            if self.ledger.stream.peek_target() <= target_step:
                return  # the stream still hands out ordinals for it
        if counts < num_prompts_per_step:
            raise GenerationFailed(
                f"step {target_step} can never be trained: only {counts} of its "
                f"{num_prompts_per_step} groups are buffered or in flight, and the stream has "
                "moved past it (the ledger and buffer disagree)"
            )

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        """Holds admission and completion while the block runs, so ledger, stream and buffer
        read inside it are one consistent cut: every ordinal in exactly one place. Generation
        itself goes on."""
        with self._cond:
            self._record_spans()  # the cut's partials: their tokens are on the record first
            yield

    def _record_spans(self) -> None:
        """Writes the pending timeline row, if any. Called under `_cond`."""
        for chunk in self._spans.values():
            if self.on_batch is not None:
                self.on_batch(chunk)
        self._spans = {}

    def _add_span(self, chunk: Chunk) -> None:
        """Adds an engine pass to the pending row (called under `_cond`): merged with it if
        that row is of the same tickets and version (the pass right before), else after
        writing it, so rows stay in the order their passes ran; written at once if groups
        landed with it (before they can be checkpointed), or once it covers `MAX_MERGED`
        passes or `MAX_MERGED_S` seconds (what a SIGKILL can take off the record)."""
        key = (chunk.version, chunk.ordinals)
        if key in self._spans:
            chunk = self._spans[key].merged(chunk)
        else:
            self._record_spans()
        self._spans = {key: chunk}
        if chunk.landed or chunk.chunks >= MAX_MERGED or chunk.seconds >= MAX_MERGED_S:
            self._record_spans()

    def _admit(self) -> list[PromptTicket]:
        with self._cond:
            while not self._stop:
                tickets = self.ledger.admit(
                    self._version, self.window, self.groups_per_batch, self.end_target
                )
                if tickets:
                    return tickets
                self._cond.wait(timeout=0.5)
            return []

    def _run(self) -> None:
        try:
            self._batches()
        except BaseException as err:  # the thread dies: `ensure_running` restarts it, counted
            self._died = err
            raise

    def _batches(self) -> None:
        """Generates batch after batch. A failed batch goes back to the front of the queue and
        is tried again; `max_failures` failures in a row stop generation for good."""
        while tickets := self._admit():
            try:
                with self.cores.busy():
                    self._generate(tickets)
                self._consecutive_failures = 0
            except KeyboardInterrupt:
                raise
            except BaseException as err:  # SystemExit from a helper too: counted, reported
                with self._cond:
                    self._record_spans()  # what the batch generated before it failed
                    self.ledger.fail([t for t in tickets if t.ordinal in self.ledger.in_flight])
                if self._stop:
                    return  # the run is ending; its logs may already be closed
                self.num_failures += 1
                self._consecutive_failures += 1
                print(f"asyncrl: generation failed ({self._consecutive_failures} in a row): {err}")
                if self._consecutive_failures >= self.max_failures:
                    self._error = err
                    return

    def ensure_running(self) -> None:
        """Restarts the worker thread if it died without being stopped, counted as a failure
        in a row like a failed batch (`max_failures` of them stop generation for good); its
        in-flight tickets go back to the front of the queue."""
        if self._thread.is_alive() or self._stop or self._error is not None:
            return
        with self._cond:
            self.ledger.fail(list(self.ledger.in_flight.values()))
        self.num_failures += 1
        self._consecutive_failures += 1
        print(
            f"asyncrl: the generation thread died ({self._consecutive_failures} in a row): "
            f"{self._died!r}"
        )
        if self._consecutive_failures >= self.max_failures:
            self._error = RuntimeError(f"the generation thread died: {self._died!r}")
            return
        self._thread = threading.Thread(target=self._run, name="asyncrl-collector", daemon=True)
        self._thread.start()

    def _generate(self, tickets: list[PromptTicket]) -> None:
        """Generates the batch's groups, a chunk of at most `chunk_tokens` tokens per sample
        at a time (0: in one pass). After each chunk, under the lock, every unfinished group's
        partial goes to the ledger (a checkpoint saves it) and every finished group to the
        buffer. A stop request ends the batch between chunks, its partials kept."""
        self._scores.clear()  # a failed batch's scores are stale
        with self._cond:
            saved = {t.ordinal: self.ledger.partials.get(t.ordinal) for t in tickets}
        partials = {t.ordinal: self._opened(t, saved[t.ordinal]) for t in tickets}
        self._land_recovered(tickets, partials)
        wanted = {t.ordinal: self._wanted_version(t, partials[t.ordinal]) for t in tickets}
        seconds = dict.fromkeys(partials, 0.0)
        while open_tickets := [t for t in tickets if not partials[t.ordinal].done]:
            if self.mid_generation_updates:  # every chunk on the newest weights, in one call
                wanted = dict.fromkeys(wanted, self._newest())
            by_version: dict[int | None, list[PromptTicket]] = {}
            for t in open_tickets:
                by_version.setdefault(wanted[t.ordinal], []).append(t)
            for version, group in by_version.items():
                chunk = self._chunk(group, partials, version)
                for t in group:
                    seconds[t.ordinal] += chunk.seconds / len(group)
                    if not self.mid_generation_updates:
                        wanted[t.ordinal] = chunk.version  # the rest of the batch keeps it
                landed = [t for t in group if partials[t.ordinal].done]
                groups = [self._group(t, partials[t.ordinal], seconds[t.ordinal]) for t in landed]
                with self._cond:  # one chunk's results land together
                    self._add_span(replace(chunk, landed=[t.ordinal for t in landed]))
                    for t in group:
                        if partials[t.ordinal].done:
                            continue
                        self.ledger.progress(t.ordinal, partials[t.ordinal])
                    for g in groups:
                        self.buffer.add(g)
                        self.ledger.complete(g.ordinal)
                        if self.episodes is not None:
                            self.episodes.forget(g.ordinal)
                if groups:
                    fault_point("collector.group_buffered")
                fault_point("collector.chunk_done")
            if self._stop:
                break  # between chunks: the partials are in the ledger
        with self._cond:
            self._record_spans()  # the batch's last rows

    def _land_recovered(self, tickets: list[PromptTicket], partials: dict[int, Partial]) -> None:
        """Groups that open finished go to the buffer without an engine pass: every episode
        recovered to its end by the steps log (`EpisodeRunner.open`), or every sample kept
        finished at a preemption notice (`asyncrl.core.kept`), scored now."""
        done = [t for t in tickets if partials[t.ordinal].done]
        if not done:
            return
        if self.episodes is not None:
            scores = [self.episodes.scores(partials[t.ordinal]) for t in done]
        else:
            scores = self.scorer([(t, self._output(partials[t.ordinal])) for t in done])
        self._scores.update({t.ordinal: s for t, s in zip(done, scores, strict=True)})
        groups = [self._group(t, partials[t.ordinal], 0.0) for t in done]
        with self._cond:
            for g in groups:
                self.buffer.add(g)
                self.ledger.complete(g.ordinal)
                if self.episodes is not None:
                    self.episodes.forget(g.ordinal)

    def _opened(self, ticket: PromptTicket, saved: Partial | None) -> Partial:
        """The ticket's samples so far: its saved partial (a resumed or failed batch's), or
        none yet; episodes get their environments (reset, or restored from the partial)."""
        if self.episodes is None:
            return saved if saved is not None else Partial.empty(self.num_generations)
        return self.episodes.open(ticket, saved, self.num_generations)

    def _prompt(self, ticket: PromptTicket) -> list[int]:
        if self.episodes is not None:
            return self.episodes.prompt(ticket)
        return list(self.prompts[ticket.dataset_index])

    def _wanted_version(self, ticket: PromptTicket, partial: Partial) -> int | None:
        """The weights version a ticket's next chunk asks for (None: the newest published)."""
        if self.pin_versions:  # deterministic mode: target t always uses version max(0, t - A)
            return max(0, ticket.target_step - self.window)
        if self.mid_generation_updates or not partial.num_tokens:
            return self._newest()
        version = int(partial.versions[partial.policy_mask].max())  # a continued sample keeps them
        # unless they are no longer kept (a run resumed with chunking or pinning switched off):
        # then it is finished on the newest, each token keeping its own version
        return version if self.weights is None or self.weights.has(version) else self._newest()

    def _newest(self) -> int | None:
        """The newest published version, as `publish_version` announced it (None without
        `weights`: the engine's newest)."""
        if self.weights is None:
            return None
        # the sync may already hold (only) the next version while its announcement is on its way
        return self._version if self.weights.has(self._version) else self.weights.newest()

    def _chunk(
        self, tickets: list[PromptTicket], partials: dict[int, Partial], version: int | None
    ) -> Chunk:
        """One engine pass over `tickets`; their partials are extended in `partials`."""
        requests = []
        for t in tickets:
            p = partials[t.ordinal]
            started = bool(p.tokens.shape[1])
            requests.append(
                GenerationRequest(
                    prompt_ids=self._prompt(t),
                    num_samples=self.num_generations,
                    noise_seed=noise_seed(self.seed, t.ordinal),
                    prefixes=p.prefixes() if started else (),
                    finished=tuple(bool(f) for f in p.finished) if started else (),
                    limits=() if p.limits is None else tuple(int(n) for n in p.limits),
                )
            )
        if self.episodes is not None:  # the ledger holds every step asked so far
            self.episodes.log.mark()
        start = time.perf_counter()
        outputs = self.engine.generate(requests, version, self.chunk_tokens or None)
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
        if self.episodes is not None:  # ended turns: the environments' steps and replies
            stepped = self.episodes.advance_all([(t, partials[t.ordinal]) for t in tickets])
            partials.update({t.ordinal: p for t, p in zip(tickets, stepped, strict=True)})
        # scoring is the collector's work, counted in the chunk's seconds; the finished groups
        # of a chunk are scored together (in parallel when rewards have worker processes)
        done = [t for t in tickets if partials[t.ordinal].done]
        if self.episodes is not None:  # an episode's reward is its environment's
            scores = [self.episodes.scores(partials[t.ordinal]) for t in done]
        else:
            scores = self.scorer([(t, self._output(partials[t.ordinal])) for t in done])
        self._scores.update({t.ordinal: s for t, s in zip(done, scores, strict=True)})
        return Chunk(
            start=start,
            seconds=time.perf_counter() - start,
            version=outputs[0].weights_version,
            tickets=tickets,
            token_starts=starts,
            token_counts=counts,
        )

    def _output(self, partial: Partial) -> GenerationOutput:
        """A finished partial as one engine output (padding after each sample's end)."""
        tokens = torch.where(partial.mask, partial.tokens, self.pad_id)
        used = partial.versions[partial.policy_mask]
        version = int(used.max()) if used.numel() else 0
        return GenerationOutput(tokens, partial.mask, partial.logprobs, version, partial.finished)

    def _group(self, ticket: PromptTicket, partial: Partial, seconds: float) -> Group:
        output = self._output(partial)
        versions = torch.where(partial.policy_mask, partial.versions, -1)
        scored = self._scores.pop(ticket.ordinal)
        return make_group(
            ticket,
            self._prompt(ticket),
            output,
            scored.rewards,
            seconds,
            versions,
            scored.components,
            None if partial.policy is None else partial.policy_mask.clone(),
        )
