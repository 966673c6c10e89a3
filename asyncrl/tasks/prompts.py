"""A task's prompts as token ids, checked against the tokenizer and the model's context."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.tasks.source import Task


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
