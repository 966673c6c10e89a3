"""`train.num_processes` end to end: real rank processes, real SIGKILLs, sharded checkpoints.

- A 2-rank run whose driver, and whose other rank, are SIGKILLed at random moments and in the
  middle of a checkpoint resumes to the end with every step trained on exactly its ordinals
  (I1), nothing kept regenerated (I3), and `asyncrl audit` passing.
- A checkpoint torn on one rank only (one rank file changed) is never loaded.
- Resharding: a checkpoint of 2 ranks resumes on 1 and then on 3 with the same schedule and
  the same state: the weights a resumed rank layout starts from are the checkpoint's, bit for
  bit, and one more step from the same checkpoint on 1 and on 3 ranks gives the same weights
  (within float summation order) — a resume that skipped the resharded optimizer would not.
- Deterministic mode on 2 ranks: killed (driver or other rank) and resumed is bitwise the
  uninterrupted 2-rank run.
- A 2-rank run learns the demo task.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import launcher
import pytest
import torch
from helpers import read_complete_records, read_records, run_cli
from safetensors.torch import load_file
from test_crash import audit, generations_per_ordinal, kill_after_steps
from test_crash import launch as crash_launch
from test_determinism import fingerprint
from test_determinism import launch as det_launch

pytestmark = pytest.mark.slow

TWO = "train.num_processes=2"
STEPS = 12
"""Steps of the deterministic 2-rank runs."""


def rank_processes(driver: int) -> list[int]:
    """PIDs of the trainer ranks > 0 that the driver process `driver` (rank 0) started and that
    are still alive. A rank's environment names its driver (`ASYNCRL_PARENT_PID`), so they are
    found after the driver died too; no other process on the machine is ever counted. Ranks
    forked by the test launcher's rank zygote (whose /proc environ is the zygote's) are found
    in its own list."""
    tag = f"ASYNCRL_PARENT_PID={driver}".encode()
    found = launcher.rank_pids(driver)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if tag in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_for_no_rank_processes(driver: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while rank_processes(driver) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(driver), "a trainer rank outlived its run"


def test_two_ranks_killed_anywhere_resume_without_losing_or_redoing_anything(tmp_path, repo_root):
    run, rng, n = tmp_path / "run", random.Random(7), 4
    # the other rank dies while writing its files of the second checkpoint (step 6)
    wait = "checkpoint.when_busy=wait"  # step 6 gets its checkpoint however slow the disk
    proc = crash_launch(run, repo_root, TWO, wait, fault="checkpoint.rank_file_written[step=6]")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "trainer rank 1" in out and "exited with -9" in out, out
    assert not (run / "checkpoints" / "step_000006").exists()  # no newer checkpoint than 3
    wait_for_no_rank_processes(proc.pid)
    # the other rank dies after its share of step 5 (the launch resumed at step 3)
    proc = crash_launch(run, repo_root, TWO, fault="rank.step_done[step=5]")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "trainer rank 1" in out, out
    wait_for_no_rank_processes(proc.pid)
    # the other rank is SIGKILLed at a random moment, once the launch trains
    proc = crash_launch(run, repo_root, TWO)
    steps_before = len(read_complete_records(run / "metrics.jsonl"))
    while len(read_complete_records(run / "metrics.jsonl")) < steps_before + rng.randint(2, 6):
        assert proc.poll() is None
        time.sleep(0.01)
    (rank,) = rank_processes(proc.pid)
    os.kill(rank, signal.SIGKILL)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 1 and "trainer rank 1" in out, out
    wait_for_no_rank_processes(proc.pid)
    # the driver (rank 0) is SIGKILLed at random moments: its other rank follows it
    kills = 0
    for _ in range(2):
        proc = crash_launch(run, repo_root, TWO)
        kills += kill_after_steps(proc, run, rng.randint(2, 8))
        wait_for_no_rank_processes(proc.pid)
    assert kills == 2
    proc = crash_launch(run, repo_root, TWO)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out

    metrics = read_records(run / "metrics.jsonl")
    final = {r["step"]: r for r in metrics}
    assert sorted(final) == list(range(45))
    for t, record in final.items():
        assert record["prompt_ordinals"] == list(range(t * n, (t + 1) * n))  # I1
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) >= 5 and all(e["skipped_ordinals"] == [] for e in resumes)
    generated = generations_per_ordinal(run)
    for resume in resumes:  # I3
        for k in resume["kept_groups"]:
            assert [a for a in generated[k] if a >= resume["attempt"]] == [], k
    done = audit(run)
    assert done.returncode == 0 and "45 steps" in done.stdout, done.stdout


def test_a_stopped_rank_stops_the_run_in_seconds_and_a_rerun_resumes(tmp_path, repo_root):
    """A stopped rank (SIGSTOP: alive, its sockets open, so no collective fails; a hung rank or
    a machine off the network looks the same) held rank 0 in a collective for 30 minutes; its
    silent heartbeat now stops the run with RankFailed after train.rank_timeout_s."""
    run = tmp_path / "run"
    proc = crash_launch(run, repo_root, TWO, "train.rank_timeout_s=3")
    while len(read_complete_records(run / "metrics.jsonl")) < 4:
        assert proc.poll() is None
        time.sleep(0.01)
    (rank,) = rank_processes(proc.pid)
    os.kill(rank, signal.SIGSTOP)
    try:  # the bound only stops a hang: the run stops itself ~3 s after the rank fell silent
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        if rank in rank_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):  # it may end after the look
                os.kill(rank, signal.SIGKILL)
    assert proc.returncode == 1, out
    assert "trainer rank 1 sent no heartbeat for" in out, out
    wait_for_no_rank_processes(proc.pid)
    proc = crash_launch(run, repo_root, TWO)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    done = audit(run)
    assert done.returncode == 0 and "45 steps" in done.stdout, done.stdout


def short_run(run: Path, repo_root: Path, steps: int, *extra: str, skip: str = "") -> str:
    proc = det_launch(run, repo_root, skip=skip, extra=(f"run.max_num_steps={steps}", *extra))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return out


def test_a_checkpoint_torn_on_one_rank_only_is_never_loaded(tmp_path, repo_root, two_rank_run):
    run = tmp_path / "run"
    shutil.copytree(two_rank_run, run)
    newest = run / "checkpoints" / f"step_{STEPS:06d}"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["format_version"] == 5
    assert {"model.rank_001.safetensors", "state.rank_001.safetensors"} <= set(manifest["files"])
    torn = newest / "state.rank_001.safetensors"
    data = bytearray(torn.read_bytes())
    data[-1] ^= 0xFF  # rank 1's last optimizer moment byte
    torn.write_bytes(bytes(data))
    out = short_run(run, repo_root, STEPS, TWO)
    assert "skipping checkpoint" in out and "state.rank_001.safetensors" in out, out
    assert f"resumed at step {STEPS - 3}" in out, out
    assert audit(run).returncode == 0


def test_a_rank_file_without_its_rows_is_judged_before_loading_and_skipped(
    tmp_path, repo_root, two_rank_run
):
    """A rank file that hashes as its manifest says but lacks a tensor's rows (a writer's bug,
    not a torn write) is refused by the coherence check, so the resume falls back to the
    older checkpoint (I4); it used to pass `latest()` and stop the launch in `decode`."""
    import hashlib

    from safetensors.torch import save_file

    run = tmp_path / "run"
    shutil.copytree(two_rank_run, run)
    newest = run / "checkpoints" / f"step_{STEPS:06d}"
    wrong = newest / "model.rank_001.safetensors"
    held = load_file(wrong)
    dropped = sorted(held)[0]
    save_file({k: v for k, v in held.items() if k != dropped}, wrong)
    manifest = json.loads((newest / "manifest.json").read_text())
    data = wrong.read_bytes()
    manifest["files"][wrong.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    out = short_run(run, repo_root, STEPS, TWO)
    assert "skipping checkpoint" in out and f"rank 1's rows of {dropped}" in out, out
    assert f"resumed at step {STEPS - 3}" in out, out
    assert audit(run).returncode == 0


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_resharding_2_to_1_to_3_continues_the_same_schedule_from_the_same_state(
    tmp_path, repo_root
):
    run = tmp_path / "run"
    short_run(run, repo_root, 3, TWO)
    exported = tmp_path / "step3"
    done = run_cli("export", str(run), "--checkpoint", "step_000003", str(exported))
    assert done.returncode == 0, done.stderr
    # a relaunch at its own step trains nothing: it ends with the weights it restored
    for ranks in (1, 3):
        copy = tmp_path / f"restored-{ranks}"
        shutil.copytree(run, copy)
        short_run(copy, repo_root, 3, f"train.num_processes={ranks}", "--force-config")
        restored, saved = weights(copy / "final_model"), weights(exported)
        assert restored.keys() == saved.keys(), ranks  # tied weights stored once, as saved
        assert all(torch.equal(restored[k], v) for k, v in saved.items()), ranks
    # one more step from the same checkpoint on 1 and on 3 ranks: the same update
    after = {}
    for ranks, skip in ((1, ""), (3, ""), (3, "optimizer")):
        copy = tmp_path / f"step4-{ranks}-{skip}"
        shutil.copytree(run, copy)
        short_run(copy, repo_root, 4, f"train.num_processes={ranks}", "--force-config", skip=skip)
        after[ranks, skip] = weights(copy / "final_model")

    def worst(a, b):
        return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b if b[k].norm() > 0)

    assert worst(after[3, ""], after[1, ""]) < 1e-5
    assert worst(after[3, "optimizer"], after[1, ""]) > 1e-3  # negative control
    # and the whole run goes on 2 -> 1 -> 3 ranks to its end, every step on its own ordinals
    short_run(run, repo_root, 6, "train.num_processes=1", "--force-config")
    short_run(run, repo_root, 9, "train.num_processes=3", "--force-config")
    final = {r["step"]: r for r in read_records(run / "metrics.jsonl")}
    assert sorted(final) == list(range(9))
    assert all(final[t]["prompt_ordinals"] == list(range(4 * t, 4 * t + 4)) for t in final)
    assert audit(run).returncode == 0


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, request):
    """An uninterrupted deterministic 2-rank run of STEPS steps (checkpoints every 3)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    short_run(run, Path(request.config.rootpath), STEPS, TWO)
    return run


@pytest.fixture(scope="module")
def two_rank_reference(two_rank_run):
    return fingerprint(two_rank_run)


def kill_by(run: Path, repo_root: Path, fault: str) -> None:
    extra = (f"run.max_num_steps={STEPS}", TWO)
    proc = det_launch(run, repo_root, fault=fault, extra=extra)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode in (-signal.SIGKILL, 1), out  # the driver killed, or it saw a rank die
    wait_for_no_rank_processes(proc.pid)


def test_two_ranks_killed_and_resumed_are_bitwise_the_uninterrupted_two_rank_run(
    tmp_path, repo_root, two_rank_reference
):
    run = tmp_path / "run"
    # the other rank, writing its second file of step 6's checkpoint
    kill_by(run, repo_root, "checkpoint.rank_file_written[step=6]:2")
    kill_by(run, repo_root, "train.weights_published[step=5]")  # the driver, after step 5
    kill_by(run, repo_root, "rank.step_done[step=7]")  # the other rank, after its share of 7
    short_run(run, repo_root, STEPS, TWO)
    assert {r["attempt"] for r in read_records(run / "metrics.jsonl")} == {0, 1, 2, 3}
    assert fingerprint(run) == two_rank_reference


def test_a_notice_mid_step_gives_the_step_up_on_every_rank_and_resumes_bitwise(
    tmp_path, repo_root, two_rank_reference, monkeypatch
):
    """SIGTERM to rank 0 as step 7's first backward is about to run (placed by state): every
    rank gives the step up before that pass (they agree on rank 0's notice before each
    backward), so the checkpoint is of step 7, the state before it, not of step 8 as at the
    next step boundary (the behaviour before); the resume is bit for bit the uninterrupted
    two-rank run."""
    from asyncrl.checkpoint.run_checkpoints import run_store

    monkeypatch.setenv("ASYNCRL_FAULT_SIGNAL", "SIGTERM")
    run = tmp_path / "run"
    proc = det_launch(run, repo_root, fault="train.backward[step=7]",
                      extra=(f"run.max_num_steps={STEPS}", TWO))  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out
    wait_for_no_rank_processes(proc.pid)
    (result,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "preemption_result"]
    assert (result["step"], result["abandoned_step"]) == (7, True)
    latest, _ = run_store(run).latest()
    assert latest is not None and latest.step == 7 and latest.format_version == 5  # both ranks'
    monkeypatch.delenv("ASYNCRL_FAULT_SIGNAL")
    short_run(run, repo_root, STEPS, TWO)
    assert fingerprint(run) == two_rank_reference
    assert audit(run).returncode == 0


def test_a_two_rank_resume_that_skips_the_optimizer_is_caught(
    tmp_path, repo_root, two_rank_reference
):
    run = tmp_path / "run"
    kill_by(run, repo_root, "train.weights_published[step=4]")
    short_run(run, repo_root, STEPS, TWO, skip="optimizer")
    assert fingerprint(run) != two_rank_reference


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(local address as /proc/net writes it, pid) of every listening TCP socket of `pids`."""
    owner = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A: LISTEN
                found.append((fields[1], owner[fields[9]]))
    return found


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1, ::1


def test_the_socket_check_sees_a_socket_listening_on_every_interface():
    """Negative control for the check below."""
    import socket

    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        found = listening_sockets([os.getpid()])
        assert found and not all(a.startswith(LOOPBACK) for a, _ in found)


def test_a_two_rank_run_learns_the_demo_task_listening_on_loopback_only(
    tmp_path, repo_root, monkeypatch
):
    """It learns, and nothing of it listens beyond loopback while it trains (I7: the ranks
    meet through a file; gloo runs over `lo`). Its rank is started as users' are, a fresh
    `python -m asyncrl.train.ranks` (not forked by the test launcher's rank zygote)."""
    monkeypatch.setenv(launcher.SPAWN_VAR, "")
    run = tmp_path / "run"
    demo = (  # configs/demo.yaml's own shape, over the crash runs' settings
        "rollout.num_prompts_per_step=16",
        "rollout.num_generations_per_prompt=16",
        "rollout.max_trajectory_age_steps=1",
    )
    proc = crash_launch(
        run, repo_root, TWO, *demo, "run.max_num_steps=100", "checkpoint.save_period=50"
    )
    while len(read_complete_records(run / "metrics.jsonl")) < 5:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    pids = [proc.pid, *rank_processes(proc.pid)]
    assert len(pids) == 2
    sockets = listening_sockets(pids)
    assert sockets and all(address.startswith(LOOPBACK) for address, _ in sockets), sockets
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rewards = [r["reward_mean"] for r in read_records(run / "metrics.jsonl")]
    first, last = sum(rewards[:15]) / 15, sum(rewards[-15:]) / 15
    assert last > first + 0.15, (first, last)


def test_torchrun_starts_the_ranks_and_asyncrl_joins_them(tmp_path, repo_root):
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml"), "--run-dir", str(run),
        "run.max_num_steps=4", "checkpoint.save_period=2", "logging.progress=false",
        "logging.plot=false",
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"}
    done = launcher.run([*command, TWO], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((run / "checkpoints/step_000004/manifest.json").read_text())
    assert "model.rank_001.safetensors" in manifest["files"]
    assert audit(run).returncode == 0


def test_a_torchrun_world_size_other_than_num_processes_is_refused(monkeypatch):
    from helpers import small_config

    from asyncrl.config import ConfigError
    from asyncrl.train.ranks import launch

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for rank 0 of 2
    monkeypatch.setenv("RANK", "0")
    for ranks in (1, 3):
        with pytest.raises(ConfigError, match=f"train.num_processes: got {ranks}, but torchrun"):
            launch(small_config(f"train.num_processes={ranks}"))


def test_a_process_can_launch_two_ranked_runs_one_after_the_other(tmp_path, monkeypatch):
    """Rank 0 is the calling process (`train()` in Python, not the CLI): its environment is
    left as it was, so a second launch starts its own ranks again."""
    import tempfile

    from helpers import small_config

    from asyncrl.train.trainer import train

    tmp = tmp_path / "tmp"  # the system's temporary directory, for this test
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    config = small_config(TWO, "run.max_num_steps=2", "checkpoint.save_period=2")
    train(config, tmp_path / "run")
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    train(small_config(TWO, "run.max_num_steps=3", "eval.every_steps=3"), tmp_path / "run")
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    wait_for_no_rank_processes(os.getpid())  # this process was rank 0
    assert (tmp_path / "run" / ".scratch").is_dir() and not list(tmp.iterdir())  # run dir's
    assert not list((tmp_path / "run" / ".scratch").glob("asyncrl-ranks-*"))  # rendezvous gone
    # the run evaluated the full weights it published: `asyncrl eval` of its final checkpoint
    # (whole tensors from both ranks' files) gives the same numbers
    from asyncrl.cli.eval import evaluate_checkpoint

    step, metrics = evaluate_checkpoint(tmp_path / "run")
    assert step == 3
    for key in ("eval/reward_mean", "eval/greedy_reward"):
        assert metrics[key] == pytest.approx(records[-1][key], abs=1e-9), key
