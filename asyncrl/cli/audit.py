"""`asyncrl audit DIR`: checks I1 (schedule) and I3 (exactly once) from the run's own records.

- I1: the record that counts for step t (its last) trained exactly ordinals [t*N, (t+1)*N).
- I3: every ordinal below the final frontier was trained by exactly one step; after a resume,
  the only ordinals below the checkpoint's cursor that are generated again are the ones it
  re-dispatched (in flight at the checkpoint), so no buffered group is regenerated; and a
  re-dispatched ordinal whose partial samples the resume continued generates no token a
  sample already had, and nothing for a sample that had finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.train.records import latest_records, read_jsonl_checked


@dataclass
class AuditReport:
    num_steps: int
    num_ordinals: int
    num_resumes: int
    violations: list[str] = field(default_factory=list)

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
    metrics: list[dict[str, Any]],
    events: list[dict[str, Any]],
    timeline: list[dict[str, Any]],
    num_prompts_per_step: int,
) -> AuditReport:
    n = num_prompts_per_step
    final = latest_records(metrics)
    last_step = final[-1]["step"] if final else -1
    resumes = [e for e in events if e.get("event") == "resume"]
    report = AuditReport(len(final), (last_step + 1) * n, len(resumes))
    present = {r["step"] for r in final}
    missing_steps = [t for t in range(last_step + 1) if t not in present]
    if missing_steps:
        report.violations.append(f"I1: steps never trained: {_ranges(missing_steps)}")
    trained_by: dict[int, list[int]] = {}
    schedule_violations = []
    for record in final:
        t, got = record["step"], record["prompt_ordinals"]
        expected = list(range(t * n, (t + 1) * n))
        if got != expected:
            schedule_violations.append(
                f"I1: step {t} trained ordinals [{_ranges(sorted(got))}], "
                f"schedule says [{_ranges(expected)}]"
            )
        for k in got:
            trained_by.setdefault(k, []).append(t)
    skipped = sorted(set(range(report.num_ordinals)) - set(trained_by))
    if skipped:
        report.violations.append(
            f"I3: {len(skipped)} ordinals below the frontier never trained: {_ranges(skipped)}"
        )
    for k, steps in sorted(trained_by.items()):
        if len(steps) > 1:
            report.violations.append(f"I3: ordinal {k} trained by steps {steps}")
    for resume in resumes:
        # In the attempt a resume started, an ordinal below the checkpoint's cursor may only be
        # generated if the resume re-dispatched it (it was in flight at the checkpoint).
        attempt, cursor = resume["attempt"], resume["cursor"]
        allowed = set(resume["reissued_ordinals"])
        kept = set(resume["kept_groups"])
        again = sorted(
            {
                k
                for span in timeline
                if span.get("kind") == "generate" and span["attempt"] == attempt
                for k in span["ordinals"]
                if k < cursor and k not in allowed
            }
        )
        if again:
            what = "kept buffered groups" if set(again) <= kept else "ordinals"
            report.violations.append(
                f"I3: attempt {attempt} generated {what} from step {resume['from_step']}'s "
                f"checkpoint again: {_ranges(again)}"
            )
        report.violations.extend(_partials_regenerated(resume, timeline))
    report.violations.extend(schedule_violations)  # last: the per-step detail of the above
    return report


def _partials_regenerated(resume: dict[str, Any], timeline: list[dict[str, Any]]) -> list[str]:
    """Tokens of the partial samples a resume continued that its attempt generated again."""
    partials = resume.get("continued_partials", {})
    found = []
    for span in timeline:
        if span.get("kind") != "generate" or span["attempt"] != resume["attempt"]:
            continue
        for k, starts, counts in zip(
            span["ordinals"],
            span.get("token_starts", []),
            span.get("token_counts", []),
            strict=False,
        ):
            saved = partials.get(str(k))
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
    read = {name: read_jsonl_checked(run_dir / f"{name}.jsonl") for name in FILES}
    report = audit_records(
        read["metrics"][0],
        read["events"][0],
        read["timeline"][0],
        int(config["rollout"]["num_prompts_per_step"]),
    )
    report.violations[:0] = [f"damaged record: {p}" for name in FILES for p in read[name][1]]
    return report


FILES = ("metrics", "events", "timeline")
"""The records `audit` reads, as `NAME.jsonl`."""


def format_report(report: AuditReport, run_dir: Path, limit: int = 20) -> str:
    head = (
        f"audit {run_dir}: {report.num_steps} steps, ordinals 0-{report.num_ordinals - 1}, "
        f"{report.num_resumes} resumes"
    )
    if report.ok:
        return f"{head}: I1 ok, I3 ok"
    lines = [f"{head}: {len(report.violations)} violations"]
    lines += [f"  {v}" for v in report.violations[:limit]]
    if len(report.violations) > limit:
        lines.append(f"  ... and {len(report.violations) - limit} more")
    return "\n".join(lines)
