"""Partial generations under SIGKILL: long completions generated in chunks, the trainer killed
mid-chunk several times and resumed to the end. The oracle is the checkpoint itself, read
before each resume: no token it held is generated again (checked against the timeline's
per-sample token spans), and `asyncrl audit` passes. The negative control resumes without
restoring the partials and must show regenerated tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import read_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from long_generation import shape, write_task
from resume_cost import train

from asyncrl.audit import audit_run_dir
from asyncrl.inspect_run import inspect_run_dir

pytestmark = pytest.mark.slow


def regenerated(run: Path, attempt: int, saved: dict) -> list[str]:
    """Tokens the checkpoint `saved` (an `inspect` of it) held that `attempt` generated again,
    from the timeline: per ordinal and sample, the index of its first new token and count."""
    found = []
    partials, buffered = saved["partial_samples"], set(saved["buffered_ordinals"])
    for span in read_records(run / "timeline.jsonl"):
        if span["kind"] != "generate" or span["attempt"] != attempt:
            continue
        for k, starts, counts in zip(
            span["ordinals"], span["token_starts"], span["token_counts"], strict=True
        ):
            if k in buffered:
                found.append(f"buffered ordinal {k}: {sum(counts)} tokens")
            if str(k) not in partials:
                continue
            had = partials[str(k)]
            for i, (start, count) in enumerate(zip(starts, counts, strict=True)):
                if count and (had["finished"][i] or start < had["lengths"][i]):
                    found.append(f"ordinal {k} sample {i}: tokens from {start} (had {had})")
    return found


def crash_and_finish(run: Path, extra: list[str], points: tuple[int, ...], skip: str = "") -> list:
    """Kills the run mid-chunk once per decode step count in `points`, resuming each time,
    then runs it to the end; returns, per resumed attempt, what its checkpoint held."""
    resumed = []
    for attempt, point in enumerate(points):
        code = train(run, *extra, fault=f"engine.decode_step:{point}", skip=skip)
        assert code == -9, f"attempt {attempt}: the kill at decode step {point} never fired"
        info = inspect_run_dir(run)
        assert info["checkpoint"] is not None, f"attempt {attempt}: killed before a checkpoint"
        resumed.append((attempt + 1, info))
    assert train(run, *extra, skip=skip) == 0
    return resumed


@pytest.fixture()
def long_shape(tmp_path: Path) -> list[str]:
    task = write_task(tmp_path / "long.jsonl")
    return [*shape(task, chunk_tokens=16), "run.max_num_steps=14"]


def test_killed_mid_chunk_three_times_no_checkpointed_token_is_generated_again(
    tmp_path, long_shape
):
    run = tmp_path / "run"
    resumed = crash_and_finish(run, long_shape, (450, 400, 350))
    # the kills landed where there was partial work to keep: unfinished samples with tokens,
    # and finished samples of groups still in flight
    samples = [s for _, info in resumed for s in info["partial_samples"].values()]
    assert sum(sum(s["lengths"]) for s in samples) > 0
    assert any(any(s["finished"]) and not all(s["finished"]) for s in samples)
    for attempt, info in resumed:
        assert regenerated(run, attempt, info) == [], f"attempt {attempt}"
    report = audit_run_dir(run)
    assert report.ok, report.violations
    assert report.num_resumes == 3 and report.num_steps == 14
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    for event, (_, info) in zip(resumes, resumed, strict=True):
        # what the trainer restored is what `inspect` reads off the checkpoint files
        assert event["continued_partials"] == info["partial_samples"]
        assert event["kept_tokens"] == info["resume_cost"]["lossless"]["kept_tokens"]


def test_negative_control_a_resume_that_drops_the_partials_regenerates_saved_tokens(
    tmp_path, long_shape
):
    run = tmp_path / "run"
    resumed = crash_and_finish(run, long_shape, (450,), skip="ledger.partial")
    found = [line for attempt, info in resumed for line in regenerated(run, attempt, info)]
    assert found, "the oracle saw nothing regenerated although no partial was restored"


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([], ["rollout.chunk_tokens=0"]),
        (["rollout.update_weights_mid_generation=true"], []),
    ],
    ids=["chunking-off", "mid-generation-updates-off"],
)
def test_a_checkpoint_with_partials_resumes_with_how_it_generates_changed(
    tmp_path, long_shape, before, after
):
    # both may change on resume; the saved partials may then hold a weights version that is no
    # longer kept: they are finished on the newest, each token keeping its own version
    run, short = tmp_path / "run", [*long_shape, "run.max_num_steps=8"]
    assert train(run, *short, *before, fault="engine.decode_step:450") == -9
    saved = inspect_run_dir(run)
    assert sum(saved["partial_tokens"].values()) > 0
    assert train(run, *short, *after) == 0
    assert regenerated(run, 1, saved) == []
    assert audit_run_dir(run).ok
