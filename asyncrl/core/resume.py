"""Resume policies: what a resume keeps, re-dispatches, skips and discards. Pure planning over
the ledger and buffer contents of one checkpoint; `asyncrl inspect` prints the same plans.

- `lossless`: keep every buffered group; dispatch the in-flight ordinals again, first, to their
  original targets; the stream continues from its true frontier. I1 and I3 hold.
- `keep_incomplete` (NeMo RL main, async GRPO): the stream resumes from its read-ahead place, so
  in-flight ordinals are skipped; short targets are topped up from the next prompts.
- `drop_incomplete` (NeMo RL async PPO): as keep_incomplete, and the buffered groups of every
  short target are deleted too, so those targets are refilled whole from the next prompts.
- `restart_episode` (what peers do with in-flight multi-turn episodes): as lossless, but the
  in-flight ordinals start over: their partial samples — the turns of their episodes, and the
  environment steps those turns made — are generated again.

Under `lossless`, an environment that can only start over (`restore = "restart"`) starts over
just the episodes that took a step and have not ended (`starts_over`): a first turn that asked
no step is continued at its token, and an ended episode is kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

ResumePolicy = Literal["lossless", "keep_incomplete", "drop_incomplete", "restart_episode"]
POLICIES: tuple[ResumePolicy, ...] = (
    "lossless",
    "keep_incomplete",
    "drop_incomplete",
    "restart_episode",
)


class SavedSample(NamedTuple):
    """One partial sample of an in-flight group, as a checkpoint holds it."""

    tokens: int
    turns: int = 0
    """Its episode's turns so far (0 for a single-turn sample)."""
    ended: bool = False
    """Its episode is over (the environment's done, or a limit): no step is left to take."""
    finished: bool = False
    """No token is left to generate in its current turn (single-turn: in the sample)."""


def starts_over(sample: SavedSample, policy: ResumePolicy, episodes_restart: bool) -> bool:
    """Whether a resume throws a partial episode sample away and generates it again from its
    first token. `restart_episode` starts every in-flight sample over. Under `lossless`, an
    environment that can only restart (`episodes_restart`) is re-made from scratch, so an
    episode that took a step must take it again, from its start; one that took none (its
    first turn) continues where it stopped, and an ended one needs its environment no more.
    The episode runner applies this same rule (`EpisodeRunner.resume`)."""
    if policy == "restart_episode":
        return True
    return policy == "lossless" and episodes_restart and sample.turns > 0 and not sample.ended


@dataclass(frozen=True)
class SavedLedger:
    """What a checkpoint says about ordinals: each is (ordinal, target_step)."""

    step: int
    num_prompts_per_step: int
    cursor: int
    in_flight: list[tuple[int, int]]
    buffered: list[tuple[int, int]]
    partial_tokens: dict[int, int] = field(default_factory=dict)
    """In-flight ordinal -> tokens of its partial samples (generated in chunks)."""
    buffered_tokens: dict[int, int] = field(default_factory=dict)
    """Buffered ordinal -> tokens of its finished group."""
    partial_samples: dict[int, list[SavedSample]] = field(default_factory=dict)
    """In-flight ordinal -> each of its partial samples (`partial_tokens`, sample by sample)."""

    @property
    def partial_turns(self) -> dict[int, int]:
        """In-flight ordinal -> the turns its episodes took so far (multi-turn runs)."""
        return {k: sum(s.turns for s in v) for k, v in self.partial_samples.items()}

    def buffered_per_target(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for _, target in self.buffered:
            counts[target] = counts.get(target, 0) + 1
        return dict(sorted(counts.items()))


@dataclass
class ResumePlan:
    policy: ResumePolicy
    kept: list[int] = field(default_factory=list)
    """Buffered ordinals that stay in the buffer."""
    discarded: list[int] = field(default_factory=list)
    """Buffered ordinals deleted: their finished groups are thrown away."""
    redispatched: list[tuple[int, int]] = field(default_factory=list)
    """(ordinal, target) dispatched again, first."""
    continued: list[int] = field(default_factory=list)
    """Re-dispatched ordinals whose saved partial samples are continued, not started over."""
    skipped: list[int] = field(default_factory=list)
    """Ordinals handed out before the checkpoint that no step will ever train."""
    fills: list[int] = field(default_factory=list)
    """Targets of the next fresh ordinals from the cursor (lossy refills), in order."""
    next_target: int = 0
    """After the fills, full steps start at this target."""
    messages: list[str] = field(default_factory=list)
    kept_tokens: int = 0
    """Generated tokens of the checkpoint the resume keeps: its kept groups' and the partial
    samples it continues."""
    regenerated_tokens: int = 0
    """Generated tokens of the checkpoint the resume throws away, to be paid for again:
    discarded groups' and the partial samples of skipped (or re-dispatched but not continued)
    ordinals."""
    turns_kept: int = 0
    """Episodes' completed turns of the checkpoint's partial samples that the resume continues."""
    turns_regenerated: int = 0
    """... that it throws away (started over, or skipped by a lossy policy)."""
    turns_recovered: int = 0
    """Turns past the checkpoint that the steps log held (their steps were asked), put back
    exactly as sampled instead of generated again (`EpisodeRunner.recover`)."""
    tool_calls_repeated: int = 0
    """Environment steps the checkpoint recorded that the resume makes again for the same
    episode (its turns started over: `restart_episode`, or an environment that can only
    restart)."""

    @property
    def num_regenerated(self) -> int:
        """Groups whose generation is paid twice: the re-dispatched ones not continued from
        saved partial samples, or (lossy) the replacements of every skipped prompt and
        discarded group. Fills of slots that had never been dispatched are not counted: that
        work was still to do anyway."""
        started_over = len(self.redispatched) - len(self.continued)
        return started_over + len(self.skipped) + len(self.discarded)


def plan_resume(
    saved: SavedLedger, policy: ResumePolicy, episodes_restart: bool = False
) -> ResumePlan:
    """The plan of `policy` on `saved`; `episodes_restart`: the run's environment can only
    start an episode over (`restore = "restart"`), so no partial episode is continued."""
    plan = _plan(saved, policy)
    tokens = saved.buffered_tokens
    plan.kept_tokens = sum(tokens.get(k, 0) for k in plan.kept)
    plan.regenerated_tokens = sum(tokens.get(k, 0) for k in plan.discarded)
    for k, n in sorted(saved.partial_tokens.items()):
        if policy not in ("lossless", "restart_episode"):  # skipped, turns and all
            plan.regenerated_tokens += n
            plan.turns_regenerated += saved.partial_turns.get(k, 0)
            continue
        kept = 0
        samples = saved.partial_samples.get(k, [SavedSample(n)])
        for sample in samples:
            if starts_over(sample, policy, episodes_restart):
                plan.regenerated_tokens += sample.tokens
                plan.turns_regenerated += sample.turns
                plan.tool_calls_repeated += sample.turns
            else:
                kept += sample.tokens
                plan.turns_kept += sample.turns
        plan.kept_tokens += kept
        if kept > 0:
            plan.continued.append(k)
    return plan


def continued_samples(
    saved: SavedLedger, policy: ResumePolicy, episodes_restart: bool = False
) -> dict[int, tuple[list[int], list[bool]]]:
    """In-flight ordinal -> each sample's tokens a resume keeps and whether it stays finished
    (0 and False: it starts over), for the samples `partial_samples` lists."""
    return {
        k: (
            [0 if starts_over(s, policy, episodes_restart) else s.tokens for s in samples],
            [s.finished and not starts_over(s, policy, episodes_restart) for s in samples],
        )
        for k, samples in saved.partial_samples.items()
    }


def _plan(saved: SavedLedger, policy: ResumePolicy) -> ResumePlan:
    n = saved.num_prompts_per_step
    if policy in ("lossless", "restart_episode"):
        return ResumePlan(
            policy=policy,
            kept=sorted(k for k, _ in saved.buffered),
            redispatched=sorted(saved.in_flight),
        )
    counts = saved.buffered_per_target()
    started = [t for _, t in saved.buffered + saved.in_flight]
    last_target = max(started, default=saved.step - 1)
    short = {t: c for t, c in counts.items() if c < n}
    plan = ResumePlan(policy=policy, skipped=sorted(k for k, _ in saved.in_flight))
    if policy == "drop_incomplete":
        plan.kept = sorted(k for k, t in saved.buffered if t not in short)
        plan.discarded = sorted(k for k, t in saved.buffered if t in short)
        if short:
            listed = ", ".join(f"{t}={c}/{n}" for t, c in short.items())
            plan.messages.append(f"Dropping incomplete restored targets: {listed}")
        counts = {t: c for t, c in counts.items() if t not in short}
    else:
        plan.kept = sorted(k for k, _ in saved.buffered)
        plan.messages.extend(f"Incomplete target {t}: {c}/{n}" for t, c in short.items())
    for target in range(saved.step, last_target + 1):
        plan.fills.extend([target] * (n - counts.get(target, 0)))
    plan.next_target = max(last_target + 1, saved.step)
    return plan
