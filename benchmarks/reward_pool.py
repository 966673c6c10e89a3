"""The reward worker pool's cost against scoring in the calling thread, side by side.

    python benchmarks/reward_pool.py [--workers 2] [--repeats 20]

Scores the math example's step shape — 8 groups of 16 completions with the `math` reward — in
the calling thread (`rollout.reward_workers=0`) and on a pool of worker processes, and prints
milliseconds per call for each; the last line is the ratio.
"""

from __future__ import annotations

import argparse
import time

from asyncrl.rollout.reward_pool import RewardJob, RewardPool

JOBS = [RewardJob([f"so the answer is \\boxed{{{i % 10}}}"] * 16, str(i % 10)) for i in range(8)]


def ms_per_call(workers: int, repeats: int) -> float:
    pool = RewardPool("asyncrl.tasks.rewards:math_reward", {}, workers=workers)
    try:
        pool.score(JOBS)  # warm: workers started, math-verify imported
        start = time.perf_counter()
        for _ in range(repeats):
            pool.score(JOBS)
        return (time.perf_counter() - start) / repeats * 1000
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    here = ms_per_call(0, args.repeats)
    pooled = ms_per_call(args.workers, args.repeats)
    print(f"in the calling thread: {here:.1f} ms per 8 groups of 16")
    print(f"on {args.workers} worker processes: {pooled:.1f} ms per 8 groups of 16")
    print(f"reward_pool: workers/thread time x{pooled / here:.2f}")


if __name__ == "__main__":
    main()
