"""benchmarks/smol.py's reading of a run: the initial weights' evaluation is the before figure,
the last evaluation the after, and the last line counts the seeds that rose by the target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from smol import read_run, summary_line


def write_run(path: Path, evals: list[tuple[int, float]]) -> Path:
    path.mkdir()
    events = [{"event": "start", "time": 100.0, "config": {"run": {"seed": 3}}}]
    for i, (step, greedy) in enumerate(evals):
        events.append(
            {
                "event": "eval",
                "time": 200.0 + 100 * i,
                "step": step,
                "eval/greedy_pass": greedy,
                "eval/stderr/greedy_pass": 0.02,
                "eval/reward/format": 0.5 + 0.1 * i,
                "eval/num_examples": 256.0,
            }
        )
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_before_is_step_minus_one_after_is_the_last_and_seeds_are_counted(tmp_path):
    up = read_run(write_run(tmp_path / "a", [(-1, 0.10), (19, 0.05), (59, 0.25)]))
    assert (up.before, up.after, up.after_step, up.seconds) == (0.10, 0.25, 59, 300.0)
    assert up.format_share == pytest.approx(0.7)
    flat = read_run(write_run(tmp_path / "b", [(-1, 0.10), (59, 0.19)]))  # 9 points: short
    line = summary_line([up, flat], 10.0)
    assert line == "smol: heldout_acc 0.100 -> 0.220 in 250 s (seeds up >= 10 points: 1/2)"


def test_a_run_without_the_initial_evaluation_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="initial weights"):
        read_run(write_run(tmp_path / "c", [(19, 0.05)]))
