"""What a task is made of: its examples (a prompt, an answer, where the row came from; a chat
prompt's messages) and its reward function. Imported by every source (`source`, `hf_data`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.core.episodes import Message
from asyncrl.tasks.reward_calls import resolve_reward_fn

__all__ = ["Example", "Message"]


@dataclass(frozen=True)
class Example:
    prompt: str
    """The prompt text; for a chat example, its messages' contents (for the alphabet and
    messages; the model sees `messages` through the chat template)."""
    answer: str
    origin: str
    """Where the example came from, for error messages: `file:row` or `sort_digits[i]`."""
    messages: tuple[Message, ...] | None = None
    """A chat prompt: the messages the tokenizer's chat template renders."""


@dataclass
class Task:
    name: str
    examples: list[Example]
    reward_target: str
    """The reward function as `module:function`."""
    reward_fn_name: str
    """How the config names it, for messages."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def reward_fn(self) -> Callable[..., Any]:
        return resolve_reward_fn(self.reward_target)

    def alphabet(self) -> set[str]:
        """Every character of every prompt and answer: the `tiny` preset's vocabulary."""
        return alphabet(self.examples)


def examples_sha256(examples: list[Example]) -> str:
    """A digest of the rows a run trains on, in dataset order: each row's prompt, chat
    messages and answer (not where it came from). Two datasets with the same rows in the same
    order have the same digest; any change to a row, an appended row or another order changes
    it."""
    digest = hashlib.sha256()
    for e in examples:
        row = [e.prompt, e.answer, list(e.messages) if e.messages is not None else None]
        digest.update(json.dumps(row, sort_keys=True).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def alphabet(examples: list[Example]) -> set[str]:
    """Every character of every prompt and answer: the `tiny` preset's vocabulary."""
    return {c for e in examples for c in e.prompt + e.answer}
