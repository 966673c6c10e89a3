"""Built-in environments (`env.name`): `guess_number`, a multi-turn game the tiny model learns
from scratch on a CPU in minutes.

`guess_number`: the example is a range `lo-hi` of digits; the environment draws a secret digit
in it from its own RNG (seeded per episode). Each assistant turn is a guess; the environment
answers `+` (the secret is higher), `-` (lower) or `?` (not a digit in the range), and ends the
episode when the guess is right, with reward 1 - 0.2 * (turns taken - 1). Guessing at random
finds the secret within 4 turns about half the time; halving the range every time always does.
The environment is `restorable`: its state (the secret, the turns, its RNG) is JSON.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from asyncrl.tasks.environments import RestoreKind, StepResult
from asyncrl.tasks.examples import Example, Message


def guess_number_examples(num_examples: int, seed: int = 0) -> list[Example]:
    """`num_examples` ranges `lo-hi` of 4 to 10 digits, opened as `lo-hi=`."""
    rng = random.Random(seed)
    out = []
    for i in range(num_examples):
        size = rng.randint(4, 10)
        lo = rng.randint(0, 10 - size)
        text = f"{lo}-{lo + size - 1}="
        out.append(Example(text, text, f"guess_number[{i}]"))
    return out


class GuessNumber:
    restore: ClassVar[RestoreKind] = "restorable"
    alphabet: ClassVar[str] = "0123456789-=+?"

    def __init__(self) -> None:
        self.lo = self.hi = self.secret = self.turns = 0
        self.rng = random.Random(0)

    def reset(self, example: Example, seed: int) -> list[Message]:
        lo, _, hi = example.prompt.rstrip("=").partition("-")
        self.lo, self.hi = int(lo), int(hi)
        self.rng = random.Random(seed)
        self.secret = self.rng.randint(self.lo, self.hi)
        self.turns = 0
        return [{"role": "user", "content": example.prompt}]

    def step(self, assistant_text: str, step_id: str) -> StepResult:
        self.turns += 1
        text = assistant_text.strip()
        if not (len(text) == 1 and text.isdigit() and self.lo <= int(text) <= self.hi):
            return StepResult([{"role": "user", "content": "?"}], None, False)
        guess = int(text)
        if guess == self.secret:
            return StepResult([], 1.0 - 0.2 * (self.turns - 1), True)
        hint = "+" if self.secret > guess else "-"
        return StepResult([{"role": "user", "content": hint}], None, False)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "lo": self.lo,
            "hi": self.hi,
            "secret": self.secret,
            "turns": self.turns,
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lo, self.hi = int(state["lo"]), int(state["hi"])
        self.secret, self.turns = int(state["secret"]), int(state["turns"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
