"""Multi-turn episodes: what one sample's episode has been so far, as plain JSON values.

A sample of an episode group is the whole episode's token sequence after the prompt: the
assistant's turns and, between them, the environment's replies (masked out of the loss). Its
`Episode` records the turns (each assistant text, its `step_id`, the environment's answer),
where the current assistant turn began, and the environment's state after the last step
(for a `restorable` environment). It travels with the sample's `Partial` into the checkpoint
cut, so a `lossless` resume continues the episode at the token where it stopped, with its
environment restored, and calls no recorded step again (DESIGN.md I9).

No IO, no torch: unit-tested in milliseconds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

Message = dict[str, str]
"""A chat message, `{"role": ..., "content": ...}` (defined here once; `asyncrl.tasks` uses it)."""


class Turn(NamedTuple):
    """One answered assistant turn: what an episode records and what `replay` is handed
    (`asyncrl.tasks.environments.Turn` is this type)."""

    assistant_text: str
    step_id: str
    messages: list[Message]
    """The environment's answer (empty when done)."""
    reward: float | None
    done: bool
    start: int = 0
    """Where the turn's assistant tokens begin in the sample (tokens after the prompt)."""
    end: int = 0
    """... and where they end (exclusive)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "text": self.assistant_text,
            "step_id": self.step_id,
            "messages": [dict(m) for m in self.messages],
            "reward": self.reward,
            "done": self.done,
            "start": self.start,
            "end": self.end,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Turn:
        return cls(
            str(state["text"]),
            str(state["step_id"]),
            [dict(m) for m in state["messages"]],
            None if state["reward"] is None else float(state["reward"]),
            bool(state["done"]),
            int(state["start"]),
            int(state["end"]),
        )


def recorded_steps(ledger_state: dict[str, Any]) -> list[str]:
    """The environment steps a ledger's saved state holds: every turn of every episode of its
    partial samples (what a `lossless` resume must not ask for again)."""
    return sorted(
        str(turn["step_id"])
        for partial in ledger_state.get("partial", {}).values()
        for episode in partial.get("episodes", ())
        for turn in episode["turns"]
    )


def step_id(ordinal: int, sample: int, turn: int, restarts: int = 0) -> str:
    """The id of a turn's environment step: `ORDINAL:SAMPLE:TURN`, and `:RESTARTS` once a
    resume started the episode over (`Episode.restarts`), so an id names one request on every
    attempt of the run: the same id is the same turn with the same text."""
    return f"{ordinal}:{sample}:{turn}" + (f":{restarts}" if restarts else "")


def parse_step_id(sid: str) -> tuple[int, int, int, int]:
    """(ordinal, sample, turn, restarts) of a step id."""
    parts = [int(x) for x in sid.split(":")]
    if len(parts) not in (3, 4):
        raise ValueError(f"not a step id: {sid!r} (ORDINAL:SAMPLE:TURN[:RESTARTS])")
    return parts[0], parts[1], parts[2], parts[3] if len(parts) == 4 else 0


def text_sha256(text: str) -> str:
    """The hash an assistant turn's text is known by in the steps log and the journals: the
    first 16 hex digits of the SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class Episode:
    opening: tuple[Message, ...]
    """The messages `reset` opened the episode with (rendered as the group's prompt)."""
    turn_start: int = 0
    """The sample's length (tokens after the prompt) where the current assistant turn began."""
    turns: tuple[Turn, ...] = ()
    """Each completed turn (its assistant tokens are `[start, end)` of the sample)."""
    done: bool = False
    """The environment said the episode is done (its last step's `done`)."""
    env_state: Any = None
    """A `restorable` environment's `state_dict()` after the last step (JSON and tensors)."""
    restarts: int = 0
    """How many times a resume started this episode over (`restart` environments)."""
    ended: bool = False
    """The episode is over: its environment said `done`, or a limit (`env.max_turns`, no room
    left under `env.max_episode_tokens`) ended it after the step that answered its last turn.
    An ended episode is never stepped again. Three states, kept apart: a *turn* ended
    (`Partial.finished` after an engine pass: EOS or the turn's token limit, its step not yet
    asked), the environment said *done* (`done`), the *episode* ended (this)."""

    @property
    def reward(self) -> float:
        """The episode's reward: the sum of its turns' rewards (None counts 0)."""
        return float(sum(t.reward or 0.0 for t in self.turns))

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def limit(self, max_new_tokens: int, max_episode_tokens: int) -> int:
        """The sample's length at which the current assistant turn must stop."""
        return min(self.turn_start + max_new_tokens, max_episode_tokens)

    def after_step(
        self,
        text: str,
        sid: str,
        start: int,
        end: int,
        messages: list[Message],
        reward: float | None,
        done: bool,
        env_state: Any,
    ) -> Episode:
        """This episode with the turn `[start, end)` (text `text`) answered by the
        environment's step `sid`."""
        reward = None if reward is None else float(reward)
        turn = Turn(text, sid, [dict(m) for m in messages], reward, bool(done), start, end)
        return replace(self, turns=(*self.turns, turn), done=done, env_state=env_state, ended=done)

    def history(self) -> list[Message]:
        """Every message so far: the opening, then each turn's assistant text and replies."""
        out = [dict(m) for m in self.opening]
        for t in self.turns:
            out.append({"role": "assistant", "content": t.assistant_text})
            out.extend(dict(m) for m in t.messages)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "opening": [dict(m) for m in self.opening],
            "turn_start": self.turn_start,
            "turns": [t.state_dict() for t in self.turns],
            "done": self.done,
            "env_state": self.env_state,
            "restarts": self.restarts,
            "ended": self.ended,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], finished: bool = False, length: int = -1) -> Episode:
        """The episode of a saved state. A state saved before `ended` existed (formats up to
        5) did not record a limit's end: its episode ended if its sample is `finished` at
        `length` tokens and its last turn, already stepped, ends there."""
        turns = state["turns"]
        ended = state.get("ended")
        if ended is None:
            ended = bool(state["done"]) or (
                finished and bool(turns) and int(turns[-1]["end"]) == length
            )
        return cls(
            opening=tuple(dict(m) for m in state["opening"]),
            turn_start=int(state["turn_start"]),
            turns=tuple(Turn.from_state(t) for t in state["turns"]),
            done=bool(state["done"]),
            env_state=state.get("env_state"),
            restarts=int(state.get("restarts", 0)),
            ended=bool(ended),
        )
