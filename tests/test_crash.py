"""Real processes, real signals: `asyncrl train` is SIGKILLed at random moments and during a
checkpoint write, resumed each time, and must end with every step trained on exactly its own
ordinals (I1), every ordinal trained once, and no buffered group generated twice (I3)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import launcher
import pytest
from helpers import read_complete_records, read_records

from asyncrl.cli.audit import _ranges
from asyncrl.faults import POINTS

pytestmark = pytest.mark.slow

N = 4
CRASH_RUN = [
    "run.max_num_steps=45",
    f"rollout.num_prompts_per_step={N}",
    "rollout.num_generations_per_prompt=4",
    "rollout.max_trajectory_age_steps=2",
    "checkpoint.save_period=3",
    "checkpoint.keep_last=2",
    "logging.progress=false",
    "logging.plot=false",
]


def launch(run_dir: Path, repo_root: Path, *extra: str, fault: str = "") -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "ASYNCRL_FAULT": fault}
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml")]
    return launcher.popen(
        [*command, "--run-dir", str(run_dir), *CRASH_RUN, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def count_lines(path: Path) -> int:
    """Complete records so far in a file the run is writing (a half-written line not counted)."""
    return len(read_complete_records(path))


def kill_after_steps(proc: subprocess.Popen, run_dir: Path, more_steps: int) -> bool:
    """SIGKILLs `proc` once metrics.jsonl has grown by `more_steps` lines; False if it ended
    first."""
    target = count_lines(run_dir / "metrics.jsonl") + more_steps
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if count_lines(run_dir / "metrics.jsonl") >= target:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return True
        time.sleep(0.01)
    proc.wait(30)
    return False


def finish(run_dir: Path, repo_root: Path, *extra: str) -> str:
    proc = launch(run_dir, repo_root, *extra)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def generations_per_ordinal(run_dir: Path) -> dict[int, list[int]]:
    """ordinal -> the attempts in which it was generated, from timeline.jsonl."""
    seen: dict[int, list[int]] = {}
    for span in read_records(run_dir / "timeline.jsonl"):
        if span["kind"] == "generate":
            for k in span["ordinals"]:
                seen.setdefault(k, []).append(span["attempt"])
    return seen


def audit(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return launcher.run(
        [sys.executable, "-m", "asyncrl.cli", "audit", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


PPO = (
    "algo.name=ppo", "algo.num_minibatches=2", "algo.kl_coef=0.05", "algo.critic_warmup_steps=3",
    "train.micro_batch_size=5",  # minibatches of 8 sequences in micro-batches of 5 and 3
)  # fmt: skip


@pytest.mark.parametrize("algo", [(), PPO], ids=["grpo", "ppo"])
def test_random_sigkills_and_a_kill_mid_checkpoint_lose_nothing(tmp_path, repo_root, algo):
    run = tmp_path / "run"
    rng = random.Random(1234)
    # 1: killed by SIGKILL while writing the second checkpoint's first file
    # (`wait`: step 6 gets its checkpoint however slow the disk; the resumes below defer)
    proc = launch(
        run, repo_root, *algo, "checkpoint.when_busy=wait", fault="checkpoint.file_written[step=6]"
    )
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == -signal.SIGKILL, out
    assert list((run / "checkpoints").glob(".tmp-step_000006-*")), "died mid-write"
    # 2-4: killed at random moments
    kills = 1
    for _ in range(3):
        kills += kill_after_steps(launch(run, repo_root, *algo), run, rng.randint(2, 9))
    assert kills == 4
    finish(run, repo_root, *algo)

    metrics = read_records(run / "metrics.jsonl")
    final = {r["step"]: r for r in metrics}
    assert sorted(final) == list(range(45))
    for t, record in final.items():
        assert record["prompt_ordinals"] == list(range(t * N, (t + 1) * N))  # I1
    assert max(r["attempt"] for r in metrics) == 4
    events = read_records(run / "events.jsonl")
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) >= 3 and all(e["skipped_ordinals"] == [] for e in resumes)
    generated = generations_per_ordinal(run)
    for resume in resumes:  # I3: a group buffered in a checkpoint is never generated again
        for k in resume["kept_groups"]:
            later = [a for a in generated[k] if a >= resume["attempt"]]
            assert later == [], f"ordinal {k} kept at attempt {resume['attempt']}, regenerated"
    done = audit(run)
    assert done.returncode == 0, done.stdout
    assert "45 steps" in done.stdout and "I1 ok, I3 ok" in done.stdout


def inspect_json(run_dir: Path) -> dict:
    shown = launcher.run(
        [sys.executable, "-m", "asyncrl.cli", "inspect", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_the_same_crash_under_drop_incomplete_is_caught_by_the_audit(tmp_path, repo_root):
    # killed right after the first checkpoint with prompts in flight became durable (a
    # collector waiting on a full window has none: which checkpoint that is depends on timing)
    run = tmp_path / "run"
    proc = launch(run, repo_root, fault="checkpoint.parent_fsynced[in_flight]")
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == -signal.SIGKILL, f"no checkpoint had prompts in flight: {out}"
    saved = inspect_json(run)
    assert saved["in_flight_ordinals"], "the newest checkpoint is the one with prompts in flight"
    out = finish(run, repo_root, "checkpoint.resume_policy=drop_incomplete")
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["skipped_ordinals"], "the checkpoint had prompts in flight"
    assert f"resumed at step {saved['step']}" in out
    done = audit(run)
    assert done.returncode == 1
    lost = sorted(resume["skipped_ordinals"] + resume["discarded_groups"])
    assert f"ordinals below the frontier never trained: {_ranges(lost)}\n" in done.stdout
    assert "I1: step" in done.stdout


def test_sigterm_writes_an_emergency_checkpoint_and_the_resume_redoes_nothing_finished(
    tmp_path, repo_root
):
    run = tmp_path / "run"
    proc = launch(run, repo_root, "run.max_num_steps=400", "checkpoint.save_period=1000")
    while count_lines(run / "metrics.jsonl") < 7 and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    *events, stopped = read_records(run / "events.jsonl")
    assert [e["event"] for e in events][-4:] == [
        "preemption_notice", "signal", "checkpoint", "preemption_result",
    ]  # fmt: skip
    assert stopped["event"] == "generation_stopped"
    stopped_at = events[-3]["step"]
    assert events[-3]["signal"] == "SIGTERM" and stopped_at >= 7
    assert events[-2]["step"] == events[-1]["step"] == events[-4]["step"] == stopped_at
    result = events[-1]  # its account of checkpoint.grace_s's 30 s, not a clock verdict
    assert result["deadline_s"] == 30.0
    assert result["met"] == (result["notice_to_durable_s"] <= result["deadline_s"])
    assert (run / "checkpoints" / f"step_{stopped_at:06d}" / "manifest.json").is_file()
    buffered_at_stop = events[-2]["buffered"]

    out = finish(run, repo_root, "run.max_num_steps=" + str(stopped_at + 3))
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == stopped_at
    assert len(resume["kept_groups"]) == buffered_at_stop
    assert not set(resume["reissued_ordinals"]) & set(resume["kept_groups"])
    trained_before = {k for r in read_records(run / "metrics.jsonl") if r["attempt"] == 0
                      for k in r["prompt_ordinals"]}  # fmt: skip
    assert not set(resume["reissued_ordinals"]) & trained_before
    assert audit(run).returncode == 0


def test_inspect_predicts_what_each_resume_policy_then_does(tmp_path, repo_root):
    import shutil

    base = tmp_path / "base"
    # killed once the first checkpoint with prompts both in flight and buffered is durable
    # (every policy then has something to keep, skip or discard) and the trainer has gone on to
    # train past it (the checkpoint is written in the background): the resumed runs must not
    # count the killed attempt's rows past the checkpoint as trained
    # (on a loaded machine the next checkpoint, 3 steps on, can also become durable before
    # the kill, leaving no row past the newest one: then the kill is placed again, from a
    # fresh run dir, up to 3 times)
    state = "checkpoint.parent_fsynced[in_flight,buffered]>train.optimizer_step:2"
    for _ in range(3):
        shutil.rmtree(base, ignore_errors=True)
        proc = launch(base, repo_root, "rollout.groups_per_batch=1", fault=state)
        out, _ = proc.communicate(timeout=480)
        assert proc.returncode == -signal.SIGKILL, f"no checkpoint was in {state}: {out}"
        info = inspect_json(base)
        step = info["step"]
        if max(r["step"] for r in read_records(base / "metrics.jsonl")) >= step:
            break
    assert info["checkpoint"].endswith(f"step_{step:06d}") and info["ledger"]["in_flight"] > 0
    assert info["ledger"]["trained"] == step * N
    assert max(r["step"] for r in read_records(base / "metrics.jsonl")) >= step, "none past it"
    table = launcher.run(
        [sys.executable, "-m", "asyncrl.cli", "inspect", str(base)], capture_output=True, text=True
    )
    assert "what resuming this checkpoint costs" in table.stdout and "lossless" in table.stdout
    n_slots = N * len(info["targets"])
    never_dispatched = n_slots - info["ledger"]["buffered"] - info["ledger"]["in_flight"]
    started = {int(t) for t in info["targets"]}
    for policy, cost in info["resume_cost"].items():
        run = tmp_path / policy
        shutil.copytree(base, run)
        policy_key = f"checkpoint.resume_policy={policy}"
        out = finish(run, repo_root, policy_key, f"run.max_num_steps={step + 6}")
        # measured from what the resumed run did, not from its own account of it. The
        # checkpoint is written in the background, so the killed attempt may have trained
        # steps past it: those rows are superseded, and only steps below it count as trained
        trained = {k for r in read_records(run / "metrics.jsonl")
                   if r["attempt"] > 0 or r["step"] < step
                   for k in r["prompt_ordinals"]}  # fmt: skip
        skipped = [k for k in info["in_flight_ordinals"] if k not in trained]
        discarded = [k for k in info["buffered_ordinals"] if k not in trained]
        generated = sum(
            1
            for span in read_records(run / "timeline.jsonl")
            if span["kind"] == "generate" and span["attempt"] == 1
            for t in span["targets"]
            if t in started
        )
        assert len(skipped) == cost["prompts_skipped"], policy
        assert len(discarded) == cost["finished_groups_discarded"], policy
        assert generated - never_dispatched == cost["groups_regenerated"], policy
        for line in cost["messages"]:
            assert line in out
    assert info["resume_cost"]["lossless"]["prompts_skipped"] == 0
    assert info["resume_cost"]["keep_incomplete"]["prompts_skipped"] > 0  # the precondition
    assert info["resume_cost"]["lossless"]["groups_regenerated"] == info["ledger"]["in_flight"]


def newest_verified_step(run_dir: Path) -> int | None:
    """The newest checkpoint on disk that a resume must load, judged without asyncrl's store:
    its manifest names this run (run.json) and its step, and every file it lists is a plain
    regular file of the directory with the listed size and SHA-256."""
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    steps = sorted(
        (int(p.name[len("step_") :]), p)
        for p in (run_dir / "checkpoints").glob("step_*")
        if p.name[len("step_") :].isdigit()
    )
    for step, path in reversed(steps):
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if manifest.get("run_id") != run_id or manifest.get("step") != step:
            continue
        files = manifest.get("files") or {}
        if files and all(
            "/" not in name
            and (path / name).is_file()
            and not (path / name).is_symlink()
            and (path / name).stat().st_size == entry["bytes"]
            and hashlib.sha256((path / name).read_bytes()).hexdigest() == entry["sha256"]
            for name, entry in files.items()
        ):
            return step
    return None


SMOKE = "checkpoint.parent_fsynced"
"""The one kill-resume-audit of `make test-fast` (marked smoke): a kill right after a checkpoint
became durable, the rerun resumed from it, audited."""


@pytest.mark.parametrize(
    "point", [pytest.param(p, marks=[pytest.mark.smoke] if p == SMOKE else []) for p in POINTS]
)
def test_a_kill_at_every_crash_point_loses_nothing(tmp_path, repo_root, point):
    run = tmp_path / "run"
    short = ["run.max_num_steps=10", "checkpoint.save_period=2", "rollout.groups_per_batch=2"]
    short += ["checkpoint.when_busy=wait"]  # a third deletion needs all 5 saves, however slow
    proc = launch(run, repo_root, *short, fault=f"{point}:3")
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == -signal.SIGKILL, f"{point} never reached: {out}"
    newest = newest_verified_step(run)  # what the kill left loadable, before the rerun looks
    # --restart only where nothing was (some points fire before any checkpoint): with it, a
    # rerun that lost every checkpoint would still pass the checks below
    finish(run, repo_root, *short, *(["--restart"] if newest is None else []))
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    rerun = [r["step"] for r in read_records(run / "metrics.jsonl") if r["attempt"] == 1]
    if newest is None:
        assert resumes == [] and rerun[:1] == [0], f"{point}: {resumes}"
    else:
        assert [e["from_step"] for e in resumes] == [newest], f"{point}: newest was {newest}"
        assert rerun[:1] == ([newest] if newest < 10 else [])  # 10: killed after the last save
    final = {r["step"]: r for r in read_records(run / "metrics.jsonl")}
    assert sorted(final) == list(range(10))
    for t, record in final.items():
        assert record["prompt_ordinals"] == list(range(t * N, (t + 1) * N))
    done = audit(run)
    assert done.returncode == 0, done.stdout
    assert not list((run / "checkpoints").glob(".tmp-*")), "temp dirs cleaned up"
