"""Learning-rate schedules (`algo.lr_schedule`, `algo.warmup_steps`): the lr of each training
step, by hand; what every algorithm records and trains with; and what a resume restores.

Oracles: factors computed by hand from Hugging Face's formulas (warm-up t/W, linear
(T-t)/(T-W), cosine 0.5*(1+cos(pi*(t-W)/(T-W)))). That a killed and resumed run's `lr` per step
is the uninterrupted run's is tests/test_determinism.py's."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import read_records, small_config

from asyncrl.algos.schedule import StepSchedule
from asyncrl.config import ConfigError
from asyncrl.config.keys import resume_rule
from asyncrl.train.components import build_components
from asyncrl.train.trainer import train


def factors(schedule: str, warmup: int, num_steps: int, steps: int) -> list[float]:
    """The lr of steps 0..steps-1 of a schedule over an optimizer at lr 1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    config = small_config(f"algo.lr_schedule={schedule}", f"algo.warmup_steps={warmup}").algo
    lr_schedule = StepSchedule(optimizer, config, num_steps)
    out = []
    for t in range(steps):
        out.append(lr_schedule.start(t))
        lr_schedule.advance()
    return out


def test_constant_is_the_base_lr_at_every_step():
    assert factors("constant", 0, 10, 10) == [1.0] * 10


def test_warmup_rises_linearly_from_0_then_holds():
    assert factors("constant", 4, 10, 7) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_warms_up_then_decays_to_0_at_max_num_steps():
    # W=2, T=10: warm-up 0, 1/2; then (10-t)/8
    expected = [0.0, 0.5, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0]
    assert factors("linear", 2, 10, 11) == pytest.approx(expected)


def test_cosine_warms_up_then_follows_half_a_cosine_to_0():
    got = factors("cosine", 2, 10, 11)
    # W=2, T=10: step 6 is half way (0.5); step 4 a quarter: (1 + cos(pi/4)) / 2
    assert got[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert got[4] == pytest.approx((1 + math.sqrt(0.5)) / 2)
    assert got[6] == pytest.approx(0.5)
    assert got[9] == pytest.approx((1 + math.cos(7 * math.pi / 8)) / 2)
    assert got[10] == pytest.approx(0.0, abs=1e-12)


def test_a_negative_warmup_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"algo\.warmup_steps"):
        small_config("algo.warmup_steps=-1")
    with pytest.raises(ConfigError, match=r"algo\.lr_schedule"):
        small_config("algo.lr_schedule=step")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
def test_every_algorithm_records_and_trains_with_the_scheduled_lr(tmp_path, name):
    extra = ["algo.critic_lr=1e-3", "algo.critic_warmup_steps=1"] if name == "ppo" else []
    config = small_config(
        f"algo.name={name}",
        "run.max_num_steps=4",
        "algo.lr=3e-4",
        "algo.lr_schedule=linear",
        "algo.warmup_steps=2",
        *extra,
    )
    train(config, tmp_path / "run")
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    factor = [0.0, 0.5, 1.0, 0.5]  # W=2, T=4
    assert [r["lr"] for r in records] == pytest.approx([3e-4 * f for f in factor])
    if name == "ppo":  # the critic's lr has the same shape, from critic_lr
        assert [r["critic_lr"] for r in records] == pytest.approx([1e-3 * f for f in factor])


def test_the_algorithm_state_carries_the_schedule_and_a_resume_restores_its_step():
    keys = ("algo.lr_schedule=linear", "algo.warmup_steps=2", "run.max_num_steps=10")
    trained = build_components(small_config(*keys)).algo
    for _ in range(5):
        trained.schedule.advance()  # as after steps 0-4
    state = trained.state_dict()
    assert state["lr_scheduler"]["last_epoch"] == 5

    fresh = build_components(small_config(*keys)).algo
    fresh.load_state_dict(state)
    assert fresh.schedule.start(5) == pytest.approx(3e-4 * 5 / 8)
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4 * 5 / 8)


def test_a_resume_takes_the_horizon_and_base_lr_of_its_own_config():
    # run.max_num_steps may change on resume: the decay's end moves; a --force-config'd
    # algo.lr takes effect (the optimizer's saved lr does not override it)
    trained = build_components(small_config("algo.lr_schedule=linear", "run.max_num_steps=10"))
    for _ in range(5):
        trained.algo.schedule.advance()
    state = trained.algo.state_dict()
    longer = small_config("algo.lr_schedule=linear", "run.max_num_steps=20", "algo.lr=1e-3")
    resumed = build_components(longer).algo
    resumed.load_state_dict(state)
    assert resumed.schedule.start(5) == pytest.approx(1e-3 * 15 / 20)


def test_a_checkpoint_from_before_schedules_resumes_at_its_step():
    keys = ("algo.name=ppo", "algo.lr_schedule=cosine", "algo.warmup_steps=2")
    state = build_components(small_config(*keys)).algo.state_dict()
    del state["lr_scheduler"], state["critic_lr_scheduler"]  # as an older asyncrl wrote it
    algo = build_components(small_config(*keys)).algo  # run.max_num_steps=6
    algo.load_state_dict(state)
    expected = (1 + math.cos(math.pi * (3 - 2) / 4)) / 2
    assert algo.schedule.start(3) == pytest.approx(3e-4 * expected)
    assert algo.critic_schedule.start(3) == pytest.approx(algo.options.critic_lr * expected)


def test_changing_the_schedule_on_resume_is_refused_but_the_horizon_may_move():
    # a changed schedule changes what the remaining steps train: semantics-bearing, refused
    # unless --force-config; run.max_num_steps may change (the decay's end moves with it)
    assert resume_rule("algo.lr_schedule") == resume_rule("algo.warmup_steps") == "semantic"
    assert resume_rule("run.max_num_steps") == "may_change"


def test_a_warm_up_as_long_as_the_run_is_refused():
    with pytest.raises(
        ConfigError, match=r"algo\.warmup_steps: got 6, must be < run\.max_num_steps=6"
    ):
        small_config("algo.warmup_steps=6")
    small_config("algo.warmup_steps=5")
