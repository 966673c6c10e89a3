"""What one crash costs under each resume policy, measured from real resumed runs.

A real `asyncrl train` process (generation-bound: 24-token completions, 2 groups per batch,
A=2) is SIGKILLed (fault injection) right after its second checkpoint became durable, with
prompts in flight and targets half-buffered, as in the seed's scenario. The run dir is copied
three times and each copy is resumed under one policy. From each resumed run's own records it
prints

    POLICY: skipped=S discarded=D regenerated=R redo_s=X

skipped: prompts no step will ever train; discarded: finished groups deleted; regenerated:
groups generated for the checkpoint's targets beyond the slots that had never been dispatched
(work done twice); redo_s: generation seconds those cost. Then the checkpoint's own cost at
the demo's shape: seconds the trainer is blocked per checkpoint against the step time.

    .venv/bin/python benchmarks/resume_cost.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from asyncrl.core.resume import POLICIES
from asyncrl.inspect_run import inspect_run_dir
from asyncrl.train.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CRASH_SHAPE = [
    # generation-bound, as LLM RL usually is: 24-token completions generated 2 groups at a
    # time, so the collector is still filling targets when a checkpoint lands
    "data.num_digits=24",
    "rollout.max_new_tokens=24",
    "rollout.num_prompts_per_step=8",
    "rollout.num_generations_per_prompt=8",
    "rollout.groups_per_batch=2",
    "rollout.max_trajectory_age_steps=2",
    "checkpoint.save_period=5",
]
QUIET = ["logging.progress=false", "logging.plot=false"]


def train(run_dir: Path, *extra: str, fault: str = "") -> int:
    env = {**os.environ, "ASYNCRL_FAULT": fault, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "configs/demo.yaml")]
    done = subprocess.run(
        [*command, "--run-dir", str(run_dir), *QUIET, *extra],
        env=env,
        capture_output=True,
        text=True,
    )
    return done.returncode


def generated_for(run_dir: Path, targets: set[int]) -> tuple[int, float]:
    """Groups the resumed attempt (1) generated for `targets`, and their generation seconds
    (each batch's seconds shared equally among its groups)."""
    count, seconds = 0, 0.0
    for span in read_jsonl(run_dir / "timeline.jsonl"):
        if span["kind"] == "generate" and span["attempt"] == 1:
            hits = sum(1 for t in span["targets"] if t in targets)
            count += hits
            seconds += span["seconds"] * hits / len(span["targets"])
    return count, seconds


def crash_and_resume(tmp: Path) -> None:
    base = tmp / "crashed"
    print("crashing a run right after its checkpoint of step 10 ...", file=sys.stderr)
    code = train(base, *CRASH_SHAPE, "run.max_num_steps=100", fault="checkpoint.parent_fsynced:2")
    assert code == -9, f"expected a SIGKILL, got exit {code}"
    info = inspect_run_dir(base)
    n, started = info["num_prompts_per_step"], {int(t) for t in info["targets"]}
    buffered, in_flight = info["ledger"]["buffered"], info["ledger"]["in_flight"]
    never_dispatched = n * len(started) - buffered - in_flight
    fill = ", ".join(f"{t}: {r['buffered']}/{n}" for t, r in info["targets"].items())
    print(
        f"checkpoint of step {info['step']}: buffered per target {{{fill}}}, "
        f"{in_flight} in flight {info['in_flight_ordinals']}"
    )
    for policy in POLICIES:
        run_dir = tmp / policy
        shutil.copytree(base, run_dir)
        print(f"resuming under {policy} ...", file=sys.stderr)
        steps = f"run.max_num_steps={max(started) + 2}"
        code = train(run_dir, *CRASH_SHAPE, steps, f"checkpoint.resume_policy={policy}")
        assert code == 0, f"{policy}: resume exited {code}"
        (resume,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
        count, seconds = generated_for(run_dir, started)
        # groups generated for the checkpoint's targets beyond the slots never dispatched
        # before the crash are work done twice
        redone = count - never_dispatched
        print(
            f"{policy}: skipped={len(resume['skipped_ordinals'])} "
            f"discarded={len(resume['discarded_groups'])} regenerated={redone} "
            f"redo_s={seconds * redone / max(count, 1):.3f}"
        )


def checkpoint_cost(tmp: Path) -> None:
    run_dir = tmp / "demo-shape"
    print("measuring checkpoints at the demo's shape ...", file=sys.stderr)
    assert train(run_dir, "run.max_num_steps=60", "checkpoint.save_period=5") == 0
    events = read_jsonl(run_dir / "events.jsonl")
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    step_s = statistics.median(r["wait_s"] + r["train_s"] + r["sync_s"] for r in steps)
    blocked_s = statistics.median(e["blocked_s"] for e in checkpoints)
    pause_s = statistics.median(e["pause_s"] for e in checkpoints)
    write_s = statistics.median(e["seconds"] for e in checkpoints)
    print(
        f"checkpoint ({checkpoints[0]['bytes'] / 1e6:.1f} MB, demo shape): trainer blocked "
        f"{blocked_s * 1e3:.1f} ms = {100 * blocked_s / step_s:.1f}% of a {step_s * 1e3:.0f} ms "
        f"step; generation bookkeeping paused {pause_s * 1e3:.2f} ms; written and verified in "
        f"the background in {write_s * 1e3:.0f} ms (medians of {len(checkpoints)})"
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        crash_and_resume(Path(tmp))
        checkpoint_cost(Path(tmp))


if __name__ == "__main__":
    main()
