"""The policy: a Hugging Face causal LM and its tokenizer.

`load_policy` either builds the `tiny` preset (a Llama-style model from a config in code,
with the character tokenizer) or loads any local `save_pretrained` directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.models.attention import use_grouped_sdpa
from asyncrl.models.tokenizer import build_char_tokenizer


@dataclass
class Policy:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    base_sha256: str | None = None
    """With LoRA adapters (`asyncrl.models.lora.apply_lora`): the frozen base's identity."""

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_id)

    @property
    def max_seq_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build_tiny_policy(config: ModelConfig, seed: int, alphabet: Iterable[str]) -> Policy:
    """A Llama-style causal LM over a character tokenizer of `alphabet`; its init is a function
    of `seed`."""
    tokenizer = build_char_tokenizer(alphabet)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=4 * config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(model_config)
    return Policy(model=model, tokenizer=tokenizer)


def load_pretrained_policy(path: str | Path) -> Policy:
    """Loads a local model directory saved with `save_pretrained` (model and tokenizer)."""
    path = Path(path)
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" would garble ours
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: cannot load a model from {path}: {err}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {path} has no eos_token; set one")
    tokenizer.padding_side = "left"
    use_grouped_sdpa(model)  # no copy of the KV heads per layer (asyncrl/models/attention.py)
    return Policy(model=model, tokenizer=tokenizer)


def load_policy(config: ModelConfig, seed: int, alphabet: Iterable[str]) -> Policy:
    """The policy of `config`: `model.path` if set, else the preset over `alphabet` (the task's
    characters; ignored for a loaded model, whose tokenizer comes with it)."""
    if config.path:
        policy = load_pretrained_policy(config.path)
    else:
        policy = build_tiny_policy(config, seed, alphabet)
    policy.model.config.use_cache = True
    return policy


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pads token rows. Returns ids [B, P] int64 and attention mask [B, P] int64."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded prompt sees the same positions as an
    unpadded one. [B, L] -> [B, L]."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def join_completions(
    prompts: list[list[int]],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    pad_id: int,
) -> tuple[dict[str, torch.Tensor], int]:
    """Model inputs for prompt + completion rows (prompts left-padded, completions right-padded)
    on the completions' device, and the prompt width P: the output at position P-1+t is the
    one that sees the prompt and completion tokens before t."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    device = completion_ids.device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    attention = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    inputs = {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids(attention),
    }
    return inputs, prompt_ids.shape[1]
