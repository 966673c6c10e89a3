"""The collector: a background worker that keeps generation ahead of the trainer.

    loop:
      admit tickets from the stream while their target is inside the window  (before pulling)
      generate their groups in one batch with the newest published weights
      score each sample, stamp the group (ordinal, target, versions), add it to the buffer
      if nothing is admissible: wait for the trainer to publish a new weights version

Admission is checked against the newest *published* version, which the engine uses from its
next batch on, so every group trained at step t was generated with a version >= t - A.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from asyncrl.core.buffer import Buffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.types import Group, PromptTicket
from asyncrl.faults import fault_point
from asyncrl.rollout.engine import GenerationEngine, GenerationOutput, GenerationRequest


class GenerationFailed(RuntimeError):
    """Generation failed `rollout.max_generation_failures` times in a row, or can never complete
    a step; the cause is chained."""


def noise_seed(seed: int, ordinal: int) -> int:
    """The sampling seed of one group: a function of (run seed, ordinal) only, so a group
    regenerated after a resume draws the same noise."""
    digest = hashlib.sha256(f"asyncrl-noise:{seed}:{ordinal}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_group(
    ticket: PromptTicket,
    prompt_ids: list[int],
    output: GenerationOutput,
    rewards: torch.Tensor,
    generation_s: float,
) -> Group:
    return Group(
        ticket=ticket,
        prompt_ids=prompt_ids,
        completion_ids=output.completion_ids,
        completion_mask=output.completion_mask,
        behaviour_logprobs=output.logprobs,
        rewards=rewards,
        version_min=output.weights_version,
        version_max=output.weights_version,
        generation_s=generation_s,
    )


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
        scorer: Callable[[PromptTicket, GenerationOutput], torch.Tensor],
        num_generations: int,
        window: int,
        seed: int,
        groups_per_batch: int,
        end_target: int,
        on_batch: Callable[[float, float, int, list[PromptTicket]], None] | None = None,
        pin_versions: bool = False,
        max_failures: int = 3,
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
        self.num_failures = 0  # every failed batch, for the metrics
        self._consecutive_failures = 0
        self._version = 0  # the newest published version; the trainer publishes on resume
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncrl-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stops admitting and waits for a batch in progress to land (at most `timeout_s`, if
        given; one still running then is abandoned, its ordinals in flight in the ledger)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

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
            yield

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
        """Generates batch after batch. A failed batch goes back to the front of the queue and
        is tried again; `max_failures` failures in a row stop generation for good."""
        while tickets := self._admit():
            try:
                self._generate(tickets)
                self._consecutive_failures = 0
            except Exception as err:
                with self._cond:
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
        """Restarts the worker thread if it died without being stopped (counted as a
        failure); its in-flight tickets go back to the front of the queue."""
        if self._thread.is_alive() or self._stop or self._error is not None:
            return
        with self._cond:
            self.ledger.fail(list(self.ledger.in_flight.values()))
        self.num_failures += 1
        self._thread = threading.Thread(target=self._run, name="asyncrl-collector", daemon=True)
        self._thread.start()

    def _generate(self, tickets: list[PromptTicket]) -> None:
        requests = [
            GenerationRequest(
                prompt_ids=self.prompts[t.dataset_index],
                num_samples=self.num_generations,
                noise_seed=noise_seed(self.seed, t.ordinal),
            )
            for t in tickets
        ]
        version = None
        if self.pin_versions:  # deterministic mode: target t always uses version max(0, t - A)
            version = max(0, tickets[0].target_step - self.window)
        start = time.perf_counter()
        outputs = self.engine.generate(requests, version)
        rewards = [self.scorer(t, out) for t, out in zip(tickets, outputs, strict=True)]
        elapsed = time.perf_counter() - start  # generation and scoring: the collector's work
        if self.on_batch is not None:  # recorded before the groups can reach a checkpoint
            self.on_batch(start, elapsed, outputs[0].weights_version, tickets)
        groups = [
            make_group(t, self.prompts[t.dataset_index], out, reward, elapsed / len(tickets))
            for t, out, reward in zip(tickets, outputs, rewards, strict=True)
        ]
        with self._cond:  # a batch lands whole: a checkpoint never splits one
            for group in groups:
                self.buffer.add(group)
                self.ledger.complete(group.ordinal)
        fault_point("collector.group_buffered")
