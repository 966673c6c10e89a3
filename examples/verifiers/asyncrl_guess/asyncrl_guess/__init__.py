"""asyncrl-guess: a number-guessing game played turn by turn, a verifiers v1 taskset
(`GuessTaskset`, id `asyncrl-guess`) exported beside its env (`GuessEnv`), which verifiers pairs
with it whenever the taskset is loaded by id."""

from asyncrl_guess.env import GuessEnv, GuessTaskset

__all__ = ["GuessEnv", "GuessTaskset"]
