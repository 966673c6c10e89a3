"""Log-probs from the last hidden states, the output layer a chunk of tokens at a time
(`head_logprobs`): the same values, entropies and gradients as the model's own logits through
`chosen_logprobs`, and no [tokens, V] matrix larger than one chunk kept for the backward pass."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.models import logprobs as lp
from asyncrl.models.logprobs import (
    chosen_logprobs,
    completion_logprobs,
    head_logprobs,
    output_head,
)
from asyncrl.models.policy import join_completions

VOCAB = 300
PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
MASK = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 6]).bool()


def tiny_llama(tied: bool, **extra: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=tied,
        **extra,
    )
    return LlamaForCausalLM(config)


def completions() -> torch.Tensor:
    return torch.randint(0, VOCAB, MASK.shape, generator=torch.Generator().manual_seed(1))


def logits_oracle(
    model: LlamaForCausalLM, shared: bool, entropy_grad: bool = True
) -> tuple[torch.Tensor, ...]:
    """Log-probs, entropies and gradients through the model's full logits (the path that
    `head_logprobs` replaces), its output layer marked as unusable."""
    lp._HEADS[model] = False
    try:
        return run(model, shared, entropy_grad)
    finally:
        del lp._HEADS[model]


def run(
    model: LlamaForCausalLM, shared: bool, entropy_grad: bool = True
) -> tuple[torch.Tensor, ...]:
    model.zero_grad()
    ids = completions()
    logprobs, entropy = completion_logprobs(
        model, PROMPTS, ids, MASK, 0.7, 0, True, entropy_grad, shared_prompts=shared
    )
    assert entropy is not None
    assert entropy.requires_grad == entropy_grad
    loss = (logprobs * MASK).sum()
    if entropy_grad:
        loss = loss + 0.1 * (entropy * MASK).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logprobs[MASK].detach(), entropy[MASK].detach(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("chunk_tokens", [5, 1 << 20])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_hidden_state_log_probs_equal_the_logits_path_values_entropies_and_gradients(
    shared: bool, tied: bool, chunk_tokens: int, entropy_grad: bool, monkeypatch
) -> None:
    """In one chunk and in chunks of 5 of the 19 tokens (whose backward passes recompute them
    one at a time), with the entropy in the loss and as a metric only."""
    monkeypatch.setattr(lp, "HEAD_CHUNK_BYTES", 4 * VOCAB * chunk_tokens)
    model = tiny_llama(tied)
    assert output_head(model) is not None  # the model is eligible: the fast path is taken
    fast = run(model, shared, entropy_grad)
    oracle = logits_oracle(model, shared, entropy_grad)
    for got, want in zip(fast, oracle, strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    assert fast[2].abs().sum() > 0  # the gradients are real


def test_under_bf16_autocast_chunks_give_the_logits_paths_gradients_within_bf16(monkeypatch):
    """bf16 autocast, chunks of 3 tokens: each chunk casts the output layer's weight itself,
    so its gradient sums the chunks in fp32 (what training under `train.dtype=bfloat16`
    does)."""
    monkeypatch.setattr(lp, "HEAD_CHUNK_BYTES", 4 * VOCAB * 3)
    model = tiny_llama(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = run(model, False, False)
        oracle = logits_oracle(model, False, False)
    for got, want in zip(fast, oracle, strict=True):
        assert (got - want).norm() <= 2e-2 * want.norm()


def test_a_batch_without_completion_tokens_still_backpropagates_zeros() -> None:
    model = tiny_llama(False)
    none = torch.zeros_like(MASK)
    logprobs, _ = completion_logprobs(model, PROMPTS, completions(), none, 1.0, 0)
    (logprobs * none).sum().backward()  # the logits path allows it; so must this one
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_one_token_chunks_give_the_same_log_probs_as_one_chunk() -> None:
    model = tiny_llama(False)
    ids = completions()
    decoder, head = output_head(model) or pytest.fail("not eligible")
    inputs, width = join_completions(PROMPTS, ids, MASK, 0)
    with torch.no_grad():
        hidden = decoder(**inputs).last_hidden_state[:, width - 1 : -1]
        small, _ = head_logprobs(head, hidden, ids, MASK, 1.0, budget_bytes=1)
        whole, _ = chosen_logprobs(head(hidden), ids, 1.0)
    assert torch.allclose(small[MASK], whole[MASK], atol=1e-6)
    assert (small[~MASK] == 0).all()


def vocabulary_sized_saved(fn, model) -> list[tuple[int, ...]]:
    """The shapes of the tensors with a vocabulary-sized dimension that autograd saved for
    the backward pass of `fn()`, the model's parameters left out."""
    params = {p.data_ptr() for p in model.parameters()}
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if VOCAB in tensor.shape and tensor.data_ptr() not in params:
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_tokens_by_vocabulary_matrix_is_kept_for_the_backward_pass(monkeypatch) -> None:
    """The memory claim, counted in elements rather than bytes of RSS: with the output layer a
    chunk at a time, autograd keeps nothing of [tokens, V] (the chunks are recomputed in the
    backward); through the model's logits it keeps at least the whole [B, T, V] log-softmax
    (the negative control)."""
    monkeypatch.setattr(lp, "HEAD_KEEP_BYTES", 0)
    model = tiny_llama(False)
    ids = completions()
    full = MASK.numel() * VOCAB

    def loss() -> None:
        logprobs, _ = completion_logprobs(model, PROMPTS, ids, MASK, 1.0, 0)
        (logprobs * MASK).sum().backward()

    assert vocabulary_sized_saved(loss, model) == []
    lp._HEADS[model] = False
    try:
        kept = vocabulary_sized_saved(loss, model)
    finally:
        del lp._HEADS[model]
    assert max(math.prod(shape) for shape in kept) >= full


class ScaledLlama(LlamaForCausalLM):
    """Logits that are not the output layer's output: 2x."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_whose_logits_are_not_its_output_layers_keeps_the_logits_path() -> None:
    torch.manual_seed(0)
    model = ScaledLlama(tiny_llama(False).config)
    assert output_head(model) is None  # found by the check on a three-token input
    ids = completions()
    with torch.no_grad():
        got, _ = completion_logprobs(model, PROMPTS, ids, MASK, 1.0, 0)
        inputs, width = join_completions(PROMPTS, ids, MASK, 0)
        want, _ = chosen_logprobs(model(**inputs).logits[:, width - 1 : -1], ids, 1.0)
    assert torch.equal(got[MASK], want[MASK])
    assert output_head(tiny_llama(False, logit_scale=0.5)) is None  # known by its config


@pytest.mark.parametrize("shared", [False, True])
def test_columns_after_the_last_real_token_are_not_run_and_change_nothing(shared, monkeypatch):
    """A micro-batch padded to the step's longest row (4 more columns than its own longest):
    the model sees only the columns up to its last real token, and the log-probs, entropies and
    gradients are those of the batch without the extra columns. The widths the decoder saw
    are counted by a hook; with the trim turned off (the negative control) it sees them all."""
    model = tiny_llama(False)
    ids = completions()
    extra = torch.randint(0, VOCAB, (len(PROMPTS), 4), generator=torch.Generator().manual_seed(2))
    padded_ids = torch.cat([ids, extra], dim=1)
    padded_mask = torch.cat([MASK, torch.zeros(len(PROMPTS), 4, dtype=torch.bool)], dim=1)
    assert output_head(model) is not None  # its one check on three tokens, before the hook
    widths: list[int] = []
    model.model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    def outputs(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model.zero_grad()
        logprobs, entropy = completion_logprobs(
            model, PROMPTS, ids, mask, 0.7, 0, True, True, shared_prompts=shared
        )
        assert logprobs.shape == entropy.shape == ids.shape
        ((logprobs + 0.1 * entropy) * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return logprobs[mask].detach(), entropy[mask].detach(), grads

    want = outputs(ids, MASK)
    want_widths, widths[:] = list(widths), []
    got = outputs(padded_ids, padded_mask)
    assert widths == want_widths  # the extra columns never reached the model
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6), (g - w).abs().max()
    monkeypatch.setattr(lp, "used_width", lambda mask: mask.shape[1])
    widths.clear()
    outputs(padded_ids, padded_mask)
    assert sum(widths) == sum(want_widths) + 4 * (1 if shared else len(want_widths))


@pytest.mark.parametrize(
    "keep_bytes", [4 * VOCAB * int(MASK.sum()), 4 * VOCAB * int(MASK.sum()) - 1]
)
def test_a_pass_whose_tokens_fit_runs_the_output_layer_once_and_keeps_it(keep_bytes, monkeypatch):
    """At `HEAD_KEEP_BYTES` the [N, V] log-softmax of the pass's N tokens is kept for the
    backward pass and the output layer runs once; a byte less and it runs twice (the chunk
    recomputed), keeping nothing of [N, V]. The gradients are the same either way."""
    monkeypatch.setattr(lp, "HEAD_KEEP_BYTES", keep_bytes)
    model = tiny_llama(False)
    ids = completions()
    assert output_head(model) is not None
    calls: list[int] = []
    model.lm_head.register_forward_hook(lambda _, args, out: calls.append(out.shape[0]))

    def loss() -> None:
        model.zero_grad()
        logprobs, _ = completion_logprobs(model, PROMPTS, ids, MASK, 1.0, 0)
        (logprobs * MASK).sum().backward()

    saved = vocabulary_sized_saved(loss, model)
    tokens = int(MASK.sum())
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    if keep_bytes >= 4 * VOCAB * tokens:
        assert calls == [tokens] and (tokens, VOCAB) in saved
    else:
        assert calls == [tokens, tokens] and saved == []
    lp._HEADS[model] = False  # the model's own logits, the oracle
    try:
        loss()
    finally:
        del lp._HEADS[model]
    oracle = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert torch.allclose(grads, oracle, rtol=1e-5, atol=1e-6)
