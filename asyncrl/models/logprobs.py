"""Log-probs of completion tokens under a policy, in fp32, without the whole batch's fp32
[B, T, V] log-softmax at once.

`completion_logprobs` is what the trainer, the reference policy and the tests call: one pass
over prompt + completion per row, or (`shared_prompts`) one pass per distinct prompt and one
over the completions against its KV cache.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from asyncrl.models.device import model_device
from asyncrl.models.policy import join_completions, left_pad, position_ids

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


def shared_prompt_outputs(
    forward: Callable[..., tuple[torch.Tensor, Any]],
    prompts: list[list[int]],
    completion_ids: torch.Tensor,  # [B, T] on the model's device
    completion_mask: torch.Tensor,  # [B, T] bool
    pad_id: int,
) -> torch.Tensor:
    """The outputs [B, T, ...] (logits or last hidden states) at the positions that predict
    each completion token, with each distinct prompt run through the model once: the prompts'
    pass keeps its KV cache, which is indexed out to the rows (a differentiable gather: the
    gradient of every row's attention flows back into its prompt's one pass), then the
    completions attend to it. The same function as the full prompt + completion pass (same
    positions, same mask); the prompt tokens of a group of G samples cost one row instead of G.
    `forward(first_only=..., **inputs)` returns the pass's outputs and its KV cache."""
    distinct, index = distinct_prompts(prompts)
    device = completion_ids.device
    rows = torch.tensor(index, device=device)
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(distinct, pad_id))
    out, cache = forward(
        first_only=True,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask),
    )
    first = out[rows, -1:]  # predicts each row's first completion token
    if completion_ids.shape[1] == 1:
        return first
    cache.batch_select_indices(rows)
    attention = torch.cat([prompt_mask[rows], completion_mask.long()], dim=1)
    width = prompt_ids.shape[1]
    rest, _ = forward(
        first_only=False,
        input_ids=completion_ids[:, :-1],
        attention_mask=attention[:, :-1],
        position_ids=position_ids(attention)[:, width:-1],
        past_key_values=cache,
    )  # position t predicts completion token t + 1
    return torch.cat([first, rest], dim=1)


def logits_forward(model: PreTrainedModel) -> Callable[..., tuple[torch.Tensor, Any]]:
    """`shared_prompt_outputs`'s forward through the whole model: logits."""
    keep = {"logits_to_keep": 1} if keeps_logits(model) else {}

    def forward(first_only: bool, **inputs: Any) -> tuple[torch.Tensor, Any]:
        out = model(**inputs, use_cache=True, **(keep if first_only else {}))
        return out.logits, out.past_key_values

    return forward


def hidden_forward(decoder: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """`shared_prompt_outputs`'s forward through the decoder alone: last hidden states."""

    def forward(first_only: bool, **inputs: Any) -> tuple[torch.Tensor, Any]:
        out = decoder(**inputs, use_cache=True)
        hidden = out.last_hidden_state
        return (hidden[:, -1:] if first_only else hidden), out.past_key_values

    return forward


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of architectures whose logits are not the output layer's output as it is."""

_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def output_head(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """The decoder and the output layer of `model` when its logits are exactly
    `output_layer(decoder(...).last_hidden_state)`, so that log-probs can be computed from the
    hidden states a chunk of tokens at a time; None when not (logit soft-capping or scaling,
    no separate decoder, an FSDP-sharded model, whose root gathers the output layer's weights
    only inside its own forward). Checked once per model on a three-token input."""
    head = model.get_output_embeddings()
    decoder = model.get_decoder()
    if (
        not isinstance(head, torch.nn.Linear)
        or decoder is model
        or isinstance(model, FSDPModule)
        or any(
            getattr(config, key, None) not in (None, 1, 1.0)
            for config in (model.config, model.config.get_text_config())
            for key in LOGIT_TRANSFORMS
        )
    ):
        return None
    if model not in _HEADS:
        _HEADS[model] = _same_logits(model, decoder, head)
    return (decoder, head) if _HEADS[model] else None


def _same_logits(model: PreTrainedModel, decoder: torch.nn.Module, head: torch.nn.Linear) -> bool:
    """Whether the model's logits equal `head(decoder(...))` on a three-token input: in eval
    mode (no dropout), in the weights' dtype (under autocast where they mix fp32 with a lower
    one, as `ReferencePolicy`'s bf16 linear layers do), and under a forked RNG (a resumed run
    draws what the uninterrupted one does)."""
    device = model_device(model)
    ids = torch.tensor([[0, 1, 2]], device=device) % head.out_features
    training = model.training
    model.eval()
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    mixed = torch.float32 in dtypes and len(dtypes) == 2
    lower = (dtypes - {torch.float32}).pop() if mixed else None
    cast = torch.autocast(device.type, dtype=lower, enabled=mixed)
    try:
        forked = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with forked, torch.no_grad(), cast:
            full = model(input_ids=ids, use_cache=False).logits
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
    finally:
        model.train(training)
    return full.shape == split.shape and torch.allclose(full, split, 1e-4, 1e-5)


HEAD_CHUNK_BYTES = 64 << 20
"""The output layer's logits are computed for this many bytes of fp32 [tokens, V] at a time
(at least one token) when log-probs come from the hidden states."""

HEAD_KEEP_BYTES = 64 << 20
"""A pass whose tokens' fp32 [tokens, V] log-softmax fits in this many bytes runs the output
layer once, as one chunk kept for the backward pass, instead of recomputing it there: on
SmolLM2 the recompute is a sixth of the output layer's products (a micro-batch of 4 rows of 80
tokens keeps 63 MB until its backward)."""


def head_logprobs(
    head: torch.nn.Linear,
    hidden: torch.Tensor,  # [B, T, H]
    tokens: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T] bool
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chosen_logprobs(head(hidden), ...)` at the masked positions (0 elsewhere), the output
    layer applied to `budget_bytes` (default `HEAD_CHUNK_BYTES`) of tokens at a time. With
    gradients on, each chunk is checkpointed: its logits and log-softmax are freed after the
    forward and recomputed, one chunk at a time, in the backward pass, so no [B, T, V] matrix
    ever exists, in any dtype (what Liger's fused linear cross-entropy does, in plain PyTorch);
    unless the whole [N, V] fits in `HEAD_KEEP_BYTES`: then it is one chunk, kept, not
    recomputed.
    Under autocast each chunk casts the output layer's weight itself (no autocast cache), so
    the chunks' weight gradients are summed in the weight's own dtype, not in bf16."""
    picked, targets = hidden[mask], tokens[mask]  # [N, H], [N]
    budget = HEAD_CHUNK_BYTES if budget_bytes is None else budget_bytes
    per = max(1, budget // (4 * head.out_features))
    grad = torch.is_grad_enabled()
    kept = len(picked) * 4 * head.out_features <= HEAD_KEEP_BYTES  # one chunk, no recompute
    per = max(per, len(picked)) if kept else per
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device)

    def chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device, dtype=dtype, enabled=autocast, cache_enabled=False):
            logits = head(h)
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        chosen = logprobs.gather(-1, t.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return chosen, chosen.new_zeros(())
        with torch.set_grad_enabled(entropy_grad and grad):
            return chosen, -(logprobs.exp() * logprobs).sum(-1)

    chosen, entropies = [], []
    for h, t in zip(picked.split(per), targets.split(per), strict=True):  # one [N, H] grad
        recompute = grad and not kept
        c, e = checkpoint(chunk, h, t, use_reentrant=False) if recompute else chunk(h, t)
        chosen.append(c)
        entropies.append(e)
    # no token at all: zeros that still carry a (zero) gradient, as the logits path's do
    zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=hidden.device)
    if not chosen:
        zeros = zeros + 0 * hidden.sum()
    logprobs = zeros.masked_scatter(mask, torch.cat(chosen)) if chosen else zeros
    if not with_entropy:
        return logprobs, None
    return logprobs, (zeros.masked_scatter(mask, torch.cat(entropies)) if chosen else zeros)


def used_width(mask: torch.Tensor) -> int:
    """The columns of a [B, T] mask up to its last true one in any row (at least 1): a
    micro-batch of a step's rows is padded to the step's longest completion, which is often in
    another micro-batch (in a 60-step SmolLM2 run, 2.3x the real completion tokens; cut to
    their own longest row, 1.26x)."""
    columns = mask.any(dim=0).nonzero()
    return max(1, int(columns[-1]) + 1) if len(columns) else 1


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
    its cache (`shared_prompt_outputs`). Where the model allows (`output_head`), the passes
    stop at the last hidden states and the output layer runs a chunk of tokens at a time
    (`head_logprobs`); else the model's logits go through `chosen_logprobs`. Inputs go to the
    model's device. Masked positions hold garbage; mask them. The columns after the last
    masked-in one (a stacked batch is padded to its longest row, often not one of these rows)
    are not run through the model: they come back as zeros (`used_width`)."""
    completion_ids = completion_ids.to(model_device(model))
    completion_mask = completion_mask.to(completion_ids.device)
    width = completion_ids.shape[1]
    used = used_width(completion_mask)
    if used < width:
        logprobs, entropy = completion_logprobs(
            model,
            prompts,
            completion_ids[:, :used],
            completion_mask[:, :used],
            temperature,
            pad_id,
            with_entropy,
            entropy_grad,
            shared_prompts,
        )
        pad = (0, width - used)
        padded = torch.nn.functional.pad
        return padded(logprobs, pad), (None if entropy is None else padded(entropy, pad))
    split = output_head(model)
    if shared_prompts:
        forward = logits_forward(model) if split is None else hidden_forward(split[0])
        out = shared_prompt_outputs(forward, prompts, completion_ids, completion_mask, pad_id)
    else:
        inputs, width = join_completions(prompts, completion_ids, completion_mask, pad_id)
        if split is None:
            full = model(**inputs, use_cache=False).logits
        else:
            full = split[0](**inputs, use_cache=False).last_hidden_state
        out = full[:, width - 1 : -1]  # predicts completion tokens
    if split is None:
        return chosen_logprobs(out, completion_ids, temperature, with_entropy, entropy_grad)
    return head_logprobs(
        split[1], out, completion_ids, completion_mask, temperature, with_entropy, entropy_grad
    )
