"""The guess environment: a number-guessing game played over one agent's live interaction.

The taskset (`GuessTaskset`) holds one game a task: a secret in 1..`max_number` and a budget of
`max_turns` guesses. The env (`GuessEnv`) plays it: it opens the `agent` seat's interaction with
the rules, reads the last integer of each reply as the guess, and answers "Higher"/"Lower" (or,
for a reply with no number, asks for one; that still spends a guess) until the model hits the
secret or the guesses run out. The model is never told "correct": a hit ends the game.

On the seat's trace, after the interaction closes: reward `solved` (weight 1.0), 1.0 when a guess
hit the secret; metric `turns`, the replies the game read; and `trace.info["guess"]`, the game's
facts (secret, guesses, verdicts). The seat rides the tool-less `null` harness, so a game costs
only its model calls."""

from __future__ import annotations

from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

from asyncrl_guess.game import RULES, feedback, parse_guess, secrets_of, verdict


class GuessData(vf.TaskData):
    """One game: `id` is "<split>-<position>"."""

    secret: int
    """The number to guess, in 1..max_number."""
    max_number: int
    """The largest number the secret may be."""
    max_turns: int
    """How many replies the model has to hit it."""


class GuessTask(vf.Task[GuessData]):
    """One game. It scores nothing itself: the env records `solved` and `turns` on the trace."""

    @property
    def key(self) -> str:
        """The game's durable id ("train-17"): the same for the same config, run after run."""
        assert self.data.id is not None
        return self.data.id


class GuessConfig(vf.TasksetConfig):
    """Which games load (`--env.taskset.*`)."""

    num_tasks: int = Field(200, ge=1)
    """How many games the taskset holds."""
    max_number: int = Field(16, ge=1)
    """Secrets lie in 1..max_number."""
    max_turns: int = Field(4, ge=1)
    """Replies the model has in each game."""
    split: Literal["train", "test"] = "train"
    """The split: each draws its secrets from its own seed."""


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    """`num_tasks` games of `split`, the same for the same config."""

    def load(self) -> list[GuessTask]:
        config = self.config
        secrets = secrets_of(config.split, config.num_tasks, config.max_number)
        return [
            GuessTask(
                GuessData(
                    id=f"{config.split}-{i}",
                    prompt=None,  # the env opens the conversation (see GuessEnv.run)
                    secret=secret,
                    max_number=config.max_number,
                    max_turns=config.max_turns,
                ),
                self.config.task,
            )
            for i, secret in enumerate(secrets)
        ]


class GuessEnvConfig(vf.EnvConfig):
    """The guess env's one seat, `agent` (`--env.agent.*`)."""

    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime={"type": "subprocess"})
    """The guesser: the tool-less `null` harness in a local subprocess (it runs no code)."""


class GuessEnv(vf.Env[GuessEnvConfig]):
    """Plays each game turn by turn over `agents.agent.interaction(...)` (see module doc)."""

    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        data = task.data
        # The seat's task carries no secret: the trace records what the model was given.
        seat_task = vf.Task(vf.TaskData(idx=data.idx, id=data.id, prompt=None))
        message = RULES.format(max_number=data.max_number, max_turns=data.max_turns)
        guesses: list[int | None] = []
        verdicts: list[str] = []
        async with agents.agent.interaction(seat_task) as player:
            while len(guesses) < data.max_turns:
                segment = await player.turn(message)
                if segment.terminated:  # the run ended (a limit, an error) instead of replying
                    break
                guess = parse_guess(segment.last_reply)
                guesses.append(guess)
                verdicts.append("none" if guess is None else verdict(guess, data.secret))
                if verdicts[-1] == "correct":
                    break
                message = feedback(
                    guess, data.secret, data.max_number, data.max_turns - len(guesses)
                )
        trace = player.trace
        solved = bool(verdicts) and verdicts[-1] == "correct"
        trace.record_reward("solved", float(solved), weight=1.0)
        trace.record_metric("turns", float(len(guesses)))
        trace.info["guess"] = {
            "secret": data.secret,
            "max_number": data.max_number,
            "max_turns": data.max_turns,
            "guesses": guesses,
            "verdicts": verdicts,
        }
