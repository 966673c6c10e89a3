"""One reward call: a group's completions scored by the task's reward function, the result
checked and brought to one shape. Imports neither torch nor anything heavy: the reward worker
processes (`asyncrl/rollout/reward_pool.py`) import only this module and the reward's own.

A reward function is `f(completion, answer)`, or, with `batched = True` on it (the
`asyncrl.tasks.rewards.batched` decorator), `f(completions, answers)` over a group. Each
sample's value is a float or a dict of named floats: the dict's `reward` entry is the reward
if it has one, else the sum of its entries; every entry is a logged component.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.base import ConfigError


class RewardFailure(RuntimeError):
    """The reward function raised, returned something that is not a reward, or a non-finite
    value; the message says which sample and what came back."""


@dataclass
class GroupScores:
    """One group's rewards [G] and its named components (each [G]), as plain lists."""

    rewards: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)


@functools.cache
def resolve_reward_fn(target: str) -> Callable[..., Any]:
    """Imports `module:function` (once per process); the error says which part is missing."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"data.reward_fn: cannot import module {module_name!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"data.reward_fn: {module_name} has no function {attr!r}")
    return fn


def score_group(
    target: str, kwargs: dict[str, Any], completions: list[str], answer: str
) -> GroupScores:
    """The rewards of one group's `completions` against its reference `answer`."""
    fn = resolve_reward_fn(target)
    if getattr(fn, "batched", False):
        values = list(fn(completions, [answer] * len(completions), **kwargs))
        if len(values) != len(completions):
            raise RewardFailure(
                f"returned {len(values)} values for a group of {len(completions)} completions"
            )
    else:
        values = []
        for text in completions:
            try:
                values.append(fn(text, answer, **kwargs))
            except KeyboardInterrupt:
                raise
            except BaseException as err:  # SystemExit too: a reward must not end the run
                raise RewardFailure(f"raised {err!r} for completion {text!r}") from err
    return collect_scores(values, completions)


def collect_scores(values: list[Any], completions: list[str]) -> GroupScores:
    """A group's rewards and components from its samples' values (floats, or dicts of named
    floats: the `reward` entry, else their sum); `completions` name the samples in errors."""
    rewards: list[float] = []
    components: dict[str, list[float]] = {}
    for i, value in enumerate(values):
        parts = value if isinstance(value, dict) else None
        if parts is not None:
            names = sorted(k for k in parts if k != "reward")
            if i and names != sorted(components):
                raise RewardFailure(
                    f"returned components {names} for completion {completions[i]!r} "
                    f"but {sorted(components)} for the others of its group"
                )
            if not parts:
                raise RewardFailure(f"returned an empty dict for completion {completions[i]!r}")
            reward = parts["reward"] if "reward" in parts else sum(parts.values())
            for name, part in parts.items():
                if name != "reward":
                    components.setdefault(name, []).append(_number(part, completions[i], name))
        elif i and components:
            raise RewardFailure(f"returned a number for {completions[i]!r}, dicts for others")
        else:
            reward = value
        rewards.append(_number(reward, completions[i], "reward"))
    return GroupScores(rewards, components)


def _number(value: Any, completion: str, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardFailure(
            f"returned {value!r} as {name} for completion {completion!r}; want a number"
        ) from None
    if not math.isfinite(number):
        raise RewardFailure(f"returned {number} as {name} for completion {completion!r}")
    return number
