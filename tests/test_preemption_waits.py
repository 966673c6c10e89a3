"""A notice is heard at every moment, and nothing after its checkpoint waits past the deadline
(issue 63, defects 3-5): real `asyncrl train` processes get their signals at states placed by
fault points or by files the run writes, never by a sleep; verdicts are exit codes, verified
checkpoints and events, never the clock (the timeouts here are only a safety net)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launcher
import pytest
from helpers import read_complete_records, read_records

from asyncrl.checkpoint.run_checkpoints import run_store
from asyncrl.cli.audit import audit_run_dir

pytestmark = pytest.mark.slow

SAFETY_S = 300
"""How long a test waits for a state or an exit before it gives up (a hung run, not a slow one:
each wait here ends in seconds on a 2-core machine)."""
SMALL = [
    "run.max_num_steps=12",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "rollout.groups_per_batch=2",
    "checkpoint.save_period=3",
    "logging.progress=false",
]


def start(run: Path, repo_root: Path, extra=(), **env_vars: str) -> tuple:
    """`asyncrl train configs/demo.yaml` on `run` in the background; its output goes to a file
    (a pipe nobody reads while the test polls could fill and stall it)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(repo_root / "tests"),
           **env_vars}  # fmt: skip
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml")]
    out = run.parent / f"{run.name}.out"
    with open(out, "a") as sink:
        proc = launcher.popen([*command, "--run-dir", str(run), *SMALL, *extra],
                              env=env, stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    return proc, out


def wait_for(proc, what: str, condition) -> None:
    """Polls until `condition()` holds; fails if the run exits first or after `SAFETY_S`."""
    give_up = time.monotonic() + SAFETY_S
    while not condition():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < give_up, f"no {what} after {SAFETY_S} s"
        time.sleep(0.02)


def finish(proc, out: Path) -> tuple[int, str]:
    try:
        proc.wait(timeout=SAFETY_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {SAFETY_S} s later:\n{out.read_text()[-3000:]}")
    return proc.returncode, out.read_text()


def events_of(run: Path, name: str) -> list[dict]:
    return [e for e in read_complete_records(run / "events.jsonl") if e["event"] == name]


def resumes_to_the_end(run: Path, repo_root: Path, extra=(), **env_vars: str) -> None:
    proc, out = start(run, repo_root, extra, **env_vars)
    code, text = finish(proc, out)
    assert code == 0, text[-3000:]
    report = audit_run_dir(run)
    assert report.ok, report.violations


def test_a_notice_during_an_evaluation_gives_it_up_and_the_checkpoint_is_verified(
    tmp_path, repo_root
):
    """Evaluations after steps 3 and 6; SIGTERM at the second decode step after step 5's
    weights are published: inside the last evaluation (the collector has nothing left to
    generate then, so every decode step is the evaluation's). The evaluation is given up,
    said in `preemption_result`, and step 6's checkpoint is verified; exit 75."""
    run = tmp_path / "run"
    proc, out = start(
        run, repo_root,
        ["run.max_num_steps=6", "eval.every_steps=3", "eval.at_start=false",
         "eval.max_examples=64", "eval.batch_prompts=8", "checkpoint.grace_s=30"],
        ASYNCRL_FAULT="train.weights_published[step=5]>engine.decode_step:2",
        ASYNCRL_FAULT_SIGNAL="SIGTERM",
    )  # fmt: skip
    code, text = finish(proc, out)
    assert code == 75, text[-3000:]
    assert [e["version"] for e in events_of(run, "eval")] == [3]  # 6's was given up
    (skipped,) = events_of(run, "eval_skipped")
    assert (skipped["version"], skipped["reason"]) == (6, "given up at a preemption notice")
    (result,) = events_of(run, "preemption_result")
    assert (result["step"], result["evaluation"], result["evaluation_version"]) == (
        6,
        "given_up",
        6,
    )
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == 6
    assert "evaluation of version 6 given up" in text
    resumes_to_the_end(run, repo_root)


WEDGING = ["data.reward_fn=failing_rewards:wedges_when_told"]


def wedged_run(tmp_path, repo_root, sig: str, extra=()) -> tuple:
    """A run whose reward call never returns once 3 steps are recorded (the collector's thread
    is stuck in it, as on a wedged vLLM server); `sig` is sent once it is stuck."""
    run, wedge = tmp_path / "run", tmp_path / "wedge"
    proc, out = start(run, repo_root, [*WEDGING, *extra], ASYNCRL_TEST_WEDGE=str(wedge))
    wait_for(proc, "3 steps", lambda: len(read_complete_records(run / "metrics.jsonl")) >= 3)
    wedge.touch()
    wait_for(proc, "a wedged reward call", Path(f"{wedge}.wedged").exists)
    proc.send_signal(getattr(signal, sig))
    return run, wedge, proc, out


def test_after_the_notices_checkpoint_a_wedged_generation_is_not_waited_on(tmp_path, repo_root):
    """SIGTERM while the collector is stuck in a call that never returns: the checkpoint is
    verified, the stuck call is given up at the deadline at the latest (counted: its ordinals
    are in flight in the checkpoint), and the run exits 75. Before issue 63 it joined the
    collector with no timeout and never exited."""
    run, wedge, proc, out = wedged_run(tmp_path, repo_root, "SIGTERM", ["checkpoint.grace_s=4"])
    code, text = finish(proc, out)
    assert code == 75, text[-3000:]
    (result,) = events_of(run, "preemption_result")
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == result["step"]
    (stopped,) = events_of(run, "generation_stopped")
    assert stopped["abandoned"] is True and stopped["in_flight"]  # counted, not waited on
    wedge.unlink()
    resumes_to_the_end(run, repo_root, WEDGING, ASYNCRL_TEST_WEDGE=str(wedge))


def test_a_second_sigint_after_the_checkpoint_is_verified_ends_the_waits_and_exits_75(
    tmp_path, repo_root
):
    """Ctrl-C has no deadline: after its checkpoint the run waits for the stuck generation,
    and a second Ctrl-C (sent once the checkpoint is verified) ends that wait. The checkpoint
    is verified, so the exit is 75, through the normal cleanup (a `generation_stopped` event
    names the signal that cut the wait short), not `os._exit(130)` as before issue 63."""
    run, wedge, proc, out = wedged_run(tmp_path, repo_root, "SIGINT")
    wait_for(proc, "the notice's checkpoint verified", lambda: events_of(run, "preemption_result"))
    proc.send_signal(signal.SIGINT)
    code, text = finish(proc, out)
    assert code == 75, text[-3000:]
    (stopped,) = events_of(run, "generation_stopped")
    assert stopped["abandoned"] is True and stopped["cut_short_by"] == "SIGINT"
    latest, _ = run_store(run).latest()
    (result,) = events_of(run, "preemption_result")
    assert latest is not None and latest.step == result["step"]
    wedge.unlink()
    resumes_to_the_end(run, repo_root, WEDGING, ASYNCRL_TEST_WEDGE=str(wedge))


def test_the_same_signal_twice_during_the_notices_checkpoint_does_not_abort_it(tmp_path, repo_root):
    """SIGTERM from outside once 3 steps are recorded, then SIGTERM again while the notice's
    checkpoint is being written (the fault point sends it, by state): Slurm with torchrun may
    deliver it twice. The checkpoint goes on and is verified; exit 75. No periodic
    checkpoint, so the first file written is the notice's. (Before issue 63: exit 130 at once,
    no checkpoint.)"""
    run = tmp_path / "run"
    fault = {"ASYNCRL_FAULT": "checkpoint.file_written", "ASYNCRL_FAULT_SIGNAL": "SIGTERM"}
    proc, out = start(run, repo_root, ["checkpoint.save_period=1000"], **fault)
    wait_for(proc, "3 steps", lambda: len(read_complete_records(run / "metrics.jsonl")) >= 3)
    proc.send_signal(signal.SIGTERM)
    code, text = finish(proc, out)
    assert code == 75, text[-3000:]
    (result,) = events_of(run, "preemption_result")
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == result["step"]
    assert "SIGTERM again" in text
    assert [e["source"] for e in read_records(run / "events.jsonl")
            if e["event"] == "preemption_notice"] == ["SIGTERM"]  # fmt: skip
    resumes_to_the_end(run, repo_root)
