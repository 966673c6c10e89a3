"""Partial generations under SIGKILL: long completions generated in chunks, the trainer killed
mid-chunk several times — each kill a few decode steps after a checkpoint holding partial
samples became durable, so every kill has partial work to keep on any machine — and resumed
to the end. The oracle is the checkpoint itself, read
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

from asyncrl.cli.audit import audit_run_dir
from asyncrl.cli.inspect import inspect_run_dir
from asyncrl.train.records import span_token_starts

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
            span["ordinals"], span_token_starts(span), span["token_counts"], strict=True
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


PARTIALS = "checkpoint.parent_fsynced[partial_tokens]"
"""The state these kills need: a durable checkpoint whose cut holds partial samples."""
MIXED = "checkpoint.parent_fsynced[partial_tokens,finished_in_flight]"
"""... and finished samples of groups still in flight (kept, never generated again)."""


def kill_in(run: Path, extra: list[str], state: str, decode_steps: int, skip: str = "") -> dict:
    """One launch killed mid-chunk, `decode_steps` decode steps after a checkpoint in `state`
    became durable (`asyncrl.faults`); returns what the newest checkpoint then holds (an
    `inspect` of it), checked to be in that state."""
    code = train(run, *extra, fault=f"{state}>engine.decode_step:{decode_steps}", skip=skip)
    assert code == -9, f"never killed (exit {code}): no checkpoint of this launch was in {state}"
    info = inspect_run_dir(run)
    assert info["checkpoint"] is not None and sum(info["partial_tokens"].values()) > 0, (
        f"the newest checkpoint is not the one in {state}: {info['checkpoint']}"
    )
    return info


def crash_and_finish(run: Path, extra: list[str], states: tuple[str, ...], skip: str = "") -> list:
    """Kills the run mid-chunk once per state in `states` (a few decode steps after a
    checkpoint in that state became durable), resuming each time, then runs it to the end;
    returns, per resumed attempt, what its checkpoint held."""
    resumed = []
    for attempt, state in enumerate(states):
        resumed.append((attempt + 1, kill_in(run, extra, state, 1 + 3 * attempt, skip)))
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
    resumed = crash_and_finish(run, long_shape, (MIXED, PARTIALS, PARTIALS))
    # the first kill's checkpoint held both kinds of partial work to keep: unfinished samples
    # with tokens, and finished samples of groups still in flight (the fault spec's state,
    # read back off the checkpoint files)
    samples = resumed[0][1]["partial_samples"].values()
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
    resumed = crash_and_finish(run, long_shape, (PARTIALS,), skip="ledger.partial")
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
    saved = kill_in(run, [*short, *before], PARTIALS, decode_steps=2)
    assert train(run, *short, *after) == 0
    assert regenerated(run, 1, saved) == []
    assert audit_run_dir(run).ok


def test_lora_killed_mid_chunk_continues_its_partials_on_the_versions_it_saved(
    tmp_path, long_shape
):
    # chunked generation keeps A+1 weights versions: the checkpoint's generation part holds
    # the older versions' adapters alone (the base is shared, never saved) and a resume must
    # finish each partial sample on the version it started with
    run, extra = tmp_path / "run", [*long_shape, "model.lora.rank=4", "model.lora.alpha=8"]
    resumed = crash_and_finish(run, extra, (PARTIALS, PARTIALS))
    for attempt, info in resumed:
        assert regenerated(run, attempt, info) == [], f"attempt {attempt}"
    report = audit_run_dir(run)
    assert report.ok, report.violations
    assert report.num_resumes == 2 and report.num_steps == 14
