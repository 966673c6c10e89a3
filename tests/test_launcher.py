"""The tests' pre-imported launcher (tests/launcher.py): what it forks is a real process that a
fresh interpreter would be, and the crash tests' kills stay real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launcher
import pytest
from helpers import process_gone

pytestmark = pytest.mark.slow  # it starts processes (the zygotes: seconds, once a worker)

PROBE = Path(__file__).with_name("launch_probe.py")


def probe(tmp_path: Path, code: int = 0, **env: str) -> tuple[dict, subprocess.CompletedProcess]:
    done = launcher.run(
        [sys.executable, str(PROBE), str(code), str(tmp_path / f"atexit-{code}")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **env},
    )
    return json.loads(done.stdout), done


@pytest.mark.skipif(not launcher.ENABLED, reason="ASYNCRL_TEST_NO_ZYGOTE is set")
def test_a_launch_gets_its_argv_folder_environment_streams_and_exit_code(tmp_path):
    seen, done = probe(tmp_path, 3, PROBE="yes")
    assert done.returncode == 3
    assert seen["argv"] == ["3", str(tmp_path / "atexit-3")]
    assert seen["cwd"] == str(tmp_path) and seen["probe"] == "yes"
    assert seen["path0"] == str(PROBE.parent)  # a script's folder first, as `python SCRIPT`
    assert seen["stdin"] == ""  # /dev/null
    assert done.stderr == "to stderr\n"
    assert (tmp_path / "atexit-3").read_text() == "atexit ran"  # the interpreter's own exit
    assert seen["torch_preloaded"], "not forked from the zygote"
    assert seen["ppid"] == os.getpid(), "reparented to the test process (the subreaper)"
    assert launcher.LAUNCHED, "counted for the fast tier's guard"


@pytest.mark.skipif(not launcher.ENABLED, reason="ASYNCRL_TEST_NO_ZYGOTE is set")
def test_consecutive_launches_draw_other_hash_seeds_and_a_set_one_gets_a_fresh_interpreter(
    tmp_path,
):
    first, _ = probe(tmp_path)
    second, _ = probe(tmp_path)
    assert first["pid"] != second["pid"]
    assert first["hash"] != second["hash"], "a run and its resume shared one hash seed"
    fixed = [probe(tmp_path, PYTHONHASHSEED="7")[0] for _ in range(2)]
    assert fixed[0]["hash"] == fixed[1]["hash"]
    assert not fixed[0]["torch_preloaded"], "PYTHONHASHSEED set: a fresh interpreter"


def test_sigkill_kills_the_launch_and_its_status_is_the_kernels(tmp_path):
    code = "import time; print('up', flush=True); time.sleep(600)"
    script = tmp_path / "sleeper.py"
    script.write_text(code)
    proc = launcher.popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.05)
    deadline = time.monotonic() + 120
    while not Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    assert process_gone(proc.pid)
    proc.communicate(timeout=60)


@pytest.mark.skipif(not launcher.ENABLED, reason="ASYNCRL_TEST_NO_ZYGOTE is set")
def test_a_rank_forked_for_a_launch_reports_its_exit_status_as_a_child_would(
    tmp_path, capfd, monkeypatch
):
    """`launcher.spawn`, what `asyncrl.train.ranks` calls through ASYNCRL_TEST_SPAWN: the rank
    zygote forks the process (another's child: its waiter's), with the asker's environment,
    folder and streams; the exit status comes back through the waiter, a SIGKILL's too; the
    tests find the live process by its driver; a changed start-up variable gets a fresh
    interpreter from subprocess."""
    monkeypatch.chdir(tmp_path)
    driver = str(os.getpid())
    env = {**os.environ, **launcher._rank_zygote_env(), "PROBE": "rank"}
    env["ASYNCRL_PARENT_PID"] = driver
    done = launcher.spawn([sys.executable, str(PROBE), "3", str(tmp_path / "atexit")], env)
    assert isinstance(done, launcher.Waited)
    assert done.wait(120) == 3 and done.returncode == 3
    seen = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert seen["probe"] == "rank" and seen["cwd"] == str(tmp_path)
    assert seen["torch_preloaded"], "not forked from the rank zygote"
    assert seen["ppid"] != os.getpid(), "the waiter's child"
    assert (tmp_path / "atexit").read_text() == "atexit ran"  # the interpreter's own exit

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    held = launcher.spawn([sys.executable, str(sleeper)], env)
    assert held.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        held.wait(0.05)
    assert launcher.rank_pids(int(driver)) == [held.pid]
    held.kill()
    assert held.wait(120) == -signal.SIGKILL
    deadline = time.monotonic() + 60  # the waiter reaps it, then the list no longer has it
    while launcher.rank_pids(int(driver)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launcher.rank_pids(int(driver)) == []

    fresh = launcher.spawn([sys.executable, str(PROBE), "0", str(tmp_path / "atexit-fresh")],
                           {**env, "OMP_NUM_THREADS": "7"})  # fmt: skip
    assert isinstance(fresh, subprocess.Popen)
    assert fresh.wait(120) == 0
    assert not json.loads(capfd.readouterr().out.strip().splitlines()[-1])["torch_preloaded"]


@pytest.mark.skipif(not launcher.ENABLED, reason="ASYNCRL_TEST_NO_ZYGOTE is set")
def test_ranks_are_still_forked_after_the_test_process_gains_a_start_up_variable(
    tmp_path, capfd, monkeypatch
):
    """Importing vLLM in the test process sets `TORCHINDUCTOR_*` and `PYTORCH_*` variables; a
    rank zygote started before would answer every later launch `fresh` (seen: this file's first
    test failed when it ran after the vLLM tests in the same worker). A changed set of the test
    process's start-up variables gets a rank zygote of its own."""
    monkeypatch.chdir(tmp_path)
    launcher._rank_zygote_env()  # a zygote started with the variables as they are
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # what `import vllm` does
    env = {**os.environ, **launcher._rank_zygote_env(), "PROBE": "rank"}
    env["ASYNCRL_PARENT_PID"] = str(os.getpid())
    done = launcher.spawn([sys.executable, str(PROBE), "0", str(tmp_path / "atexit")], env)
    assert isinstance(done, launcher.Waited), "answered fresh: started with other variables"
    assert done.wait(120) == 0
    seen = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert seen["torch_preloaded"] and seen["probe"] == "rank"
