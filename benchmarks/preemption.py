"""Preemption with a deadline: SIGTERM at a random moment of a run, how long from the notice to
a verified checkpoint, against `checkpoint.grace_s` (issue 43).

    .venv/bin/python benchmarks/preemption.py                 # `make bench-preemption`
    .venv/bin/python benchmarks/preemption.py --sizes 25M --modes full

Per size (Qwen2-architecture models saved by `asyncrl.models.scratch`, random init, as
`benchmarks/scale.py` builds them) and mode (full fine-tuning; LoRA rank 16), `asyncrl train`
runs in a child process in scale.py's shape (2 prompts x 2 samples, 8 new tokens, one torch
thread a side) with a checkpoint every 2 steps, so the run has measured its checkpoint time
before the notice. The parent sends SIGTERM once the run has recorded a random number of steps
in [3, 5] and a further random delay in [0, one step] (mid-step, mid-generation or
mid-checkpoint-write: placed by the run's state, then by a fraction of its own step time). The
run must exit 75 with a verified checkpoint; its `preemption_result` event gives the seconds
from the notice to the checkpoint verified, and whether that was before the deadline.
`--grace-s` sets the deadline (default 30: Kubernetes' default grace period). Where the
checkpoint cannot fit (`--grace-s 2` at 300M), the run first keeps the rollouts of the newest
verified checkpoint's weights beside it (`kept_first_s`, `kept_tokens`). It prints a table,
one line per mode, and last the line of full fine-tuning:

    preemption_lora: notice_to_durable_s=A,B,C deadline_s=30 met=K/3
    preemption: notice_to_durable_s=A,B,C deadline_s=30 met=K/3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import RUN, format_table, human, prepare

from asyncrl.checkpoint.run_checkpoints import run_store

ROOT = Path(__file__).resolve().parents[1]
SIZES = "25M,100M,300M"
MODES = {"full": [], "lora": ["model.lora.rank=16"]}
SHAPE = [*(s for s in RUN if not s.startswith("checkpoint.save_period")),
         "checkpoint.save_period=2"]  # fmt: skip


@dataclass
class Result:
    label: str
    mode: str
    num_params: int
    step: int
    notice_to_durable_s: float
    met: bool
    abandoned: bool
    checkpoint_bytes: int
    kept_s: float | None = None
    """Where the checkpoint could not fit: seconds to write the kept rollouts beside the newest
    verified checkpoint (`rollouts_kept`), before the checkpoint's own write."""
    kept_tokens: int = 0


def result_line(name: str, results: list[Result], deadline_s: float) -> str:
    """`NAME: notice_to_durable_s=A,B,C deadline_s=D met=K/N`."""
    times = ",".join(f"{r.notice_to_durable_s:.1f}" for r in results)
    met = sum(r.met for r in results)
    return f"{name}: notice_to_durable_s={times} deadline_s={deadline_s:g} met={met}/{len(results)}"


def steps_recorded(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip().endswith("}"))


def preempt(
    label: str, mode: str, tmp: Path, grace_s: float, rng: random.Random, extra: list[str]
) -> Result:
    num_params, model_dir, how = prepare(label, tmp)
    run_dir = tmp / f"run-{label}-{mode}"
    config = how.get("config", ROOT / "configs/demo.yaml")
    args = [f"model.path={model_dir}", "run.max_num_steps=1000", *SHAPE, *how.get("shape", []),
            f"checkpoint.grace_s={grace_s}", *MODES[mode], *extra]  # fmt: skip
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(config), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [*command, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    target = rng.randint(3, 5)
    print(f"{label} {mode}: training to step {target} ...", file=sys.stderr)
    started = None
    while proc.poll() is None and steps_recorded(run_dir) < target:
        if started is None and steps_recorded(run_dir) >= 1:
            started = time.perf_counter()
        time.sleep(0.05)
    if proc.poll() is not None:
        raise RuntimeError(f"{run_dir}: exited {proc.returncode} before the notice")
    step_s = (time.perf_counter() - (started or time.perf_counter())) / max(target - 1, 1)
    time.sleep(rng.uniform(0.0, step_s))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate()
    if proc.returncode != 75:
        raise RuntimeError(f"{run_dir}: SIGTERM gave exit {proc.returncode}, not 75:\n{output}")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]
    (result,) = [e for e in events if e["event"] == "preemption_result"]
    latest, _ = run_store(run_dir).latest()
    if latest is None or latest.step != result["step"]:
        raise RuntimeError(f"{run_dir}: no verified checkpoint of step {result['step']}")
    (saved,) = [e for e in events if e["event"] == "checkpoint" and e["reason"] == "stop"] or [
        e for e in events if e["event"] == "checkpoint"
    ][-1:]
    kept = [e for e in events if e["event"] == "rollouts_kept"]
    shutil.rmtree(run_dir)
    shutil.rmtree(model_dir, ignore_errors=True)
    return Result(
        label, mode, num_params, int(result["step"]), float(result["notice_to_durable_s"]),
        bool(result["met"]), bool(result.get("abandoned_step")), int(saved["bytes"]),
        float(kept[0]["seconds"]) if kept else None, int(kept[0]["tokens"]) if kept else 0,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=SIZES, help=f"comma-separated (default {SIZES})")
    parser.add_argument("--modes", default="lora,full", help="full, lora (default both)")
    parser.add_argument("--grace-s", type=float, default=30.0, help="checkpoint.grace_s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="scratch dir (default a temp)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    modes = [m for m in args.modes.split(",") if m]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mode in modes:
            for label in args.sizes.split(","):
                results.append(preempt(label, mode, Path(tmp), args.grace_s, rng, args.set))
    rows = [
        {
            "size": r.label, "params": human(r.num_params), "mode": r.mode,
            "stopped_at": str(r.step), "checkpoint": human(r.checkpoint_bytes, "B"),
            "step_given_up": "yes" if r.abandoned else "no",
            "notice_to_durable_s": f"{r.notice_to_durable_s:.2f}",
            "met": "yes" if r.met else "NO",
            "kept_first_s": "-" if r.kept_s is None else f"{r.kept_s:.3f}",
            "kept_tokens": str(r.kept_tokens),
        }
        for r in results
    ]  # fmt: skip
    for line in format_table(rows):
        print(line)
    for mode in sorted(modes, key=lambda m: m == "full"):  # the line last
        name = "preemption" if mode == "full" else f"preemption_{mode}"
        print(result_line(name, [r for r in results if r.mode == mode], args.grace_s))


if __name__ == "__main__":
    main()
