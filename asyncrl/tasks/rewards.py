"""Built-in reward functions: `f(completion: str, answer: str) -> float | dict[str, float]`
(see `asyncrl/tasks/reward_calls.py` for the contract). `partial_match` and `exact_match` are
pure and cheap; `math_reward` verifies mathematical equivalence with `math-verify`."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any


def partial_match(completion: str, answer: str) -> float:
    """Fraction of positions where the completion has the answer's character, over the
    longer of the two, so missing and extra characters both cost credit. In [0, 1]."""
    length = max(len(completion), len(answer))
    if length == 0:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return hits / length


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion equals the answer after stripping whitespace, else 0.0."""
    return float(completion.strip() == answer.strip())


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a reward function that scores a whole group in one call:
    `f(completions: list[str], answers: list[str]) -> list[float | dict[str, float]]`."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


BOXED = re.compile(r"\\boxed\s*\{")


def boxed_contents(completion: str) -> list[str]:
    """The contents of each `\\boxed{...}` in the completion, braces balanced
    (`\\boxed{\\frac{1}{2}}` holds `\\frac{1}{2}`); an unclosed one holds the rest."""
    contents = []
    for match in BOXED.finditer(completion):
        depth, start = 1, match.end()
        for i in range(start, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[i], 0)
            if depth == 0:
                contents.append(completion[start:i])
                break
        else:
            contents.append(completion[start:])
    return contents


def reference_answer(answer: str) -> str:
    """The final answer of a reference: what follows GSM8K's `####` if there is one, else the
    whole text."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def math_reward(completion: str, answer: str, format_reward: float = 0.0) -> dict[str, float]:
    """`correct`: 1 if the completion's final answer — its `\\boxed{}` or else its last number
    or expression, as `math-verify` extracts it — is mathematically equivalent to the
    reference's (`1/2`, `0.5` and `\\frac{2}{4}` agree; `1,000` is 1000), else 0; no answer is
    0. `format`: 1 if the completion has exactly one `\\boxed{}` and something in it (so
    that a policy cannot earn the bonus by repeating empty `\\boxed{}`s, which
    SmolLM2-135M-Instruct learned to do in 40 steps when any `\\boxed{` counted). The reward
    is `correct + format_reward * format`.

    math-verify bounds its own parsing and comparison with `signal.alarm`, which only the main
    thread of a process may use: in a reward worker process (`rollout.reward_workers`) it does;
    in the generation thread it runs without (set `reward_workers` for untrusted answers)."""
    from math_verify import parse, verify  # heavy (sympy): imported on first use

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(reference_answer(answer), parsing_timeout=timeout)
    predicted = parse(completion, parsing_timeout=timeout) if completion.strip() else []
    correct = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout)
    boxed = boxed_contents(completion)
    formatted = float(len(boxed) == 1 and bool(boxed[0].strip()))
    return {
        "reward": float(correct) + format_reward * formatted,
        "correct": float(correct),
        "format": formatted,
    }


logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled", per call
