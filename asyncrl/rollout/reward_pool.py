"""Where reward calls run: in the calling thread, or in a pool of worker processes with a
per-call timeout (`rollout.reward_workers`, `rollout.reward_timeout_s`).

Processes rather than threads, because a call past its timeout must be stopped, and only a
process can be (pebble kills the worker and starts a fresh one); and because math checking in
pure Python holds the GIL. The workers are *spawned*, not forked from a process that runs
torch and threads, and import only `asyncrl.tasks.reward_calls` and the reward's own module.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.reward_calls import GroupScores, RewardFailure, score_group

POLL_S = 0.2
"""How often a caller waiting for a reward call checks whether the pool was closed."""


@dataclass(frozen=True)
class RewardJob:
    completions: list[str]
    answer: str


CLOSED = "was stopped: the run is ending (its reward pool closed)"


class RewardPool:
    """Scores groups with `target` (`module:function`) called with `kwargs`: in this thread
    when `workers` is 0, else in that many spawned processes, each call stopped after
    `timeout_s` (0: never). Each result is a `GroupScores` or the `RewardFailure` that says
    why not; the caller decides what a failure costs."""

    def __init__(
        self, target: str, kwargs: dict[str, Any], workers: int = 0, timeout_s: float = 0.0
    ) -> None:
        self.target = target
        self.kwargs = dict(kwargs)
        self.workers = workers
        self.timeout_s = timeout_s
        self._pool: Any = None
        self._closed = threading.Event()
        if workers:
            from pebble import ProcessPool  # only the pool needs it

            self._pool = ProcessPool(
                max_workers=workers, context=multiprocessing.get_context("spawn")
            )

    def score(self, jobs: list[RewardJob]) -> list[GroupScores | RewardFailure]:
        """Every job's scores, in order; all jobs run in parallel on the pool. Once the pool is
        closed every call fails (never in this thread instead: a hanging reward would then
        hold up the end of the run without a timeout)."""
        if self._closed.is_set():
            return [RewardFailure(CLOSED) for _ in jobs]
        if self._pool is None:
            return [self._call_here(job) for job in jobs]
        futures = [
            self._pool.schedule(
                score_group,
                args=(self.target, self.kwargs, job.completions, job.answer),
                timeout=self.timeout_s or None,
            )
            for job in jobs
        ]
        return [self._result(future) for future in futures]

    def _call_here(self, job: RewardJob) -> GroupScores | RewardFailure:
        try:
            return score_group(self.target, self.kwargs, job.completions, job.answer)
        except RewardFailure as failure:
            return failure
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # a batched function's own exception, SystemExit too
            return RewardFailure(f"raised {err!r}")

    def _result(self, future: Any) -> GroupScores | RewardFailure:
        # returns as soon as the call ends; every POLL_S checks that `close` was not called (a
        # closed pool may never resolve a running call's future)
        while not concurrent.futures.wait([future], timeout=POLL_S).done:
            if self._closed.is_set():
                return RewardFailure(CLOSED)
        try:
            result: GroupScores = future.result()
        except concurrent.futures.TimeoutError:
            return RewardFailure(
                f"ran past rollout.reward_timeout_s={self.timeout_s:g} s (its worker process "
                "was stopped and replaced)"
            )
        except RewardFailure as failure:
            return failure
        except Exception as err:  # a batched function's own, or the worker process died
            return RewardFailure(f"raised {err!r}")
        return result

    def close(self) -> None:
        """Stops the worker processes (a call still running is abandoned, and whoever waits
        for it gets a failure)."""
        self._closed.set()
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
