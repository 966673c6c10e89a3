"""Preemption notices with deadlines, end to end (issue 43): real `asyncrl train` processes get
SIGTERM or SIGUSR1 at a state placed by a fault point (`ASYNCRL_FAULT_SIGNAL`), stop at their
earliest consistent point with a verified checkpoint (exit 75), say at the notice whether it
fits before the deadline, and resume bit for bit the run without the notice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import launcher
import pytest
from helpers import read_records
from test_determinism import DETERMINISTIC, STEPS, fingerprint

from asyncrl.checkpoint.run_checkpoints import run_store
from asyncrl.cli.audit import audit_run_dir
from asyncrl.cli.inspect import inspect_run_dir, preemption_line

pytestmark = pytest.mark.slow

MICRO = ["train.micro_batch_size=4"]
"""16 rows a step in 4 micro-batches: a notice can come between two of them."""


def launch(
    run: Path, repo_root: Path, fault: str = "", sig: str = "", extra=(), **env_vars: str
) -> tuple:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "ASYNCRL_FAULT": fault,
           "ASYNCRL_FAULT_SIGNAL": sig, **env_vars}  # fmt: skip
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml")]
    proc = launcher.popen(
        [*command, "--run-dir", str(run), *DETERMINISTIC, *MICRO, *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=480)
    return proc.returncode, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    run = tmp_path_factory.mktemp("reference") / "run"
    code, out = launch(run, Path(request.config.rootpath))
    assert code == 0, out[-3000:]
    steps, weights = fingerprint(run)
    assert len(steps) == STEPS
    return steps, weights


def events_of(run: Path, name: str) -> list[dict]:
    return [e for e in read_records(run / "events.jsonl") if e["event"] == name]


@pytest.mark.parametrize(
    ("fault", "stopped_at", "given_up"),
    [
        # between step 7's micro-batches: the step has changed no weight, so it is given up and
        # the checkpoint is of step 7, the state before it
        ("train.backward[step=7]:2", 7, True),
        # the control: right after step 7's optimizer update the step is finished, so the
        # checkpoint is of step 8 (the next boundary, as before issue 43)
        ("train.optimizer_step[step=7]", 8, False),
    ],
    ids=["mid-step", "after-update"],
)
def test_sigterm_stops_at_the_earliest_consistent_point_and_resumes_bitwise(
    tmp_path, repo_root, reference, fault, stopped_at, given_up
):
    run = tmp_path / "run"
    code, out = launch(run, repo_root, fault, "SIGTERM", ["checkpoint.grace_s=30"])
    assert code == 75, out[-3000:]
    (notice,) = events_of(run, "preemption_notice")
    assert (notice["source"], notice["deadline_s"], notice["step"]) == ("SIGTERM", 30.0, stopped_at)
    assert notice["node"] and notice["deadline"] == pytest.approx(notice["time"] + notice["left_s"])
    assert notice["checkpoint_estimate_s"] > 0  # step 3's at least: step 6's waited for it
    (result,) = events_of(run, "preemption_result")
    assert (result["step"], result["abandoned_step"]) == (stopped_at, given_up)
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == stopped_at  # verified
    assert f"checkpoint of step {stopped_at} verified" in out
    assert ("given up" in out) == given_up
    line = preemption_line(inspect_run_dir(run)["last_preemption"])
    assert line.startswith(f"last preemption: SIGTERM at step {stopped_at} (deadline 30 s)")
    agrees_with_itself(notice, result, out, line)
    code, out = launch(run, repo_root)
    assert code == 0, out[-3000:]
    assert fingerprint(run) == reference
    assert audit_run_dir(run).ok, audit_run_dir(run).violations


def agrees_with_itself(notice: dict, result: dict, out: str, line: str) -> None:
    """What the run said at the notice and after follows from the times it measured (the
    verdicts themselves are times, so a test checks their account, not the clock)."""
    if notice["checkpoint_estimate_s"] is None:  # the notice came before a checkpoint was timed
        assert notice["fits"] is None and "no checkpoint of this run measured yet" in out
        assert "it fits" not in out and "does NOT fit" not in out
    else:
        assert notice["fits"] == (notice["checkpoint_estimate_s"] <= notice["left_s"])
        assert ("it fits" in out) == notice["fits"] != ("does NOT fit" in out)
    assert result["met"] == (result["notice_to_durable_s"] <= result["deadline_s"])
    assert ("(met" in line) == result["met"] and ("AFTER the deadline" in out) != result["met"]


def test_a_deadline_the_checkpoint_cannot_meet_is_said_at_the_notice(tmp_path, repo_root):
    """`checkpoint.grace_s=0`: no checkpoint fits (nor is met) whatever the machine's speed.
    The run says so at the notice, still writes and verifies its checkpoint (never a torn one),
    and records that the deadline was missed; the resume is exact."""
    run = tmp_path / "run"
    code, out = launch(run, repo_root, "train.backward[step=7]:2", "SIGTERM",
                       ["checkpoint.grace_s=0"])  # fmt: skip
    assert code == 75, out[-3000:]
    # the newest verified checkpoint stands: step 6's, or step 3's while 6's is being written
    assert "does NOT fit" in out and re.search(r"\(step [36]'s\) stands", out)
    (notice,) = events_of(run, "preemption_notice")
    assert notice["fits"] is False
    (result,) = events_of(run, "preemption_result")
    assert result["met"] is False and "AFTER the deadline" in out
    assert "(MISSED" in preemption_line(inspect_run_dir(run)["last_preemption"])
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == 7
    code, out = launch(run, repo_root)
    assert code == 0, out[-3000:]
    assert audit_run_dir(run).ok


def spans_of(run: Path, attempt: int, ordinals: set[int]) -> dict[int, int]:
    """Tokens each of `ordinals` was generated in `attempt` (its generation spans)."""
    tokens: dict[int, int] = {}
    for span in read_records(run / "timeline.jsonl"):
        if span.get("kind") != "generate" or span.get("attempt") != attempt:
            continue
        for k, counts in zip(span["ordinals"], span["token_counts"], strict=True):
            if k in ordinals:
                tokens[k] = tokens.get(k, 0) + sum(counts)
    return tokens


@pytest.mark.parametrize("kept_put_back", [True, False], ids=["kept", "control"])
def test_killed_at_the_deadline_the_rollouts_of_the_checkpoints_weights_are_kept(
    tmp_path, repo_root, reference, kept_put_back
):
    """`checkpoint.grace_s=0`: the notice's checkpoint cannot fit, so the run first writes,
    beside the newest verified checkpoint S, the rollouts weights S (or older) sampled since;
    then the kill at the deadline comes while step 7's checkpoint is being written (placed
    by state: `ASYNCRL_FAULT_THEN`). The resume from S puts them back: none of their tokens
    is generated again, and the run is bit for bit the uninterrupted one. The control resumes
    with them ignored (`ASYNCRL_TEST_SKIP_RESTORE=kept`): as exact (deterministic mode
    generates the same tokens again), but it pays for every one of them a second time."""
    run = tmp_path / "run"
    code, out = launch(run, repo_root, "train.backward[step=7]:2", "SIGTERM",
                       ["checkpoint.grace_s=0"],
                       ASYNCRL_FAULT_THEN="checkpoint.file_written[step=7]")  # fmt: skip
    assert code == -9, out[-3000:]
    # 6's write may be in progress at the notice: kept beside 3, then again beside 6 once
    # verified (its retain deletes the file beside 3)
    *_, kept = events_of(run, "rollouts_kept")
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == kept["step"] in (3, 6)
    assert kept["cut_step"] == 7 and kept["tokens"] > 0
    assert [p.name for p in (run / "checkpoints").glob("kept_*")] == [kept["path"].split("/")[-1]]
    assert "does NOT fit" in out and f"kept beside step {kept['step']}'s checkpoint" in out
    assert not events_of(run, "preemption_result")  # the kill came first
    info = inspect_run_dir(run)
    assert info["kept_rollouts"]["ordinals"] == kept["ordinals"]
    assert preemption_line(info["last_preemption"]).endswith(
        f"beside step {kept['step']}'s checkpoint"
    )
    ordinals = set(kept["ordinals"])
    before = spans_of(run, 0, ordinals)
    assert set(before) == ordinals  # each was generated before the kill
    skip = {} if kept_put_back else {"ASYNCRL_TEST_SKIP_RESTORE": "kept"}
    code, out = launch(run, repo_root, **skip)
    assert code == 0, out[-3000:]
    assert fingerprint(run) == reference
    report = audit_run_dir(run)
    assert report.ok, report.violations
    (resume,) = events_of(run, "resume")
    again = spans_of(run, 1, ordinals)
    if kept_put_back:
        assert resume["kept_rollouts"]["ordinals"] == kept["ordinals"]
        assert resume["kept_rollouts"]["tokens"] == kept["tokens"]
        finished = {k for k, p in resume["continued_partials"].items() if all(p["finished"])}
        assert not {str(k) for k in again} & finished  # no finished kept group generated again
        assert sum(again.values()) < sum(before.values())
    else:
        assert "kept_rollouts" not in resume
        assert again == before  # all of it paid for again, token for token
    assert not list((run / "checkpoints").glob("kept_*"))  # stale once a newer one verified


def test_slurms_sigusr1_is_a_notice_with_its_own_deadline(tmp_path, repo_root):
    run = tmp_path / "run"
    code, out = launch(run, repo_root, "train.backward[step=4]", "SIGUSR1",
                       ["checkpoint.signal_warning_s=45"])  # fmt: skip
    assert code == 75, out[-3000:]
    (notice,) = events_of(run, "preemption_notice")
    assert (notice["source"], notice["deadline_s"]) == ("SIGUSR1", 45.0)
    (result,) = events_of(run, "preemption_result")
    assert result["abandoned_step"] is True
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == 4
    agrees_with_itself(
        notice, result, out, preemption_line(inspect_run_dir(run)["last_preemption"])
    )
