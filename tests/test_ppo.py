"""PPO's parts on a real tiny model: the critic's initialisation, critic warm-up, the number of
updates per step, the metrics, and the reference policy a resume must rebuild identically."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import groups_of, read_records, small_config

from asyncrl.algos.update import stack_groups
from asyncrl.checkpoint.store import CheckpointError
from asyncrl.cli.inspect import inspect_run_dir
from asyncrl.models.critic import completion_values
from asyncrl.train.components import build_components
from asyncrl.train.trainer import train


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_critic_starts_from_the_policy_body_with_a_zero_head():
    rng = torch.get_rng_state()
    parts = build_components(small_config("algo.name=ppo"))
    assert torch.equal(rng, torch.get_rng_state())  # built without touching the global RNG
    critic, policy = parts.algo.critic, parts.policy.model
    assert type(critic).__name__ == "LlamaForTokenClassification" and critic.num_labels == 1
    body = policy.base_model.state_dict()
    for name, tensor in critic.base_model.state_dict().items():
        assert torch.equal(tensor, body[name]), name
    assert critic.base_model is not policy.base_model
    batch = stack_groups(groups_of(parts), parts.policy.pad_id)
    values = completion_values(
        critic, batch["prompts"], batch["completion_ids"], batch["completion_mask"], 0
    )
    assert values.shape == batch["completion_ids"].shape and (values == 0).all()


def test_critic_warmup_trains_the_critic_and_leaves_the_policy_alone():
    parts = build_components(small_config("algo.name=ppo", "algo.critic_warmup_steps=2"))
    groups = groups_of(parts)
    policy_before, critic_before = weights(parts.policy.model), weights(parts.algo.critic)
    metrics = parts.algo.step(groups, 1)  # step 1 < 2: warm-up
    assert not changed(policy_before, parts.policy.model)
    assert changed(critic_before, parts.algo.critic)
    assert metrics["policy_updated"] == 0.0 and "grad_norm" not in metrics
    metrics = parts.algo.step(groups, 2)
    assert changed(policy_before, parts.policy.model) and metrics["policy_updated"] == 1.0


def test_each_step_makes_epochs_times_minibatches_updates_and_reports_every_metric():
    overrides = ["algo.name=ppo", "algo.ppo_epochs=3", "algo.num_minibatches=2", "algo.kl_coef=0.1"]
    parts = build_components(small_config(*overrides))
    metrics = parts.algo.step(groups_of(parts), 0)
    for optimizer in (parts.algo.optimizer, parts.algo.critic_optimizer):
        steps = {float(s["step"]) for s in optimizer.state_dict()["state"].values()}
        assert steps == {6.0}  # 3 epochs x 2 minibatches
    expected = {
        "loss", "policy_loss", "value_loss", "explained_variance", "clip_frac", "approx_kl",
        "entropy", "kl_ref", "is_ratio_mean", "is_ratio_max", "is_ratio_min",
        "is_truncated_frac", "advantage_mean", "advantage_std", "value_mean", "return_mean",
        "grad_norm", "critic_grad_norm", "value_clip_frac", "ratio_mean", "ratio_max",
        "reward_mean", "policy_updated",
    }  # fmt: skip
    assert expected <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    # later minibatches see a policy that already moved: the ratio is no longer 1
    assert metrics["ratio_max"] > 1.0 and metrics["approx_kl"] > 0
    assert metrics["kl_ref"] > 0  # the policy moved away from the reference during the step


def test_a_critic_from_model_path_and_a_resume_that_checks_the_rebuilt_reference(tmp_path):
    source = build_components(small_config()).policy
    source.model.save_pretrained(tmp_path / "model")
    source.tokenizer.save_pretrained(tmp_path / "model")
    run = tmp_path / "run"
    config = small_config("algo.name=ppo", "algo.kl_coef=0.1", f"model.path={tmp_path / 'model'}")
    critic = build_components(config).algo.critic  # loaded from the directory, head zeroed
    body = source.model.base_model.state_dict()
    assert all(torch.equal(t, body[k]) for k, t in critic.base_model.state_dict().items())
    assert (critic.score.weight == 0).all()
    config.run.max_num_steps = 2
    train(config, run)
    info = inspect_run_dir(run)
    assert info["algorithm"] == "ppo" and info["has_critic"] and info["reference_sha256"]
    config.run.max_num_steps = 3
    train(config, run)  # control: the same files rebuild the same reference
    assert [r["step"] for r in read_records(run / "metrics.jsonl")] == [0, 1, 2]
    other = build_components(small_config("run.seed=5")).policy
    other.model.save_pretrained(tmp_path / "model")  # the files under model.path change
    config.run.max_num_steps = 4
    with pytest.raises(CheckpointError, match="reference policy rebuilt from the config"):
        train(config, run)


def test_one_update_per_step_reuses_its_forward_passes_with_the_same_numbers():
    def one_step(reuse: bool):
        parts = build_components(small_config("algo.name=ppo", "algo.kl_coef=0.1"))
        parts.algo.reuse_forward = reuse
        metrics = parts.algo.step(groups_of(parts), 0)
        return metrics, weights(parts.policy.model), weights(parts.algo.critic)

    (m1, p1, c1), (m2, p2, c2) = one_step(True), one_step(False)
    assert m1 == m2
    assert all(torch.equal(p1[k], p2[k]) for k in p1) and all(torch.equal(c1[k], c2[k]) for k in c1)


def test_a_checkpoint_holds_the_critic_as_it_was_at_the_cut(tmp_path, monkeypatch):
    """The critic and its optimizer are copied in the background while the next step runs,
    and written later still: the files must hold them as they were at the cut."""
    from safetensors.torch import load_file

    from asyncrl.train.trainer import Trainer

    at_cut = []
    capture = Trainer.capture

    def remember(self):
        critic = {k: v.detach().clone() for k, v in self.parts.algo.critic.state_dict().items()}
        moments = self.parts.algo.critic_optimizer.state_dict()["state"]
        at_cut.append((self.step, critic, {i: s["exp_avg"].clone() for i, s in moments.items()}))
        return capture(self)

    monkeypatch.setattr(Trainer, "capture", remember)
    config = small_config(
        "algo.name=ppo", "run.max_num_steps=4", "checkpoint.save_period=2", "checkpoint.keep_last=5"
    )
    train(config, tmp_path / "run")
    step, critic, exp_avg = at_cut[0]  # the cut at step 2; steps 2 and 3 trained after it
    assert step == 2 and exp_avg
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_000002" / "state.safetensors")
    later = load_file(tmp_path / "run" / "checkpoints" / "step_000004" / "state.safetensors")
    for name, value in critic.items():
        assert torch.equal(saved[f"algorithm/critic/{name}"], value), name
    for i, value in exp_avg.items():
        assert torch.equal(saved[f"algorithm/critic_optimizer/state/{i}/exp_avg"], value)
    # the control: training went on, so the next checkpoint's critic differs
    assert any(not torch.equal(later[f"algorithm/critic/{k}"], v) for k, v in critic.items())


def test_a_grpo_checkpoint_forced_onto_ppo_is_refused_with_the_reason(tmp_path):
    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    info = inspect_run_dir(run)
    assert info["algorithm"] == "grpo" and not info["has_critic"]
    assert info["reference_sha256"] is None
    with pytest.raises(CheckpointError, match="has no critic"):
        train(small_config("run.max_num_steps=3", "algo.name=ppo"), run, force_config=True)
