"""RLOO's leave-one-out advantages against hand-computed numbers and a slow reference loop, and
the algorithm behind the registry like any other."""

from __future__ import annotations

import pytest
import torch
from helpers import groups_of, small_config

from asyncrl.algos import ALGORITHMS, algorithm_class
from asyncrl.algos.rloo import RLOO, leave_one_out_advantages
from asyncrl.config import ConfigError
from asyncrl.config.keys import build_config


def test_each_sample_is_judged_against_the_mean_of_the_others_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 0.0, 0.0, 0.0]])
    # row 0: baselines 1/3, 2/3, 2/3, 1/3; row 1: all equal -> 0; row 2: 0, 1, 1, 1
    want = torch.tensor(
        [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0], [3.0, -1.0, -1.0, -1.0]]
    )
    assert torch.allclose(leave_one_out_advantages(rewards), want)


def test_leave_one_out_matches_a_slow_loop_and_is_g_over_g_minus_one_times_the_centred_reward():
    rewards = torch.rand(5, 7, generator=torch.Generator().manual_seed(3))
    slow = torch.zeros_like(rewards)
    for n in range(5):
        for i in range(7):
            others = [rewards[n, j].item() for j in range(7) if j != i]
            slow[n, i] = rewards[n, i] - sum(others) / len(others)
    got = leave_one_out_advantages(rewards)
    assert torch.allclose(got, slow, atol=1e-6)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    assert torch.allclose(got, 7 / 6 * centred, atol=1e-6)
    assert torch.allclose(got.sum(dim=1), torch.zeros(5), atol=1e-6)  # a zero-mean baseline


def test_rloo_is_in_the_registry_and_needs_two_samples_per_prompt():
    assert ALGORITHMS["rloo"] == "asyncrl.algos.rloo:RLOO" and algorithm_class("rloo") is RLOO
    assert build_config({}, ["algo.name=rloo"]).algo.name == "rloo"
    with pytest.raises(ConfigError, match=r"algo\.name=rloo needs >= 2"):
        small_config("algo.name=rloo", "rollout.num_generations_per_prompt=1")


def test_rloo_steps_with_its_own_advantages_not_grpos(monkeypatch):

    from asyncrl.algos import grpo
    from asyncrl.train.components import build_components

    seen = []
    real = grpo.ClippedPolicyLoss.__call__

    def spy(self, logprobs, old, advantages, mask, *args, **kwargs):
        seen.append(advantages.clone())
        return real(self, logprobs, old, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(grpo.ClippedPolicyLoss, "__call__", spy)
    parts = build_components(small_config("algo.name=rloo"))
    groups = groups_of(parts)
    metrics = parts.algo.step(groups, 0)
    rewards = torch.stack([g.rewards for g in groups])
    assert torch.equal(seen[0], leave_one_out_advantages(rewards).reshape(-1, 1))
    assert metrics["reward_mean"] == pytest.approx(float(rewards.mean()))


def test_rloos_entropy_bonus_is_scaled_by_the_std_of_the_steps_advantages(monkeypatch):
    """`algo.entropy_scale=advantage_std` (the default): the bonus enters the loss with
    `entropy_coef * std(advantages)`; GRPO's and `none` keep `entropy_coef` as given. (With
    `entropy_coef` tuned for GRPO's std-scaled advantages RLOO learnt nothing on the demo.)"""
    from asyncrl.algos import grpo
    from asyncrl.train.components import build_components

    seen: list[float] = []
    real = grpo.regularise

    def spy(*args, **kwargs):
        seen.append(args[-1])  # the entropy coefficient the step used
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "regularise", spy)
    got = {}
    for name, scale in (("rloo", "advantage_std"), ("rloo", "none"), ("grpo", None)):
        extra = [f"algo.entropy_scale={scale}"] if scale else []
        parts = build_components(small_config(f"algo.name={name}", "algo.entropy_coef=0.1", *extra))
        groups = groups_of(parts)
        seen.clear()
        parts.algo.step(groups, 0)
        rewards = torch.stack([g.rewards for g in groups])
        got[(name, scale)] = (set(seen), rewards)
    (scaled,), rewards = got[("rloo", "advantage_std")]
    std = float(leave_one_out_advantages(rewards).std(unbiased=False))
    assert std > 0 and scaled == pytest.approx(0.1 * std)
    assert got[("rloo", "none")][0] == {0.1} and got[("grpo", None)][0] == {0.1}
    with pytest.raises(ConfigError, match=r"algo\.entropy_scale"):
        small_config("algo.name=rloo", "algo.entropy_scale=sometimes")


def test_an_rloo_run_from_before_entropy_scale_resumes_only_with_the_bonus_it_had():
    """A checkpoint's config that predates `algo.entropy_scale` trained with the coefficient
    as given (`none`): with a bonus, the new default would change the run, so it differs (a
    resume is refused unless `algo.entropy_scale=none`); without one the two are the same."""
    from asyncrl.config.keys import semantic_differences

    for coef, expected in (
        (0.1, ["algo.entropy_scale: checkpoint='none', now='advantage_std'"]),
        (0.0, []),
    ):
        now = build_config({}, ["algo.name=rloo", f"algo.entropy_coef={coef}"])
        saved = now.to_dict()
        del saved["algo"]["entropy_scale"]  # written before the key existed
        assert semantic_differences(saved, now) == expected
    same = build_config({}, ["algo.name=rloo", "algo.entropy_coef=0.1", "algo.entropy_scale=none"])
    saved = same.to_dict()
    del saved["algo"]["entropy_scale"]
    assert semantic_differences(saved, same) == []
