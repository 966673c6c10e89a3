"""A launch ends its launched servers and its scratch copy of the model however it ends (issue 63,
defect 5): exit 130 by `os._exit` (the same signal twice), an interpreter exit that never
called `shutdown`, a SIGKILL of the trainer alone; so does vLLM in process
(`rollout.engine=vllm`) its copy. And what a kill of everything leaves, the next launch ends,
by what was recorded: a group only while it is still the recorded one (a pid is reused), also
when its leader died and its members live."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import process_gone

from asyncrl.rollout import lifeline
from asyncrl.rollout.lifeline import Proc, leftover_groups, start_time
from asyncrl.rollout.servers import RECORD, Server, stop_stale

TESTS = Path(__file__).resolve().parent


# -- which recorded groups are still the recorded ones: pure -------------------------------------


def test_a_recorded_group_is_ended_only_while_its_leader_is_the_recorded_process():
    table = {100: Proc(100, 100, 5000), 101: Proc(100, 100, 5001)}
    assert leftover_groups([(100, 5000)], table, own_pgrp=1) == [100]
    # pid 100 is another process now (another start time): the recorded group ended
    assert leftover_groups([(100, 4000)], table, own_pgrp=1) == []
    assert leftover_groups([(100, 0)], table, own_pgrp=1) == []  # no start time: never
    assert leftover_groups([(100, 5000)], table, own_pgrp=100) == []  # this process's own


def test_a_group_whose_leader_died_is_ended_through_the_members_it_left():
    """vLLM's engine outliving the server's process: members of the recorded session, started
    after its leader (Linux reuses no pid while a group of that id lives)."""
    table = {101: Proc(100, 100, 5001), 300: Proc(300, 300, 9000)}
    assert leftover_groups([(100, 5000)], table, own_pgrp=1) == [100]
    assert leftover_groups([(100, 6000)], table, own_pgrp=1) == []  # started before: not it
    assert leftover_groups([(200, 5000)], table, own_pgrp=1) == []  # nothing of it lives


# -- the next launch: real processes --------------------------------------------------------------


def session_with_a_member() -> tuple[int, int, int]:
    """A session (as a launched server's) whose leader has exited, leaving a member (its
    engine): (leader pid, leader start time, member pid)."""
    script = "sleep 600 & echo $!; read _"
    pipe = subprocess.PIPE
    leader = subprocess.Popen(["sh", "-c", script], stdin=pipe, stdout=pipe, text=True,
                              start_new_session=True)  # fmt: skip
    assert leader.stdout is not None and leader.stdin is not None
    member = int(leader.stdout.readline())
    started = start_time(leader.pid)
    leader.stdin.close()
    leader.wait()  # reaped: no /proc entry of the leader remains
    return leader.pid, started, member


def test_the_next_launch_ends_a_recorded_group_whose_leader_died_and_spares_a_reused_pid(
    tmp_path,
):
    pid, started, member = session_with_a_member()
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)  # not the recorded one
    try:
        rows = [{"index": 0, "pid": pid, "started": started},
                {"index": 1, "pid": other.pid, "started": start_time(other.pid) - 1}]  # fmt: skip
        (tmp_path / RECORD).write_text(json.dumps(rows))
        assert stop_stale(tmp_path) == [pid]
        assert process_gone(member, 30)
        assert other.poll() is None  # its pid recorded, its start time not: left alone
        assert not (tmp_path / RECORD).exists()
    finally:
        other.kill()
        other.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def test_a_reaped_servers_signal_never_reaches_a_process_that_reused_its_pid():
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        reaped = SimpleNamespace(pid=other.pid, returncode=0)  # its pid reused by `other`
        server = Server(0, "", process=reaped, started=start_time(other.pid) - 1)  # type: ignore[arg-type]
        server.signal(signal.SIGKILL)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_guard_ends_the_recorded_groups_still_alive_and_removes_the_recorded_paths(tmp_path):
    """The guard's cleanup, run here on its input: a live recorded group is ended whole, a
    recorded pid that is another process's is spared, the paths are removed."""
    server = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"], start_new_session=True)
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    scratch = tmp_path / ".scratch" / "copy"
    scratch.mkdir(parents=True)
    rows = [{"group": server.pid, "started": start_time(server.pid)},
            {"group": other.pid, "started": start_time(other.pid) + 1},
            {"path": str(scratch)}]  # fmt: skip
    try:
        lifeline.guard(BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'{"gr'))
        assert server.wait(30) == -signal.SIGKILL
        assert other.poll() is None and not scratch.exists()
    finally:
        for process in (server, other):
            process.kill()
            process.wait()


# -- a launch that ends at once: real processes, stand-in servers -------------------------------

CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
from helpers import DIGITS
from asyncrl.config import ModelConfig
from asyncrl.models.policy import load_policy
from asyncrl.rollout import servers, vllm_server
from asyncrl.rollout.engine import EngineSpec, GenerationRequest
from asyncrl.rollout.weight_sync import CopyWeightSync

servers.server_command = lambda model_dir, port, dtype, vllm: [
    sys.executable, {fake!r}, "--port", str(port), "--child"]
policy = load_policy(ModelConfig(), seed=0, alphabet=DIGITS)
weights = CopyWeightSync(max_versions=2)
weights.publish(0, policy.model.state_dict())
run = {run!r}
options = {{"servers": {{"launch": 2}}, "run_dir": run}}
spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 4, 1.0, options=options,
                  scratch_dir=os.path.join(run, ".scratch"))
engine = vllm_server.VLLMServerEngine(spec, weights)
engine.generate([GenerationRequest([1, 2], 2, noise_seed=i) for i in range(4)])
guard = getattr(engine, "_lifeline", None)
up = {{"guard": guard.process.pid if guard else 0, "scratch": engine._dir}}
print("UP", json.dumps(up), flush=True)
sys.stdin.read()
if {end!r} == "exit":
    sys.exit(1)  # an exception's way out, with no shutdown called
os._exit(130)  # the same signal twice (train/signals.py)
"""


def start_child(code: str) -> tuple[subprocess.Popen, dict]:
    """A child running `code` once it printed `UP {json}` (its state to look at)."""
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    lines = [child.stdout.readline()]
    while lines[-1] and not lines[-1].startswith("UP "):
        lines.append(child.stdout.readline())
    assert lines[-1], "".join(lines)
    return child, json.loads(lines[-1][3:])


def end_child(child: subprocess.Popen, end: str, up: dict) -> None:
    """Ends the child as `end` says (SIGKILL, or its stdin closed: it ends itself), then waits
    for the state to look at: its lifeline's guard has done its work."""
    if end == "SIGKILL":
        child.kill()
    else:
        assert child.stdin is not None
        child.stdin.close()
    child.wait(60)
    if up["guard"]:
        assert process_gone(up["guard"], 60)


@pytest.mark.slow
@pytest.mark.parametrize("end", ["os._exit(130)", "exit", "SIGKILL"])
def test_a_launch_that_ends_at_once_leaves_no_server_process_and_no_scratch_copy(tmp_path, end):
    """Two launched servers (stand-ins, each with one more process in its group, as vLLM's
    engine) have served a batch; the launch then ends without stopping them. Once its lifeline
    has done its work, no process of either group is left, and the scratch copy is gone."""
    run = tmp_path / "run"
    code = CHILD.format(tests=str(TESTS), fake=str(TESTS / "fake_vllm.py"), run=str(run),
                        end="exit" if end == "exit" else "")  # fmt: skip
    child, up = start_child(code)
    rows = json.loads((run / "servers" / RECORD).read_text())
    pids = [row["pid"] for row in rows]
    for index in range(2):  # their engines: one more process in each group
        log = (run / "servers" / f"server_{index}.log").read_text()
        pids += [int(x.split()[-1]) for x in log.splitlines() if x.startswith("fake_vllm child")]
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]  # the precondition, read now
    assert len(pids) == 4 and alive == pids, (pids, alive)
    end_child(child, end, up)
    assert all(process_gone(pid, 10) for pid in pids), pids
    assert not Path(up["scratch"]).exists()


# -- vLLM in process: its scratch copy, with no server to end ------------------------------------

ENGINE_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
from helpers import DIGITS
from asyncrl.config import ModelConfig
from asyncrl.models.policy import load_policy
from asyncrl.rollout import vllm_engine
from asyncrl.rollout.engine import EngineSpec
from asyncrl.rollout.weight_sync import CopyWeightSync

vllm_engine._start_llm = lambda path, spec, options: None  # the copy's code path, not vLLM's
policy = load_policy(ModelConfig(), seed=0, alphabet=DIGITS)
spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 4, 1.0, scratch_dir={scratch!r})
engine = vllm_engine.VLLMGenerationEngine(spec, CopyWeightSync(max_versions=2))
guard = getattr(engine, "_lifeline", None)
up = {{"guard": guard.process.pid if guard else 0, "copy": engine._dir}}
print("UP", json.dumps(up), flush=True)
sys.stdin.read()
os._exit(130)  # the same signal twice (train/signals.py)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["os._exit(130)", "SIGKILL"])
def test_an_in_process_vllm_engine_that_ends_at_once_leaves_no_scratch_copy(tmp_path, end):
    """`rollout.engine=vllm`'s copy of the model (its config, under `RUN_DIR/.scratch/`), made
    by the engine's own start-up (vLLM itself stubbed out), is gone once the process that made
    it ends by `os._exit` or SIGKILL, neither of which runs a finalizer: its lifeline removes
    it, not the next launch."""
    code = ENGINE_CHILD.format(tests=str(TESTS), scratch=str(tmp_path / ".scratch"))
    child, up = start_child(code)
    copy = Path(up["copy"])
    assert (copy / "config.json").exists() and copy.parent == tmp_path / ".scratch"
    end_child(child, end, up)
    assert not copy.exists()


@pytest.mark.slow
def test_a_collected_in_process_vllm_engine_removes_its_copy_and_ends_its_guard(
    tmp_path, monkeypatch
):
    """An engine dropped in a process that lives on (a test, a rebuilt engine) leaves neither
    its copy nor a guard process behind."""
    from helpers import DIGITS

    from asyncrl.config import ModelConfig
    from asyncrl.models.policy import load_policy
    from asyncrl.rollout import vllm_engine
    from asyncrl.rollout.engine import EngineSpec
    from asyncrl.rollout.weight_sync import CopyWeightSync

    monkeypatch.setattr(vllm_engine, "_start_llm", lambda path, spec, options: None)
    policy = load_policy(ModelConfig(), seed=0, alphabet=DIGITS)
    spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 4, 1.0,
                      scratch_dir=str(tmp_path / ".scratch"))  # fmt: skip
    engine = vllm_engine.VLLMGenerationEngine(spec, CopyWeightSync(max_versions=2))
    copy, guard = Path(engine._dir), engine._lifeline.process
    assert copy.exists() and guard.poll() is None
    del engine
    gc.collect()
    assert guard.poll() is not None  # ended, and waited for
    assert not copy.exists()
