"""What an agent run learnt (`make agent-demo`), from its own `metrics.jsonl`:

    python -m asyncrl.examples.agent_report RUN_DIR

prints `reward: A -> B, tool calls: X% -> Y% of runs` (the first quarter of the steps against
the last) and writes `RUN_DIR/plots/agent.png`, reward and tool-call share per step.

A step's reward is its record's `reward_mean`. Its tool-call share is the increase of the
cumulative `agent/runs_calling_tools` (runs whose completions held a parsed tool call, counted
as their groups land) since the step before, over the runs the step trained (its
`prompt_ordinals` times `rollout.num_generations_per_prompt` of `RUN_DIR/config.yaml`); a
quarter's share is the same ratio over its steps. Not `agent/runs`: that counts runs as they
start, a window's worth ahead (with `max_trajectory_age_steps=1`, the first record already
counts two steps' runs and the last steps none). A step recorded more than once (a resume
trained it again) counts its last record; a counter that went down started again from 0 (a
resumed process), so its increase is its value.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from asyncrl.train.records import iter_jsonl

CALLING = "agent/runs_calling_tools"


@dataclass(frozen=True)
class StepPoint:
    step: int
    reward: float
    num_runs: int
    """Runs the step trained."""
    num_calling: int
    """Runs that called a tool, counted since the step before."""

    @property
    def tool_call_share(self) -> float:
        return self.num_calling / self.num_runs if self.num_runs else math.nan


def read_points(run_dir: Path) -> list[StepPoint]:
    """One point a step, in step order, from the last record of each step."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    group_size = int(config["rollout"]["num_generations_per_prompt"])
    records = {int(r["step"]): r for r in iter_jsonl(run_dir / "metrics.jsonl") if "step" in r}
    points, last = [], 0
    for step in sorted(records):
        record = records[step]
        calling = int(record.get(CALLING, 0))
        num_runs = len(record["prompt_ordinals"]) * group_size
        new = calling - last if calling >= last else calling
        points.append(StepPoint(step, float(record["reward_mean"]), num_runs, new))
        last = calling
    return points


def quarters(points: list[StepPoint]) -> tuple[list[StepPoint], list[StepPoint]]:
    """The first and the last quarter of the steps (at least one step each)."""
    size = max(1, len(points) // 4)
    return points[:size], points[-size:]


def summary(points: list[StepPoint]) -> str:
    """`reward: A -> B, tool calls: X% -> Y% of runs` over the first and last quarter."""
    first, last = quarters(points)
    reward = lambda span: sum(p.reward for p in span) / len(span)  # noqa: E731

    def share(span: list[StepPoint]) -> str:
        runs = sum(p.num_runs for p in span)
        return f"{100 * sum(p.num_calling for p in span) / runs:.0f}%" if runs else "n/a"

    return (
        f"reward: {reward(first):.3f} -> {reward(last):.3f}, "
        f"tool calls: {share(first)} -> {share(last)} of runs"
    )


def plot(points: list[StepPoint], path: Path) -> None:
    """Reward and tool-call share against step, one above the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p.step for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [p.reward for p in points], color="tab:blue", linewidth=1.0)
    top.set_ylabel("reward_mean")
    bottom.plot(steps, [100 * p.tool_call_share for p in points], color="tab:orange")
    bottom.set_ylabel("runs calling a tool (%)")
    bottom.set_xlabel("step")
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    top.set_title(summary(points))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.examples.agent_report",
        description="Reward and tool-call share of an agent run, first quarter -> last.",
    )
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    points = read_points(args.run_dir)
    if not points:
        raise SystemExit(f"{args.run_dir / 'metrics.jsonl'}: no step records")
    print(summary(points))
    plot(points, args.run_dir / "plots" / "agent.png")
    print(f"plot: {args.run_dir / 'plots' / 'agent.png'}")


if __name__ == "__main__":
    main()
