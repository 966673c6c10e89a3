"""Reward functions that fail on purpose, named as `module:function` by the failure tests."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from asyncrl.tasks.rewards import batched


def raises_on_7(completion: str, answer: str) -> float:
    if answer == "7":
        raise ValueError("cannot score answer 7")
    return float(completion == answer)


def exits_on_7(completion: str, answer: str) -> float:
    if answer == "7":
        raise SystemExit("a reward helper exited")
    return float(completion == answer)


def nan_on_7(completion: str, answer: str) -> float:
    return math.nan if answer == "7" else float(completion == answer)


def _fails_now() -> bool:
    """True for the first `ASYNCRL_TEST_FAIL_TIMES` calls that ask (unset: always), counted
    with files in `ASYNCRL_TEST_FAIL_DIR`, so that worker processes share the count."""
    times = os.environ.get("ASYNCRL_TEST_FAIL_TIMES")
    if times is None:
        return True
    folder = Path(os.environ["ASYNCRL_TEST_FAIL_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    done = len(list(folder.iterdir()))
    if done >= int(times):
        return False
    (folder / f"{done}-{os.getpid()}-{time.monotonic_ns()}").touch()
    return True


def sleeps_on_7(completion: str, answer: str) -> float:
    if answer == "7" and _fails_now():
        time.sleep(120)
    return float(completion == answer)


def raises_sometimes_on_7(completion: str, answer: str) -> float:
    if answer == "7" and _fails_now():
        raise ValueError("cannot score answer 7 yet")
    return float(completion == answer)


@batched
def batched_parts(completions: list[str], answers: list[str]) -> list[dict[str, float]]:
    """A batched reward with two named components; the reward is their sum."""
    return [
        {"exact": float(c == a), "length": len(c) / 10}
        for c, a in zip(completions, answers, strict=True)
    ]


def uneven_parts(completion: str, answer: str) -> dict[str, float]:
    """Components that differ between the samples of a group: refused."""
    return {"a": 1.0} if completion == answer else {"b": 0.0}


def empty_parts(completion: str, answer: str) -> dict[str, float]:
    return {}


def text_part(completion: str, answer: str) -> dict[str, object]:
    return {"reward": 1.0, "note": "fine"}


@batched
def batched_short(completions: list[str], answers: list[str]) -> list[float]:
    return [1.0]


@batched
def batched_raises(completions: list[str], answers: list[str]) -> list[float]:
    raise RuntimeError("the grader is down")


def wedges_when_told(completion: str, answer: str) -> float:
    """Scores like an exact match until the file `ASYNCRL_TEST_WEDGE` names exists; from then
    on a call never returns (a wedged reward service, or a vLLM server that answers `/health`
    but no request): it first creates `<that file>.wedged`, so a test knows the collector's
    thread is stuck in it."""
    wedge = Path(os.environ["ASYNCRL_TEST_WEDGE"])
    if wedge.exists():
        Path(f"{wedge}.wedged").touch()
        while True:
            time.sleep(1)
    return float(completion == answer)
