"""Agent runs under SIGKILL (DESIGN.md I11), with an agent from outside the package
(`tests/user_agents/loop_agent.py`: a plain `openai` loop that rewrites its history, each
answer run through a journaled tool whose own journal records every execution).

Kills are placed by state (`asyncrl.faults`): right after a pass's completions became durable
in the agent log and before any agent got them (`agent.call_logged`), after a tool ran and
before its result was logged (`agent.tool_ran`), and after a checkpoint became durable. The
oracles: the uninterrupted run (a deterministic resume must equal it bit for bit), the tool's
own journal (at most one repeat per kill: the tool cut off mid-call), `asyncrl audit` (I1, I3,
and I11 from the agent log: no completion the log held generated again). Negative control: a
resume that does not read the agent log generates the logged completions again, and the audit
says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import launcher
import pytest
from helpers import assert_exact_run, read_records
from test_determinism import fingerprint

from asyncrl.cli.audit import audit_run_dir
from asyncrl.examples.math_chat import prepare

pytestmark = pytest.mark.slow

STEPS = 8
N = 2


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("math_chat"))


def overrides(files) -> list[str]:
    return [
        f"model.path={files['model']}",
        f"data.path={files['train']}",
        f"run.max_num_steps={STEPS}",
        f"rollout.num_prompts_per_step={N}",
        "rollout.num_generations_per_prompt=2",
        "rollout.max_new_tokens=6",
        "rollout.reward_workers=0",
        "rollout.reward_timeout_s=0",
        "agent.name=loop_agent:run",
        "agent.max_calls=3",
        "agent.max_tokens=24",
        "eval.every_steps=0",
        "algo.warmup_steps=0",
        "algo.lr_schedule=constant",
        "checkpoint.save_period=2",
        "checkpoint.when_busy=wait",
        "logging.progress=false",
        "logging.plot=false",
        "logging.tensorboard=false",
        "logging.mlflow=false",
    ]


def run_to(run: Path, repo_root: Path, files, fault: str = "", skip: str = "", extra=()):
    """One launch to its end or its kill: (exit code, output)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(repo_root / "tests" / "user_agents"), os.environ.get("PYTHONPATH")])
        ),
        "PYTHONWARNINGS": "ignore",
        "AGENT_TOOL_JOURNAL": str(run.parent / f"{run.name}.journal"),
        "ASYNCRL_FAULT": fault,
        "ASYNCRL_TEST_SKIP_RESTORE": skip,
    }
    command = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "train",
        str(repo_root / "configs/math_chat.yaml"),
    ]
    command += ["--run-dir", str(run), *overrides(files), *extra]
    proc = launcher.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def tool_repeats(run: Path) -> int:
    keys = Counter((run.parent / f"{run.name}.journal").read_text().split())
    return sum(n - 1 for n in keys.values())


def kill_and_finish(run: Path, repo_root: Path, files, faults: list[str], extra=(), skip=""):
    for fault in faults:
        code, out = run_to(run, repo_root, files, fault, skip, extra)
        assert code == -signal.SIGKILL, f"{fault} never fired (exit {code}):\n{out[-2000:]}"
    code, out = run_to(run, repo_root, files, skip=skip, extra=extra)
    assert code == 0, out[-3000:]


FAULTS = [
    # after a checkpoint, completions durable in the agent log, no agent has them yet
    "checkpoint.parent_fsynced>agent.call_logged:3",
    "checkpoint.parent_fsynced>agent.tool_ran:3",  # a tool ran, its result not yet logged
    "checkpoint.parent_fsynced>agent.call_logged:2",
]


def test_killed_mid_call_and_mid_tool_a_deterministic_agent_run_is_bitwise_the_same(
    tmp_path_factory, repo_root, chat_files
):
    reference = tmp_path_factory.mktemp("reference") / "run"
    code, out = run_to(reference, repo_root, chat_files, extra=["run.deterministic=true"])
    assert code == 0, out[-3000:]
    run = tmp_path_factory.mktemp("killed") / "run"
    kill_and_finish(run, repo_root, chat_files, FAULTS, extra=["run.deterministic=true"])
    assert fingerprint(run) == fingerprint(reference)
    assert_exact_run(run, STEPS, N)  # the audit too: I11 from the agent log
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) == len(FAULTS)
    assert sum(r["agent_calls_replayed"] for r in resumes) > 0, resumes
    replays = [e for e in read_records(run / "events.jsonl") if e["event"] == "agent_replay"]
    assert replays and sum(e["agent_calls_replayed"] for e in replays) > 0, replays
    assert all(e["agent_calls_diverged"] == 0 for e in replays)  # a deterministic agent
    # the tool acted at most once more per kill (only one cut off between acting and logging)
    assert tool_repeats(run) <= len(FAULTS)
    assert sum(r["tool_calls_repeated"] for r in resumes) == tool_repeats(run)


def test_killed_at_random_states_an_agent_run_keeps_the_schedule_and_replays(
    tmp_path, repo_root, chat_files
):
    run = tmp_path / "run"
    kill_and_finish(run, repo_root, chat_files, FAULTS[:2])
    assert_exact_run(run, STEPS, N)
    assert tool_repeats(run) <= 2


def test_a_resume_that_does_not_read_the_agent_log_generates_again_and_the_audit_says_so(
    tmp_path, repo_root, chat_files
):
    run = tmp_path / "run"
    kill_and_finish(run, repo_root, chat_files, FAULTS[:1], skip="agent_log")
    report = audit_run_dir(run)
    assert any("generated again" in v for v in report.violations), report.violations
    assert tool_repeats(run) > 1  # the tools since the checkpoint acted again too
