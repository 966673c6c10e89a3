"""The environment protocol of multi-turn episodes (`env.name`, docs/environments.md).

An environment plays one episode: `reset(example, seed)` opens it with messages, then after
each assistant turn `step(assistant_text, step_id)` answers with messages, a reward (or None)
and whether the episode is done. Messages are `{"role": ..., "content": ...}` dicts. The
class says how a resumed run gets an episode's environment back (`restore`):

- `restorable`: `state_dict()` after each step is saved in the checkpoint cut (JSON values and
  tensors, never pickle: DESIGN.md I7) and given back with `load_state_dict(state)` after a
  `reset(example, seed)`;
- `replay`: deterministic given its seed and the history: after `reset(example, seed)` it is
  handed the recorded turns, `replay(turns)` (each a `Turn`: `assistant_text`, `step_id`,
  `messages`, `reward`, `done`, and where its tokens are, `start`, `end`), and rebuilds its
  state without acting again;
- `restart`: neither: the episode starts over (counted in the resume event).

`step_id` is `"ORDINAL:SAMPLE:TURN"`, with `:RESTARTS` once a resume started the episode over
(a `restart` environment, or `checkpoint.resume_policy=restart_episode`), the same on every
attempt of the run: one id is one request, with one text. It is unique within a run; across
runs, `idempotency_key(run_id, step_id)` is (an environment learns the run's id through its
optional `set_run_id(run_id)`, called before `set_workdir` and `reset`), so a journal or an
outside service shared by runs never answers one run's step with another's result. An
environment whose steps act on the outside world passes that key to the service as its
idempotency key: only the service can make an action at most once across a kill that lands
inside it. `reset` must not act on the outside world: a resume calls it again. Every sample of
a group is opened from the same example and must open with the same messages (its seed may
differ: it is for hidden state).
"""

from __future__ import annotations

import importlib
from typing import ClassVar, Literal, NamedTuple, Protocol

from asyncrl.config import BUILTIN_ENVIRONMENTS, ConfigError
from asyncrl.core.episodes import Turn
from asyncrl.tasks.examples import Example, Message

__all__ = ["Environment", "StepResult", "Turn", "environment_class", "idempotency_key"]

RestoreKind = Literal["restorable", "replay", "restart"]
RESTORE_KINDS: tuple[str, ...] = ("restorable", "replay", "restart")


class StepResult(NamedTuple):
    messages: list[Message]
    """What the environment says next (empty when done)."""
    reward: float | None
    """A reward for this turn, or None; the episode's reward is the sum of its turns'."""
    done: bool


class Environment(Protocol):
    restore: ClassVar[RestoreKind]
    alphabet: ClassVar[str]
    """Optional: characters its messages use beyond the examples' (for the `tiny` preset's
    character vocabulary)."""

    def reset(self, example: Example, seed: int) -> list[Message]: ...

    def step(self, assistant_text: str, step_id: str) -> StepResult: ...


def idempotency_key(run_id: str, step_id: str) -> str:
    """A step's key across runs: `RUN_ID/STEP_ID` (the step id alone where no run id is known,
    as in a test driving an environment by hand)."""
    return f"{run_id}/{step_id}" if run_id else step_id


def environment_class(name: str) -> type[Environment]:
    """The class `env.name` names (a built-in's short name or `module:Class`), checked against
    the protocol; a name that does not resolve is a `ConfigError` naming `env.name`."""
    target = BUILTIN_ENVIRONMENTS.get(name, name)
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"env.name: cannot load {target!r} ({err}); give a built-in's name "
            f"({', '.join(BUILTIN_ENVIRONMENTS)}) or 'module:Class' importable from here"
        ) from err
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    kind = getattr(cls, "restore", None)
    if missing or kind not in RESTORE_KINDS:
        problem = (
            f"has no {' or '.join(missing)} method" if missing
            else f"says restore={kind!r}, not one of {', '.join(RESTORE_KINDS)}"
        )  # fmt: skip
        raise ConfigError(f"env.name: {target} {problem} (docs/environments.md: the protocol)")
    needs = {"restorable": ("state_dict", "load_state_dict"), "replay": ("replay",)}
    for method in needs.get(kind, ()):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(
                f"env.name: {target} says restore={kind!r} but has no {method} method"
            )
    result: type[Environment] = cls
    return result
