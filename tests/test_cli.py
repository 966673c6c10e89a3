"""The user-facing surface (DESIGN.md's contract), frozen: CLI commands and options, config keys,
metrics and events schema. Changing any of these must be deliberate: update this test, the
README and DESIGN.md's contract together."""

from __future__ import annotations

import argparse

import pytest
from helpers import SMALL, read_records, run_cli

from asyncrl.cli.main import build_parser, parse_args
from asyncrl.config.keys import config_keys

FROZEN_COMMANDS = {
    "train": {"config", "--run-dir", "--restart", "--force-config", "overrides"},
    "inspect": {"run_dir", "--json"},
    "audit": {"run_dir"},
    "plot": {"run_dir"},
    "export": {"run_dir", "--checkpoint", "out", "--adapter"},
    "eval": {"run_dir", "--checkpoint", "--json", "overrides"},
    "prepare-model": {"name", "out"},
}

FROZEN_CONFIG_KEYS = [
    "run.seed", "run.max_num_steps", "run.deterministic", "run.torch_threads", "run.share_cores",
    "model.preset", "model.path", "model.hidden_size", "model.num_layers", "model.num_heads",
    "model.max_seq_len", "model.lora.rank", "model.lora.alpha", "model.lora.dropout",
    "model.lora.target_modules", "model.lora.merge_for_generation",
    "data.task", "data.path", "data.split", "data.revision", "data.prompt_key", "data.messages_key",
    "data.answer_key", "data.system_prompt", "data.apply_chat_template", "data.reward_fn",
    "data.format_reward", "data.fewshot", "data.fewshot_key", "data.num_digits",
    "data.num_examples",
    "env.name", "env.max_turns", "env.max_episode_tokens",
    "agent.name", "agent.args", "agent.max_calls", "agent.max_tokens", "agent.timeout_s",
    "agent.retries", "agent.tool_parser",
    "rollout.num_prompts_per_step", "rollout.num_generations_per_prompt",
    "rollout.max_new_tokens", "rollout.temperature", "rollout.overlong_buffer",
    "rollout.overlong_penalty", "rollout.max_trajectory_age_steps",
    "rollout.max_generation_failures", "rollout.reward_workers", "rollout.reward_timeout_s",
    "rollout.groups_per_batch", "rollout.chunk_tokens",
    "rollout.update_weights_mid_generation",
    "rollout.engine",
    "rollout.backend", "rollout.num_workers", "rollout.device", "rollout.dtype",
    "rollout.vllm.kv_cache_bytes", "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm.max_model_len", "rollout.vllm.max_num_seqs", "rollout.vllm.enforce_eager",
    "rollout.vllm.enable_prefix_caching", "rollout.vllm.multiprocessing",
    "rollout.vllm.lora_requests",
    "rollout.servers.launch", "rollout.servers.urls", "rollout.servers.max_restarts",
    "rollout.servers.health_timeout_s", "rollout.servers.start_timeout_s",
    "train.device", "train.dtype", "train.micro_batch_size", "train.shared_prompts",
    "train.num_processes", "train.rank_timeout_s",
    "algo.name", "algo.lr", "algo.lr_schedule", "algo.warmup_steps", "algo.weight_decay",
    "algo.adam_beta1", "algo.adam_beta2",
    "algo.adam_epsilon", "algo.loss_aggregation", "algo.max_grad_norm", "algo.clip_eps",
    "algo.kl_coef", "algo.kl_estimator", "algo.entropy_coef",
    # the `grpo` algorithm's own keys (asyncrl/config/algos.py GRPOOptions)
    "algo.scale_rewards", "algo.mismatch_tis_cap", "algo.skip_zero_variance_groups",
    # the `ppo` algorithm's own keys (asyncrl/config/algos.py PPOOptions)
    "algo.kl_in_reward", "algo.gamma",
    "algo.lam", "algo.normalize_advantages", "algo.ppo_epochs", "algo.num_minibatches",
    "algo.critic_lr", "algo.value_clip_eps", "algo.critic_warmup_steps", "algo.tis_cap",
    # the `rloo` algorithm's own keys (asyncrl/config/algos.py RLOOOptions)
    "algo.entropy_scale",
    "checkpoint.save_period", "checkpoint.every_s", "checkpoint.when_busy",
    "checkpoint.grace_s", "checkpoint.signal_warning_s",
    "checkpoint.keep_last", "checkpoint.resume_policy", "checkpoint.staging_buffer",
    "eval.every_steps", "eval.at_start", "eval.path", "eval.split", "eval.max_examples",
    "eval.num_samples", "eval.temperature", "eval.greedy", "eval.pass_threshold",
    "eval.batch_prompts",
    "logging.progress", "logging.tensorboard", "logging.plot", "logging.wandb",
    "logging.wandb_project", "logging.wandb_run_name", "logging.mlflow",
    "logging.mlflow_tracking_uri", "logging.mlflow_experiment",
    "ray.address", "ray.num_cpus_per_worker", "ray.watch_drains", "ray.drain_poll_s",
]  # fmt: skip

CONTRACT_METRICS = {
    "step", "attempt", "prompt_ordinals", "dataset_indices", "reward_mean", "loss",
    "generation_version_min", "generation_version_max", "wall_s",
}  # fmt: skip


def test_cli_commands_and_options_are_frozen():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = {
        name: {
            opt for a in p._actions for opt in (a.option_strings or [a.dest]) if a.dest != "help"
        }
        for name, p in sub.choices.items()
    }
    assert found == FROZEN_COMMANDS


def test_config_keys_are_frozen():
    assert config_keys() == FROZEN_CONFIG_KEYS


def test_overrides_may_stand_before_or_after_run_dir():
    before = parse_args(["train", "c.yaml", "algo.lr=0.1", "--run-dir", "d", "run.seed=2"])
    assert before.config == "c.yaml" and before.run_dir == "d"
    assert before.overrides == ["algo.lr=0.1", "run.seed=2"]


@pytest.mark.slow
def test_train_from_the_command_line_writes_the_contract_files(tmp_path, repo_root):
    run = tmp_path / "run"
    done = run_cli(
        "train", str(repo_root / "configs" / "demo.yaml"), "--run-dir", str(run),
        *SMALL, "run.max_num_steps=3", "logging.plot=true",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "3 steps in" in done.stdout and "reward_mean" in done.stdout
    records = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert set(record) >= CONTRACT_METRICS
    assert (run / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(run / "reward_curve.png").shape[:2] == (374, 990)


@pytest.mark.slow
def test_bad_input_exits_2_with_a_message_naming_the_key(tmp_path, repo_root):
    demo = str(repo_root / "configs" / "demo.yaml")
    done = run_cli("train", demo, "--run-dir", str(tmp_path / "r"), "rollout.num_prompt_per_step=3")
    assert done.returncode == 2
    assert "did you mean rollout.num_prompts_per_step" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_run_dir_with_foreign_run_files_is_refused(tmp_path, repo_root):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    done = run_cli("train", str(repo_root / "configs" / "demo.yaml"), "--run-dir", str(run))
    assert done.returncode == 2
    assert "holds files of a run but no run.json" in done.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.slow
def test_a_checkpoint_from_a_newer_asyncrl_is_refused_with_exit_2_and_nothing_trained(
    tmp_path, repo_root
):
    import json

    from asyncrl.config.keys import load_config
    from asyncrl.train.trainer import train

    demo = str(repo_root / "configs" / "demo.yaml")
    run = tmp_path / "run"
    train(load_config(demo, [*SMALL, "run.max_num_steps=4", "checkpoint.save_period=2"]), run)
    manifest_path = run / "checkpoints" / "step_000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 99  # as a future asyncrl would write it
    manifest_path.write_text(json.dumps(manifest))
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "events.jsonl")}

    done = run_cli("train", demo, "--run-dir", str(run), *SMALL, "checkpoint.save_period=2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("asyncrl: error: ") and str(manifest_path) in line
    assert "format version 99" in line and "upgrade asyncrl to resume it" in line
    assert {name: (run / name).read_bytes() for name in before} == before  # nothing trained
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    shown = run_cli("inspect", str(run))
    assert shown.returncode == 2 and "format version 99" in shown.stderr
    assert "Traceback" not in shown.stderr


@pytest.mark.slow
def test_a_run_dir_that_cannot_be_created_exits_2_naming_it(tmp_path, repo_root):
    (tmp_path / "a-file").write_text("")
    demo = str(repo_root / "configs" / "demo.yaml")
    for run in ("/proc/asyncrl-test/run", str(tmp_path / "a-file" / "run")):
        done = run_cli("train", demo, "--run-dir", run, *SMALL)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"asyncrl: error: {run}: cannot create the run dir"), line
