"""Threads vs Ray with 1 and 2 generation workers, side by side in one run, plus the cost of
moving weights to workers through Ray's object store.

For each shape, trains `--steps` steps with `rollout.backend=threads`, then `ray` with
`rollout.num_workers=1` and `2` (a local Ray started and stopped by each run), and prints
steady-state steps/s (records after `--warmup`), the driver's weight-publish seconds per step
(`sync_s`: a copy on threads, a `ray.put` on Ray) and the workers' fetch-and-load seconds per
step. Then a probe: a state dict of `--probe-mb` MB put once and fetched by an actor, as NumPy
arrays and as torch tensors (median of 5).

    .venv/bin/python benchmarks/ray_scaleout.py [--steps 60] [--warmup 10] [--probe-mb 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.config.keys import build_config
from asyncrl.train.records import read_jsonl
from asyncrl.train.trainer import train

SHAPES = {
    "gen-heavy": [
        "data.num_digits=24", "rollout.max_new_tokens=24", "rollout.num_prompts_per_step=4",
        "rollout.num_generations_per_prompt=4",
    ],
    "demo": ["rollout.num_prompts_per_step=16", "rollout.num_generations_per_prompt=16"],
}  # fmt: skip
BACKENDS = {
    "threads": ["rollout.backend=threads"],
    "ray x1": ["rollout.backend=ray", "rollout.num_workers=1"],
    "ray x2": ["rollout.backend=ray", "rollout.num_workers=2"],
}


def measure(overrides: list[str], steps: int, warmup: int, run_dir: Path) -> dict[str, float]:
    config = build_config(
        {},
        [
            *overrides,
            f"run.max_num_steps={steps}",
            "logging.progress=false",
            "logging.plot=false",
            "checkpoint.save_period=1000000",
        ],
    )
    start = time.perf_counter()
    train(config, run_dir)
    total_s = time.perf_counter() - start
    records = read_jsonl(run_dir / "metrics.jsonl")
    steady = records[warmup:]
    span_s = steady[-1]["wall_s"] - steady[0]["wall_s"]
    load = [r.get("weights_load_s", 0.0) for r in steady]
    return {
        "steps_per_s": (len(steady) - 1) / span_s,
        "sync_ms": 1e3 * statistics.mean(r["sync_s"] for r in steady),
        "load_ms": 1e3 * (load[-1] - load[0]) / (len(steady) - 1),
        "wait_ms": 1e3 * statistics.mean(r["wait_s"] for r in steady),
        "overhead_s": total_s - records[-1]["wall_s"],
    }


def probe(megabytes: float, repeats: int = 5) -> dict[str, float]:
    """Seconds to put a state dict of `megabytes` and have an actor fetch it, by payload type."""
    import numpy as np
    import ray
    import torch

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")

    @ray.remote
    class Sink:
        def take(self, refs: list) -> int:
            state = ray.get(refs[0])
            return sum(
                int(v.nbytes if isinstance(v, np.ndarray) else v.numel() * 4)
                for v in state.values()
            )

    sink = Sink.remote()
    n = int(megabytes * 2**20 / 4 / 16)
    tensors = {f"w{i}": torch.randn(n) for i in range(16)}
    payloads = {"numpy": {k: v.numpy() for k, v in tensors.items()}, "torch": tensors}
    ray.get(sink.take.remote([ray.put({"x": np.zeros(1)})]))  # warm the actor
    out = {}
    for name, payload in payloads.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ref = ray.put(payload)
            ray.get(sink.take.remote([ref]))
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--probe-mb", type=float, default=10.0)
    args = parser.parse_args()
    print(
        "| shape | backend | steps/s | vs threads | publish ms/step | worker load ms/step "
        "| trainer wait ms/step | start+stop s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for shape, overrides in SHAPES.items():
            base = None
            for backend, extra in BACKENDS.items():
                print(f"[{shape}] {backend} ...", file=sys.stderr, flush=True)
                run_dir = Path(tmp) / f"{shape}-{backend.replace(' ', '')}"
                m = measure([*overrides, *extra], args.steps, args.warmup, run_dir)
                base = base or m["steps_per_s"]
                print(
                    f"| {shape} | {backend} | {m['steps_per_s']:.2f} | "
                    f"{m['steps_per_s'] / base:.2f} | {m['sync_ms']:.1f} | {m['load_ms']:.1f} | "
                    f"{m['wait_ms']:.0f} | {m['overhead_s']:.1f} |",
                    flush=True,
                )
    seconds = probe(args.probe_mb)
    print(
        f"weights through the object store, {args.probe_mb:g} MB put + fetched by an actor: "
        f"NumPy {seconds['numpy'] * 1e3:.1f} ms, torch tensors {seconds['torch'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
