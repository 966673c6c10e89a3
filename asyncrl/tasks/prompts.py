"""A task's prompts as token ids, checked against the tokenizer and the model's context. Chat
prompts go through the tokenizer's chat template, as `transformers` applies it for generation
(`add_generation_prompt=True`)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.tasks.examples import Example, Task


def prompt_ids(example: Example, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids the model is prompted with: the chat template's rendering of a chat
    example's messages followed by the assistant's turn opening, or the prompt text as it is
    (no special tokens added)."""
    if example.messages is None:
        return list(tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{example.origin}: a chat prompt, but the tokenizer has no chat template (use a "
            "model.path whose tokenizer has one)"
        )
    encoded: Any = tokenizer.apply_chat_template(
        list(example.messages), add_generation_prompt=True, tokenize=True
    )
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def encode_prompts(
    task: Task | list[Example],
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    max_seq_len: int,
    budget_key: str = "rollout.max_new_tokens",
) -> list[list[int]]:
    """Token ids of every example's prompt. Refuses, naming the example, a prompt with
    characters the tokenizer cannot represent or too long for the model's context with
    `max_new_tokens` more (the key `budget_key` sets)."""
    unk = tokenizer.unk_token_id
    encoded = []
    for example in task.examples if isinstance(task, Task) else task:
        ids = prompt_ids(example, tokenizer)
        if unk is not None and unk in ids:
            raise ConfigError(
                f"{example.origin}: the prompt has characters the tokenizer does not know"
            )
        if len(ids) + max_new_tokens > max_seq_len:
            raise ConfigError(
                f"{example.origin}: prompt is {len(ids)} tokens; with "
                f"{budget_key}={max_new_tokens} it exceeds the model's context of "
                f"{max_seq_len} tokens"
            )
        encoded.append(ids)
    return encoded
