"""Ray drains on a real local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head node
with no CPUs, where the driver and the buffer actor run, and two 1-CPU nodes for the generation
worker). The drain is Ray's own command, `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N`; the node is then SIGKILLed, as the autoscaler would at the
deadline. Every moment is placed by state: the drain and the control's kill while the worker
has just begun a call (its process title turns to `ray::GenerationWorker.generate`, Ray's
own), the kill after the run's `drain_handback` event.

- A generation node drained: its worker hands its call back with the tokens it has, they are
  continued on a worker on the other node, no batch fails (a failed batch is the only way
  generated tokens are thrown away), every group lands once, the schedule is exact and the
  audit passes. Control: `ray.watch_drains=false` (the old behaviour), the same kill loses the
  worker's batch.
- The trainer's node drained: a notice with Ray's deadline, a verified checkpoint, exit 75;
  the same command resumes and finishes with the audit passing.

Ray binds its servers to the node address: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes it
127.0.0.1 for every process (this machine cannot reach its own external address).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_exact_run, landed_per_ordinal, read_records

from asyncrl.cli.inspect import inspect_run_dir, preemption_line

pytestmark = pytest.mark.slow

N = 16
LOCAL = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    saved = {key: os.environ.get(key) for key in LOCAL}
    os.environ.update(LOCAL)
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="rd", dir="/tmp")  # Ray's socket paths must stay short
    head = {"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "temp_dir": temp}  # fmt: skip
    made = Cluster(initialize_head=True, connect=False, head_node_args=head)
    try:
        yield made
    finally:
        made.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def cluster(ray_cluster: Any) -> Any:
    """The module's cluster with two generation nodes alive (a test kills one)."""
    while len(ray_cluster.worker_nodes) < 2:
        ray_cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray_cluster.wait_for_nodes()
    return ray_cluster


def start_run(repo_root: Path, run: Path, address: str, *overrides: str) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml"),
        "--run-dir", str(run), "rollout.backend=ray", "rollout.num_workers=1",
        f"ray.address={address}", "ray.drain_poll_s=0.02", f"rollout.num_prompts_per_step={N}",
        "rollout.max_new_tokens=56", "run.max_num_steps=8", "checkpoint.save_period=4",
        "logging.progress=false", "logging.plot=false", *overrides,
    ]  # fmt: skip
    env = {**os.environ, **LOCAL, "PYTHONWARNINGS": "ignore"}
    out = open(run.parent / f"{run.name}.out", "a")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def events(run: Path, name: str) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return [r for r in records if r["event"] == name]


def wait_for(what: str, ready: Callable[[], Any], proc: subprocess.Popen, run: Path) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while not (found := ready()):
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {what}:\n{output(run)}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {TIMEOUT_S} s:\n{output(run)}")
        time.sleep(0.01)
    return found


def output(run: Path, tail: int = 3000) -> str:
    return (run.parent / f"{run.name}.out").read_text()[-tail:]


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def call_started(pid: int, proc: subprocess.Popen, run: Path) -> None:
    """Returns once the run's worker process `pid` (its `generation_worker` event's: never
    another suite's) has just begun a call: Ray titles an actor's process `ray::CLASS`, and
    `ray::CLASS.METHOD` while a method runs (a call lasts a few hundred ms; the watcher polls
    every 20 ms)."""
    wait_for("an idle worker", lambda: title(pid) == "ray::GenerationWorker", proc, run)
    wait_for("a call", lambda: title(pid) != "ray::GenerationWorker", proc, run)
    assert title(pid) in ("ray::GenerationWorker.generate", ""), title(pid)


def worker_node(run: Path, proc: subprocess.Popen, cluster: Any) -> tuple[Any, int]:
    """The cluster node the run's generation worker runs on and its process id, once the run
    has trained two steps (its workers are busy generating for the next ones)."""

    def placed() -> dict[str, Any] | None:
        steps = len(read_records(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
        placements = events(run, "generation_worker")
        return placements[-1] if steps >= 2 and placements else None

    placement = wait_for("a placed generation worker", placed, proc, run)
    (node,) = [n for n in cluster.worker_nodes if n.node_id == placement["node"]]
    return node, int(placement["pid"])


def drain_now(cluster: Any, node_id: str, deadline_s: int = 60) -> None:
    """The drain `ray drain-node` asks for, through the same GCS call, without the command's
    second or two of start-up (a generation call here is shorter)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = time.time_ns() // 1_000_000 + deadline_s * 1000
    accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
        node_id, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION, "spot reclaimed", deadline_ms
    )
    assert accepted, why


def drain(cluster: Any, node_id: str, deadline_s: int = 60) -> None:
    """Ray's command."""
    subprocess.run(
        ["ray", "drain-node", "--address", cluster.address, "--node-id", node_id,
         "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaimed",
         "--deadline-remaining-seconds", str(deadline_s)],
        check=True, env={**os.environ, **LOCAL}, capture_output=True, timeout=60,
        executable=str(Path(sys.executable).parent / "ray"),
    )  # fmt: skip


@pytest.mark.parametrize("watch", [True, False], ids=["hands-back", "control-old-behaviour"])
def test_a_drained_generation_node_hands_its_tokens_back(tmp_path, repo_root, cluster, watch):
    run = tmp_path / "run"
    proc = start_run(repo_root, run, cluster.address, f"ray.watch_drains={str(watch).lower()}")
    try:
        node, pid = worker_node(run, proc, cluster)
        call_started(pid, proc, run)
        drain_now(cluster, node.node_id)
        if watch:
            (handback,) = wait_for("the hand-back", lambda: events(run, "drain_handback"), proc,
                                   run)  # fmt: skip
        else:
            call_started(pid, proc, run)
        cluster.remove_node(node, allow_graceful=False)  # SIGKILL: the deadline's kill
        assert proc.wait(TIMEOUT_S) == 0, output(run)
    finally:
        proc.kill()
    last = assert_exact_run(run, 8, N)[-1]
    assert set(landed_per_ordinal(run).values()) == {1}  # every group landed once
    spans = [s for s in read_records(run / "timeline.jsonl") if s["kind"] == "generate"]
    (notice,) = events(run, "preemption_notice") or [None]
    if not watch:  # the kill took the worker's batch: thrown away, generated again
        assert notice is None
        assert last["generation_failures"] >= 1 and last["workers_replaced"] == 1, last
        return
    assert notice["source"] == "ray_drain" and notice["node"] == node.node_id
    assert notice["role"] == "generation" and notice["workers"] == [0]
    assert 0 < notice["deadline_s"] <= 60
    # the worker was in a call and ended it at once, handing its requests back unfinished with
    # the tokens it had (none if the drain came before its first token; that the tokens are
    # the ones an uninterrupted call samples is tests/test_engine.py's)
    assert handback["in_call"] and handback["stopped_early"], handback
    assert handback["requests"] > 0 and handback["unfinished_samples"] > 0, handback
    assert last["generation_failures"] == 0 and last["workers_retired"] == 1, last
    assert last["workers_replaced"] == 0, last
    # its replacement runs on the other node
    placements = events(run, "generation_worker")
    assert [p["incarnation"] for p in placements] == [0, 1]
    assert placements[1]["node"] not in ("", node.node_id)
    # the handed-back samples went on from their tokens: a timeline row of two or more passes
    passes: dict[tuple[int, ...], int] = {}
    for span in spans:
        key = tuple(span["ordinals"])
        passes[key] = passes.get(key, 0) + span["chunks"]
    assert max(passes.values()) >= 2, spans
    assert "handed back" in output(run, tail=0)
    line = preemption_line(inspect_run_dir(run)["last_preemption"])
    assert line.startswith(f"last preemption: ray_drain of node {node.node_id[:8]} (deadline")
    assert f"handed back {handback['requests']} requests ({handback['tokens']} tokens kept)" in line


def test_a_drained_trainer_node_checkpoints_and_the_run_resumes(tmp_path, repo_root, cluster):
    run = tmp_path / "run"
    # steps enough that the drain, not the end, stops it: the command's start-up takes
    # seconds, a step here a fraction of one
    proc = start_run(repo_root, run, cluster.address, "run.max_num_steps=1000")
    try:
        worker_node(run, proc, cluster)  # the run is under way
        drain(cluster, cluster.head_node.node_id, deadline_s=45)
        assert proc.wait(TIMEOUT_S) == 75, output(run)
    finally:
        proc.kill()
    (notice,) = events(run, "preemption_notice")
    assert notice["source"] == "ray_drain" and notice["node"] == cluster.head_node.node_id
    assert 0 < notice["deadline_s"] <= 45
    (result,) = events(run, "preemption_result")
    # the run's account, not the machine's speed: whether the deadline was met is what the
    # measured seconds say (a slow machine may miss it; the checkpoint is verified either way)
    assert result["met"] == (result["notice_to_durable_s"] <= result["deadline_s"]), result
    saved = [e for e in events(run, "checkpoint") if e["reason"] == "stop"]
    assert saved and saved[-1]["step"] == result["step"]
    assert "ray_drain: preemption notice" in output(run, tail=0)
    line = preemption_line(inspect_run_dir(run)["last_preemption"])
    assert line.startswith(f"last preemption: ray_drain at step {result['step']} (deadline")
    assert ("(met" if result["met"] else "(MISSED") in line, line
    steps = result["step"] + 4  # the resumed launch trains 4 more
    resumed = start_run(repo_root, run, cluster.address, f"run.max_num_steps={steps}")
    try:
        assert resumed.wait(TIMEOUT_S) == 0, output(run)
    finally:
        resumed.kill()
    assert f"resumed at step {result['step']}" in output(run, tail=0)
    assert_exact_run(run, steps, N)
