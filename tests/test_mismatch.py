"""Engine/trainer mismatch: the per-step metrics on a hand-computed case, and the truncated
importance weights of GRPO and RLOO (`algo.mismatch_tis_cap`) checked against their definition.

Oracle for the correction: with behaviour log-probs equal to the trainer's own, the gradient
is G0 (ratio 1, nothing clipped). Behaviour log-probs lower by d on every token make each
weight pi_trainer / pi_behaviour = e^d, so the corrected gradient must be exactly
min(e^d, cap) * G0. A negative control shows what the uncorrected GRPO does with the same
mismatch: it clips (ratio e^d > 1 + eps), and its gradient is neither.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import groups_of, small_config

from asyncrl.core.losses import mismatch_stats
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.train.components import build_components

COMMON = (
    "model.hidden_size=32",
    "model.num_heads=2",
    "rollout.max_new_tokens=6",
    "rollout.num_generations_per_prompt=4",
    "algo.max_grad_norm=0",
    "algo.kl_coef=0",
    "algo.entropy_coef=0",
)
SHIFT = 0.5


def test_mismatch_metrics_on_a_hand_computed_case():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    behaviour = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[True, True, False]])
    same = torch.tensor([[True, False, True]])
    stats = mismatch_stats(trainer, behaviour, mask, same)

    def k3(d: float) -> float:
        return math.exp(d) - d - 1

    assert stats["offpolicy_kl"] == pytest.approx((k3(0.5) + k3(0.0)) / 2)
    assert stats["mismatch_kl"] == pytest.approx(k3(0.5))
    assert stats["mismatch_max_abs_diff"] == pytest.approx(0.5)
    assert stats["mismatch_tokens"] == 1
    none = mismatch_stats(trainer, behaviour, mask, torch.zeros_like(same))
    assert "mismatch_kl" not in none and none["mismatch_tokens"] == 0


@pytest.fixture(scope="module")
def groups():
    parts = build_components(small_config(*COMMON))
    found = groups_of(parts, 3)
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.25, 1.0, 1.0], [0.2, 0.9, 0.0, 0.4]])
    model, pad = parts.policy.model, parts.policy.pad_id
    exact = []
    for group, r in zip(found, rewards, strict=True):
        with torch.no_grad():
            own, _ = completion_logprobs(
                model,
                [group.prompt_ids] * group.num_rows,
                group.completion_ids,
                group.completion_mask,
                1.0,
                pad,
            )
        own = own.masked_fill(~group.completion_mask, 0.0)
        exact.append(dataclasses.replace(group, rewards=r, behaviour_logprobs=own))
    return exact


def shifted(groups, by):
    return [
        dataclasses.replace(g, behaviour_logprobs=g.behaviour_logprobs - by * g.completion_mask)
        for g in groups
    ]


def gradient(algo_keys, groups):
    algo = build_components(small_config(*COMMON, *algo_keys)).algo
    seen = []
    handle = algo.optimizer.register_step_pre_hook(
        lambda *_: seen.append(
            torch.cat([p.grad.flatten() for p in algo.model.parameters() if p.grad is not None])
        )
    )
    metrics = algo.step(groups, 3)
    handle.remove()
    return seen[0], metrics


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_truncated_importance_weights_scale_the_gradient_as_defined(name, groups):
    g0, _ = gradient((f"algo.name={name}",), groups)
    assert float(g0.norm()) > 0
    untruncated, metrics = gradient(
        (f"algo.name={name}", "algo.mismatch_tis_cap=10"), shifted(groups, SHIFT)
    )
    assert relative(untruncated, math.exp(SHIFT) * g0) < 1e-5
    assert metrics["is_ratio_mean"] == pytest.approx(math.exp(SHIFT), rel=1e-5)
    capped = (f"algo.name={name}", "algo.mismatch_tis_cap=1.2")
    truncated, metrics = gradient(capped, shifted(groups, SHIFT))
    assert relative(truncated, 1.2 * g0) < 1e-5
    assert metrics["is_truncated_frac"] == 1.0
    # the mismatch is reported: every token is 0.5 off (offpolicy_kl = k3(0.5))
    assert metrics["offpolicy_kl"] == pytest.approx(math.exp(SHIFT) - SHIFT - 1, rel=1e-4)


def test_without_the_correction_grpo_clips_the_mismatched_tokens(groups):
    """Negative control: `mismatch_tis_cap=0` (the ratio against the behaviour log-probs)
    with the same mismatch clips every positive-advantage token; the gradient is neither G0
    nor scaled."""
    g0, _ = gradient(("algo.name=grpo",), groups)
    plain, metrics = gradient(("algo.name=grpo",), shifted(groups, SHIFT))
    assert metrics["clip_frac"] > 0.2
    for scale in (1.0, math.exp(SHIFT), 1.2):
        assert relative(plain, scale * g0) > 0.05


def test_the_mismatch_is_measured_on_the_tokens_of_the_trainers_own_version(groups):
    """Step 3 holds weights version 3: only tokens sampled by version 3 count as mismatch
    (the others also differ by the weights lag)."""
    mixed = shifted(groups, SHIFT)
    mixed = [dataclasses.replace(g, version_max=3 if i == 0 else 2) for i, g in enumerate(mixed)]
    _, metrics = gradient(("algo.name=grpo",), mixed)
    assert metrics["mismatch_tokens"] == float(mixed[0].completion_mask.sum())
    assert metrics["mismatch_max_abs_diff"] == pytest.approx(SHIFT, rel=1e-5)
    assert metrics["mismatch_kl"] == pytest.approx(math.exp(SHIFT) - SHIFT - 1, rel=1e-4)
