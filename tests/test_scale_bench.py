"""The pure parts of benchmarks/scale.py: the exponent fit, splitting RSS samples by checkpoint
intervals, steady-state rates and the formatting of the last line."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from scale import (
    checkpoint_intervals,
    fit_exponent,
    format_table,
    human,
    split_samples,
    steady_state,
    summary_line,
)


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0, 2.0])
def test_the_fit_recovers_the_exponent_of_an_exact_power_law(power):
    xs = [1e6, 5e6, 2e7, 7.5e7, 3e8]
    assert fit_exponent(xs, [3.0 * x**power for x in xs]) == pytest.approx(power)


def test_the_fit_is_the_least_squares_slope_of_noisy_points():
    # log-log points (0, 0), (1, 1), (2, 3): slope = sum(dx*dy)/sum(dx^2) = (1*1.33+1*1.67)/2
    xs = [1.0, math.e, math.e**2]
    ys = [1.0, math.e, math.e**3]
    assert fit_exponent(xs, ys) == pytest.approx(1.5)


def test_the_fit_needs_two_sizes_and_positive_costs():
    assert math.isnan(fit_exponent([1e6], [2.0]))
    assert math.isnan(fit_exponent([1e6, 1e6], [2.0, 3.0]))
    assert math.isnan(fit_exponent([1e6, 2e6], [2.0, 0.0]))


def test_a_checkpoint_interval_runs_from_the_staging_copy_to_the_event():
    events = [
        {"event": "start", "time": 90.0},
        {"event": "checkpoint", "time": 100.0, "seconds": 4.0, "blocked_s": 0.5},
        {"event": "checkpoint", "time": 200.0, "seconds": 10.0},  # no blocked_s: 0
    ]
    assert checkpoint_intervals(events) == [(95.5, 100.0), (190.0, 200.0)]


def test_samples_split_into_inside_and_outside_the_intervals_within_the_run():
    samples = [(t, int(t)) for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)]
    inside, outside = split_samples(samples, [(2.5, 4.0), (6.0, 6.5)], start=2.0, end=7.0)
    assert inside == [3, 4, 6]  # interval ends are inside
    assert outside == [2, 5, 7]  # 1 and 8 are before the start and after the end


def test_steady_state_leaves_out_step_0_and_resumed_attempts():
    metrics = [
        {"step": 0, "attempt": 0, "wall_s": 5.0, "num_tokens": 100.0},  # warm-up: excluded
        {"step": 1, "attempt": 0, "wall_s": 7.0, "num_tokens": 30.0},
        {"step": 2, "attempt": 0, "wall_s": 9.0, "num_tokens": 10.0},
        {"step": 3, "attempt": 1, "wall_s": 30.0, "num_tokens": 99.0},  # the resume's
    ]
    step_s, tokens_per_s = steady_state(metrics)
    assert step_s == pytest.approx(2.0)
    assert tokens_per_s == pytest.approx(40.0 / 4.0)


def test_the_last_line_has_the_names_an_issue_quotes():
    line = summary_line(bytes_per_param=73.2, write_gbps=0.1, disk_gbps=0.4, blocked=0.125)
    assert line == "scale: peak_bytes_per_param=73 ckpt_write_vs_disk=0.25 blocked_per_step=12.5%"


def test_numbers_and_tables_are_formatted_for_reading():
    assert human(75_812_352) == "75.8M" and human(1.2e9, "B") == "1.2GB" and human(512) == "512"
    assert format_table([{"a": "1", "bb": "22"}, {"a": "333", "bb": "4"}]) == [
        "  a  bb",
        "  1  22",
        "333   4",
    ]


def test_the_lora_line_compares_lora_with_full_fine_tuning_side_by_side():
    from lora import ratios
    from scale import SizeResult

    def result(step_s: float, rss: int, ckpt: float, blocked: float) -> SizeResult:
        return SizeResult("300M", 100, step_s, 1.0, rss, rss, rss, ckpt, blocked, 1.0, 1.0, "")

    line = ratios(
        "300M",
        {
            "full": result(8.0, 2600, 1000.0, 1.0),
            "lora": result(2.0, 1000, 23.0, 0.02),
            "lora_merged": result(2.5, 1200, 23.0, 0.02),
        },
    )
    assert line == (
        "lora: size=300M ckpt_vs_full=2.3% blocked_per_step=1.0% peak_bytes_per_param=10.0 "
        "(full 26.0) steps_per_s_vs_full=4.00 merged_vs_peft_step=1.25"
    )


def test_the_deferral_line_compares_defer_with_wait_side_by_side():
    from deferral import deferral_line
    from scale import SizeResult

    def result(step_s: float, blocked: float, num_checkpoints: int, num_deferred: int):
        return SizeResult(
            "300M", 100, step_s, 1.0, 1, 1, 1, 1.0, blocked, 1.0, 1.0, "", num_checkpoints,
            num_deferred, write_wait_s=blocked / 2,
        )  # fmt: skip

    line = deferral_line("300M", {"wait": result(6.0, 5.2, 4, 0), "defer": result(5.0, 0.25, 4, 2)})
    assert line == (
        "deferral: size=300M blocked_per_step wait=86.7% defer=5.0% "
        "steps_per_s_defer_vs_wait=1.20 checkpoints wait=4 defer=4 deferred=2 "
        "previous_write_wait_ms wait=2600 defer=125"
    )


def test_the_blocked_median_leaves_out_the_first_and_a_final_checkpoint_that_waited_by_design():
    from scale import steady

    events = [
        {"step": 3, "reason": "save_period"},
        {"step": 7, "reason": "save_period", "deferred_from": 6},
        {"step": 10, "reason": "every_s"},
        {"step": 12, "reason": "final"},
    ]
    assert [e["step"] for e in steady(events)] == [7, 10]
    assert [e["step"] for e in steady(events[:1])] == [3]  # one: that one
    assert [e["step"] for e in steady([{"step": 6}, {"step": 9}])] == [9]  # older events


def test_the_lora_curve_line_takes_the_last_five_steps_and_the_best_lora_lr():
    from lora_curve import Curve, moving_mean, summary_line

    def curve(label: str, fmt: list[float], correct: float, wall: float) -> Curve:
        steps = list(range(len(fmt)))
        return Curve(label, steps, [wall] * len(fmt), fmt, [correct] * len(fmt))

    full = curve("full", [0.0] * 5 + [0.5] * 5, 0.25, 300.0)
    loras = {
        1e-4: curve("a", [0.1] * 10, 0.0, 250.0),
        3e-4: curve("b", [0.0] * 5 + [0.9] * 5, 0.5, 260.0),
    }
    # the last 5 steps' 160 samples: se = sqrt(0.5 * 0.5 / 160) = 0.0395, sqrt(.09 / 160) = 0.0237
    assert summary_line(full, loras) == (
        "lora_curve: steps=10 format_last5 full=0.500+-0.040 lora=0.900+-0.024 (lr 0.0003) "
        "correct_last5 full=0.250 lora=0.500 wall_s full=300 lora=260"
    )
    assert moving_mean([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], n=5) == [0.0, 0.5, 2 / 3, 0.75, 0.8, 1.0]


def test_vllm_lora_last_line_gives_requests_over_merged_per_size():
    from vllm_lora import line, ratios

    r = {"publish_ms": 25.4, "update_ms": 87.0, "gen_tok_s": 54.2, "version_s": 38.18}
    m = {"publish_ms": 1098.0, "update_ms": 558.0, "gen_tok_s": 120.0, "version_s": 19.09}
    assert line("requests", "smollm2", r) == (
        "requests smollm2: publish_ms=25 update_ms=87 gen_tok/s=54 version_s=38.18"
    )
    assert ratios({"smollm2": {"requests": r, "merged": m}}) == (
        "vllm_lora: requests/merged smollm2 version_s x2.00 gen_tok/s x0.45"
    )
    # on a launched server (--engine vllm_server): said in each line
    assert line("merged", "100M", m, "vllm_server").startswith("merged 100M (vllm_server): ")
    assert ratios({"100M": {"requests": r, "merged": m}}, "vllm_server").startswith(
        "vllm_lora: requests/merged on vllm_server 100M version_s x2.00"
    )
