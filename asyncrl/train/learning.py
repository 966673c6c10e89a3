"""Why a run is not learning, said while it runs: the share of samples cut at the length limit
(`truncated_share`), of groups whose samples all got the same reward (`zero_variance_groups`,
the algorithm's), and of rewards that are partial, paid for the form only
(`partial_reward_share`). Each is a field of the step's `metrics.jsonl` record; `LearningWatch`
says once, with the knob to turn, when one of them stays high.

Plain Python over the step's groups and records: the trainer prints what it says, records it
as a `not_learning` event, and the end-of-run summary repeats it (asyncrl/cli/report.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from asyncrl.core.types import Group
from asyncrl.rollout.overlong import OVERLONG

CORRECT = "correct"
"""The reward component that says a sample is right (`data.reward_fn=math`'s, and a verifiers
rubric's by that name); a sample paid something while its `correct` is 0 is paid for the rest
(the format, a tool's use) only."""


def task_rewards(group: Group) -> torch.Tensor:
    """[G] the group's rewards without the overlong penalty: what the task paid."""
    return group.rewards - group.reward_components.get(OVERLONG, torch.zeros(()))


def cut_samples(group: Group, end_id: int) -> torch.Tensor:
    """[G] bool: the samples whose last generated token is not `end_id` (the end of an
    assistant turn, or the model's eos), cut at the length limit. A sample's last token is its
    last row's last trained token (a multi-turn episode's last turn, a segmented sample's last
    segment); a sample with no trained token is not cut."""
    mask = group.policy_mask
    rows = group.row_samples
    cut = torch.zeros(group.num_samples, dtype=torch.bool)
    for row in range(mask.shape[0]):  # rows in sample order: a sample's last row is last
        positions = mask[row].nonzero()
        if len(positions):
            last = int(group.completion_ids[row, int(positions[-1])])
            cut[int(rows[row]) if rows is not None else row] = last != end_id
    return cut


def truncated_share(groups: list[Group], end_id: int) -> float:
    """The share of the step's samples cut at the length limit (`cut_samples`)."""
    cut = [cut_samples(g, end_id) for g in groups]
    total = sum(len(c) for c in cut)
    return sum(int(c.sum()) for c in cut) / total if total else 0.0


def truncated_reward_gap(groups: list[Group], end_id: int) -> float | None:
    """The mean task reward of the samples that ended minus that of the samples cut: above 0
    where being cut costs reward (an answer cut before its box). None unless both kinds are
    among the step's samples."""
    cut = torch.cat([cut_samples(g, end_id) for g in groups]) if groups else torch.zeros(0)
    rewards = torch.cat([task_rewards(g) for g in groups]) if groups else torch.zeros(0)
    if not bool(cut.any()) or bool(cut.all()):
        return None
    return float(rewards[~cut].mean() - rewards[cut].mean())


def zero_reward_groups(groups: list[Group]) -> float:
    """The share of the step's groups in which no sample earned anything (every task reward 0
    or below): nothing to learn from, and nothing right to learn towards."""
    if not groups:
        return 0.0
    return sum(bool((task_rewards(g) <= 0).all()) for g in groups) / len(groups)


def partial_reward_share(groups: list[Group]) -> float | None:
    """The share of the samples paid a positive task reward while their `correct` component
    is 0: partial rewards (the format bonus of `data.format_reward`, a rubric's other parts).
    None where the step's reward has no `correct` component."""
    partial = counted = 0
    for group in groups:
        correct = group.reward_components.get(CORRECT)
        if correct is None:
            continue
        counted += len(correct)
        partial += int(((task_rewards(group) > 0) & (correct == 0)).sum())
    return partial / counted if counted else None


def learning_fields(groups: list[Group], end_id: int) -> dict[str, float]:
    """A step's `truncated_share`, `zero_reward_groups`, and where defined
    `truncated_reward_gap` and `partial_reward_share`."""
    fields = {
        "truncated_share": truncated_share(groups, end_id),
        "zero_reward_groups": zero_reward_groups(groups),
    }
    gap = truncated_reward_gap(groups, end_id)
    if gap is not None:
        fields["truncated_reward_gap"] = gap
    partial = partial_reward_share(groups)
    if partial is not None:
        fields["partial_reward_share"] = partial
    return fields


@dataclass(frozen=True)
class Knobs:
    """The settings the advice names, as the run has them."""

    max_new_tokens: int
    num_generations: int
    temperature: float
    format_reward: float | None = None
    """`data.format_reward`, where the run's reward is `data.reward_fn=math`'s."""


@dataclass(frozen=True)
class Signal:
    field: str
    threshold: float


SIGNALS = (
    Signal("truncated_share", 0.5),
    Signal("zero_reward_groups", 0.9),
    Signal("partial_reward_share", 0.5),
)
"""A field, and the mean over `LearningWatch.window` steps at or above which it is said
(`truncated_share` only where being cut costs reward: `LearningWatch.observe`)."""


def advice(field: str, share: float, knobs: Knobs) -> str:
    """What to say of a signal at `share`, naming the knob."""
    if field == "truncated_share":
        return (
            f"{share:.0%} of completions hit rollout.max_new_tokens={knobs.max_new_tokens}: "
            "raise it, or add a length penalty (rollout.overlong_buffer)"
        )
    if field == "zero_reward_groups":
        return (
            f"{share:.0%} of groups earned nothing on any sample, so there is nothing to "
            f"learn from them: raise rollout.num_generations_per_prompt="
            f"{knobs.num_generations} or rollout.temperature={knobs.temperature:g}, or give "
            "easier prompts"
        )
    if field == "partial_reward_share":
        paid = (
            f"data.format_reward={knobs.format_reward:g}"
            if knobs.format_reward is not None
            else "the reward's parts other than `correct`"
        )
        return (
            f"{share:.0%} of rewards were partial, paid for the form only ({paid}) while the "
            "answer was wrong: lower it, or make sure right answers are reachable"
        )
    raise ValueError(f"no advice for {field!r}")


def learning_window(max_num_steps: int) -> int:
    """The steps a signal's mean is taken over: a tenth of the run, at least 5 (a model
    trained from scratch writes no end of turn in its first steps; a short run is told
    within its first steps)."""
    return max(5, max_num_steps // 10)


class LearningWatch:
    """Feeds on the step records; `observe` returns what is newly to say: a signal whose mean
    over the last `window` records is at or above its threshold, once per signal. The
    truncation is said only where it may cost reward: the samples cut earned less than those
    that ended (`truncated_reward_gap` above 0 over the window), or nothing was earned
    (`reward_mean` 0 or below): a task whose answers fill the limit by design (the built-in
    digits tasks) learns with every sample cut."""

    def __init__(self, knobs: Knobs, window: int = 5) -> None:
        self.knobs = knobs
        self.window = window
        fields = [s.field for s in SIGNALS] + ["truncated_reward_gap", "reward_mean"]
        self.recent: dict[str, deque[float | None]] = {f: deque(maxlen=window) for f in fields}
        self.said: set[str] = set()

    def observe(self, record: dict[str, object]) -> list[tuple[str, float, str]]:
        """`(field, share, message)` for each signal said now."""
        for key, recent in self.recent.items():
            value = record.get(key)
            recent.append(float(value) if isinstance(value, int | float) else None)
        out = []
        for signal in SIGNALS:
            share = self._mean(signal.field)
            if signal.field in self.said or share is None or share < signal.threshold:
                continue
            if signal.field == "truncated_share" and not self._cut_costs():
                continue
            self.said.add(signal.field)
            out.append((signal.field, share, advice(signal.field, share, self.knobs)))
        return out

    def _mean(self, key: str, full: bool = True) -> float | None:
        """The mean of `key` over the window's records that have it; None before the window is
        full of them (`full`), or where none has it."""
        values = [v for v in self.recent[key] if v is not None]
        if not values or (full and len(values) < self.window):
            return None
        return sum(values) / len(values)

    def _cut_costs(self) -> bool:
        gap = self._mean("truncated_reward_gap", full=False)
        reward = self._mean("reward_mean", full=False)
        return (gap is not None and gap > 0) or (reward is not None and reward <= 0)
