"""What a run's records cost to read as the run grows: `asyncrl plot`, `asyncrl audit`,
`asyncrl inspect` and a resumed launch on run dirs of 10k, 100k and 1M steps.

A real demo run (`configs/demo.yaml`, 4 steps, checkpoints at 2 and 4) gives the run dir:
its config, `run.json`, checkpoints and one record of each kind. Its records are then
extended to S steps with rows of exactly those shapes (a metrics record per step, a
generation and a training span per step, a checkpoint event every 10 steps, two resumes),
consistent enough that `audit` passes. Each command runs in its own process; its peak RSS is
the `ru_maxrss` the kernel reports for it (`os.wait4`), its time the wall clock. The resumed
launch trains 2 more steps from the real checkpoint (what a launch reads does not depend on
the records: the attempt count is in `run.json`, the wall-clock offset in the checkpoint);
its end-of-run summary reads `metrics.jsonl` once.

    .venv/bin/python benchmarks/records.py [--steps 10000 100000 1000000]

The last line: `records: max_rss_mb=M max_s=S` over the four commands at the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ASYNCRL = [sys.executable, "-m", "asyncrl.cli"]
SHAPE = ["run.max_num_steps=4", "checkpoint.save_period=2", "logging.plot=false"]
QUIET = ["logging.progress=false"]


def measured(argv: list[str]) -> tuple[float, float, str]:
    """Runs `argv`; returns (peak RSS MB, seconds, its last output line). Fails loudly."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{out[-3000:]}")
    lines = [line for line in out.splitlines() if line.strip()]
    return usage.ru_maxrss / 1024, seconds, lines[-1] if lines else ""


def templates(run: Path) -> dict[str, Any]:
    def first(name: str, **where: Any) -> dict[str, Any]:
        for line in (run / name).read_text().splitlines():
            record = json.loads(line)
            if all(record.get(k) == v for k, v in where.items()):
                return record
        raise SystemExit(f"{run / name}: no record with {where}")

    return {
        "metrics": first("metrics.jsonl", step=1),
        "generate": first("timeline.jsonl", kind="generate"),
        "train": first("timeline.jsonl", kind="train"),
        "checkpoint": first("events.jsonl", event="checkpoint"),
        "start": first("events.jsonl", event="start"),
    }


def extend(run: Path, steps: int, t: dict[str, Any], n: int) -> None:
    """Rewrites the run dir's records as a run of `steps` steps (attempts 0-2: resumes a
    quarter and half way, each from a checkpoint with nothing in flight)."""
    resumes = {steps // 4: 1, steps // 2: 2}
    t0 = float(t["start"]["time"])
    dt = 0.1  # seconds per step
    with (
        (run / "metrics.jsonl").open("w") as metrics,
        (run / "timeline.jsonl").open("w") as timeline,
        (run / "events.jsonl").open("w") as events,
    ):
        events.write(json.dumps({**t["start"], "time": t0}) + "\n")
        attempt = 0
        for step in range(steps):
            now = t0 + step * dt
            if step in resumes:
                attempt = resumes[step]
                start = {**t["start"], "time": now, "attempt": attempt, "from_step": step}
                events.write(json.dumps(start) + "\n")
                resume = {
                    "event": "resume", "time": now, "attempt": attempt, "from_step": step,
                    "cursor": step * n, "policy": "lossless", "kept_groups": [],
                    "reissued_ordinals": [], "skipped_ordinals": [], "discarded_groups": [],
                    "continued_partials": {},
                }  # fmt: skip
                events.write(json.dumps(resume) + "\n")
            ordinals = list(range(step * n, (step + 1) * n))
            gen = {
                **t["generate"], "start": now, "seconds": dt / 2, "version": step,
                "attempt": attempt, "ordinals": ordinals, "targets": [step] * n,
                "landed": ordinals,
            }  # fmt: skip
            timeline.write(json.dumps(gen, separators=(",", ":")) + "\n")
            train = {**t["train"], "start": now + dt / 2, "seconds": dt / 2, "step": step}
            timeline.write(json.dumps({**train, "attempt": attempt}, separators=(",", ":")) + "\n")
            record = {
                **t["metrics"], "step": step, "attempt": attempt, "prompt_ordinals": ordinals,
                "generation_version_min": max(0, step - 1), "generation_version_max": step,
                "wall_s": (step + 1) * dt,
            }  # fmt: skip
            metrics.write(json.dumps(record, separators=(",", ":")) + "\n")
            if step % 10 == 9:
                checkpoint = {**t["checkpoint"], "time": now + dt, "step": step + 1}
                events.write(json.dumps(checkpoint) + "\n")
        end = {"event": "end", "time": t0 + steps * dt, "step": steps, "wall_s": steps * dt}
        events.write(json.dumps(end) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-records-"))
    try:
        base = work / "base"
        print("training the 4-step run the records extend ...", file=sys.stderr)
        measured([*ASYNCRL, "train", "configs/demo.yaml", "--run-dir", str(base), *SHAPE, *QUIET])
        config = (base / "config.yaml").read_text()
        n = int(next(line for line in config.splitlines() if "num_prompts_per_step" in line)
                .split(":")[1])  # fmt: skip
        t = templates(base)
        rows = []
        for steps in args.steps:
            run = work / f"run_{steps}"
            shutil.copytree(base, run)
            start = time.perf_counter()
            extend(run, steps, t, n)
            size_mb = sum((run / f).stat().st_size for f in
                          ("metrics.jsonl", "events.jsonl", "timeline.jsonl")) / 2**20  # fmt: skip
            print(f"{steps} steps: {size_mb:.0f} MB of records written in "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr)  # fmt: skip
            commands = {
                "plot": [*ASYNCRL, "plot", str(run)],
                "audit": [*ASYNCRL, "audit", str(run)],
                "inspect": [*ASYNCRL, "inspect", str(run)],
                "resume": [
                    *ASYNCRL,
                    "train",
                    "configs/demo.yaml",
                    "--run-dir",
                    str(run),
                    "run.max_num_steps=6",
                    "checkpoint.save_period=2",
                    "logging.plot=false",
                    *QUIET,
                ],
            }
            results = {}
            for name, argv in commands.items():
                rss, seconds, last = measured(argv)
                results[name] = (rss, seconds)
                print(f"  {name:8s} {rss:7.0f} MB {seconds:7.1f} s   {last[:90]}", file=sys.stderr)
            rows.append((steps, size_mb, results))
            shutil.rmtree(run)
        print("\nsteps      records MB | " + " | ".join(f"{c:>15s}" for c in commands))
        for steps, size_mb, results in rows:
            cells = " | ".join(f"{rss:6.0f} MB {s:5.1f} s" for rss, s in results.values())
            print(f"{steps:>9d}  {size_mb:9.0f}  | {cells}")
        first, last = rows[0][2], rows[-1][2]
        growth = " ".join(f"{name}={last[name][0] / first[name][0]:.2f}x" for name in commands)
        print(f"peak RSS at {rows[-1][0]} steps over {rows[0][0]}: {growth}")
        print(
            f"records: max_rss_mb={max(r for r, _ in last.values()):.0f} "
            f"max_s={max(s for _, s in last.values()):.1f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
