"""The collector: a background worker that keeps generation ahead of the trainer.

    loop:
      admit tickets from the stream while their target is inside the window  (before pulling)
      hand the batch to the run's `Rollout` (`asyncrl.rollout.rollouts`): a single turn, an
        environment episode or an agent run per sample; it generates and lands its groups
      if nothing is admissible: wait for the trainer to publish a new weights version

The collector knows no kind of sample. A `Rollout` sees it as a `Landing` and calls it from
this thread: `saved` (the ledger's partials of the batch's tickets), `version_for` / `newest`
(the weights a sample asks for), `land(chunk, progress, groups)` (under the lock: the timeline
row, unfinished partials to the ledger, finished groups to the buffer, their ordinals
completed) and `stopping` (a stop was asked: return between steps). A batch that raises goes
back to the front of the queue and is retried; `RolloutFatal` stops generation at once.

Admission is checked against the newest *published* version, which the engine uses from its
next batch on, so every group trained at step t was generated with versions >= t - A (with
mid-generation updates a group's later chunks use newer versions; its oldest token still
obeys the bound).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

from asyncrl.core.buffer import Buffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.partial import Partial
from asyncrl.core.seeds import noise_seed
from asyncrl.core.types import Group, PromptTicket
from asyncrl.faults import fault_point
from asyncrl.models.threads import CoreShare
from asyncrl.rollout.rollouts import Chunk, Rollout, RolloutFatal, make_group
from asyncrl.rollout.weight_sync import WeightSource

__all__ = [
    "MAX_MERGED", "MAX_MERGED_S", "Chunk", "Collector", "GenerationFailed", "make_group",
    "noise_seed",
]  # fmt: skip
"""`Chunk`, `make_group` and `noise_seed` live in `rollouts` and `core.seeds`; named here too."""


class GenerationFailed(RuntimeError):
    """Generation failed `rollout.max_generation_failures` times in a row, or once with
    `RolloutFatal`, or can never complete a step; the cause is chained."""


MAX_MERGED = 32
MAX_MERGED_S = 10.0
"""A timeline row covers at most this many engine passes, or about this many seconds."""


class Collector:
    """Runs generation on a background thread until `stop()`; the `Landing` of its rollout.

    One lock (`_cond`) guards admission (ledger.admit) and completion (`land`: a step's
    buffer.add together with ledger.complete and its partials' ledger.progress), so `cut()`
    under the same lock always sees every ordinal in exactly one place: pending, in flight or
    buffered. Generation itself runs outside the lock.
    """

    def __init__(
        self,
        ledger: Ledger,
        buffer: Buffer,
        rollout: Rollout,
        window: int,
        groups_per_batch: int,
        end_target: int,
        on_batch: Callable[[Chunk], None] | None = None,
        pin_versions: bool = False,
        max_failures: int = 3,
        weights: WeightSource | None = None,
        cores: CoreShare | None = None,
    ) -> None:
        self.ledger = ledger
        self.buffer = buffer
        self.rollout = rollout  # how a batch's samples are generated: the one kind of this run
        self.window = window
        self.groups_per_batch = groups_per_batch
        self.end_target = end_target  # run.max_num_steps: no group for a step that never trains
        self.on_batch = on_batch
        self.pin_versions = pin_versions
        self.max_failures = max_failures
        self.weights = weights  # the engine's weights versions, to pin a continued sample's
        self.cores = cores or CoreShare(0)  # this thread's torch threads while it generates
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
        """Stops admitting, and ends the generation in progress where the rollout can
        (`Rollout.halt`: the torch engine after the token it is sampling; the batch's tokens go
        to the ledger as partials, in flight). For a run that is stopping: the engine
        generates nothing more. Does not wait (`join`)."""
        self._ask_stop()
        self.rollout.halt()

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
        """Raises `GenerationFailed` if generation gave up (`RolloutFatal`, or failures in a
        row); restarts a dead worker thread. The trainer calls this while it waits."""
        if isinstance(self._error, RolloutFatal):
            raise GenerationFailed(f"generation stopped: {self._error}") from self._error
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
        is tried again; `max_failures` failures in a row, or one `RolloutFatal`, stop
        generation for good."""
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
                fatal = isinstance(err, RolloutFatal)  # the rollout says a retry cannot mend it
                again = "not retried" if fatal else f"{self._consecutive_failures} in a row"
                print(f"asyncrl: generation failed ({again}): {err}")
                if fatal or self._consecutive_failures >= self.max_failures:
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
        """One batch through the rollout, then its last timeline rows."""
        self.rollout.generate(tickets, self)
        with self._cond:
            self._record_spans()  # the batch's last rows

    # --- the Landing the rollout calls (asyncrl.rollout.rollouts), from this thread

    @property
    def stopping(self) -> bool:
        return self._stop

    def saved(self, tickets: list[PromptTicket]) -> dict[int, Partial | None]:
        with self._cond:
            return {t.ordinal: self.ledger.partials.get(t.ordinal) for t in tickets}

    def land(self, chunk: Chunk | None, progress: dict[int, Partial], groups: list[Group]) -> None:
        """`Landing.land`: the timeline row, the partials and the groups together under the
        lock; the fault points after it, for a chunk."""
        with self._cond:
            if chunk is not None:
                self._add_span(replace(chunk, landed=[g.ordinal for g in groups]))
            for ordinal, partial in progress.items():
                self.ledger.progress(ordinal, partial)
            for g in groups:
                self.buffer.add(g)
                self.ledger.complete(g.ordinal)
        if chunk is None:
            return
        if groups:
            fault_point("collector.group_buffered")
        fault_point("collector.chunk_done")

    def version_for(self, ticket: PromptTicket, partial: Partial | None) -> int | None:
        """The weights version a ticket's next generation asks for (None: the newest)."""
        if self.pin_versions:  # deterministic mode: target t always uses version max(0, t - A)
            return max(0, ticket.target_step - self.window)
        if partial is None or not partial.num_tokens:
            return self.newest()
        version = int(partial.versions[partial.policy_mask].max())  # a continued sample keeps them
        # unless they are no longer kept (a run resumed with chunking or pinning switched off):
        # then it is finished on the newest, each token keeping its own version
        return version if self.weights is None or self.weights.has(version) else self.newest()

    def newest(self) -> int | None:
        """The newest published version, as `publish_version` announced it (None without
        `weights`: the engine's newest)."""
        if self.weights is None:
            return None
        # the sync may already hold (only) the next version while its announcement is on its way
        return self._version if self.weights.has(self._version) else self.weights.newest()
