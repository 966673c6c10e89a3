"""The number-guessing game behind the guess environment, free of verifiers: the secrets of each
split, the reading of a guess from a reply, and what the model is told after each guess."""

from __future__ import annotations

import random
import re

SPLIT_SEEDS = {"train": 20250303, "test": 20250404}
"""Each split draws its secrets from its own random stream."""

RULES = (
    "I am thinking of a whole number between 1 and {max_number}. Guess it: you have {max_turns} "
    "guesses, and after each one I will tell you whether the number is higher or lower. "
    "Reply with your guess as a number."
)

_INTEGER = re.compile(r"-?\d+")


def secrets_of(split: str, num_tasks: int, max_number: int) -> list[int]:
    """The secrets of the first `num_tasks` games of `split`, each in 1..`max_number`, the
    same on every call."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, not {split!r}")
    rng = random.Random(SPLIT_SEEDS[split])
    return [rng.randint(1, max_number) for _ in range(num_tasks)]


def parse_guess(reply: str) -> int | None:
    """The last integer written in `reply` ("I guess 8" -> 8), or None when it holds none."""
    found = _INTEGER.findall(reply)
    return int(found[-1]) if found else None


def verdict(guess: int, secret: int) -> str:
    """ "correct", "higher" (the secret is above the guess) or "lower" (below it)."""
    if guess == secret:
        return "correct"
    return "higher" if secret > guess else "lower"


def feedback(guess: int | None, secret: int, max_number: int, guesses_left: int) -> str:
    """What the model is told after a guess that missed: "Higher" or "Lower", with the guess
    named; or, for a reply with no number in it (`guess` None), to answer with one. Ends with
    the guesses left."""
    if guess is None:
        told = f"I found no number in your reply. Reply with one number from 1 to {max_number}."
    else:
        direction = verdict(guess, secret)
        if direction == "correct":
            raise ValueError(f"{guess} is the secret: there is nothing to tell")
        told = f"{direction.capitalize()}: the number is {direction} than {guess}."
    return f"{told} You have {guesses_left} guess{'es' if guesses_left != 1 else ''} left."
