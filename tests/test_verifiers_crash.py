"""A verifiers environment trained under SIGKILL (`agent.name=verifiers:MODULE`, DESIGN.md I11):
`tests/user_envs/journal_calc`, an environment from outside the package whose `calculate` tool
(served by verifiers in a process of its own, called by verifiers' harness over MCP) appends a
line to a journal file on every execution. The model is `asyncrl.examples.agent_math`'s tiny
one, warm-started to call `calculate` in part of its runs.

Kills are placed by state (`asyncrl.faults`): right after a tool's result became durable in the
agent log (`agent.tool_logged`: the resumed episode must get it from the log), after a tool's
result came back and before it was logged (`agent.tool_ran`), each after a checkpoint became
durable. The oracles: the uninterrupted run (a deterministic resume must equal it bit for bit),
the tool's own journal (at most one repeat per kill), `asyncrl audit` (I1, I3, and I11 from the
agent log).
Negative control: a resume that does not read the agent log runs the logged tool again, and
generates the logged completions again, which the audit reports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import launcher
import pytest
from helpers import assert_exact_run, read_records
from test_determinism import fingerprint

from asyncrl.cli.audit import audit_run_dir
from asyncrl.examples.agent_math import prepare

pytestmark = pytest.mark.slow

STEPS = 6
N = 2
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("agent_math"))


def run_to(
    run: Path, repo_root: Path, files, fault: str = "", skip: str = "", extra=(), env_extra=None
):
    """One launch to its end or its kill: (exit code, output)."""
    journal = run.parent / f"{run.name}.journal"
    env = {
        **os.environ,
        # absolute: verifiers starts the tool server in a directory of its own
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(repo_root / "tests" / "user_envs"), os.environ.get("PYTHONPATH")])
        ),
        "PYTHONWARNINGS": "ignore",
        "ASYNCRL_FAULT": fault,
        "ASYNCRL_TEST_SKIP_RESTORE": skip,
        **(env_extra or {}),
    }
    args = f"{{path: {files['train']}, num_tasks: 24, journal: {journal}}}"
    config = repo_root / "configs" / "agent_demo.yaml"
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(config)]
    command += [
        "--run-dir", str(run),
        f"model.path={files['model']}",
        "agent.name=verifiers:journal_calc",
        f"agent.args={args}",
        f"run.max_num_steps={STEPS}",
        f"rollout.num_prompts_per_step={N}",
        "rollout.num_generations_per_prompt=2",
        "checkpoint.save_period=2",
        "checkpoint.when_busy=wait",
        "logging.progress=false",
        "logging.plot=false",
        *extra,
    ]  # fmt: skip
    proc = launcher.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, files) -> Path:
    """The uninterrupted deterministic run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    code, out = run_to(run, REPO_ROOT, files, extra=["run.deterministic=true"])
    assert code == 0, out[-3000:]
    return run


def tool_runs(run: Path) -> int:
    journal = run.parent / f"{run.name}.journal"
    return len(journal.read_text().splitlines()) if journal.exists() else 0


def kill_and_finish(run: Path, repo_root: Path, files, faults: list[str], extra=(), skip=""):
    for fault in faults:
        code, out = run_to(run, repo_root, files, fault, skip, extra)
        assert code == -signal.SIGKILL, f"{fault} never fired (exit {code}):\n{out[-2000:]}"
    code, out = run_to(run, repo_root, files, skip=skip, extra=extra)
    assert code == 0, out[-3000:]


FAULTS = [
    "checkpoint.parent_fsynced>agent.tool_logged:1",  # a tool's result durable: replayed
    "checkpoint.parent_fsynced>agent.tool_ran:1",  # a tool ran, its result not yet logged
]
"""Each after a checkpoint of its own launch: with a checkpoint every 2 steps of 6, at steps 2
and 4 (the resumes start there)."""


def test_a_verifiers_environment_killed_mid_call_and_mid_tool_is_bitwise_the_same(
    tmp_path_factory, repo_root, files, reference
):
    last = read_records(reference / "metrics.jsonl")[-1]
    assert last["agent/tools_executed"] == tool_runs(reference) > 0  # the journal agrees
    # every call of verifiers' harness continued its sample: one row a sample, its tokens the
    # generated ones at every tool turn
    assert last["agent/prefix_breaks"] == 0 and last["agent/calls"] > last["agent/runs_landed"]
    run = tmp_path_factory.mktemp("killed") / "run"
    kill_and_finish(run, repo_root, files, FAULTS, extra=["run.deterministic=true"])
    assert fingerprint(run) == fingerprint(reference)
    assert_exact_run(run, STEPS, N)  # the audit too: I11 from the agent log
    last = read_records(run / "metrics.jsonl")[-1]
    assert {"reward/correct", "reward/answered"} <= set(last)
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) == len(FAULTS)
    assert sum(r["agent_calls_replayed"] for r in resumes) > 0, resumes
    replays = [e for e in read_records(run / "events.jsonl") if e["event"] == "agent_replay"]
    assert replays and all(e["agent_calls_diverged"] == 0 for e in replays), replays
    assert sum(e["tool_calls_replayed"] for e in replays) > 0, replays  # answered from the log
    # the tool ran at most once more per kill: the one cut off between acting and logging
    repeats = tool_runs(run) - tool_runs(reference)
    assert 0 <= repeats <= len(FAULTS)
    assert sum(r["tool_calls_repeated"] for r in resumes) == repeats


def test_a_resume_that_does_not_read_the_agent_log_runs_the_tools_again(
    tmp_path_factory, repo_root, files, reference
):
    run = tmp_path_factory.mktemp("unread") / "run"
    kill_and_finish(run, repo_root, files, FAULTS[:1], ["run.deterministic=true"], "agent_log")
    report = audit_run_dir(run)
    assert any("generated again" in v for v in report.violations), report.violations
    assert tool_runs(run) > tool_runs(reference)  # the tool whose result the log held ran again


def test_a_rubric_that_raises_stops_the_run_naming_it_and_a_rerun_loses_nothing(tmp_path, files):
    """The rubric raises from the 11th episode a process scores (in the third step: 4 episodes a
    step, a checkpoint every 2): the run stops naming the error, never training a 0; the same
    command, the rubric mended, resumes and keeps the schedule."""
    run = tmp_path / "run"
    code, out = run_to(run, REPO_ROOT, files, env_extra={"JOURNAL_CALC_RAISE_AFTER": "10"})
    assert code not in (0, -signal.SIGKILL), out[-3000:]
    assert "the rubric is broken" in out and "failed on ordinal" in out, out[-3000:]
    trained = [r for r in read_records(run / "metrics.jsonl")]
    assert trained and max(r["step"] for r in trained) < STEPS
    code, out = run_to(run, REPO_ROOT, files)
    assert code == 0, out[-3000:]
    assert_exact_run(run, STEPS, N)


def test_an_env_that_plays_turn_by_turn_trains_every_turn_as_one_sample(tmp_path, files):
    """`asyncrl_guess` (examples/verifiers): an `Env` whose `run()` answers each guess itself
    (the MultiTurnEnv of older verifiers), its seat relaunched each turn with the conversation
    so far. Every turn continues its sample: no prefix break, several calls a run."""
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "asyncrl.cli", "train",
        str(REPO_ROOT / "configs" / "agent_demo.yaml"), "--run-dir", str(run),
        f"model.path={files['model']}",
        "agent.name=verifiers:asyncrl_guess",
        "agent.args={num_tasks: 8, max_turns: 3}",
        "run.max_num_steps=2",
        "rollout.num_prompts_per_step=2",
        "rollout.num_generations_per_prompt=2",
        "logging.progress=false",
        "logging.plot=false",
    ]  # fmt: skip
    proc = launcher.popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    last = read_records(run / "metrics.jsonl")[-1]
    assert last["agent/prefix_breaks"] == 0
    assert last["agent/calls"] > last["agent/runs_landed"] == 8
    assert "reward/solved" in last
    assert_exact_run(run, 2, 2)
