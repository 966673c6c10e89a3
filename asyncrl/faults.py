"""Fault injection for crash tests: the process SIGKILLs itself at a named point, in a named state.

`ASYNCRL_FAULT` is read once, at import. Unset — the default — every `fault_point` call is one
comparison and nothing else. The points mark where durable or shared state changes (`POINTS`
in the trainer's process, `WORKER_POINTS`, `RANK_POINTS`), and `FACTS` says what each point
knows of the state it is in.

    POINT                         its first pass
    POINT:N                       its N-th pass
    POINT[FACT,FACT=V]:N          its N-th pass among those in that state: `FACT` holds where the
                                  fact is non-zero, `FACT=V` where it equals the integer V
    STAGE>STAGE>...               each stage counts only once the one before it was reached;
                                  the kill is at the last one

A kill is placed by the state a test needs, never by how far a machine of some speed got:
`checkpoint.parent_fsynced[partial_tokens,finished_in_flight]>engine.decode_step` kills at the
first decode step after a checkpoint holding partial samples became durable, on any machine;
`train.weights_published[step=10]` right after step 10's update, whatever step the launch
resumed at. A launch that never reaches the state is not killed, so a test sees that (exit 0,
not -9) and says its precondition was not met.

`ASYNCRL_FAULT_SIGNAL=SIGTERM` sends that signal instead of SIGKILL, once: a preemption
notice placed by state (`train.backward[step=3]:2`: in the middle of step 3's passes).
`ASYNCRL_FAULT_THEN`, a second spec, counts only once the first was reached and SIGKILLs
there: the kill at the deadline after the notice (`checkpoint.file_written[step=3]`: while
the notice's checkpoint is being written).

Facts come from the point's call (`fault_point("train.optimizer_step", step=t)`) and from the
calling thread's `fault_facts(...)` context: the checkpoint writer states the facts of the cut
it writes for every point of that write.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asyncrl.core.episodes import recorded_steps

CUT_FACTS = (
    "step", "in_flight", "buffered", "partial_tokens", "finished_in_flight", "episode_steps",
    "first_turn_tokens",
)  # fmt: skip
"""What a checkpoint write knows of its cut: its step, the ordinals in flight and the groups
buffered in it, the tokens of its partial samples, its finished samples of groups still in
flight, the environment steps its episodes took, and the tokens of episodes in their first
turn (no step asked yet) (`cut_facts`)."""

POINTS = (
    "checkpoint.file_written",  # one checkpoint file written and fsynced (temp dir)
    "checkpoint.manifest_written",  # manifest written, before the rename
    "checkpoint.renamed",  # temp dir renamed to step_NNNNNN, before the parent fsync
    "checkpoint.parent_fsynced",  # the checkpoint is durable
    "checkpoint.retention_deleted",  # one old checkpoint deleted
    "train.backward",  # a micro-batch's backward pass about to run (its step changed nothing)
    "train.optimizer_step",  # step's optimizer update done, weights not yet published
    "train.weights_published",  # step's new version handed to the engine
    "collector.group_buffered",  # one chunk moved groups from in flight to the buffer
    "collector.chunk_done",  # one chunk of a batch appended to its partial generations
    "engine.decode_step",  # an engine is about to sample one more token of a batch
)
"""Points in the trainer's process (one-process runs: tests/test_crash.py kills at each)."""
WORKER_POINTS = (
    "worker.generate",  # a Ray generation worker actor received a batch (kills the actor)
)
"""Points in Ray worker processes. The pass count is per process, so a replaced worker
counts again from zero."""
RANK_POINTS = (
    "rank.step_done",  # a trainer rank > 0 finished its share of a step (train.num_processes)
    "checkpoint.rank_file_written",  # a trainer rank > 0 wrote one of its checkpoint files
)
"""Points in the trainer's other ranks (`train.num_processes` > 1; every such rank counts its
own passes): rank 0 sees the rank die (tests/test_data_parallel_runs.py). Only these count in
a rank > 0, and `POINTS` only in rank 0."""
EPISODE_POINTS = (
    "episode.env_answered",  # an environment answered a turn, its result not yet logged
    "episode.env_step",  # the result logged (env_steps.jsonl), the reply not yet in the sample
)
"""Points of multi-turn runs (`env.name`) in the trainer's process
(tests/test_episode_crash.py)."""
AGENT_POINTS = (
    "agent.call_logged",  # a pass's completions durable in the agent log, not yet answered
    "agent.tool_ran",  # a journaled tool returned, its result not yet in the agent log
    "agent.tool_logged",  # a journaled tool's result durable in the agent log
)
"""Points of agent runs (`agent.name`) in the trainer's process (tests/test_agent_crash.py,
tests/test_verifiers_crash.py)."""
SERVER_POINTS = (
    "server.tokens_received",  # a token of a request's stream arrived from a vLLM server
)
"""Points of `rollout.engine=vllm_server`, in the trainer's process, for
`ASYNCRL_SERVER_FAULT`: where one is reached, the server the stream came from is sent
`ASYNCRL_SERVER_FAULT_SIGNAL` (SIGKILL; SIGSTOP hangs it), not this process
(tests/test_vllm_servers.py)."""
FACTS: dict[str, tuple[str, ...]] = {
    **{point: CUT_FACTS for point in POINTS if point.startswith("checkpoint.")},
    "train.backward": ("step",),
    "train.optimizer_step": ("step",),
    "train.weights_published": ("step",),
    "rank.step_done": ("step",),
    "checkpoint.rank_file_written": ("step",),
    "server.tokens_received": ("server", "version"),
}
"""The facts each point states; a point not named states none."""


@dataclass(frozen=True)
class Stage:
    """One stage of a fault spec: the `count`-th pass of `point` whose facts meet `conditions`
    ((fact, None) holds where the fact is non-zero; (fact, V) where it equals V)."""

    point: str
    conditions: tuple[tuple[str, int | None], ...] = ()
    count: int = 1

    def holds(self, facts: dict[str, int]) -> bool:
        for fact, value in self.conditions:
            have = facts.get(fact)
            if have is None or (not have if value is None else have != value):
                return False
        return True


_STAGE = re.compile(r"(?P<point>[a-z_.]+)(?:\[(?P<when>[^\]]*)\])?(?::(?P<count>\d+))?")


def parse(spec: str, var: str = "ASYNCRL_FAULT") -> tuple[Stage, ...]:
    """The stages of an `ASYNCRL_FAULT` value (see the module docstring); () for none. Raises
    ValueError naming the variable and the unknown point or fact, or the part that does not
    parse."""
    stages = []
    for part in filter(None, (p.strip() for p in spec.split(">"))):
        match = _STAGE.fullmatch(part)
        if match is None:
            raise ValueError(f"{var}: {part!r} is not POINT[FACT,FACT=V]:N")
        point = match["point"]
        points = (
            POINTS + WORKER_POINTS + RANK_POINTS + EPISODE_POINTS + AGENT_POINTS + SERVER_POINTS
        )
        if point not in points:
            known = ", ".join(points)
            raise ValueError(f"{var}: unknown point {point!r}; known: {known}")
        conditions = []
        for condition in filter(None, (c.strip() for c in (match["when"] or "").split(","))):
            fact, eq, value = condition.partition("=")
            if fact not in FACTS.get(point, ()):
                known = ", ".join(FACTS.get(point, ())) or "none"
                raise ValueError(f"{var}: {point} knows no fact {fact!r}; it knows: {known}")
            if eq and not re.fullmatch(r"-?\d+", value):
                raise ValueError(f"{var}: {condition!r}: the value must be an integer")
            conditions.append((fact, int(value) if eq else None))
        count = int(match["count"] or 1)
        if count < 1:
            raise ValueError(f"{var}: {part!r}: the pass count starts at 1")
        stages.append(Stage(point, tuple(conditions), count))
    return tuple(stages)


class Trigger:
    """Walks the stages of a spec as points pass; `passed` says when the last one is reached."""

    def __init__(self, stages: tuple[Stage, ...]) -> None:
        self.stages = stages
        self.index = 0
        self.passes = 0

    def passed(self, name: str, facts: dict[str, int]) -> bool:
        if self.index >= len(self.stages):
            return False
        stage = self.stages[self.index]
        if stage.point != name or not stage.holds(facts):
            return False
        self.passes += 1
        if self.passes < stage.count:
            return False
        self.index, self.passes = self.index + 1, 0
        return self.index == len(self.stages)


def parse_signal(name: str, var: str = "ASYNCRL_FAULT_SIGNAL") -> signal.Signals:
    """The signal a variable names (default SIGKILL); ValueError naming both if unknown."""
    try:
        return signal.Signals[name or "SIGKILL"]
    except KeyError:
        raise ValueError(f"{var}: unknown signal {name!r}, e.g. SIGTERM") from None


_STAGES = parse(os.environ.get("ASYNCRL_FAULT", ""))
_SERVER_STAGES = parse(os.environ.get("ASYNCRL_SERVER_FAULT", ""), "ASYNCRL_SERVER_FAULT")
_SERVER_TRIGGER = Trigger(_SERVER_STAGES) if _SERVER_STAGES else None
_SERVER_SIGNAL = parse_signal(
    os.environ.get("ASYNCRL_SERVER_FAULT_SIGNAL", ""), "ASYNCRL_SERVER_FAULT_SIGNAL"
)
_SIGNAL = parse_signal(os.environ.get("ASYNCRL_FAULT_SIGNAL", ""))
_TRIGGER = Trigger(_STAGES) if _STAGES else None
_THEN = parse(os.environ.get("ASYNCRL_FAULT_THEN", ""))
_THEN_TRIGGER = Trigger(_THEN) if _THEN and _STAGES else None
_OTHER_RANK = int(os.environ.get("RANK", "0") or 0) > 0
"""A trainer rank > 0 (`RANK`, as `train.num_processes` or torchrun sets it): only
`RANK_POINTS` count there. Every rank inherits `ASYNCRL_FAULT`, and ranks > 0 pass some of the
trainer's points too (`train.backward`): a spec placed there is for rank 0 alone."""
_lock = threading.Lock()
_local = threading.local()


@contextlib.contextmanager
def fault_facts(**facts: int) -> Iterator[None]:
    """States `facts` for every fault point this thread passes inside the block."""
    before = getattr(_local, "facts", {})
    _local.facts = {**before, **facts}
    try:
        yield
    finally:
        _local.facts = before


def fault_point(name: str, **facts: int) -> None:
    """Marks a crash point; kills this process with SIGKILL where `ASYNCRL_FAULT` is reached
    (or sends it `ASYNCRL_FAULT_SIGNAL`, once: a preemption notice placed by state)."""
    if _TRIGGER is None or (_OTHER_RANK and name not in RANK_POINTS):
        return
    facts = {**getattr(_local, "facts", {}), **facts}
    with _lock:
        fired = _TRIGGER.index >= len(_TRIGGER.stages)
        reached = _TRIGGER.passed(name, facts)
        then = fired and _THEN_TRIGGER is not None and _THEN_TRIGGER.passed(name, facts)
    if reached:
        os.kill(os.getpid(), _SIGNAL)
    elif then:
        os.kill(os.getpid(), signal.SIGKILL)


def server_fault_point(name: str, send: Callable[[signal.Signals], None], **facts: int) -> None:
    """A point of a vLLM server's work: where `ASYNCRL_SERVER_FAULT` is reached, `send` gets
    `ASYNCRL_SERVER_FAULT_SIGNAL` (it signals that server's processes), once."""
    if _SERVER_TRIGGER is None:
        return
    with _lock:
        reached = _SERVER_TRIGGER.passed(name, facts)
    if reached:
        send(_SERVER_SIGNAL)


def cut_facts(states: dict[str, Any]) -> dict[str, int]:
    """The `CUT_FACTS` (less `step`) of a cut's live part states (`state_dict()` by part name:
    the ledger's and the buffer's are read)."""
    ledger = states["ledger"]
    partials = ledger.get("partial", {}).values()
    return {
        "in_flight": len(ledger["in_flight"]),
        "buffered": len(states["buffer"]["groups"]),
        "partial_tokens": sum(int(p["mask"].sum()) for p in partials),
        "finished_in_flight": sum(int(p["finished"].sum()) for p in partials),
        "episode_steps": len(recorded_steps(ledger)),
        "first_turn_tokens": sum(
            int(n)
            for p in partials
            for n, e in zip(p["mask"].sum(dim=1), p.get("episodes") or (), strict=False)
            if not e["turns"]
        ),
    }
