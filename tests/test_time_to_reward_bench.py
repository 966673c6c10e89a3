"""benchmarks/time_to_reward.py: the trailing mean, the first step over a threshold, medians
with seeds that never got there, the final reward, and one real (short) run end to end."""

import math
import sys
from pathlib import Path

import launcher
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from time_to_reward import (  # noqa: E402
    SeedResult,
    analyse,
    final_reward,
    median_reached,
    table,
    time_to,
    trailing_means,
)


def test_trailing_means_start_once_the_window_is_full():
    assert trailing_means([1.0, 2.0, 3.0, 5.0], 2) == [None, 1.5, 2.5, 4.0]
    assert trailing_means([1.0], 3) == [None]


def test_time_to_is_the_first_step_whose_trailing_mean_reaches_the_threshold():
    rewards = [0.0, 1.0, 1.0, 0.0, 1.0]  # 2-step means: -, .5, 1, .5, .5
    wall = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert time_to(rewards, wall, 0.5, 2) == (2.0, 2)
    assert time_to(rewards, wall, 0.9, 2) == (3.0, 3)
    assert time_to(rewards, wall, 1.1, 2) is None
    # a single good step is not enough when the window is longer
    assert time_to([0.0, 0.0, 1.0], [1.0, 2.0, 3.0], 0.5, 3) is None


def test_final_reward_is_the_mean_of_the_last_tenth():
    assert final_reward([0.0] * 18 + [1.0, 0.5]) == pytest.approx(0.75)
    assert final_reward([0.2, 0.4, 0.6]) == pytest.approx(0.6)  # at least one step


def seed(reached):
    return SeedResult(0, 100, 10.0, 0.9, {"0.9": reached})


def test_a_seed_that_never_reaches_a_threshold_counts_as_infinite_in_the_median():
    assert median_reached([seed((10.0, 100)), seed(None), seed((30.0, 300))], "0.9") == (
        30.0,
        300,
    )
    assert median_reached([seed((10.0, 100)), seed(None), seed(None)], "0.9") is None


def test_analyse_keeps_the_latest_record_of_a_step_a_resume_trained_again():
    records = [
        {"step": 0, "attempt": 0, "reward_mean": 0.0, "wall_s": 1.0},
        {"step": 1, "attempt": 0, "reward_mean": 0.0, "wall_s": 2.0},
        {"step": 1, "attempt": 1, "reward_mean": 1.0, "wall_s": 3.0},
        {"step": 2, "attempt": 1, "reward_mean": 1.0, "wall_s": 4.0},
    ]
    result = analyse(records, 7, (0.5, 0.9), window=2)
    assert (result.steps, result.wall_s) == (3, 4.0)
    assert result.reached == {"0.5": (3.0, 2), "0.9": (4.0, 3)}
    assert result.steps_per_s == pytest.approx(0.75)
    assert math.isclose(result.final_reward, 1.0)


def test_the_table_has_a_row_per_variant_and_dashes_where_a_seed_missed():
    out = table([("v", [seed((10.0, 100)), seed(None)])], (0.9,))
    assert out.splitlines()[2] == "| v | 2 | 10.00 | 0.900 | — | 100, — |"


@pytest.mark.slow
def test_a_short_real_run_prints_the_last_line(tmp_path):
    done = launcher.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "time_to_reward.py"),
            "--seeds",
            "1",
            "--dir",
            str(tmp_path),
            "--set",
            "run.max_num_steps=6",
            "--set",
            "rollout.num_prompts_per_step=4",
            "--set",
            "rollout.num_generations_per_prompt=4",
            "--window",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[1].startswith("seed 0: 6 steps in ")
    assert lines[-1].startswith("time_to_0.9: median ")
    assert (tmp_path / "summary.json").exists() and (tmp_path / "seed0" / "metrics.jsonl").exists()
