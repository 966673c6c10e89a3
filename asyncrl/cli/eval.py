"""`asyncrl eval DIR [--checkpoint step_N] [eval.KEY=VALUE ...] [data.reward_fn=M:F]`: a
verified checkpoint's policy evaluated as the run evaluates (`asyncrl.rollout.evaluation`), with
the config the checkpoint holds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from asyncrl.checkpoint.run_checkpoints import verified_checkpoint
from asyncrl.checkpoint.snapshot import read_parts
from asyncrl.cli.export import checkpoint_policy
from asyncrl.config import ConfigError
from asyncrl.config.data import BUILTIN_REWARDS
from asyncrl.config.keys import build_config
from asyncrl.models.device import bound_onednn_cache
from asyncrl.rollout.evaluation import build_evaluator, task_reward_pool
from asyncrl.tasks.source import load_task


def evaluate_checkpoint(
    run_dir: Path, checkpoint: str | None = None, overrides: Sequence[str] = ()
) -> tuple[int, dict[str, float]]:
    """`asyncrl eval`: the evaluation of a verified checkpoint of `run_dir` (default: the
    newest; `step_N` names one) with the config that checkpoint was written with (its
    manifest-covered `state.json`; `eval.*` and `data.reward_fn` changed by `overrides`), on
    the policy it saved. Nothing from the run dir is executed (I7): a reward that is not built
    in is imported only when `overrides` name it. Returns the step the checkpoint was saved
    after and the `eval/...` metrics. Raises `RunCheckpointsError` / `ConfigError` naming what
    is missing."""
    verified = verified_checkpoint(run_dir, checkpoint)
    _, saved = read_parts(verified)
    # the sections an evaluation reads; `algo` may hold keys this asyncrl no longer accepts
    config = build_config({k: v for k, v in saved.items() if k != "algo"}, list(overrides))
    if config.agent.name.startswith("verifiers:"):
        raise ConfigError(
            f"agent.name={config.agent.name}: asyncrl eval evaluates single-turn completions of "
            "data.*, and a verifiers run's rows and reward are its environment's; evaluate its "
            "held-out split as docs/verifiers.md#held-out-evaluation shows"
        )
    named = any(o.startswith("data.reward_fn=") for o in overrides)
    if config.data.reward_target not in BUILTIN_REWARDS.values() and not named:
        raise ConfigError(
            f"data.reward_fn: the run's reward {config.data.reward_fn!r} is not built in, and "
            "asyncrl eval runs no code named by a run dir; name it on the command line to "
            f"import it: data.reward_fn={config.data.reward_fn}"
        )
    bound_onednn_cache()
    if config.run.torch_threads:  # as the run evaluated: the same float reduction order
        torch.set_num_threads(config.run.torch_threads)
    policy, _ = checkpoint_policy(verified)
    task = load_task(config.data)
    pool = task_reward_pool(task, config.rollout)
    try:
        evaluator = build_evaluator(config, policy, task, pool)
        return verified.step, evaluator.evaluate(verified.step, policy.model.state_dict())
    finally:
        pool.close()
