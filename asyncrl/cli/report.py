"""The end-of-run summary and the reward curve, from the run's own `metrics.jsonl`."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from asyncrl.cli.plot_data import PlotData


SUMMED = ("generation_s", "train_s", "wait_s")
SIGNAL_FIELDS = {
    "truncated_share": "cut at the length limit",
    "zero_variance_groups": "groups with no variance",
    "zero_reward_groups": "groups that earned nothing",
    "partial_reward_share": "partial rewards",
}
"""The summary's `learning` line: a step field, and what it is called there."""


@dataclass
class Summary:
    """Per step, what the summary shows of its last record, in a few bytes a step (float32
    columns; NaN: no record), read in one pass."""

    reward: array = field(default_factory=lambda: array("f"))
    stale: array = field(default_factory=lambda: array("f"))
    seconds: dict[str, array] = field(default_factory=lambda: {k: array("f") for k in SUMMED})
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Evaluated step -> its `eval/...` fields (the last record of a step counts)."""
    initial_eval: dict[str, Any] | None = None
    """The initial weights' evaluation (`eval.at_start`), with `step` -1."""
    signals: dict[str, array] = field(
        default_factory=lambda: {k: array("f") for k in SIGNAL_FIELDS}
    )
    """Why a run may not be learning (`asyncrl.train.learning`); NaN where a step has none."""
    advice: dict[str, str] = field(default_factory=dict)
    """What the run said of them (`not_learning` events: signal -> message, the last)."""
    wall_s: float = 0.0

    def add(self, r: dict[str, Any]) -> None:
        t = int(r["step"])
        columns = [self.reward, self.stale, *self.seconds.values(), *self.signals.values()]
        if t >= len(self.reward):
            for column in columns:
                column.extend([math.nan] * (t + 1 - len(column)))
        self.reward[t] = r["reward_mean"]
        self.stale[t] = t - r["generation_version_min"]
        for key, column in self.seconds.items():
            column[t] = r[key]
        for key, column in self.signals.items():
            column[t] = r.get(key, math.nan)
        if any(key.startswith("eval/") for key in r):  # an evaluated step
            self.evals[t] = _eval_fields(r)
        else:
            self.evals.pop(t, None)
        if t == len(self.reward) - 1:
            self.wall_s = float(r["wall_s"])


def _eval_fields(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k == "step" or k.startswith("eval/")}


def read_initial_eval(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The initial weights' evaluation (`eval` events of `version` 0: the last one)."""
    found = None
    for e in events:
        if e.get("event") == "eval" and e.get("version") == 0:
            found = {"step": -1, **{k: v for k, v in e.items() if k.startswith("eval/")}}
    return found


def read_advice(events: Iterable[dict[str, Any]]) -> dict[str, str]:
    """What the run said of its learning (`not_learning` events: signal -> its last message)."""
    return {str(e["signal"]): str(e["message"]) for e in events if e.get("event") == "not_learning"}


def read_summary(metrics: Iterable[dict[str, Any]]) -> Summary:
    summary = Summary()
    for record in metrics:
        summary.add(record)
    return summary


def _window_mean(values: np.ndarray, first: bool) -> float:
    k = max(1, len(values) // 10)
    return float((values[:k] if first else values[-k:]).mean())


def summarize(summary: Summary, run_dir: Path) -> str:
    """A one-screen text summary of a finished run."""
    present = ~np.isnan(np.asarray(summary.reward, dtype=np.float64))
    if not present.any():
        return f"asyncrl: no steps were trained; run dir {run_dir}"

    def column(values: array) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)[present]

    rewards, stale = column(summary.reward), column(summary.stale)
    total = {k: float(column(c).sum()) for k, c in summary.seconds.items()}
    wall_s, n = summary.wall_s, len(rewards)
    lines = [
        f"asyncrl: {n} steps in {wall_s:.1f} s ({n / max(wall_s, 1e-9):.2f} steps/s), "
        f"run dir {run_dir}",
        f"  reward_mean   first 10%: {_window_mean(rewards, True):.3f}   "
        f"last 10%: {_window_mean(rewards, False):.3f}   best: {rewards.max():.3f}",
        f"  staleness     mean {stale.mean():.2f} steps, max {int(stale.max())}; "
        f"{int((stale > 0).sum())}/{n} steps trained on older weights",
        f"  time          generation {total['generation_s']:.1f} s, training "
        f"{total['train_s']:.1f} s, trainer waited {total['wait_s']:.1f} s for rollouts",
        *_eval_lines(
            summary.initial_eval or (summary.evals[min(summary.evals)] if summary.evals else None),
            summary.evals[max(summary.evals)] if summary.evals else None,
        ),
        *_learning_lines(summary, present),
        "  files         config.yaml metrics.jsonl events.jsonl timeline.jsonl "
        "reward_curve.png final_model/ checkpoints/"
        + "".join(f" {d}/" for d in OPTIONAL_DIRS if (run_dir / d).exists()),
        f"  check         asyncrl audit {run_dir}   |   asyncrl inspect {run_dir}",
    ]
    return "\n".join(lines)


def _learning_lines(summary: Summary, present: np.ndarray) -> list[str]:
    """The shares of `SIGNAL_FIELDS` over the last 10% of the steps (those the run recorded),
    and what the run said of them."""
    parts = []
    for key, name in SIGNAL_FIELDS.items():
        values = np.asarray(summary.signals[key], dtype=np.float64)[present]
        values = values[~np.isnan(values)]
        if len(values):
            parts.append(f"{name} {_window_mean(values, False):.0%}")
    lines = [f"  learning      last 10%: {', '.join(parts)}"] if parts else []
    return lines + [f"  not learning? {message}" for message in summary.advice.values()]


OPTIONAL_DIRS = ("final_adapter", "tensorboard", "wandb", "mlruns")
"""Run-dir folders the summary lists when the run wrote them (a LoRA run's adapters, the
trackers')."""


def _eval_lines(first: dict[str, Any] | None, last: dict[str, Any] | None) -> list[str]:
    """The first and last evaluation's results, when the run evaluated."""
    if first is None or last is None:
        return []
    k = next((key for key in last if key.startswith("eval/pass@") and key != "eval/pass@1"), "")

    def result(r: dict[str, Any]) -> str:
        passes = f", {k[5:]} {r[k]:.3f}" if k in r else ""
        greedy = f", greedy {r['eval/greedy_pass']:.3f}" if "eval/greedy_pass" in r else ""
        when = "before training" if r["step"] < 0 else f"after step {r['step']}"
        reward = f"reward {r['eval/reward_mean']:.3f}" if "eval/reward_mean" in r else ""
        return f"{reward}{passes}{greedy} {when}".lstrip(", ")

    return [f"  eval          {result(first)}  ->  {result(last)}"]


def plot_reward_curve(data: PlotData, path: Path) -> None:
    """reward_mean against step and against wall time, side by side, as a PNG (a long run's
    every k-th step, as `asyncrl plot` draws it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards = data.step_series("reward_mean")
    wall = data.wall_at(steps)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for axis, xs, label in ((by_step, steps, "step"), (by_time, wall, "wall time (s)")):
        axis.plot(xs, rewards, color="tab:blue", linewidth=1.2)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    by_step.set_ylabel("reward_mean (0-1)")
    by_step.set_ylim(0, 1.02)
    fig.suptitle("asyncrl: mean reward per training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def end_of_run_report(run_dir: Path, plot: bool) -> str:
    """The summary of a finished run from its own records, after writing its plots if `plot`
    (`asyncrl train` prints it once `train()` returned). Each record file is read once, a
    line at a time."""
    from asyncrl.cli.plots import run_plot_data, write_plots
    from asyncrl.train.records import iter_jsonl

    summary = read_summary(iter_jsonl(run_dir / "metrics.jsonl"))
    events = list(iter_jsonl(run_dir / "events.jsonl"))
    summary.initial_eval = read_initial_eval(events)
    summary.advice = read_advice(events)
    if plot and len(summary.reward):
        data, age = run_plot_data(run_dir)
        plot_reward_curve(data, run_dir / "reward_curve.png")
        write_plots(run_dir, (data, age))
    return summarize(summary, run_dir)
