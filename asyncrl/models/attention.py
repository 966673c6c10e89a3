"""Grouped-query attention without copying the KV heads, for Hugging Face models on the CPU.

transformers' `sdpa` attention hands grouped-query attention (fewer KV heads than query heads,
as in SmolLM2, Llama 3, Qwen2) to `scaled_dot_product_attention(enable_gqa=True)` only when
there is no attention mask; with one (every left-padded batch: generation's rows, training's
micro-batches) it first copies each layer's keys and values out to every query head
(`repeat_kv`). In a decode step that copy is the whole KV cache, per layer, per token: on a
2-core AVX2 CPU it was 8.3 s of a 31 s generation of SmolLM2 (4 prompts x 8 samples, 80 new
tokens, `torch.profiler`), and the attention's forward and backward in training took 3.2x the
time of the grouped kernel.

`asyncrl_sdpa` is `sdpa` with that copy left out on the CPU, where torch's kernels take the
mask and the groups together: the forward is bit for bit the same (the query heads of a group
read the same keys either way; checked in tests/test_attention.py), the backward's key and
value gradients equal it up to the order their groups are summed. Anything else (a GPU, a
model without groups, a paged cache, a position bias, a causal pass over a longer cache) goes
to transformers' own `sdpa` unchanged.

A pass that builds a graph (training: grad enabled and the query requires it) takes
`grouped_matmul_attention` instead: the same function as two batched products with the groups
folded into the query rows, so no KV head is copied either, and a softmax in fp32. torch's
CPU `scaled_dot_product_attention` has a backward that costs ten times its forward: in a
SmolLM2 training step (4 micro-batches of 8 rows, bf16 autocast, 2026-12-05, an Intel Xeon
with AMX) it took 3.1 s of 15.3 s, for 0.3 s of forward. Generation, evaluation and the
reference policy (no graph) keep the fused kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "asyncrl_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: [B, H, Q, D] queries over [B, K, L, D] keys
    and values (K divides H) -> ([B, Q, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    plain = (
        groups == 1
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions", False)
        or (causal and kv_length != q_length)
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if torch.is_grad_enabled() and query.requires_grad:
        return grouped_matmul_attention(query, key, value, attention_mask, dropout, scaling, causal)
    return grouped_fused_attention(query, key, value, attention_mask, dropout, scaling, causal)


def grouped_fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    causal: bool,
) -> tuple[torch.Tensor, None]:
    """`grouped_matmul_attention`'s function through torch's fused kernel
    (`scaled_dot_product_attention` with `enable_gqa`): passes without a graph."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def grouped_matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    causal: bool,
) -> tuple[torch.Tensor, None]:
    """Attention of [B, H, Q, D] queries over [B, K, L, D] keys and values as two batched
    products, each KV head's G = H / K query heads stacked into one [G * Q, D] block (no KV
    head copied), the softmax in fp32 (as transformers' eager attention). `attention_mask`:
    sdpa's, boolean (True attends) or additive, [B or 1, 1, Q, L]. A query row that may attend
    to nothing (a left pad) gets a uniform average, never NaN (its output is never used)."""
    batch, heads, q_length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    stacked = query.reshape(batch, kv_heads, groups * q_length, dim)
    scores = torch.matmul(stacked, key.transpose(-1, -2)).view(
        batch, kv_heads, groups, q_length, kv_length
    )
    scores = scores.float() * scale
    if causal:
        attention_mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device)
        attention_mask = attention_mask.tril(kv_length - q_length)[None, None]
    if attention_mask is not None:
        mask = attention_mask.unsqueeze(2)  # [B, 1, 1, Q, L]: every KV head, every group
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    if dropout > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs.view(batch, kv_heads, groups * q_length, kv_length), value)
    out = out.view(batch, heads, q_length, dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as `sdpa`


def grouped(model: PreTrainedModel) -> bool:
    """Whether any attention layer of `model` has fewer KV heads than query heads."""
    return any(getattr(m, "num_key_value_groups", 1) > 1 for m in model.modules())


def use_grouped_sdpa(model: PreTrainedModel) -> bool:
    """Switches a model that runs transformers' `sdpa` over grouped heads to `asyncrl_sdpa`;
    whether it did (eager, flash or other attention, and models without groups, are left as
    they are)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not grouped(model):
        return False
    model.set_attn_implementation(NAME)
    return True
