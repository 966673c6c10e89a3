"""benchmarks/calculator_curve.py's reading of a run: per window of steps, the mean episode
reward and turns from the metrics, and the share of episodes that called the tool from the
calculator's own journal (by step id), matched to the steps' prompt ordinals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from calculator_curve import windows


def test_a_window_counts_the_episodes_that_called_the_tool(tmp_path):
    rows = [
        {"step": 0, "prompt_ordinals": [0, 1], "reward_mean": 0.1, "reward/turns": 1.0},
        {"step": 1, "prompt_ordinals": [2, 3], "reward_mean": 0.3, "reward/turns": 2.0},
        {"step": 1, "prompt_ordinals": [2, 3], "reward_mean": 0.5, "reward/turns": 3.0},  # counts
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "env").mkdir()
    calls = ["0:1:0", "2:0:0", "2:0:1", "3:1:0"]  # ordinal 2 sample 0 called twice: one episode
    (tmp_path / "env" / "calculator.jsonl").write_text(
        "".join(json.dumps({"step_id": s, "result": "1"}) + "\n" for s in calls) + '{"step'
    )  # a torn last line is no call
    (first, second) = windows(tmp_path, 1, group=2)
    assert (first["step"], first["reward"], first["tool"]) == (0, 0.1, 1 / 4)
    assert (second["reward"], second["turns"], second["tool"]) == (0.5, 3.0, 2 / 4)
    (both,) = windows(tmp_path, 2, group=2)
    assert both["tool"] == 3 / 8
