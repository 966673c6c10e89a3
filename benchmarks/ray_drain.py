"""What a Ray drain of a generation node costs a run, on a real local three-node Ray cluster
(`ray.cluster_utils.Cluster`: a head node without CPUs for the driver, two 1-CPU nodes for the
generation worker), `configs/demo.yaml` on `rollout.backend=ray`.

Each trial: once the run has trained 2 steps, its worker's node is drained (`ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 60`, through the GCS call the
command makes) when the worker has just begun a call, and SIGKILLed after the hand-back (or, in
the control, `ray.watch_drains=false`, at the worker's next call). Printed per trial: seconds
from the drain to the hand-back, requests and tokens handed back, seconds until the replacement
was placed on the other node, failed batches (a failed batch's tokens are generated again).

    .venv/bin/python benchmarks/ray_drain.py [--trials 3]

Last line: `ray_drain: handback_s=A tokens_kept=K failed_batches=F control_failed_batches=C`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOCAL = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
IDLE = "ray::GenerationWorker"  # its process title; `.generate` added during a call


def events(run: Path, name: str) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record["event"] == name:
            found.append(record)
    return found


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def wait(ready: Any, proc: subprocess.Popen) -> Any:
    while not (found := ready()):
        if proc.poll() is not None:
            raise SystemExit(f"the run ended ({proc.returncode}) early")
        time.sleep(0.005)
    return found


def trial(watch: bool, work: Path, index: int) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2

    temp = tempfile.mkdtemp(prefix="rd", dir="/tmp")
    head = {"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "temp_dir": temp}  # fmt: skip
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    run = work / f"{'watch' if watch else 'control'}-{index}"
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        args = [
            sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "configs/demo.yaml"),
            "--run-dir", str(run), "rollout.backend=ray", "rollout.num_workers=1",
            f"ray.address={cluster.address}", "ray.drain_poll_s=0.02",
            f"ray.watch_drains={str(watch).lower()}", "rollout.max_new_tokens=56",
            "run.max_num_steps=10", "logging.progress=false", "logging.plot=false",
        ]  # fmt: skip
        out = open(work / f"{run.name}.out", "w")  # noqa: SIM115
        proc = subprocess.Popen(args, env={**os.environ, **LOCAL}, stdout=out, stderr=out)
        metrics = run / "metrics.jsonl"

        def placed() -> dict[str, Any] | None:
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            where = events(run, "generation_worker")
            return where[-1] if steps >= 2 and where else None

        placement = wait(placed, proc)
        node_id, pid = placement["node"], int(placement["pid"])  # Ray titles its process
        (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
        wait(lambda: title(pid) == IDLE, proc)
        wait(lambda: title(pid) != IDLE, proc)  # a call has just begun
        drained = time.time()
        accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
            node_id, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION, "benchmark",
            int(drained * 1000) + 60_000,
        )  # fmt: skip
        assert accepted, why
        if watch:
            wait(lambda: events(run, "drain_handback"), proc)
        else:
            wait(lambda: title(pid) == IDLE, proc)
            wait(lambda: title(pid) != IDLE, proc)
        cluster.remove_node(node, allow_graceful=False)
        code = proc.wait()
        assert code == 0, (work / f"{run.name}.out").read_text()[-2000:]
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    last = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    result: dict[str, Any] = {"failed_batches": last["generation_failures"]}
    if watch:
        (handback,) = events(run, "drain_handback")
        placements = events(run, "generation_worker")
        result.update(
            handback_s=handback["after_s"],
            requests=handback["requests"],
            tokens=handback["tokens"],
            placed_s=placements[-1]["time"] - handback["time"],
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (a temp dir)")
    options = parser.parse_args()
    os.environ.update(LOCAL)
    work = options.dir or Path(tempfile.mkdtemp(prefix="ray_drain_"))
    work.mkdir(parents=True, exist_ok=True)
    print("trial  mode     drain_to_handback_s  requests  tokens_kept  replacement_placed_s  "
          "failed_batches")  # fmt: skip
    watched, controls = [], []
    for index in range(options.trials):
        for watch in (True, False):
            r = trial(watch, work, index)
            (watched if watch else controls).append(r)
            if watch:
                figures = (f"{r['handback_s']:19.2f}  {r['requests']:8d}  {r['tokens']:11d}  "
                           f"{r['placed_s']:20.1f}")  # fmt: skip
                print(f"{index:5d}  drain    {figures}  {r['failed_batches']:14d}")
            else:
                print(f"{index:5d}  control  {'-':>19}  {'-':>8}  {'-':>11}  {'-':>20}  "
                      f"{r['failed_batches']:14d}")  # fmt: skip
    handback = max(r["handback_s"] for r in watched)
    print(
        f"ray_drain: handback_s={handback:.2f} tokens_kept={sum(r['tokens'] for r in watched)} "
        f"failed_batches={sum(r['failed_batches'] for r in watched)} "
        f"control_failed_batches={sum(r['failed_batches'] for r in controls)}"
    )


if __name__ == "__main__":
    main()
