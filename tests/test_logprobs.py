"""Log-probs from the last hidden states, the output layer a chunk of tokens at a time
(`head_logprobs`): the same values, entropies and gradients as the model's own logits through
`chosen_logprobs`, and no [tokens, V] matrix larger than one chunk kept for the backward pass."""

from __future__ import annotations

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


def logits_oracle(model: LlamaForCausalLM, shared: bool) -> tuple[torch.Tensor, ...]:
    """Log-probs, entropies and gradients through the model's full logits (the path that
    `head_logprobs` replaces), its output layer marked as unusable."""
    lp._HEADS[model] = False
    try:
        return run(model, shared)
    finally:
        del lp._HEADS[model]


def run(model: LlamaForCausalLM, shared: bool) -> tuple[torch.Tensor, ...]:
    model.zero_grad()
    ids = completions()
    logprobs, entropy = completion_logprobs(
        model, PROMPTS, ids, MASK, 0.7, 0, True, True, shared_prompts=shared
    )
    assert entropy is not None
    ((logprobs * MASK).sum() + 0.1 * (entropy * MASK).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logprobs[MASK].detach(), entropy[MASK].detach(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_hidden_state_log_probs_equal_the_logits_path_values_entropies_and_gradients(
    shared: bool, tied: bool
) -> None:
    model = tiny_llama(tied)
    assert output_head(model) is not None  # the model is eligible: the fast path is taken
    fast = run(model, shared)
    oracle = logits_oracle(model, shared)
    for got, want in zip(fast, oracle, strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    assert fast[2].abs().sum() > 0  # the gradients are real


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


def largest_saved(fn) -> int:
    """The most elements of any tensor autograd saved for the backward pass of `fn()`."""
    sizes = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


def test_no_tokens_by_vocabulary_matrix_is_kept_for_the_backward_pass() -> None:
    """The memory claim, counted in elements rather than bytes of RSS: with the output layer a
    chunk at a time, autograd keeps nothing of [tokens, V] (the chunks are recomputed in the
    backward); through the model's logits it keeps at least the whole [B, T, V] log-softmax
    (the negative control)."""
    model = tiny_llama(False)
    ids = completions()
    full = MASK.numel() * VOCAB

    def loss() -> None:
        logprobs, _ = completion_logprobs(model, PROMPTS, ids, MASK, 1.0, 0)
        (logprobs * MASK).sum().backward()

    weights = max(p.numel() for p in model.parameters())
    fast = largest_saved(loss)
    assert fast <= max(weights, MASK.numel() * 32)  # weights and [B, T, H] hidden states only
    assert fast < full
    lp._HEADS[model] = False
    try:
        assert largest_saved(loss) >= full
    finally:
        del lp._HEADS[model]


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
