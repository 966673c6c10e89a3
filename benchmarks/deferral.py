"""Checkpoints that never wait for the disk: `checkpoint.when_busy=defer` (the default) against
`wait`, side by side, by the real CLI, at sizes whose checkpoint takes longer to write than the
steps between two of them.

    .venv/bin/python benchmarks/deferral.py                  # `make bench-deferral`, ~10 min
    .venv/bin/python benchmarks/deferral.py --sizes 75M,300M --steps 12

Each size of `benchmarks/scale.py` is trained full fine-tuning in its shape (N=2 x G=2, 8 new
tokens, a checkpoint every 3 steps, keep_last 2), once with `wait` and once with `defer`, one
after the other. Per size it prints a table row per mode, the checkpoints written and deferred,
and a line of ratios, one per size (in `--sizes` order, so the last line is the last size's):

    deferral: size=S blocked_per_step wait=W% defer=D% steps_per_s_defer_vs_wait=X
              checkpoints wait=A defer=B deferred=C previous_write_wait_ms wait=E defer=F

`blocked_per_step` is the median trainer time blocked per periodic checkpoint after the first
(the cut, any wait for the previous write, optimizer steps held by the staging copy) over the
steady step time; the run's final checkpoint, which always waits, is left out.
`previous_write_wait_ms` is the part of it spent waiting for the previous write (what deferral
removes); the table also gives `staging_wait_ms`, optimizer steps held by the background staging
copy (what `checkpoint.staging_buffer=keep` removes, for 12 more bytes per parameter).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import SizeResult, format_table, measure_size, row

MODES = {"wait": ["checkpoint.when_busy=wait"], "defer": ["checkpoint.when_busy=defer"]}


def deferral_line(label: str, results: dict[str, SizeResult]) -> str:
    """The size's line of `defer` against `wait`."""
    wait, defer = results["wait"], results["defer"]
    return (
        f"deferral: size={label} blocked_per_step wait={100 * wait.blocked_s / wait.step_s:.1f}% "
        f"defer={100 * defer.blocked_s / defer.step_s:.1f}% "
        f"steps_per_s_defer_vs_wait={wait.step_s / defer.step_s:.2f} "
        f"checkpoints wait={wait.num_checkpoints} defer={defer.num_checkpoints} "
        f"deferred={defer.num_deferred} "
        f"previous_write_wait_ms wait={1e3 * wait.write_wait_s:.0f} "
        f"defer={1e3 * defer.write_wait_s:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="300M", help="sizes of benchmarks/scale.py")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--dir", type=Path, default=None, help="work here (default: a temp dir)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    lines, table = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label in args.sizes.split(","):
            results = {}
            for mode, keys in MODES.items():
                print(f"{label} {mode}:", file=sys.stderr)
                results[mode] = measure_size(label, Path(tmp), args.steps, [*args.set, *keys])
                r = results[mode]
                extra = {
                    "checkpoints": str(r.num_checkpoints),
                    "deferred": str(r.num_deferred),
                    "write_wait_ms": f"{1e3 * r.write_wait_s:.0f}",
                    "staging_wait_ms": f"{1e3 * r.hook_wait_s:.0f}",
                }
                table.append({"mode": mode, **row(r), **extra})
            lines.append(deferral_line(label, results))
            print(lines[-1], file=sys.stderr)
    for text in format_table(table):
        print(text)
    print(f"(full fine-tuning, save_period 3; benchmark took {time.perf_counter() - began:.0f} s)")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
