"""Learning-rate schedules: `algo.lr_schedule` and `algo.warmup_steps`, per training step.

Each optimizer an algorithm owns (the policy's; PPO's critic's) gets a `StepSchedule`: a
`torch.optim.lr_scheduler.LambdaLR` built by transformers' `get_*_schedule_with_warmup`, so
the factor of training step t is Hugging Face's, warm-up included (0 at step 0):

    t < W:     t / max(1, W)                                     (W = algo.warmup_steps)
    constant:  1
    linear:    max(0, (T - t) / max(1, T - W))                   (T = run.max_num_steps)
    cosine:    max(0, 0.5 * (1 + cos(pi * (t - W) / max(1, T - W))))

The scheduler advances once per *training* step, however many optimizer steps that step
takes (PPO's epochs and minibatches) and also when it takes none (PPO's critic warm-up): the
lr is a function of the training step. Its state (`last_epoch` = the next step) is saved with
the algorithm, so a resumed run's lr at step t is the uninterrupted run's.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from asyncrl.config import AlgoConfig


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: AlgoConfig, num_steps: int
) -> LambdaLR:
    """transformers' schedule `algo.lr_schedule` over `optimizer`'s current lr, with
    `algo.warmup_steps` of warm-up and its decay ending at step `num_steps`. Its lambdas are
    `functools.partial`s: their arguments (the horizon) are not saved in its `state_dict`, so
    a resume takes the horizon of the config it runs with."""
    warmup = config.warmup_steps
    if config.lr_schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, num_steps)
    if config.lr_schedule == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, num_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)


class StepSchedule:
    """One optimizer's learning rate per training step: `start(t)` before step t's updates
    returns the lr they use, `advance()` after them moves to step t+1.

    `state_dict` is the LambdaLR's (JSON values only). `load_state_dict` must come after the
    optimizer's own (which restores the lr it had): it restores the step, keeps the base lr of
    *this* config (`algo.lr`, changed only with `--force-config`, then takes effect) and sets
    the optimizer's lr to that step's. A checkpoint written before schedules existed has no
    such state (`None`): the run had a constant lr, and `start(t)` places the schedule at t."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: AlgoConfig, num_steps: int):
        self.optimizer = optimizer
        self.scheduler = build_lr_scheduler(optimizer, config, num_steps)
        self._place_at_start = False

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def start(self, step: int) -> float:
        """The lr training step `step` uses (placing a schedule restored without state)."""
        if self._place_at_start:
            self._place(step)
            self._place_at_start = False
        return self.lr

    def advance(self) -> None:
        """To the next training step. torch warns when a schedule steps before its optimizer
        did; here that is PPO's critic warm-up, where the policy's lr still follows the step."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self._place_at_start = True
            return
        base_lrs = list(self.scheduler.base_lrs)
        self.scheduler.load_state_dict(dict(state))
        self.scheduler.base_lrs = base_lrs
        self._place(int(state["last_epoch"]))

    def _place(self, step: int) -> None:
        """The schedule at `step`, the optimizer's lr that step's (LambdaLR computes it). Its
        count of `step()` calls is left as it was: a state loaded and saved again is the same."""
        num_calls = self.scheduler._step_count
        self.scheduler.last_epoch = step - 1
        self.advance()
        self.scheduler._step_count = num_calls
