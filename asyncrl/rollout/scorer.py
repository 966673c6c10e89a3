"""Scoring: each sample's completion decoded and the group passed to the task's reward function
(through a `RewardPool`: in this thread or in worker processes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.core.types import PromptTicket
from asyncrl.rollout.engine import GenerationOutput
from asyncrl.rollout.reward_pool import RewardJob, RewardPool
from asyncrl.tasks.examples import Example, Task
from asyncrl.tasks.reward_calls import RewardFailure


class RewardError(RuntimeError):
    """A reward call raised, returned no reward, or ran past its timeout; names the ordinal."""


@dataclass
class Scored:
    """One group's rewards [G] float32 and its named reward components (each [G])."""

    rewards: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)


class Scorer:
    """Decodes completions and scores each group with the task's reward function. Examples
    are looked up by the ticket's `dataset_index` (`examples` defaults to the task's: the
    evaluation passes its own)."""

    def __init__(
        self,
        task: Task,
        tokenizer: PreTrainedTokenizerBase,
        pool: RewardPool | None = None,
        examples: Sequence[Example] | None = None,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.pool = pool or RewardPool(task.reward_target, task.reward_kwargs)
        self.examples = task.examples if examples is None else examples
        self.num_failures = 0  # reward calls that failed (raised or timed out), for the metrics

    def __call__(self, ticket: PromptTicket, output: GenerationOutput) -> torch.Tensor:
        """One group's rewards [G]."""
        return self.score([(ticket, output)])[0].rewards

    def score(self, items: list[tuple[PromptTicket, GenerationOutput]]) -> list[Scored]:
        """Every group's scores, the groups scored in parallel when the pool has workers.
        Raises `RewardError` naming the first group whose call failed."""
        results = self.results(items)
        self.num_failures += sum(isinstance(r, RewardFailure) for r in results)
        for (ticket, _), result in zip(items, results, strict=True):
            if isinstance(result, RewardFailure):
                example = self._example(ticket)
                raise RewardError(
                    f"{self.task.reward_fn_name} on ordinal {ticket.ordinal} ({example.origin}) "
                    f"{result}"
                ) from result
        return [r for r in results if isinstance(r, Scored)]

    def results(
        self, items: list[tuple[PromptTicket, GenerationOutput]]
    ) -> list[Scored | RewardFailure]:
        """Every group's scores, or the failure of its reward call (not counted: the caller
        decides what a failure costs)."""
        jobs = [RewardJob(self._texts(output), self._example(t).answer) for t, output in items]
        return [
            result
            if isinstance(result, RewardFailure)
            else Scored(
                torch.tensor(result.rewards, dtype=torch.float32),
                {k: torch.tensor(v, dtype=torch.float32) for k, v in result.components.items()},
            )
            for result in self.pool.score(jobs)
        ]

    def _example(self, ticket: PromptTicket) -> Example:
        return self.examples[ticket.dataset_index]

    def _texts(self, output: GenerationOutput) -> list[str]:
        return [
            str(self.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True))
            for ids, mask in zip(output.completion_ids, output.completion_mask, strict=True)
        ]
