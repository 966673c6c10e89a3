"""`algo.skip_zero_variance_groups`: groups whose rewards are all equal leave the step's passes.

The oracle is the same algorithm on the same groups with the option off: without KL and entropy
terms a uniform group's samples add nothing to the loss (advantage 0), so the gradient must be
the same, while the passes see only the other groups' rows. A normaliser recounted over the
trained rows alone (the easy mistake) would scale the gradient by 12/8 and fail the comparison;
so would leaving out a group that has spread.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import small_config
from test_micro_batches import COMMON, gradients_of_each_update, worst_relative_error
from test_micro_batches import groups as groups

from asyncrl.config import ConfigError
from asyncrl.train.components import build_components
from asyncrl.train.records import step_record

NO_REGULARISERS = ("algo.kl_coef=0", "algo.entropy_coef=0")
SKIP = "algo.skip_zero_variance_groups=true"


def with_rewards(groups, rewards):
    return [
        dataclasses.replace(g, rewards=torch.tensor(r))
        for g, r in zip(groups, rewards, strict=True)
    ]


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
@pytest.mark.parametrize("micro_batch_size", [0, 3])
def test_a_uniform_group_is_left_out_and_the_gradient_is_the_same(groups, algo, micro_batch_size):
    one_uniform = with_rewards(groups, [[1.0, 0.0, 0.5, 0.0], [1.0] * 4, [0.2, 0.9, 0.0, 0.4]])
    keys = (f"algo.name={algo}", *NO_REGULARISERS)
    oracle, whole = gradients_of_each_update((*keys, "train.micro_batch_size=0"), 0, one_uniform)
    assert any(float(g.norm()) > 0 for g in oracle[0].values())
    grads, metrics = gradients_of_each_update((*keys, SKIP), micro_batch_size, one_uniform)
    assert metrics["trained_rows"] == 8  # the uniform group's 4 rows were not trained
    assert "trained_rows" not in whole
    assert metrics["zero_variance_groups"] == whole["zero_variance_groups"] == pytest.approx(1 / 3)
    assert worst_relative_error(oracle, grads) <= 1e-6
    assert metrics["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert metrics["num_tokens"] == whole["num_tokens"]  # over every sample


def rows_through_the_model(groups, *keys):
    """The rows each forward pass of one step ran on (full passes: prompt and completion)."""
    parts = build_components(small_config(*COMMON, "train.shared_prompts=false", *keys))
    seen: list[int] = []
    embeddings = parts.algo.model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, out: seen.append(len(out)))
    metrics = parts.algo.step(groups, 3)
    handle.remove()
    return seen, metrics


def test_the_passes_see_only_the_trained_rows(groups):
    one_varied = with_rewards(groups, [[0.0] * 4, [0.0, 1.0, 0.0, 0.0], [0.5] * 4])
    seen, metrics = rows_through_the_model(one_varied, SKIP)
    assert metrics["trained_rows"] == 4
    full, _ = rows_through_the_model(one_varied)  # the control: every row
    assert sum(full) - sum(seen) == 8, f"passes on {seen} rows, against {full} without"


def test_a_step_of_uniform_groups_changes_no_weight_and_still_counts(groups):
    uniform = with_rewards(groups, [[0.0] * 4, [1.0] * 4, [0.5] * 4])
    parts = build_components(small_config(*COMMON, SKIP, "algo.lr_schedule=linear"))
    algo = parts.algo
    before = {n: p.detach().clone() for n, p in algo.model.named_parameters()}
    metrics = algo.step(uniform, 0)
    assert metrics["trained_rows"] == 0 and metrics["zero_variance_groups"] == 1.0
    assert metrics["grad_norm"] == 0.0
    for name, param in algo.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert not algo.optimizer.state, "the optimizer stepped"
    # the schedule moved on: the next step's lr is step 1's
    lr_next = algo.step(with_rewards(groups, [[0.0, 1.0, 0.0, 0.0]] * 3), 1)["lr"]
    reference = build_components(small_config(*COMMON, "algo.lr_schedule=linear")).algo
    reference.step(uniform, 0)
    assert lr_next == reference.step(uniform, 1)["lr"]


def test_ppo_has_no_such_key():
    with pytest.raises(ConfigError, match="skip_zero_variance_groups"):
        small_config("algo.name=ppo", SKIP)


def test_the_step_record_names_the_groups_left_out(groups):
    """`skipped_ordinals` in metrics.jsonl: what `benchmarks/floor.py` leaves out of the
    training floor. The groups' ordinals are 0, 1, 2; the middle one has spread."""
    one_varied = with_rewards(groups, [[0.0] * 4, [0.0, 1.0, 0.0, 0.0], [0.5] * 4])
    _, metrics = rows_through_the_model(one_varied, SKIP)
    record = step_record(3, 0, one_varied, metrics)
    assert record["skipped_ordinals"] == [one_varied[0].ordinal, one_varied[2].ordinal]
    _, whole = rows_through_the_model(one_varied)  # the control: nothing left out, no field
    assert "skipped_ordinals" not in step_record(3, 0, one_varied, whole)
