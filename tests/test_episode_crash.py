"""Multi-turn episodes under SIGKILL (DESIGN.md I9), with a user's environment that lives
outside the package (`tests/user_envs/tally_game.py`, `env.name=tally_game:...`).

Kills are placed by state (`asyncrl.faults`): after a checkpoint whose cut holds episodes in
flight became durable, then mid-environment-step (`episode.env_step`), mid-turn
(`engine.decode_step`) or mid-checkpoint-write. The oracles: the uninterrupted run (a
deterministic resume must equal it bit for bit), the checkpoint read before each resume (no
environment step it recorded is called again: the environment's own journal says which
process called which step) and `asyncrl audit`. Negative controls: a resume that skips
restoring the environments differs from the uninterrupted run; `restart_episode`, and an
environment that can only restart, call recorded steps again and say so in the resume event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import launcher
import pytest
from helpers import read_records
from test_determinism import fingerprint

from asyncrl.checkpoint.run_checkpoints import run_store
from asyncrl.checkpoint.snapshot import read_parts
from asyncrl.cli.audit import audit_run_dir
from asyncrl.cli.inspect import inspect_run_dir

pytestmark = pytest.mark.slow

STEPS = 24
"""Steps of each run: room for three kills, each after a cut that holds episodes in flight
(whether a cut does depends on where the collector was; a step costs ~0.1 s, a launch ~1 s)."""
BASE = [
    f"run.max_num_steps={STEPS}",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "rollout.groups_per_batch=2",
    "rollout.max_trajectory_age_steps=1",
    "env.max_turns=3",
    "checkpoint.save_period=2",
    "checkpoint.when_busy=wait",
    "logging.progress=false",
    "logging.plot=false",
]
DETERMINISTIC = ["run.deterministic=true"]
IN_FLIGHT = "checkpoint.parent_fsynced[episode_steps]"
"""A durable checkpoint whose cut holds episodes in flight with environment steps taken
(partial tokens alone may be first turns, with no step recorded yet)."""


def launch(
    run: Path, repo_root: Path, env_name: str, fault: str = "", skip: str = "", extra=()
) -> subprocess.Popen:
    user_envs = str(repo_root / "tests" / "user_envs")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [user_envs, os.environ.get("PYTHONPATH")])),
        "PYTHONWARNINGS": "ignore",
        "TALLY_JOURNAL": str(run.parent / f"{run.name}.journal"),
        "ASYNCRL_FAULT": fault,
        "ASYNCRL_TEST_SKIP_RESTORE": skip,
    }
    command = [sys.executable, "-m", "asyncrl.cli", "train"]
    command += [str(repo_root / "configs/multi_turn_game.yaml"), "--run-dir", str(run)]
    command += [*BASE, f"env.name=tally_game:{env_name}", *extra]
    return launcher.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def run_to(run: Path, repo_root: Path, env_name: str, fault: str = "", skip: str = "",
           extra=()) -> tuple[int, int, str]:  # fmt: skip
    """One launch to its end (or its kill): (exit code, pid, output)."""
    proc = launch(run, repo_root, env_name, fault, skip, extra)
    out, _ = proc.communicate(timeout=480)
    return proc.returncode, proc.pid, out


def parse_or_none(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def calls(run: Path) -> list[tuple[int, str]]:
    """(pid, step_id) of every environment step, in order, from the environment's journal."""
    journal = run.parent / f"{run.name}.journal"
    return [(int(p), s) for p, s, _ in (line.split() for line in journal.read_text().splitlines())]


def executed_twice(journal: list[tuple[int, str]]) -> list[str]:
    """The turns (`ORDINAL:SAMPLE:TURN`, whatever the restart count) the environment executed
    more than once: a journal keyed by the full id cannot see a turn asked again under a new
    one."""
    turns = Counter(":".join(sid.split(":")[:3]) for _, sid in journal)
    return sorted(t for t, n in turns.items() if n > 1)


def cut_steps(run: Path) -> set[str]:
    """The steps a kill cut inside: an attempt logged the step's request (`env_steps.jsonl`)
    and never its result."""
    asked: set[tuple[str, int]] = set()
    answered: set[tuple[str, int]] = set()
    for record in read_records(run / "env_steps.jsonl"):
        key = (record.get("step_id"), record.get("attempt"))
        if record.get("kind") == "request":
            asked.add(key)
        elif record.get("kind") == "result":
            answered.add(key)
    return {step for step, _ in asked - answered}


def recorded_steps(run: Path) -> set[str]:
    """The environment steps the newest checkpoint's episodes in flight recorded."""
    info = inspect_run_dir(run)
    return {s for samples in info["episodes_in_flight"].values() for e in samples
            for s in e["step_ids"]}  # fmt: skip


def kill_resume_and_finish(run: Path, repo_root: Path, env_name: str, faults: list[str],
                           extra=()) -> list[tuple[set[str], int]]:  # fmt: skip
    """Kills the run once per fault, resuming each time, then runs it to the end; returns per
    resume what its checkpoint recorded and the pid of the launch that resumed from it."""
    recorded, pids = [], []
    for fault in faults:
        code, pid, out = run_to(run, repo_root, env_name, fault, extra=extra)
        assert code == -signal.SIGKILL, f"{fault} never fired (exit {code}):\n{out[-2000:]}"
        pids.append(pid)
        recorded.append(recorded_steps(run))
        assert recorded[-1], f"the checkpoint after {fault} holds no episode in flight"
    code, pid, out = run_to(run, repo_root, env_name, extra=extra)
    assert code == 0, out[-3000:]
    return list(zip(recorded, [*pids[1:], pid], strict=True))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request) -> tuple[list[tuple], str]:
    repo_root = Path(request.config.rootpath)
    run = tmp_path_factory.mktemp("reference") / "run"
    code, _, out = run_to(run, repo_root, "Tally", extra=DETERMINISTIC)
    assert code == 0, out[-3000:]
    return fingerprint(run)


def test_killed_mid_step_mid_turn_and_mid_checkpoint_a_deterministic_run_is_bitwise_the_same(
    tmp_path, repo_root, reference
):
    run = tmp_path / "run"
    faults = [
        f"{IN_FLIGHT}>episode.env_step:2",  # mid-environment-step
        f"{IN_FLIGHT}>engine.decode_step:3",  # mid-turn
        f"{IN_FLIGHT}>checkpoint.file_written",  # mid-checkpoint-write
    ]
    resumes = kill_resume_and_finish(run, repo_root, "Tally", faults, extra=DETERMINISTIC)
    assert fingerprint(run) == reference
    journal = calls(run)
    for recorded, pid in resumes:  # no step a checkpoint recorded is called again
        again = recorded & {s for p, s in journal if p == pid}
        assert not again, f"recorded steps called again after the resume: {sorted(again)}"
    # issue 63, defect 1: no turn executed twice under any id. The episodes never start over,
    # so every step keeps the id the steps log knows it by (no restart count), and a step
    # past the cut is answered from the log. The one exception the design allows: a step a
    # kill cut inside (its request logged, its result not: the checkpoint writer's fault can
    # fire while the collector's thread is in a step), asked again once
    renamed = [s for _, s in journal if len(s.split(":")) > 3]
    assert not renamed, f"steps asked under new ids: {renamed[:10]}"
    twice = executed_twice(journal)
    assert set(twice) <= cut_steps(run) and len(twice) <= len(faults), twice[:10]
    events = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert len(events) == len(faults)
    for e in events:
        assert (e["turns_regenerated"], e["tool_calls_repeated"], e["tokens_regenerated"]) == (
            0, 0, 0,
        ), e  # fmt: skip
    assert sum(e["turns_kept"] for e in events) > 0
    assert audit_run_dir(run).ok


def test_a_resume_that_does_not_restore_the_environments_is_caught(tmp_path, repo_root, reference):
    run = tmp_path / "run"
    code, _, out = run_to(run, repo_root, "Tally", f"{IN_FLIGHT}>engine.decode_step:3",
                          extra=DETERMINISTIC)  # fmt: skip
    assert code == -signal.SIGKILL, out[-2000:]
    # without the steps log, which would answer the steps past the cut from its records, the
    # environments the resume did not restore are asked
    (run / "env_steps.jsonl").unlink()
    code, _, out = run_to(run, repo_root, "Tally", skip="env_state", extra=DETERMINISTIC)
    assert code == 0, out[-3000:]
    assert fingerprint(run) != reference


def test_audit_catches_a_lossless_resume_that_lost_its_episodes(tmp_path, repo_root):
    """Negative control of audit's I9: the partial samples not restored (a test switch), so
    the episodes start over and ask for recorded steps again, while the resume, planned from
    what it restored, declares no repeat; the checkpoint event says what the cut held."""
    run = tmp_path / "run"
    # killed writing the next checkpoint: its write began after the previous one's writer had
    # recorded that checkpoint's event (`recorded_steps`), which the resume then starts from
    code, _, out = run_to(run, repo_root, "TallyState", f"{IN_FLIGHT}>checkpoint.file_written")
    assert code == -signal.SIGKILL, out[-2000:]
    step = inspect_run_dir(run)["step"]
    assert any(e["event"] == "checkpoint" and e["step"] == step and e["recorded_steps"]
               for e in read_records(run / "events.jsonl"))  # fmt: skip
    # the steps log cut back to the checkpoint's offset: else a later turn the killed launch
    # logged past the cut meets the lost episodes' regenerated text under its id, and the run
    # refuses it (one id, one request) before audit can look, whenever the kill came late
    latest, _ = run_store(run).latest()
    offset = int(read_parts(latest)[0]["trainer"].get("env_steps_offset") or 0)
    with open(run / "env_steps.jsonl", "r+b") as f:
        f.truncate(offset)
    proc = launch(run, repo_root, "TallyState", skip="ledger.partial")
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 0, out[-3000:]
    report = audit_run_dir(run)
    assert [v for v in report.violations if v.startswith("I9: attempt 1 asked again")], report


@pytest.mark.parametrize(
    ("env_name", "policy", "repeats"),
    [
        ("TallyState", "lossless", False),  # restored from its saved state
        ("TallyState", "restart_episode", True),  # what peers do: the episode starts over
        ("TallyRestart", "lossless", True),  # an environment that can only start over
    ],
)
def test_what_each_resume_policy_and_restore_kind_redoes(
    tmp_path, repo_root, env_name, policy, repeats, monkeypatch
):
    run = tmp_path / "run"
    code, _, out = run_to(run, repo_root, env_name, f"{IN_FLIGHT}>episode.env_step:2")
    assert code == -signal.SIGKILL, out[-2000:]
    recorded = recorded_steps(run)
    assert recorded
    # what `inspect` predicts, the environment's module importable as where the run ran
    monkeypatch.syspath_prepend(str(repo_root / "tests" / "user_envs"))
    info = inspect_run_dir(run)
    assert info["env_restore"] == ("restart" if env_name == "TallyRestart" else "restorable")
    predicted = info["resume_cost"][policy]
    code, pid, out = run_to(run, repo_root, env_name, extra=[f"checkpoint.resume_policy={policy}"])
    assert code == 0, out[-3000:]
    # a turn asked again: under a new id when its episode started over (`O:S:T:RESTARTS`)
    asked = {s for p, s in calls(run) if p == pid}
    called_again = recorded & {":".join(s.split(":")[:3]) for s in asked}
    (event,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    if repeats:
        assert called_again and event["tool_calls_repeated"] >= len(called_again) > 0
        assert not recorded & asked, "a restarted episode asked again under a recorded id"
        assert event["turns_regenerated"] > 0 and event["tokens_regenerated"] > 0
    else:
        assert not called_again
        assert (event["turns_regenerated"], event["tool_calls_repeated"]) == (0, 0)
        assert event["turns_kept"] > 0
        # inspect read the steps log past the cut: the turns the resume then recovered
        assert info["steps_past_checkpoint"]["logged"] == event["turns_recovered"] > 0
    for key in ("turns_regenerated", "tool_calls_repeated", "turns_kept"):
        assert predicted[key] == event[key], (key, predicted, event)
    assert audit_run_dir(run).ok


def test_a_restart_environment_continues_a_first_turn_that_asked_no_step(
    tmp_path, repo_root, monkeypatch
):
    """Issue 44, defect 6: an environment that can only start over lost the tokens of a first
    turn that had asked no step. Turns of up to 16 tokens in chunks of 1, killed after a checkpoint
    whose cut holds such a turn: the resume continues it at its token (`continued_partials`:
    audit's I3 then checks that no token of it was generated again) and starts over only the
    episodes that took a step, as `inspect` predicted."""
    run = tmp_path / "run"
    # turns of up to 16 tokens: a first turn spans many chunks, so about half the cuts hold
    # one (5 and 6 of 12 in two runs, idle AMD EPYC); with turns of 6, a cut caught one only
    # where the cores were shared (none of 12 alone: the cut waits out the previous write)
    extra = ["rollout.chunk_tokens=1", "rollout.max_new_tokens=16", "env.max_episode_tokens=56"]
    fault = "checkpoint.parent_fsynced[first_turn_tokens]>episode.env_step:2"
    code, _, out = run_to(run, repo_root, "TallyRestart", fault, extra=extra)
    assert code == -signal.SIGKILL, out[-2000:]
    monkeypatch.syspath_prepend(str(repo_root / "tests" / "user_envs"))  # inspect knows it
    predicted = inspect_run_dir(run)["resume_cost"]["lossless"]  # restarts (`restore`)
    code, _, out = run_to(run, repo_root, "TallyRestart", extra=extra)
    assert code == 0, out[-3000:]
    (event,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    kept = [n for p in event["continued_partials"].values() for n in p["lengths"] if n]
    assert kept, event["continued_partials"]
    for key in ("turns_regenerated", "tool_calls_repeated", "turns_kept", "kept_tokens"):
        assert predicted[key] == event[key], (key, predicted, event)
    assert audit_run_dir(run).ok, audit_run_dir(run).violations


@pytest.mark.parametrize(
    "variant",
    [
        [],  # one trainer process, full fine-tuning
        # two trainer ranks (FSDP2 on gloo), whose step costs more than a turn of 2 tokens:
        # the generator would wait at every cut for the step to admit its next prompts, so no
        # cut would hold an episode with a step taken. Turns of 24 tokens make generation the
        # slower side (3.8 s against 2.0 s of training over 12 steps here), as in one process
        ["train.num_processes=2", "rollout.max_new_tokens=24", "env.max_episode_tokens=56"],
        ["model.lora.rank=4"],  # LoRA adapters
        # vLLM in process: its per-turn limits (no chunks: a turn is one call, which stops
        # it), each turn continued from the episode's tokens
        ["rollout.engine=vllm", "rollout.vllm.kv_cache_bytes=33554432", "rollout.chunk_tokens=0"],
    ],
    ids=["chunked", "2-ranks", "lora", "vllm"],
)
def test_killed_past_the_checkpoint_a_default_mode_run_asks_each_step_once_with_one_text(
    tmp_path, repo_root, variant
):
    """Issue 44's check: episodes capped by env.max_turns that never say done (Tally ends at
    3 turns, the cap is 2), chunks of 2 tokens (siblings out of lockstep), the default mode,
    killed past a checkpoint: after an environment step (its result logged), and inside one
    (asked, its result not logged). The environment's own journal (`PID STEP_ID TEXT_SHA256`)
    must show every step asked with one text, none past the cap, and at most one step
    executed twice per kill (the one in flight); the steps log recovered turns instead of
    regenerating them. Before the write-ahead log, every step after the checkpoint ran again
    after a kill, with a new text."""
    run = tmp_path / "run"
    # a checkpoint every step, 48 steps, not STEPS and every 2: each kill needs a cut holding
    # episodes with a step taken (one cut in 8-10 here), and in a CI run on a fast machine a
    # launch found none in what was left of 24 steps and finished unkilled (~0.1 s a step)
    extra = ["env.max_turns=2", "rollout.chunk_tokens=2", *variant, "run.max_num_steps=48",
             "checkpoint.save_period=1"]  # fmt: skip
    faults = [f"{IN_FLIGHT}>episode.env_step:3", f"{IN_FLIGHT}>episode.env_answered:2"]
    for fault in faults:
        code, _, out = run_to(run, repo_root, "Tally", fault, extra=extra)
        assert code == -signal.SIGKILL, out[-2000:]
    code, _, out = run_to(run, repo_root, "Tally", extra=extra)
    assert code == 0, out[-3000:]
    journal = [line.split() for line in (tmp_path / "run.journal").read_text().splitlines()]
    texts: dict[str, set[str]] = {}
    for _, sid, sha in journal:
        texts.setdefault(sid, set()).add(sha)
    assert all(len(t) == 1 for t in texts.values()), {s: t for s, t in texts.items() if len(t) > 1}
    assert all(int(sid.split(":")[2]) < 2 for sid in texts), "stepped past env.max_turns"
    twice = [s for s in texts if sum(1 for _, sid, _ in journal if sid == s) > 1]
    assert len(twice) <= len(faults) - 1, twice  # the kill inside a step: that step alone
    events = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert len(events) == len(faults)
    assert all(e["turns_regenerated"] == 0 for e in events)
    assert sum(e["turns_recovered"] for e in events) > 0
    assert audit_run_dir(run).ok, audit_run_dir(run).violations
    # every turn stopped at its limit (rollout.max_new_tokens a turn) or sooner, at EOS; the
    # steps log's requests hold each turn's tokens (a torn last line of a kill is skipped)
    cap = 24 if "rollout.max_new_tokens=24" in variant else 2
    lines = (run / "env_steps.jsonl").read_text().splitlines()
    turns = [r for r in map(parse_or_none, lines) if r and r["kind"] == "request"]
    assert turns and max(len(r["tokens"]) for r in turns) == cap


def test_killed_at_random_points_a_restorable_environment_with_tensors_runs_each_step_once(
    tmp_path, repo_root
):
    """Issue 63, defect 2: a `restorable` environment whose state holds tensors. Its result
    records kept the state only where it was JSON, so each step past the cut was asked again
    on resume (1,127 of 7,271 steps executed twice in the review's runs; in a small case the
    next turn came back under a logged id with other text and every relaunch failed). Killed
    after a step's result was logged and inside a step (asked, its result not logged): the
    run finishes, audit passes, and the environment's journal shows at most the one step in
    flight at the second kill executed twice."""
    run = tmp_path / "run"
    extra = ["env.max_turns=2", "rollout.chunk_tokens=2", "run.max_num_steps=48",
             "checkpoint.save_period=1"]  # fmt: skip
    faults = [f"{IN_FLIGHT}>episode.env_step:3", f"{IN_FLIGHT}>episode.env_answered:2"]
    for fault in faults:
        code, _, out = run_to(run, repo_root, "TallyTensor", fault, extra=extra)
        assert code == -signal.SIGKILL, f"{fault} never fired (exit {code}):\n{out[-2000:]}"
    code, _, out = run_to(run, repo_root, "TallyTensor", extra=extra)
    assert code == 0, out[-3000:]
    journal = calls(run)
    assert len(executed_twice(journal)) <= 1, executed_twice(journal)
    events = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert sum(e["turns_recovered"] for e in events) > 0
    assert all(e["episodes_start_over"] is False for e in events)
    results = [r for r in map(parse_or_none, (run / "env_steps.jsonl").read_text().splitlines())
               if r and r["kind"] == "result"]  # fmt: skip
    assert results and all("state_tensors" in r for r in results)
    assert audit_run_dir(run).ok, audit_run_dir(run).violations
