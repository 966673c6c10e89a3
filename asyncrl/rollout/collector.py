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

import hashlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.core.buffer import Buffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.types import Group, PromptTicket
from asyncrl.faults import fault_point
from asyncrl.rollout.engine import GenerationEngine, GenerationOutput, GenerationRequest
from asyncrl.tasks.source import Task


class GenerationFailed(RuntimeError):
    """Generation failed `rollout.max_generation_failures` times in a row, or can never complete
    a step; the cause is chained."""


class RewardError(RuntimeError):
    """The reward function raised or returned a non-finite value; names the ordinal."""


def noise_seed(seed: int, ordinal: int) -> int:
    """The sampling seed of one group: a function of (run seed, ordinal) only, so a group
    regenerated after a resume draws the same noise."""
    digest = hashlib.sha256(f"asyncrl-noise:{seed}:{ordinal}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def encode_prompts(
    task: Task, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, max_seq_len: int
) -> list[list[int]]:
    """Token ids of every example's prompt. Refuses, naming the example, a prompt with
    characters the tokenizer cannot represent or too long for the model's context."""
    unk = tokenizer.unk_token_id
    encoded = []
    for example in task.examples:
        ids = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        if unk is not None and unk in ids:
            raise ConfigError(
                f"{example.origin}: the prompt has characters the tokenizer does not know"
            )
        if len(ids) + max_new_tokens > max_seq_len:
            raise ConfigError(
                f"{example.origin}: prompt is {len(ids)} tokens; with "
                f"rollout.max_new_tokens={max_new_tokens} it exceeds the model's context of "
                f"{max_seq_len} tokens"
            )
        encoded.append(ids)
    return encoded


class Scorer:
    """Decodes completions and applies the task's reward function to each sample."""

    def __init__(self, task: Task, tokenizer: PreTrainedTokenizerBase) -> None:
        self.task = task
        self.tokenizer = tokenizer

    def __call__(self, ticket: PromptTicket, output: GenerationOutput) -> torch.Tensor:
        example = self.task.examples[ticket.dataset_index]
        rewards = []
        for ids, mask in zip(output.completion_ids, output.completion_mask, strict=True):
            text = str(self.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True))
            where = f"{self.task.reward_fn_name} on ordinal {ticket.ordinal} ({example.origin})"
            try:
                value = float(self.task.reward_fn(text, example.answer))
            except Exception as err:
                raise RewardError(f"{where} raised {err!r} for completion {text!r}") from err
            if not math.isfinite(value):
                raise RewardError(f"{where} returned {value} for completion {text!r}")
            rewards.append(value)
        return torch.tensor(rewards, dtype=torch.float32)


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
        max_age_steps: int,
        seed: int,
        batch_groups: int,
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
        self.max_age_steps = max_age_steps
        self.seed = seed
        self.batch_groups = batch_groups
        self.on_batch = on_batch
        self.pin_versions = pin_versions
        self.max_failures = max_failures
        self.num_failures = 0  # every failed batch, for the metrics
        self._consecutive_failures = 0
        self._version = engine.weights_version
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncrl-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stops admitting and waits up to `timeout_s` for a batch in progress to land; one
        still running then is abandoned (its ordinals stay in flight in the ledger)."""
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

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any], float]:
        """One consistent cut of ledger and buffer; returns them and the seconds admission and
        completion were held up while copying."""
        with self._cond:
            start = time.perf_counter()
            ledger_state = self.ledger.state_dict()
            buffer_state = self.buffer.state_dict()
            return ledger_state, buffer_state, time.perf_counter() - start

    def _admit(self) -> list[PromptTicket]:
        with self._cond:
            while not self._stop:
                tickets = self.ledger.admit(self._version, self.max_age_steps, self.batch_groups)
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
            version = max(0, tickets[0].target_step - self.max_age_steps)
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
