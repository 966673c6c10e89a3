"""Mid-generation weight updates (`rollout.update_weights_mid_generation`), with and without,
side by side in one run, on the long-generation shape (completions of 1-128 tokens, the
lengths varying as an untrained model's do; 16 tokens per chunk, A=1;
`benchmarks/long_generation.py`).

Each variant trains the same run (same seed, same prompts) for `--steps` steps as a real
`asyncrl train` process; from its `metrics.jsonl` it prints

    VARIANT: steps/s=X gen_tok/s=R wait_s=W stale_oldest=S stale_tokens=T mixed_groups=M/G

steps/s: steps over the run's own wall seconds; gen_tok/s: trained tokens over the
collector's generation seconds (`unchunked` is the same shape generated in one pass per
batch: the cost of re-prefilling each chunk's prefix); wait_s: the trainer's median wait for its
groups per step; stale_oldest: mean over steps of (step - the oldest weights version of any
token trained), the I2 quantity, bounded by A either way; stale_tokens: mean over every
trained token of (step - the version that sampled it); mixed_groups: trained groups whose
tokens came from more than one weights version. The last line compares the two.

    .venv/bin/python benchmarks/mid_generation.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from long_generation import shape, write_task

from asyncrl.train.records import latest_records, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "unchunked": ["rollout.chunk_tokens=0"],
    "without": ["rollout.update_weights_mid_generation=false"],
    "with": ["rollout.update_weights_mid_generation=true"],
}
"""`unchunked` (each batch in one pass, no partials) shows what chunking itself costs."""


def run(run_dir: Path, overrides: list[str]) -> dict[str, float]:
    command = [
        sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "configs/demo.yaml"),
        "--run-dir", str(run_dir), "--restart", "logging.progress=false", "logging.plot=false",
        *overrides,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    records = latest_records(read_jsonl(run_dir / "metrics.jsonl"))
    tokens = [r["num_tokens"] for r in records]
    return {
        "steps_per_s": len(records) / records[-1]["wall_s"],
        "gen_tokens_per_s": sum(tokens) / sum(r["generation_s"] for r in records),
        "wait_s": statistics.median(r["wait_s"] for r in records),
        "stale_oldest": statistics.mean(r["step"] - r["generation_version_min"] for r in records),
        "stale_tokens": sum(
            r["token_staleness_mean"] * n for r, n in zip(records, tokens, strict=True)
        )
        / sum(tokens),
        "mixed_groups": sum(r["mixed_version_groups"] for r in records),
        "groups": sum(len(r["prompt_ordinals"]) for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = [*shape(write_task(Path(tmp) / "long.jsonl")), f"run.max_num_steps={args.steps}"]
        results = {}
        for name, extra in VARIANTS.items():
            print(f"training {args.steps} steps: {name} ...", file=sys.stderr)
            results[name] = r = run(Path(tmp) / name, base + extra)
            print(
                f"{name}: steps/s={r['steps_per_s']:.2f} gen_tok/s={r['gen_tokens_per_s']:.0f} "
                f"wait_s={r['wait_s']:.3f} "
                f"stale_oldest={r['stale_oldest']:.2f} stale_tokens={r['stale_tokens']:.3f} "
                f"mixed_groups={r['mixed_groups']}/{r['groups']}"
            )
    a, b = results["without"], results["with"]
    print(
        f"mid_generation: steps/s {a['steps_per_s']:.2f} -> {b['steps_per_s']:.2f} "
        f"(x{b['steps_per_s'] / a['steps_per_s']:.2f}), token staleness {a['stale_tokens']:.3f} "
        f"-> {b['stale_tokens']:.3f} steps, oldest token {a['stale_oldest']:.2f} -> "
        f"{b['stale_oldest']:.2f} steps"
    )


if __name__ == "__main__":
    main()
