"""asyncrl_sdpa (asyncrl/models/attention.py): grouped-query attention with a mask, without
copying the KV heads, gives transformers' `sdpa` logits bit for bit, and only grouped models
are switched to it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.models.attention import NAME, use_grouped_sdpa
from asyncrl.models.policy import left_pad, position_ids


def tiny(kv_heads: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_grouped_attention_with_padding_gives_sdpas_logits_bit_for_bit():
    model = tiny(kv_heads=2)
    ids, mask = left_pad([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], pad_id=0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        assert use_grouped_sdpa(model) and model.config._attn_implementation == NAME
        got = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert torch.equal(got, want)
    # and a decode step over a cache, the engine's shape
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        nxt = torch.tensor([[11], [12], [13]])
        want = model(input_ids=nxt, attention_mask=step, past_key_values=out.past_key_values)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        model.set_attn_implementation(NAME)
        got = model(input_ids=nxt, attention_mask=step, past_key_values=out.past_key_values)
    assert torch.equal(got.logits, want.logits)


def test_a_model_without_groups_keeps_sdpa():
    model = tiny(kv_heads=4)
    assert not use_grouped_sdpa(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_pass_that_trains_takes_the_grouped_products_and_gives_eagers_gradients(monkeypatch):
    """With a graph (training), asyncrl_sdpa runs `grouped_matmul_attention`: its logits and
    every parameter's gradient match transformers' own eager attention (which copies the KV
    heads: an independent implementation) over left-padded rows, in fp32 and under bf16
    autocast; a pass without a graph still takes the fused kernel."""
    from asyncrl.models import attention

    calls = []
    products = attention.grouped_matmul_attention

    def counted(*args, **kwargs):
        calls.append(args[0].requires_grad)
        return products(*args, **kwargs)

    monkeypatch.setattr(attention, "grouped_matmul_attention", counted)
    ids, mask = left_pad([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], pad_id=0)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)}
    real = mask.bool()

    def run(implementation: str, dtype: torch.dtype | None):
        model = tiny(kv_heads=2).train()
        model.set_attn_implementation(implementation)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            logits = model(**inputs).logits.float()
        logits[real].logsumexp(-1).sum().backward()
        return logits[real], {n: p.grad for n, p in model.named_parameters()}

    for dtype, tol in ((None, 1e-5), (torch.bfloat16, 2e-2)):
        calls.clear()
        got, got_grads = run(NAME, dtype)
        assert calls and all(calls), "the training pass did not take the grouped products"
        want, want_grads = run("eager", dtype)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=tol, atol=tol, msg=name)
    calls.clear()
    with torch.no_grad():
        model = tiny(kv_heads=2)
        model.set_attn_implementation(NAME)
        model(**inputs)
    assert not calls  # no graph: the fused kernel


def test_the_attention_benchmark_compares_the_same_function():
    """benchmarks/attention_step.py times the fused kernel (`grouped_fused_attention`, what
    passes without a graph run) against grouped_matmul_attention: the two give the same
    attention (so the benchmark compares speed, not different math)."""
    from asyncrl.models.attention import grouped_fused_attention, grouped_matmul_attention

    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4)
    mask[1, :, :, :3] = False  # a left-padded row
    for args in ((mask, 0.0, None, False), (None, 0.0, 0.3, False)):
        want, _ = grouped_fused_attention(query, key, value, *args)
        got, _ = grouped_matmul_attention(query, key, value, *args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
