"""The learning knobs of the time-to-reward work: loss aggregation, reward scaling, AdamW's
betas and epsilon, and the shared-prompt forward pass (each prompt of a group run once).

Oracles: hand-computed weights and advantages, a slow per-sequence loop, and the full
prompt + completion forward pass for the shared one (with a negative control that mixes up
which prompt a row belongs to)."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from asyncrl.config import ConfigError
from asyncrl.core.advantages import group_advantages, scaled_group_advantages
from asyncrl.core.losses import loss_weights, masked_sum
from asyncrl.models.logprobs import completion_logprobs, distinct_prompts
from asyncrl.models.policy import load_pretrained_policy
from asyncrl.models.scratch import save_scratch_model
from asyncrl.train.components import build_components

MASK = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
VALUES = torch.tensor([[1.0, 3.0, 100.0], [2.0, 100.0, 100.0], [3.0, 6.0, 9.0]])


def test_token_mean_weights_are_the_mask_over_the_steps_real_tokens():
    weights, normaliser = loss_weights(MASK, "token_mean", max_new_tokens=3)
    assert weights is MASK
    assert float(masked_sum(VALUES, weights) / normaliser) == pytest.approx(24 / 6)


def test_sequence_mean_is_the_mean_of_each_sequences_token_mean():
    weights, normaliser = loss_weights(MASK, "sequence_mean", max_new_tokens=3)
    slow = sum(
        sum(float(v) for v, m in zip(row, keep, strict=True) if m) / int(keep.sum())
        for row, keep in zip(VALUES, MASK, strict=True)
    ) / len(MASK)
    assert slow == pytest.approx((2 + 2 + 6) / 3)
    assert float(masked_sum(VALUES, weights) / normaliser) == pytest.approx(slow)
    # split into micro-batches over the step's normaliser: the parts add up to the whole
    parts = sum(float(masked_sum(VALUES[r], weights[r]) / normaliser) for r in ([0], [1, 2]))
    assert parts == pytest.approx(slow)


def test_constant_divides_by_sequences_times_max_new_tokens():
    weights, normaliser = loss_weights(MASK, "constant", max_new_tokens=4)
    assert float(normaliser) == 12.0
    assert float(masked_sum(VALUES, weights) / normaliser) == pytest.approx(24 / 12)


def test_reward_scaling_group_batch_and_none_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.5]])
    centred = torch.tensor([[0.5, -0.5], [0.0, 0.0], [-0.25, 0.25]])
    assert torch.equal(scaled_group_advantages(rewards, "group"), group_advantages(rewards))
    assert torch.allclose(scaled_group_advantages(rewards, "none"), centred)
    batch_std = float(rewards.std(unbiased=False))
    assert torch.allclose(
        scaled_group_advantages(rewards, "batch"), centred / (batch_std + 1e-6), atol=1e-6
    )


def test_grpo_uses_its_reward_scaling():
    algo = build_components(small_config("algo.scale_rewards=none")).algo
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(algo.advantages(rewards), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_adamw_takes_its_betas_and_epsilon_from_the_config():
    keys = ("algo.adam_beta1=0.8", "algo.adam_beta2=0.95", "algo.adam_epsilon=1e-6")
    grpo = build_components(small_config(*keys)).algo
    ppo = build_components(small_config(*keys, "algo.name=ppo")).algo
    for optimizer in (grpo.optimizer, ppo.optimizer, ppo.critic_optimizer):
        group = optimizer.param_groups[0]
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("algo.adam_beta2=1.0", "algo.adam_beta2"),
        ("algo.adam_epsilon=0", "algo.adam_epsilon"),
        ("algo.loss_aggregation=mean", "algo.loss_aggregation"),
        ("algo.scale_rewards=std", "algo.scale_rewards"),
    ],
)
def test_bad_learning_keys_are_refused_naming_the_key(override, named):
    with pytest.raises(ConfigError, match=named):
        small_config(override)


def test_reward_scaling_is_grpos_key_and_refused_under_rloo():
    with pytest.raises(ConfigError, match=r"algo\.name=grpo"):
        small_config("algo.name=rloo", "algo.scale_rewards=none")


# --- the shared-prompt forward pass ------------------------------------------------------


def test_distinct_prompts_keeps_each_run_of_equal_rows_once():
    a, b = [1, 2], [3]
    assert distinct_prompts([a, a, [1, 2], b, b, a]) == ([[1, 2], [3], [1, 2]], [0, 0, 0, 1, 1, 2])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama preset, and a saved Qwen2 (grouped-query attention) with a BPE tokenizer."""
    tiny = build_components(small_config()).policy
    path = save_scratch_model(tmp_path_factory.mktemp("qwen2") / "m", arch="qwen2", seed=3)
    return {"llama": tiny, "qwen2": load_pretrained_policy(path)}


def batch(policy, lengths=(2, 5, 3), samples=3, width=4):
    """Rows of `samples` samples per prompt (prompts of different lengths, so some are padded)
    with completions of different lengths."""
    gen = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    prompts = []
    for n in lengths:
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        prompts += [prompt] * samples
    ids = torch.randint(3, vocab, (len(prompts), width), generator=gen)
    ends = torch.randint(1, width + 1, (len(prompts),), generator=gen)
    mask = torch.arange(width).unsqueeze(0) < ends.unsqueeze(1)
    return prompts, ids, mask


def logprobs_and_grads(policy, prompts, ids, mask, shared):
    model = policy.model
    model.zero_grad(set_to_none=True)
    logprobs, _ = completion_logprobs(
        model, prompts, ids, mask, 0.9, policy.pad_id, shared_prompts=shared
    )
    (logprobs * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logprobs * mask).detach(), grads


def max_grad_error(want, got):
    assert want.keys() == got.keys()
    return max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "rows", [slice(None), slice(1, 7), slice(4, 5)], ids=["all", "split", "one"]
)
def test_shared_prompts_give_the_full_passes_logprobs_and_gradients(models, arch, rows):
    """Rows that split a group (a micro-batch boundary) and a lone row included."""
    policy = models[arch]
    prompts, ids, mask = batch(policy)
    prompts, ids, mask = prompts[rows], ids[rows], mask[rows]
    full, full_grads = logprobs_and_grads(policy, prompts, ids, mask, shared=False)
    shared, shared_grads = logprobs_and_grads(policy, prompts, ids, mask, shared=True)
    torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)
    assert max_grad_error(full_grads, shared_grads) < 1e-5


def test_shared_prompts_with_one_token_completions(models):
    policy = models["llama"]
    prompts, ids, mask = batch(policy, width=1)
    full, _ = logprobs_and_grads(policy, prompts, ids, mask, shared=False)
    shared, _ = logprobs_and_grads(policy, prompts, ids, mask, shared=True)
    torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)


def test_a_row_attending_to_another_groups_prompt_would_be_caught(models, monkeypatch):
    """Negative control: if the cache rows were indexed to the wrong prompt, the comparison
    with the full pass fails."""
    import asyncrl.models.logprobs as logprobs_module

    policy = models["llama"]
    prompts, ids, mask = batch(policy)
    full, _ = logprobs_and_grads(policy, prompts, ids, mask, shared=False)
    real = logprobs_module.distinct_prompts

    def shifted(rows):
        distinct, index = real(rows)
        return distinct, [(i + 1) % len(distinct) for i in index]

    monkeypatch.setattr(logprobs_module, "distinct_prompts", shifted)
    wrong, _ = logprobs_and_grads(policy, prompts, ids, mask, shared=True)
    assert float((wrong - full).abs().max()) > 1e-2
