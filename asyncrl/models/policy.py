"""The policy: a Hugging Face causal LM and its tokenizer.

`load_policy` either builds the `tiny` preset (a Llama-style model from a config in code,
with the character tokenizer) or loads any local `save_pretrained` directory.
"""

from __future__ import annotations

import inspect
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
from asyncrl.models.device import model_device
from asyncrl.models.tokenizer import build_char_tokenizer


@dataclass
class Policy:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

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


LOGSOFTMAX_CHUNK_BYTES = 256 << 20
"""The fp32 log-softmax of a batch's completion logits is computed this many bytes of rows at a
time (at least one row), so no [B, T, V] fp32 matrix beyond the model's own logits exists at
once outside autograd's saved tensors."""


def chunk_rows(num_rows: int, row_elements: int, budget_bytes: int = LOGSOFTMAX_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 [rows, T, V] fits in `budget_bytes`."""
    return max(1, min(num_rows, budget_bytes // max(4 * row_elements, 1)))


def chosen_logprobs(
    logits: torch.Tensor,  # [B, T, V] any float dtype
    tokens: torch.Tensor,  # [B, T]
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    budget_bytes: int = LOGSOFTMAX_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-prob [B, T] of each chosen token under `softmax(logits / temperature)` in fp32,
    and (`with_entropy`) each position's entropy [B, T], a chunk of rows at a time.

    Row by row this is exactly `log_softmax(logits.float() / temperature).gather(tokens)`
    (the same kernel on each row: bit-identical), but the fp32 log-softmax of only one chunk
    exists at a time outside autograd. The entropy is computed without a graph unless
    `entropy_grad` (it is a metric unless the loss has an entropy bonus), so its
    `exp(logp) * logp` matrices are never kept for the backward pass."""
    rows = chunk_rows(logits.shape[0], logits.shape[1] * logits.shape[2], budget_bytes)
    chosen, entropies = [], []
    for start in range(0, logits.shape[0], rows):
        part = logits[start : start + rows].float() / temperature
        logprobs = torch.log_softmax(part, dim=-1)
        chosen.append(logprobs.gather(-1, tokens[start : start + rows].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(-(logprobs.exp() * logprobs).sum(-1))
    return torch.cat(chosen), (torch.cat(entropies) if with_entropy else None)


def distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The prompts with each run of equal consecutive rows (a group's samples) kept once, and
    for each row the index of its prompt among them."""
    distinct: list[list[int]] = []
    index: list[int] = []
    for row in prompts:
        if not distinct or (row is not distinct[-1] and row != distinct[-1]):
            distinct.append(row)
        index.append(len(distinct) - 1)
    return distinct, index


def keeps_logits(model: PreTrainedModel) -> bool:
    """Whether the model's forward takes `logits_to_keep` (every current HF causal LM does)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def shared_prompt_logits(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completion_ids: torch.Tensor,  # [B, T] on the model's device
    completion_mask: torch.Tensor,  # [B, T] bool
    pad_id: int,
) -> torch.Tensor:
    """The logits [B, T, V] that predict each completion token, with each distinct prompt run
    through the model once: the prompts' pass keeps its KV cache, which is indexed out to the
    rows (a differentiable gather: the gradient of every row's attention flows back into its
    prompt's one pass), then the completions attend to it. The same function as the full
    prompt + completion pass (same positions, same mask); the prompt tokens of a group of G
    samples cost one row instead of G."""
    distinct, index = distinct_prompts(prompts)
    device = completion_ids.device
    rows = torch.tensor(index, device=device)
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(distinct, pad_id))
    keep = {"logits_to_keep": 1} if keeps_logits(model) else {}
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask),
        use_cache=True,
        **keep,
    )
    first = out.logits[rows, -1:]  # predicts each row's first completion token
    if completion_ids.shape[1] == 1:
        return first
    cache = out.past_key_values
    cache.batch_select_indices(rows)
    attention = torch.cat([prompt_mask[rows], completion_mask.long()], dim=1)
    width = prompt_ids.shape[1]
    rest = model(
        input_ids=completion_ids[:, :-1],
        attention_mask=attention[:, :-1],
        position_ids=position_ids(attention)[:, width:-1],
        past_key_values=cache,
        use_cache=True,
    ).logits  # position t predicts completion token t + 1
    return torch.cat([first, rest], dim=1)


def completion_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completion_ids: torch.Tensor,  # [B, T]
    completion_mask: torch.Tensor,  # [B, T] bool
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    shared_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of each completion token under `model` at `temperature`, and
    (`with_entropy`) the entropy [B, T] of each position's token distribution (differentiable
    only with `entropy_grad`). One full forward pass over prompt + completion per row, or,
    with `shared_prompts`, one pass per distinct prompt and one over the completions against
    its cache (`shared_prompt_logits`). Inputs go to the model's device. Masked positions hold
    garbage; mask them."""
    completion_ids = completion_ids.to(model_device(model))
    completion_mask = completion_mask.to(completion_ids.device)
    if shared_prompts:
        logits = shared_prompt_logits(model, prompts, completion_ids, completion_mask, pad_id)
    else:
        inputs, width = join_completions(prompts, completion_ids, completion_mask, pad_id)
        logits = model(**inputs, use_cache=False).logits
        logits = logits[:, width - 1 : -1]  # predicts completion tokens
    return chosen_logprobs(logits, completion_ids, temperature, with_entropy, entropy_grad)
