"""Micro-batches do not change a step: its gradients are the same however it is split.

The oracle is the same algorithm on the same groups with the whole step in one forward and
backward pass (`train.micro_batch_size=0`); the splits are 2, 3 and N*G micro-batches. Losses
are masked sums over the step's normaliser (STYLE.md rule 14). A negative control divides by
each micro-batch's own tokens instead (a per-micro-batch mean, what gradient accumulation of
mean losses does), and the comparison must catch it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import groups_of, small_config

from asyncrl.algos import grpo, ppo
from asyncrl.algos.update import shortest_first
from asyncrl.models.logprobs import chosen_logprobs
from asyncrl.train.components import build_components

NUM_GROUPS = 3  # x 4 samples = 12 rows: 1, 2, 3 and 12 micro-batches are sizes 0, 6, 4, 1
SPLITS = {"1": 0, "2": 6, "3": 4, "N*G": 1}
COMMON = (
    "model.hidden_size=32",
    "model.num_heads=2",
    "rollout.max_new_tokens=6",
    "algo.max_grad_norm=0",  # compare the raw accumulated gradients
    "algo.kl_coef=0.1",  # every loss term: surrogate, KL penalty, entropy bonus
    "algo.entropy_coef=0.01",
)
ALGOS = {
    "grpo": ("algo.name=grpo",),
    "rloo": ("algo.name=rloo",),
    "ppo": ("algo.name=ppo",),
    # 8 updates, each at weights the earlier ones moved: fp32 noise of ~1e-7 in one update's
    # gradient moves Adam's first, sign-like step of near-zero components, and that grows in
    # the later updates' gradients with the lr (1.1e-6 at lr 3e-4); a small lr keeps the
    # comparison about the split, not about Adam's amplification
    "ppo-minibatches-epochs": (
        "algo.name=ppo",
        "algo.num_minibatches=2",
        "algo.ppo_epochs=2",
        "algo.kl_in_reward=true",
        "algo.lr=1e-5",
        "algo.critic_lr=1e-5",
    ),
    "grpo-sequence-mean": ("algo.loss_aggregation=sequence_mean", "algo.scale_rewards=none"),
    "ppo-constant": ("algo.name=ppo", "algo.loss_aggregation=constant"),
    "grpo-full-passes": ("train.shared_prompts=false",),
}


@pytest.fixture(scope="module")
def groups():
    """Real groups of unequal completion lengths, with rewards that give every group a
    non-zero advantage."""
    parts = build_components(small_config(*COMMON, "rollout.num_generations_per_prompt=4"))
    found = groups_of(parts, NUM_GROUPS)
    lengths = {int(n) for g in found for n in g.completion_mask.sum(1)}
    assert len(lengths) > 1, "the test needs completions of different lengths"
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.25, 1.0, 1.0], [0.2, 0.9, 0.0, 0.4]])
    return [dataclasses.replace(g, rewards=r) for g, r in zip(found, rewards, strict=True)]


def gradients_of_each_update(algo_keys, micro_batch_size, groups, step=3):
    """The gradients every optimizer step of one training step applies, per optimizer
    and parameter name, with the algorithm freshly built (same seed, same weights)."""
    config = small_config(*COMMON, *algo_keys, f"train.micro_batch_size={micro_batch_size}")
    algo = build_components(config).algo
    models = {id(algo.optimizer): algo.model}
    if hasattr(algo, "critic_optimizer"):
        models[id(algo.critic_optimizer)] = algo.critic
    seen: list[dict[str, torch.Tensor]] = []

    def record(optimizer, args, kwargs):
        model = models[id(optimizer)]
        seen.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )

    handles = [o.register_step_pre_hook(record) for o in (algo.optimizer,)]
    if hasattr(algo, "critic_optimizer"):
        handles.append(algo.critic_optimizer.register_step_pre_hook(record))
    metrics = algo.step(groups, step)
    for handle in handles:
        handle.remove()
    return seen, metrics


def worst_relative_error(expected, actual):
    assert len(expected) == len(actual)
    worst = 0.0
    for want, got in zip(expected, actual, strict=True):
        assert want.keys() == got.keys()
        for name in want:
            scale = float(want[name].norm())
            if scale > 0:
                worst = max(worst, float((got[name] - want[name]).norm()) / scale)
    return worst


@pytest.mark.parametrize("algo", list(ALGOS))
def test_any_split_into_micro_batches_gives_the_whole_steps_gradients(algo, groups):
    oracle, whole = gradients_of_each_update(ALGOS[algo], 0, groups)
    assert oracle and all(oracle), "no gradient was recorded"
    assert any(float(g.norm()) > 0 for g in oracle[0].values())
    for name, size in SPLITS.items():
        grads, metrics = gradients_of_each_update(ALGOS[algo], size, groups)
        error = worst_relative_error(oracle, grads)
        assert error <= 1e-6, f"{algo}, {name} micro-batches: relative gradient error {error:.2e}"
        assert metrics["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
        assert metrics["entropy"] == pytest.approx(whole["entropy"], rel=1e-5)


def test_a_per_micro_batch_mean_would_be_caught(groups, monkeypatch):
    """Negative control: the same comparison fails when each micro-batch is divided by its own
    token count (the losses' default without the step's normaliser)."""
    oracle, _ = gradients_of_each_update(ALGOS["grpo"], 0, groups)
    monkeypatch.setattr(grpo, "loss_weights", lambda mask, how, tokens: (mask, None))
    grads, _ = gradients_of_each_update(ALGOS["grpo"], 4, groups)
    assert worst_relative_error(oracle, grads) > 1e-2
    monkeypatch.undo()
    monkeypatch.setattr(ppo, "normaliser_of", lambda mask: None)
    monkeypatch.setattr(ppo, "loss_weights", lambda mask, how, tokens: (mask, None))
    oracle, _ = gradients_of_each_update(ALGOS["ppo-minibatches-epochs"], 0, groups)
    grads, _ = gradients_of_each_update(ALGOS["ppo-minibatches-epochs"], 4, groups)
    assert worst_relative_error(oracle, grads) > 1e-2


def test_chunked_log_softmax_is_the_plain_one_row_by_row():
    """`chosen_logprobs` a row at a time equals the full fp32 log-softmax + gather, values and
    gradients, bit for bit; the entropy carries no graph unless asked to."""
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 50, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 50, (5, 7))
    full = torch.log_softmax(logits.float() / 0.7, dim=-1)
    plain = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    plain_entropy = -(full.exp() * full).sum(-1)
    (plain_grad,) = torch.autograd.grad(plain.sum(), logits)
    # a budget of one row's fp32 [T, V]: five chunks
    chunked, entropy = chosen_logprobs(
        logits, tokens, 0.7, with_entropy=True, budget_bytes=7 * 50 * 4
    )
    assert torch.equal(chunked, plain)
    assert torch.equal(entropy, plain_entropy.detach())
    assert not entropy.requires_grad
    (chunked_grad,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.equal(chunked_grad, plain_grad)
    _, with_grad = chosen_logprobs(logits, tokens, 0.7, True, entropy_grad=True, budget_bytes=1)
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad, plain_entropy, rtol=0, atol=0)


def test_each_groups_rows_are_ordered_shortest_first_and_the_groups_stay_together():
    """Hand-computed: groups of 3 rows (rows 0-2 and 6-8 trained, 3-5 left out); a row's
    width is its last real column, so row 7 (a hole, then a token at column 4) is 5 wide."""
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],  # row 0: 3
            [1, 0, 0, 0, 0],  # row 1: 1
            [1, 1, 1, 0, 0],  # row 2: 3 (after row 0: the order is stable)
            [1, 1, 1, 1, 1],
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0],  # row 6: 4
            [1, 0, 0, 0, 1],  # row 7: 5
            [0, 0, 0, 0, 0],  # row 8: 0
        ]
    ).bool()
    rows = torch.tensor([0, 1, 2, 6, 7, 8])
    groups = torch.arange(9) // 3
    assert shortest_first(rows, mask, groups).tolist() == [1, 0, 2, 8, 6, 7]
    assert shortest_first(rows[:0], mask, groups).tolist() == []


def test_grpos_passes_are_cut_from_rows_ordered_by_width(groups, monkeypatch):
    """The rows GRPO's micro-batches get, seen by `select`: each group's rows shortest first,
    where the groups' own order is not."""
    seen: list[list[int]] = []
    select = grpo.select

    def spy(batch, rows):
        part = select(batch, rows)
        seen.append(part["completion_mask"].long().cumsum(1).argmax(1).tolist())
        return part

    monkeypatch.setattr(grpo, "select", spy)
    gradients_of_each_update(ALGOS["grpo"], 2, groups)
    share, widths = seen[0], [w for part in seen[1:] for w in part]  # the share, its passes
    assert widths == share and len(share) == 4 * NUM_GROUPS
    for i in range(0, len(share), 4):
        assert share[i : i + 4] == sorted(share[i : i + 4])
    given = [g.policy_mask.long().cumsum(1).argmax(1).tolist() for g in groups]
    assert any(w != sorted(w) for w in given)  # the groups' own order is not: it was sorted
    assert [sorted(w) for w in given] == [share[i : i + 4] for i in range(0, len(share), 4)]
