"""`asyncrl audit DIR`: checks I1 (schedule) and I3 (exactly once) from the run's own records.

- I1: the record that counts for step t (its last) trained exactly ordinals [t*N, (t+1)*N).
- I3: every ordinal below the final frontier was trained by exactly one step; after a resume,
  the only ordinals below the checkpoint's cursor that are generated again are the ones it
  re-dispatched (in flight at the checkpoint), so no buffered group is regenerated; and a
  re-dispatched ordinal whose partial samples the resume continued generates no token a
  sample already had, and nothing for a sample that had finished.
- I9 (multi-turn runs, from `RUN_DIR/env_steps.jsonl`: every environment step asked for, with
  its attempt): no step a checkpoint recorded (its `checkpoint` event's `recorded_steps`) is
  asked for again by the attempt that resumed from it unless that resume declared it
  (`tool_calls_repeated`, as `restart_episode` does); each episode's steps are its turns 0,
  1, 2, ... without a gap, each below `env.max_turns`; a resume that declared repeats
  (`tool_calls_repeated`, as `restart_episode` does) asked again for no more steps than it
  declared; past the checkpoint, a resumed attempt asked again for no step whose result an
  earlier attempt had logged (the steps log answers those; a request the kill left without a
  result may be asked again); an attempt whose episodes do not start over
  (`episodes_start_over: false` in its resume event) asked no step under a new restart count
  of an episode whose results an earlier attempt had logged; one step id was asked with one
  text (`text_sha256`); and in the environments' own journals (`RUN_DIR/env/*.jsonl`, a JSON
  object with a `step_id` a line, as the built-in calculator keeps: its result rows count as
  executions, its intent rows do not) no step was executed twice, nor for a text other than
  the log's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.cli.audit_agents import audit_agent_log
from asyncrl.core.episodes import parse_step_id
from asyncrl.train.records import iter_jsonl, span_token_starts
from asyncrl.train.rundir import read_run_id, records_version


@dataclass
class AuditReport:
    num_steps: int
    num_ordinals: int
    num_resumes: int
    violations: list[str] = field(default_factory=list)
    num_env_steps: int | None = None
    """Environment steps the run's journals hold (None: no journal)."""
    num_agent_calls: int | None = None
    """Model calls the agent log holds (None: no agent log)."""
    step_texts: dict[str, str] = field(default_factory=dict)
    """Step id -> the hash of the text the steps log asked it with."""

    @property
    def ok(self) -> bool:
        return not self.violations


def _ranges(ordinals: list[int]) -> str:
    """Compact `3-5, 9` form of a sorted list."""
    parts, start = [], None
    for i, k in enumerate(ordinals):
        if start is None:
            start = k
        if i + 1 == len(ordinals) or ordinals[i + 1] != k + 1:
            parts.append(f"{start}" if start == k else f"{start}-{k}")
            start = None
    return ", ".join(parts)


def audit_records(
    metrics: Iterable[dict[str, Any]],
    events: Iterable[dict[str, Any]],
    timeline: Iterable[dict[str, Any]],
    num_prompts_per_step: int,
) -> AuditReport:
    """The audit of a run's records, each iterable read once, events first (only the resumes
    are kept), in memory that grows with the number of steps by a byte each (and with the
    violations), not with the records: a step that trained its scheduled ordinals is one
    byte, and every ordinal is then trained exactly once by construction."""
    n = num_prompts_per_step
    resumes = [e for e in events if e.get("event") == "resume"]
    status = bytearray()  # per step, its last record: ABSENT, ON_SCHEDULE or OFF_SCHEDULE
    off: dict[int, list[int]] = {}  # the ordinals of the steps OFF_SCHEDULE
    for record in metrics:
        t, got = record["step"], record["prompt_ordinals"]
        if t >= len(status):
            status.extend(bytes(t + 1 - len(status)))
        if got == list(range(t * n, (t + 1) * n)):
            status[t] = ON_SCHEDULE
            off.pop(t, None)
        else:
            status[t], off[t] = OFF_SCHEDULE, got
    last_step = len(status) - 1
    report = AuditReport(len(status) - status.count(ABSENT), (last_step + 1) * n, len(resumes))
    missing_steps = [t for t, state in enumerate(status) if state == ABSENT]
    if missing_steps:
        report.violations.append(f"I1: steps never trained: {_ranges(missing_steps)}")
    trained_by: dict[int, list[int]] = {}  # only ordinals an OFF_SCHEDULE step trained
    for t, got in sorted(off.items()):
        for k in got:
            trained_by.setdefault(k, []).append(t)
    for k, steps in trained_by.items():  # the step whose schedule holds k trained it too
        owner = k // n
        if 0 <= owner < len(status) and status[owner] == ON_SCHEDULE:
            steps.append(owner)
            steps.sort()
    skipped = sorted(
        k
        for t, state in enumerate(status)
        if state != ON_SCHEDULE
        for k in range(t * n, (t + 1) * n)
        if k not in trained_by
    )
    if skipped:
        report.violations.append(
            f"I3: {len(skipped)} ordinals below the frontier never trained: {_ranges(skipped)}"
        )
    for k, steps in sorted(trained_by.items()):
        if len(steps) > 1:
            report.violations.append(f"I3: ordinal {k} trained by steps {steps}")
    report.violations.extend(_resume_violations(resumes, timeline))
    report.violations.extend(  # last: the per-step detail of the above
        f"I1: step {t} trained ordinals [{_ranges(sorted(got))}], "
        f"schedule says [{_ranges(list(range(t * n, (t + 1) * n)))}]"
        for t, got in sorted(off.items())
    )
    return report


ABSENT, ON_SCHEDULE, OFF_SCHEDULE = 0, 1, 2


def _resume_violations(
    resumes: list[dict[str, Any]], timeline: Iterable[dict[str, Any]]
) -> list[str]:
    """In the attempt a resume started, an ordinal below the checkpoint's cursor may only be
    generated if the resume re-dispatched it (it was in flight at the checkpoint), and then
    no token of it that a continued partial sample already had. One pass over the timeline."""
    by_attempt: dict[int, list[int]] = {}  # two resumes may share an attempt (a kill between)
    for i, e in enumerate(resumes):
        by_attempt.setdefault(e["attempt"], []).append(i)
    allowed = [set(e["reissued_ordinals"]) for e in resumes]
    again: list[set[int]] = [set() for _ in resumes]
    partials: list[list[str]] = [[] for _ in resumes]
    for span in timeline:
        if span.get("kind") != "generate":
            continue
        for i in by_attempt.get(span.get("attempt", -1), ()):
            cursor = resumes[i]["cursor"]
            again[i].update(k for k in span["ordinals"] if k < cursor and k not in allowed[i])
            partials[i].extend(_partials_regenerated(resumes[i], span))
    found = []
    for resume, ordinals, regenerated in zip(resumes, again, partials, strict=True):
        if ordinals:
            what = "kept buffered groups" if ordinals <= set(resume["kept_groups"]) else "ordinals"
            found.append(
                f"I3: attempt {resume['attempt']} generated {what} from step "
                f"{resume['from_step']}'s checkpoint again: {_ranges(sorted(ordinals))}"
            )
        found.extend(regenerated)
    return found


def _partials_regenerated(resume: dict[str, Any], span: dict[str, Any]) -> list[str]:
    """Tokens of the partial samples a resume continued that a span of its attempt generated
    again."""
    saved_partials = resume.get("continued_partials", {})
    found = []
    for k, starts, counts in zip(
        span["ordinals"], span_token_starts(span), span.get("token_counts", []), strict=False
    ):
        saved = saved_partials.get(str(k))
        if saved is None:
            continue
        for i, (start, count) in enumerate(zip(starts, counts, strict=True)):
            if count and saved["finished"][i]:
                found.append(
                    f"I3: attempt {resume['attempt']} generated {count} tokens for sample {i} "
                    f"of ordinal {k}, finished in step {resume['from_step']}'s checkpoint"
                )
            elif count and start < saved["lengths"][i]:
                found.append(
                    f"I3: attempt {resume['attempt']} generated tokens {start}-"
                    f"{min(start + count, saved['lengths'][i]) - 1} of sample {i} of ordinal "
                    f"{k} again (step {resume['from_step']}'s checkpoint had "
                    f"{saved['lengths'][i]})"
                )
    return found


def audit_run_dir(run_dir: Path) -> AuditReport:
    """I1 and I3 from the run's records. A damaged record (an undecodable line other than a
    torn last one) is a violation naming its file and line: the check it carried (a resume's
    kept groups, a step's ordinals) cannot be made, so the audit cannot pass."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    strict = records_version(run_dir) is not None  # only a last line may be torn
    problems: dict[str, list[str]] = {name: [] for name in FILES}
    metrics, events, timeline = (
        iter_jsonl(run_dir / f"{name}.jsonl", problems[name], strict) for name in FILES
    )
    report = audit_records(
        metrics, events, timeline, int(config["rollout"]["num_prompts_per_step"])
    )
    report.violations[:0] = [f"damaged record: {p}" for name in FILES for p in problems[name]]
    _audit_steps(run_dir, report, int((config.get("env") or {}).get("max_turns", 0)), strict)
    _audit_journals(run_dir / "env", report, read_run_id(run_dir))
    agent_events = list(iter_jsonl(run_dir / "events.jsonl", [], strict))
    report.num_agent_calls = audit_agent_log(run_dir, report.violations, strict, agent_events)
    return report


def _audit_steps(
    run_dir: Path, report: AuditReport, max_turns: int = 0, strict: bool = False
) -> None:
    """I9 from the steps log and the resume events (see the module docstring); with
    `max_turns` > 0 (`env.max_turns`), no episode stepped at a turn past it."""
    path = run_dir / "env_steps.jsonl"
    if not path.exists():
        return
    problems: list[str] = []
    records = list(iter_jsonl(path, problems, strict))
    requests = [r for r in records if r.get("kind", "request") == "request"]
    asked = [(str(r["step_id"]), int(r["attempt"])) for r in requests]
    answered: dict[str, int] = {}  # step id -> the first attempt that logged its result
    for r in records:
        if r.get("kind") == "result":
            answered.setdefault(str(r["step_id"]), int(r["attempt"]))
    report.violations += [f"damaged record: {p}" for p in problems]
    report.num_env_steps = len({s for s, _ in asked})
    texts: dict[str, str] = {}  # step id -> the hash of the text it was first asked with
    for r in requests:
        if (
            "text_sha256" in r
            and texts.setdefault(str(r["step_id"]), r["text_sha256"]) != r["text_sha256"]
        ):
            report.violations.append(
                f"I9: step {r['step_id']} asked with two different texts (attempt "
                f"{r['attempt']}): one id must be one request"
            )
    report.step_texts = texts
    first_attempt: dict[str, int] = {}
    for sid, attempt in asked:
        first_attempt.setdefault(sid, attempt)
    saved: dict[int, list[str]] = {}  # checkpoint step -> the steps its cut held, as written
    for event in iter_jsonl(run_dir / "events.jsonl"):
        if event.get("event") == "checkpoint" and "recorded_steps" in event:
            saved[int(event["step"])] = event["recorded_steps"]
        if event.get("event") != "resume":
            continue
        # what the cut held as its writer recorded it (a resume's own account may have lost
        # what its restore lost), else as the resume read it
        recorded = set(saved.get(int(event["from_step"]), event.get("recorded_steps", [])))
        for later in [k for k in saved if k > int(event["from_step"])]:
            del saved[later]  # never durable (else the resume would be from it): rewritten
        # the resumed attempt (a later one resumes from a later cut, checked by its own event;
        # a finished group generated again would break I3)
        again = sorted({s for s, a in asked if a == event["attempt"] and s in recorded})
        declared = int(event.get("tool_calls_repeated") or 0)
        if len(again) > declared:  # a restart's declared repeats excuse that many, no more
            report.violations.append(
                f"I9: attempt {event['attempt']} asked again for {len(again)} "
                f"environment steps step {event['from_step']}'s checkpoint had recorded "
                f"(the resume declared {declared or 'none'}): {', '.join(again[:10])}"
            )
        # past the cut, a step whose result an earlier attempt logged is answered from the
        # log, never asked again; only those the kill left without a result may be (a pass's
        # requests are written ahead together, so several may be; at most the one inside the
        # environment at the kill had been asked)
        attempt = int(event["attempt"])
        redone = sorted(
            {
                s
                for s, a in asked
                if a == attempt and s not in recorded and first_attempt[s] < a
                and answered.get(s, attempt) < attempt
            }
        )  # fmt: skip
        if redone:
            report.violations.append(
                f"I9: attempt {attempt} asked again for {len(redone)} environment steps whose "
                f"results an earlier attempt had logged after the checkpoint (the steps log "
                f"answers those): {', '.join(redone[:10])}"
            )
    report.violations += _new_ids(asked, answered, run_dir)
    turns: dict[str, set[int]] = {}
    for step_id, _ in asked:
        ordinal, sample, turn, restarts = parse_step_id(step_id)
        turns.setdefault(f"{ordinal}:{sample}" + (f":{restarts}" if restarts else ""), set()).add(
            turn
        )
    gaps = sorted(k for k, t in turns.items() if t != set(range(max(t) + 1)))
    if gaps:
        report.violations.append(f"I9: episodes whose steps skip a turn: {', '.join(gaps[:10])}")
    past = sorted(k for k, t in turns.items() if max_turns and max(t) >= max_turns)
    if past:
        report.violations.append(
            f"I9: episodes stepped past env.max_turns={max_turns} (turns are counted from 0): "
            f"{', '.join(past[:10])}"
        )


def _new_ids(asked: list[tuple[str, int]], answered: dict[str, int], run_dir: Path) -> list[str]:
    """I9's ids: an attempt whose resume event says its episodes do not start over
    (`episodes_start_over: false`) asks every step under the id the steps log knows it by.
    An episode it opened under a new restart count while an earlier attempt had logged a
    result of that episode under a lower one executed those steps again under new ids, which
    no journal keyed by id can tell."""
    keeps = {
        int(e["attempt"])
        for e in iter_jsonl(run_dir / "events.jsonl")
        if e.get("event") == "resume" and e.get("episodes_start_over") is False
    }
    found: list[str] = []
    for attempt in sorted(keeps):
        before = {parse_step_id(s) for s, a in asked if a < attempt}
        opened = {(o, i, r) for o, i, _, r in before}
        done = [parse_step_id(s) for s, a in answered.items() if a < attempt]
        again = sorted(
            s
            for s, a in asked
            if a == attempt
            and (step := parse_step_id(s))[3] > 0
            and step[:2] + step[3:] not in opened
            and any((o, i) == step[:2] and r < step[3] for o, i, _, r in done)
        )
        if again:
            found.append(
                f"I9: attempt {attempt} asked {len(again)} environment steps under new ids "
                f"(a restart count) though its episodes do not start over, while earlier "
                f"attempts had logged their episodes' results: {', '.join(again[:10])}"
            )
    return found


def _audit_journals(folder: Path, report: AuditReport, run_id: str = "") -> None:
    """I9 from the environments' journals: no step id executed twice (a result row is an
    execution; an intent row, written before the tool acts, is not); rows another run wrote
    (their `run_id`) are not this run's."""
    journals = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if not journals:
        return
    journaled = 0
    for path in journals:
        problems: list[str] = []
        seen: dict[str, int] = {}
        begun: dict[str, int] = {}  # step id -> intent rows (calls begun)
        for row in iter_jsonl(path, problems):
            if isinstance(row, dict) and "step_id" in row:
                sid = str(row["step_id"])
                if run_id and row.get("run_id") not in (None, "", run_id):
                    continue  # another run's step, in a journal the runs share
                if row.get("intent"):  # an intent is not an execution: its result is
                    begun[sid] = begun.get(sid, 0) + 1
                else:
                    seen[sid] = seen.get(sid, 0) + 1
                asked = report.step_texts.get(sid)
                if row.get("text_sha256") and asked and row["text_sha256"] != asked:
                    report.violations.append(
                        f"I9: {path.parent.name}/{path.name} executed step {sid} for a text "
                        f"(hash {row['text_sha256']}) other than the one the steps log asked "
                        f"it with ({asked})"
                    )
        report.violations += [f"damaged record: {p}" for p in problems]
        journaled += len(seen)
        again = sorted(s for s, n in begun.items() if n > 1)
        if len(again) > report.num_resumes:  # a kill inside a call may leave one begun twice
            report.violations.append(
                f"I9: {len(again)} tool calls begun more than once ({path.parent.name}/"
                f"{path.name}) over {report.num_resumes} resumes (a kill inside a call, at "
                f"most one a resume, may): {', '.join(again[:10])}"
            )
        twice = sorted(s for s, n in seen.items() if n > 1)
        if twice:
            report.violations.append(
                f"I9: environment steps executed more than once ({path.parent.name}/"
                f"{path.name}): {', '.join(twice[:10])}"
            )
    report.num_env_steps = report.num_env_steps or journaled


FILES = ("metrics", "events", "timeline")
"""The records `audit` reads, as `NAME.jsonl`, in the order `audit_records` takes them."""


def format_report(report: AuditReport, run_dir: Path, limit: int = 20) -> str:
    head = (
        f"audit {run_dir}: {report.num_steps} steps, ordinals 0-{report.num_ordinals - 1}, "
        f"{report.num_resumes} resumes"
    )
    if report.ok:
        steps, calls = report.num_env_steps, report.num_agent_calls
        return (
            f"{head}: I1 ok, I3 ok"
            + (f", I9 ok ({steps} environment steps)" if steps else "")
            + (f", I11 ok ({calls} agent calls)" if calls else "")
        )
    lines = [f"{head}: {len(report.violations)} violations"]
    lines += [f"  {v}" for v in report.violations[:limit]]
    if len(report.violations) > limit:
        lines.append(f"  ... and {len(report.violations) - limit} more")
    return "\n".join(lines)
