"""Scoring: each sample's completion decoded and passed to the task's reward function."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.core.types import PromptTicket
from asyncrl.rollout.engine import GenerationOutput
from asyncrl.tasks.source import Task


class RewardError(RuntimeError):
    """The reward function raised or returned a non-finite value; names the ordinal."""


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
