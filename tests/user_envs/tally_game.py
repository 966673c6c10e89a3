"""A user's environment, outside the asyncrl package (`env.name=tally_game:Tally` with this
folder on PYTHONPATH): the tests' proof that `module:Class` works end to end.

The episode keeps a running tally: it starts at a digit drawn from the episode's seed; each
turn adds the digits of the assistant's text and one more draw of the environment's RNG, mod
10, and the environment answers with the new tally. After 3 turns it ends with reward
tally / 9 (so an environment restored wrong changes the reward, even on the last turn). Every
step is written to the journal `$TALLY_JOURNAL` (`PID STEP_ID TEXT_SHA256` a line): the tests
read which process called which step, with which text.

Three kinds, one per way of coming back after a resume: `Tally` replays its recorded turns
(checking each against what it would have answered), `TallyState` saves its state (`TallyTensor`
with tensors in it), and `TallyRestart` can only start over.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any


def _journal(step_id: str, text: str) -> None:
    path = os.environ.get("TALLY_JOURNAL")
    if path:
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {step_id} {sha}\n")


class Tally:
    restore = "replay"
    alphabet = "0123456789-=+?"
    max_turns = 3

    def reset(self, example: Any, seed: int) -> list[dict[str, str]]:
        self.rng = random.Random(seed)
        self.tally = self.rng.randint(0, 9)
        self.turns = 0
        return [{"role": "user", "content": example.prompt}]

    def _advance(self, text: str) -> tuple[list[dict[str, str]], float | None, bool]:
        self.turns += 1
        digits = sum(int(c) for c in text if c.isdigit())
        self.tally = (self.tally + digits + self.rng.randint(0, 9)) % 10
        done = self.turns >= self.max_turns
        reward = self.tally / 9 if done else None
        return ([] if done else [{"role": "user", "content": str(self.tally)}]), reward, done

    def step(self, text: str, step_id: str) -> tuple[list[dict[str, str]], float | None, bool]:
        _journal(step_id, text)
        return self._advance(text)

    def replay(self, turns: list[Any]) -> None:
        for turn in turns:
            messages, reward, done = self._advance(turn.assistant_text)
            if (messages, reward, done) != (turn.messages, turn.reward, turn.done):
                raise RuntimeError(f"replay of {turn.step_id} differs from the record")


class TallyState(Tally):
    restore = "restorable"

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"tally": self.tally, "turns": self.turns, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tally, self.turns = int(state["tally"]), int(state["turns"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


class TallyTensor(TallyState):
    """Restorable, its state holding tensors (the protocol allows them): the tally as a 0-d
    tensor and the RNG's internal state as an int64 tensor."""

    def state_dict(self) -> dict[str, Any]:
        import torch

        version, internal, gauss = self.rng.getstate()
        return {"tally": torch.tensor(self.tally), "turns": self.turns,
                "rng": [version, torch.tensor(internal, dtype=torch.int64), gauss]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tally, self.turns = int(state["tally"]), int(state["turns"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal.tolist()), gauss))


class TallyRestart(Tally):
    restore = "restart"


class TallyLong(TallyState):
    """Eight turns an episode: `benchmarks/resume_cost.py`'s long multi-turn shape."""

    max_turns = 8
