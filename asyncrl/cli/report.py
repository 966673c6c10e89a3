"""The end-of-run summary and the reward curve, from the run's own `metrics.jsonl`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _window_mean(values: list[float], first: bool) -> float:
    k = max(1, len(values) // 10)
    part = values[:k] if first else values[-k:]
    return sum(part) / len(part)


def summarize(records: list[dict[str, Any]], run_dir: Path, wall_s: float) -> str:
    """A one-screen text summary of a finished run."""
    if not records:
        return f"asyncrl: no steps were trained; run dir {run_dir}"
    rewards = [r["reward_mean"] for r in records]
    stale = [r["step"] - r["generation_version_min"] for r in records]
    gen_s = sum(r["generation_s"] for r in records)
    train_s = sum(r["train_s"] for r in records)
    wait_s = sum(r["wait_s"] for r in records)
    async_steps = sum(1 for r in records if r["generation_version_min"] < r["step"])
    lines = [
        f"asyncrl: {len(records)} steps in {wall_s:.1f} s "
        f"({len(records) / max(wall_s, 1e-9):.2f} steps/s), run dir {run_dir}",
        f"  reward_mean   first 10%: {_window_mean(rewards, True):.3f}   "
        f"last 10%: {_window_mean(rewards, False):.3f}   best: {max(rewards):.3f}",
        f"  staleness     mean {sum(stale) / len(stale):.2f} steps, max {max(stale)}; "
        f"{async_steps}/{len(records)} steps trained on older weights",
        f"  time          generation {gen_s:.1f} s, training {train_s:.1f} s, "
        f"trainer waited {wait_s:.1f} s for rollouts",
        *_eval_lines(records),
        "  files         config.yaml metrics.jsonl events.jsonl timeline.jsonl "
        "reward_curve.png final_model/ checkpoints/"
        + "".join(f" {d}/" for d in OPTIONAL_DIRS if (run_dir / d).exists()),
        f"  check         asyncrl audit {run_dir}   |   asyncrl inspect {run_dir}",
    ]
    return "\n".join(lines)


OPTIONAL_DIRS = ("tensorboard", "wandb", "mlruns")
"""Run-dir folders the summary lists when the run wrote them (the trackers')."""


def _eval_lines(records: list[dict[str, Any]]) -> list[str]:
    """The first and last evaluation's results, when the run evaluated."""
    evaluated = [r for r in records if "eval/reward_mean" in r]
    if not evaluated:
        return []
    first, last = evaluated[0], evaluated[-1]
    k = next((key for key in last if key.startswith("eval/pass@") and key != "eval/pass@1"), "")

    def result(r: dict[str, Any]) -> str:
        passes = f", {k[5:]} {r[k]:.3f}" if k in r else ""
        return f"reward {r['eval/reward_mean']:.3f}{passes} after step {r['step']}"

    return [f"  eval          {result(first)}  ->  {result(last)}"]


def plot_reward_curve(records: list[dict[str, Any]], path: Path) -> None:
    """reward_mean against step and against wall time, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    wall = [r["wall_s"] for r in records]
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
    (`asyncrl train` prints it once `train()` returned)."""
    from asyncrl.cli.plots import write_plots
    from asyncrl.train.records import latest_records, read_jsonl

    records = latest_records(read_jsonl(run_dir / "metrics.jsonl"))
    if plot and records:
        plot_reward_curve(records, run_dir / "reward_curve.png")
        write_plots(run_dir)
    return summarize(records, run_dir, records[-1]["wall_s"] if records else 0.0)
