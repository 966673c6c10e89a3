"""`asyncrl plot DIR`: pictures of the pipeline from the run's own records, into `DIR/plots/`.

1. `reward_loss.png`  reward and loss against step and wall time, checkpoints and resumes marked
2. `timeline.png`     generation and training spans over wall time (whole run and a close-up)
3. `staleness.png`    step - generation version: its distribution, and per step
4. `ledger.png`       ordinals trained / buffered / in flight / pending over time, and skipped
5. `eval.png`         evaluation: mean reward, pass@1, pass@k and greedy against step (only for
                      runs with `eval.every_steps`)

Each `figure_*` function draws a `PlotData` (asyncrl/cli/plot_data.py: the records read in
one pass each, in bounded memory) and returns a matplotlib Figure (tests inspect them);
`write_plots` saves them. Times on the time axes are seconds since the run's first span, gaps
included. A long run is drawn thinned: every k-th step (the titles say so), spans closer than
a pixel as one bar.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml
from matplotlib.figure import Figure

from asyncrl.cli.plot_data import PlotData, read_plot_data
from asyncrl.train.records import iter_jsonl

COLORS = {"generate": "tab:orange", "train": "tab:blue", "checkpoint": "0.6", "resume": "tab:red"}


def _every(stride: int, what: str = "step") -> str:
    return "" if stride == 1 else f", every {stride}th {what} shown"


def figure_reward_loss(data: PlotData) -> Figure:
    """2x2: reward and loss against step (top) and wall time (bottom). Grey dotted lines mark
    checkpoints, red dashed lines resumes."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharey="col")
    marks = [(step, ":", "checkpoint") for _, step in data.checkpoints.items()]
    marks += [(e["from_step"], "--", "resume") for e in data.resumes]
    for col, key, label in ((0, "reward_mean", "reward_mean (0-1)"), (1, "loss", "loss")):
        steps, values = data.step_series(key)
        walls = data.wall_at(steps)
        for row, xs, xlabel in ((0, steps, "step"), (1, walls, "wall time (s)")):
            axis = axes[row][col]
            axis.plot(xs, values, color=COLORS["train"], linewidth=1.0, label=key)
            mark_walls = data.wall_at([step - 1 for step, _, _ in marks])
            for (step, style, event), wall in zip(marks, mark_walls, strict=True):
                x = step if row == 0 else wall if step else 0.0
                axis.axvline(x, color=COLORS[event], linestyle=style, linewidth=0.8)
            axis.set_xlabel(xlabel)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].plot([], [], color=COLORS["checkpoint"], linestyle=":", label="checkpoint")
    axes[0][0].plot([], [], color=COLORS["resume"], linestyle="--", label="resume")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(
        "reward and loss per step (the last record of each step"
        f"{_every(data.steps.stride)}{_every(data.checkpoints.stride, 'checkpoint')})"
    )
    fig.tight_layout()
    return fig


def figure_timeline(data: PlotData) -> Figure:
    """Gantt chart of generation (the collector's worker) and training over wall time: the
    whole run on top, a close-up of a few steps a quarter into the run below."""
    t0 = 0.0 if data.t0 == float("inf") else data.t0
    fig, (whole, close) = plt.subplots(2, 1, figsize=(10, 4.6))
    close_gen = [(s["start"] - t0, s["seconds"]) for s in data.close_up if s["kind"] != "train"]
    close_train = [(s["start"] - t0, s["seconds"]) for s in data.close_up if s["kind"] == "train"]
    for axis, gen, train in (
        (
            whole,
            [(a - t0, b) for a, b in data.gen.spans],
            [(a - t0, b) for a, b in data.train.spans],
        ),
        (close, close_gen, close_train),
    ):
        axis.broken_barh(gen, (10, 8), facecolors=COLORS["generate"], label="generate")
        axis.broken_barh(train, (0, 8), facecolors=COLORS["train"], label="train")
        axis.set_yticks([4, 14], labels=["trainer", "generation\nworker 0"])
        axis.set_xlabel("wall time since the first span (s)")
        axis.grid(axis="x", alpha=0.3)
    for start in data.starts[1:]:
        whole.axvline(start["time"] - t0, color=COLORS["resume"], linestyle="--", linewidth=0.8)
    if data.close_up_window is not None:
        close.set_xlim(data.close_up_window[0] - t0, data.close_up_window[1] - t0)
    merged = (
        "" if data.gen.gap == 0 and data.train.gap == 0 else ", spans closer than a pixel merged"
    )
    whole.legend(loc="upper right", fontsize=8, ncols=2)
    whole.set_title(f"generation and training over time (red dashed: a relaunch{merged})")
    close.set_title("close-up: generation of the next step overlaps training of this one")
    fig.tight_layout()
    return fig


def figure_staleness(data: PlotData, max_age: int) -> Figure:
    """How many steps old the weights were that generated each step's groups."""
    ages = data.oldest_age
    fig, (hist, per_step) = plt.subplots(1, 2, figsize=(10, 3.4))
    values = list(range(max_age + 1))
    hist.bar(values, [ages.count(v + 1) for v in values], color=COLORS["generate"])
    hist.set_xticks(values)
    hist.set_xlabel("staleness of the oldest group (steps)")
    hist.set_ylabel("steps")
    hist.set_title(f"distribution (bound A = {max_age})")
    steps, oldest_version = data.step_series("generation_version_min")
    _, newest_version = data.step_series("generation_version_max")
    oldest = [t - v for t, v in zip(steps, oldest_version, strict=True)]
    newest = [t - v for t, v in zip(steps, newest_version, strict=True)]
    per_step.plot(steps, oldest, color=COLORS["generate"], linewidth=1.0, label="oldest group")
    per_step.plot(steps, newest, color=COLORS["train"], linewidth=1.0, label="newest group")
    per_step.axhline(max_age, color="black", linestyle=":", linewidth=0.8, label="bound A")
    per_step.set_xlabel("step")
    per_step.set_ylabel("step - generation version")
    per_step.set_title(f"per step{_every(data.steps.stride)}")
    per_step.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure_ledger(data: PlotData) -> Figure:
    series = data.ledger
    fig, axis = plt.subplots(figsize=(10, 3.6))
    keys = ("trained", "buffered", "in_flight", "pending")
    axis.stackplot(
        series["time"],
        *(series[k] for k in keys),
        labels=["trained", "buffered", "in flight", "pending"],
        colors=["tab:blue", "tab:green", "tab:orange", "0.85"],
        step="post",
    )
    if any(series["skipped"]):
        axis.step(
            series["time"],
            series["skipped"],
            where="post",
            color="tab:red",
            linewidth=1.5,
            label="skipped (never trained)",
        )
    axis.set_xlabel("wall time since the first span (s)")
    axis.set_ylabel("ordinals")
    axis.legend(loc="center right", fontsize=8)
    axis.set_title("the ledger over time: where every ordinal of the run's schedule is")
    fig.tight_layout()
    return fig


def figure_eval(data: PlotData) -> Figure:
    """The `eval/...` results of the evaluated weights — the initial ones too
    (`eval.at_start`) — against the steps trained and against wall time, with the training
    reward for comparison."""
    evaluated = data.evals.items()
    points = [(step + 1, r) for step, r in evaluated]  # weights after step t: t+1 steps
    walls = dict(
        zip([s for s, _ in evaluated], data.wall_at([s for s, _ in evaluated]), strict=True)
    )
    if data.initial_eval is not None:
        points.insert(0, (0, data.initial_eval))
    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    keys = ["eval/reward_mean", "eval/pass@1"]
    keys += sorted({k for _, r in points for k in r if k.startswith("eval/pass@")} - set(keys))
    keys += ["eval/greedy_reward", "eval/greedy_pass"]
    for key in keys:
        series = [(trained, r[key]) for trained, r in points if key in r]
        if not series:
            continue
        style = "--" if key == "eval/reward_mean" else "-"  # with 0/1 rewards it lies on pass@1
        xs, ys = zip(*series, strict=True)
        by_step.plot(xs, ys, style, marker="o", label=key[5:])
        seconds = [walls.get(trained - 1, 0.0) for trained in xs]  # the initial weights: 0 s
        by_wall.plot(seconds, ys, style, marker="o", label=key[5:])
    steps, rewards = data.step_series("reward_mean")
    by_step.plot([t + 1 for t in steps], rewards, color="0.7", linewidth=0.8,
                 label="training reward")  # fmt: skip
    by_wall.plot(data.wall_at(steps), rewards, color="0.7", linewidth=0.8, label="training reward")
    by_step.set_xlabel("steps trained (0: the initial weights)")
    by_wall.set_xlabel("wall time (s)")
    by_step.set_ylabel("reward / pass rate")
    last = points[-1][1] if points else None
    fig.suptitle(
        f"evaluation ({int(last['eval/num_examples'])} prompts"
        f"{_every(data.evals.stride, 'evaluated step')})"
        if last
        else "evaluation (none recorded)"
    )
    by_step.legend(loc="best", fontsize=8)
    for axis in (by_step, by_wall):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def run_plot_data(run_dir: Path) -> tuple[PlotData, int]:
    """The run dir's records read for the plots, and its `rollout.max_trajectory_age_steps`."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    n = int(config["rollout"]["num_prompts_per_step"])
    age = int(config["rollout"]["max_trajectory_age_steps"])
    metrics, events, timeline = (
        iter_jsonl(run_dir / f"{name}.jsonl") for name in ("metrics", "events", "timeline")
    )
    return read_plot_data(metrics, events, timeline, n), age


def write_plots(run_dir: Path, read: tuple[PlotData, int] | None = None) -> list[Path]:
    """Renders the plots into `run_dir/plots/` (`eval.png` only for a run that evaluated);
    returns their paths. `read`: `run_plot_data(run_dir)` when the caller has it already."""
    data, age = read or run_plot_data(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    figures = {
        "reward_loss.png": figure_reward_loss(data),
        "timeline.png": figure_timeline(data),
        "staleness.png": figure_staleness(data, age),
        "ledger.png": figure_ledger(data),
    }
    if data.evals.rows:
        figures["eval.png"] = figure_eval(data)
    paths = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths
