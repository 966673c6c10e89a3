"""`asyncrl eval DIR [--checkpoint step_N] [eval.KEY=VALUE ...]`: a verified checkpoint's policy
evaluated as the run evaluates (`asyncrl.rollout.evaluation`), with the run's own config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from asyncrl.checkpoint.run_checkpoints import RunCheckpointsError, verified_checkpoint
from asyncrl.cli.export import checkpoint_policy
from asyncrl.config.keys import load_config
from asyncrl.rollout.evaluation import build_evaluator, task_reward_pool
from asyncrl.tasks.source import load_task


def evaluate_checkpoint(
    run_dir: Path, checkpoint: str | None = None, overrides: Sequence[str] = ()
) -> tuple[int, dict[str, float]]:
    """`asyncrl eval`: the evaluation of a verified checkpoint of `run_dir` (default: the
    newest; `step_N` names one) with the run's config (`run_dir/config.yaml`, its `eval.*`
    settings changed by `overrides`), on the policy the checkpoint saved. Returns the step it
    was saved after and the `eval/...` metrics. Raises `RunCheckpointsError` / `ConfigError`
    naming what is missing."""
    if not (run_dir / "config.yaml").is_file():
        raise RunCheckpointsError(f"{run_dir}: not a run dir (no config.yaml)")
    config = load_config(run_dir / "config.yaml", list(overrides))
    if config.run.torch_threads:  # as the run evaluated: the same float reduction order
        torch.set_num_threads(config.run.torch_threads)
    verified = verified_checkpoint(run_dir, checkpoint)
    policy, _ = checkpoint_policy(verified)
    task = load_task(config.data)
    pool = task_reward_pool(task, config.rollout)
    try:
        evaluator = build_evaluator(config, policy, task, pool)
        return verified.step, evaluator.evaluate(verified.step, policy.model.state_dict())
    finally:
        pool.close()
