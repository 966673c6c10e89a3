"""`asyncrl plot DIR`: pictures of the pipeline from the run's own records, into `DIR/plots/`.

1. `reward_loss.png`  reward and loss against step and wall time, checkpoints and resumes marked
2. `timeline.png`     generation and training spans over wall time (whole run and a close-up)
3. `staleness.png`    step - generation version: its distribution, and per step
4. `ledger.png`       ordinals trained / buffered / in flight / pending over time, and skipped
5. `eval.png`         evaluation: mean reward, pass@1, pass@k and greedy against step (only for
                      runs with `eval.every_steps`)

Each `figure_*` function returns a matplotlib Figure (tests inspect them); `write_plots` saves
them. Times on the time axes are seconds since the run's first launch, gaps included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml
from matplotlib.figure import Figure

from asyncrl.train.records import latest_records, read_jsonl

Records = list[dict[str, Any]]
COLORS = {"generate": "tab:orange", "train": "tab:blue", "checkpoint": "0.6", "resume": "tab:red"}


def _events(events: Records, name: str) -> Records:
    return [e for e in events if e.get("event") == name]


def figure_reward_loss(metrics: Records, events: Records) -> Figure:
    """2x2: reward and loss against step (top) and wall time (bottom). Grey dotted lines mark
    checkpoints, red dashed lines resumes."""
    records = latest_records(metrics)
    wall_of = {r["step"]: r["wall_s"] for r in records}
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharey="col")
    for col, key, label in ((0, "reward_mean", "reward_mean (0-1)"), (1, "loss", "loss")):
        values = [r[key] for r in records]
        for row, xs, xlabel in (
            (0, steps, "step"),
            (1, [r["wall_s"] for r in records], "wall time (s)"),
        ):
            axis = axes[row][col]
            axis.plot(xs, values, color=COLORS["train"], linewidth=1.0, label=key)
            for event, style in (("checkpoint", ":"), ("resume", "--")):
                steps_marked = [
                    e["step"] if event == "checkpoint" else e["from_step"]
                    for e in _events(events, event)
                ]
                for step in steps_marked:
                    x = step if row == 0 else wall_of.get(step - 1, 0.0)
                    axis.axvline(x, color=COLORS[event], linestyle=style, linewidth=0.8)
            axis.set_xlabel(xlabel)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].plot([], [], color=COLORS["checkpoint"], linestyle=":", label="checkpoint")
    axes[0][0].plot([], [], color=COLORS["resume"], linestyle="--", label="resume")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle("reward and loss per step (the last record of each step)")
    fig.tight_layout()
    return fig


def _spans(timeline: Records, kind: str, t0: float) -> list[tuple[float, float]]:
    return [(s["start"] - t0, s["seconds"]) for s in timeline if s.get("kind") == kind]


def figure_timeline(timeline: Records, events: Records) -> Figure:
    """Gantt chart of generation (the collector's worker) and training over wall time: the
    whole run on top, a close-up of a few steps in the middle below."""
    t0 = min((s["start"] for s in timeline), default=0.0)
    gen, train = _spans(timeline, "generate", t0), _spans(timeline, "train", t0)
    fig, (whole, close) = plt.subplots(2, 1, figsize=(10, 4.6))
    for axis in (whole, close):
        axis.broken_barh(gen, (10, 8), facecolors=COLORS["generate"], label="generate")
        axis.broken_barh(train, (0, 8), facecolors=COLORS["train"], label="train")
        axis.set_yticks([4, 14], labels=["trainer", "generation\nworker 0"])
        axis.set_xlabel("wall time since the first launch (s)")
        axis.grid(axis="x", alpha=0.3)
    for start in _events(events, "start")[1:]:
        whole.axvline(start["time"] - t0, color=COLORS["resume"], linestyle="--", linewidth=0.8)
    if train:
        middle = train[len(train) // 4][0]  # inside the first launch, away from its end
        width = 6 * max(sum(s for _, s in train) / len(train), 1e-3)
        close.set_xlim(middle - width / 2, middle + width / 2)
    whole.legend(loc="upper right", fontsize=8, ncols=2)
    whole.set_title("generation and training over time (red dashed: a relaunch)")
    close.set_title("close-up: generation of the next step overlaps training of this one")
    fig.tight_layout()
    return fig


def figure_staleness(metrics: Records, max_age: int) -> Figure:
    """How many steps old the weights were that generated each step's groups."""
    records = latest_records(metrics)
    oldest = [r["step"] - r["generation_version_min"] for r in records]
    newest = [r["step"] - r["generation_version_max"] for r in records]
    fig, (hist, per_step) = plt.subplots(1, 2, figsize=(10, 3.4))
    values = list(range(max_age + 1))
    hist.bar(values, [oldest.count(v) for v in values], color=COLORS["generate"])
    hist.set_xticks(values)
    hist.set_xlabel("staleness of the oldest group (steps)")
    hist.set_ylabel("steps")
    hist.set_title(f"distribution (bound A = {max_age})")
    steps = [r["step"] for r in records]
    per_step.plot(steps, oldest, color=COLORS["generate"], linewidth=1.0, label="oldest group")
    per_step.plot(steps, newest, color=COLORS["train"], linewidth=1.0, label="newest group")
    per_step.axhline(max_age, color="black", linestyle=":", linewidth=0.8, label="bound A")
    per_step.set_xlabel("step")
    per_step.set_ylabel("step - generation version")
    per_step.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ledger_series(
    metrics: Records, events: Records, timeline: Records, n: int
) -> dict[str, list[float]]:
    """Ordinal counts over time, rebuilt from the records: trained (steps of the current
    lineage, so a resume from an older checkpoint drops back), buffered, in flight (generation
    batches running), pending (the rest of the run's final schedule) and skipped (cumulative,
    from lossy resumes). Times are seconds since the first span."""
    starts = _events(events, "start")
    resumes = {e["attempt"]: e for e in _events(events, "resume")}
    spans = [s for s in timeline if s.get("kind") in ("generate", "train")]
    if not spans or not starts:
        return {k: [] for k in ("time", "trained", "buffered", "in_flight", "pending", "skipped")}
    t0 = min(s["start"] for s in spans)
    frontier = (max(r["step"] for r in metrics) + 1) * n if metrics else 0
    times = sorted({s["start"] for s in spans} | {s["start"] + s["seconds"] for s in spans})
    out: dict[str, list[float]] = {
        k: [] for k in ("time", "trained", "buffered", "in_flight", "pending", "skipped")
    }
    for now in times:
        launch = max(
            (e for e in starts if e["time"] <= now), key=lambda e: e["time"], default=starts[0]
        )
        attempt, base = launch["attempt"], launch["from_step"] * n
        kept = len(resumes[attempt]["kept_groups"]) if attempt in resumes else 0
        mine = [s for s in spans if s.get("attempt") == attempt]
        trained = base + n * sum(
            1 for s in mine if s["kind"] == "train" and s["start"] + s["seconds"] <= now
        )
        gens = [s for s in mine if s["kind"] == "generate"]
        finished = kept + sum(  # a chunked batch's groups land with the chunk that ends them
            len(s["landed"] if "landed" in s else s["ordinals"])
            for s in gens
            if s["start"] + s["seconds"] <= now
        )
        in_flight = sum(
            len(s["ordinals"]) for s in gens if s["start"] <= now < s["start"] + s["seconds"]
        )
        buffered = max(0, finished - (trained - base))
        skipped = sum(len(e["skipped_ordinals"]) for a, e in resumes.items() if a <= attempt)
        out["time"].append(now - t0)
        out["trained"].append(trained)
        out["buffered"].append(buffered)
        out["in_flight"].append(in_flight)
        out["pending"].append(max(0, frontier - trained - buffered - in_flight))
        out["skipped"].append(skipped)
    return out


def figure_ledger(metrics: Records, events: Records, timeline: Records, n: int) -> Figure:
    series = ledger_series(metrics, events, timeline, n)
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


def figure_eval(metrics: Records) -> Figure:
    """The `eval/...` results of the steps that were evaluated, against step, with the
    training reward for comparison."""
    records = latest_records(metrics)
    evaluated = [r for r in records if "eval/reward_mean" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in evaluated]
    keys = ["eval/reward_mean", "eval/pass@1"]
    keys += sorted({k for r in evaluated for k in r if k.startswith("eval/pass@")} - set(keys))
    keys += ["eval/greedy_reward"]
    for key in keys:
        points = [(r["step"], r[key]) for r in evaluated if key in r]
        if points:  # the mean reward dashed: with 0/1 rewards it lies on pass@1
            style = "--" if key == "eval/reward_mean" else "-"
            ax.plot(*zip(*points, strict=True), style, marker="o", label=key[5:])
    ax.plot(
        [r["step"] for r in records],
        [r["reward_mean"] for r in records],
        color="0.7",
        linewidth=0.8,
        label="training reward",
    )
    ax.set_xlabel("step (weights after it)")
    ax.set_ylabel("reward / pass rate")
    ax.set_title(f"evaluation ({int(evaluated[-1]['eval/num_examples'])} prompts)" if steps else
                 "evaluation (none recorded)")  # fmt: skip
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_plots(run_dir: Path) -> list[Path]:
    """Renders the plots into `run_dir/plots/` (`eval.png` only for a run that evaluated);
    returns their paths."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    n = int(config["rollout"]["num_prompts_per_step"])
    age = int(config["rollout"]["max_trajectory_age_steps"])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    timeline = read_jsonl(run_dir / "timeline.jsonl")
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    figures = {
        "reward_loss.png": figure_reward_loss(metrics, events),
        "timeline.png": figure_timeline(timeline, events),
        "staleness.png": figure_staleness(metrics, age),
        "ledger.png": figure_ledger(metrics, events, timeline, n),
    }
    if any("eval/reward_mean" in r for r in metrics):
        figures["eval.png"] = figure_eval(metrics)
    paths = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths
