import os
import sys
import time
from pathlib import Path

# Before torch loads OpenMP (libgomp reads it once, at load; launches inherit it): OpenMP's
# threads otherwise spin for a while after each parallel region, and the suite runs 2 workers
# whose runs each keep up to 2 threads busy on 2 cores, so a spinning thread takes the core
# another process's thread waits for. A multi-turn run killed and resumed, beside two busy
# loops: 44-46 s of resume by default, 17-21 s with PASSIVE (alone 8.4-9.2 s against
# 10.4-10.8 s: the product keeps libgomp's default; docs/testing.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import launcher
import pytest
import torch

FAST_TIER_BUDGET_S = 5.0
"""`make test-fast` (`pytest --fast-tier`): a test whose setup or call uses more CPU time than
this fails, naming it. CPU time of the test process, not wall time: a machine busy with other
work stretches the wall clock, not the work a test does (the wall-clock bound that only stops a
hang is pytest-timeout's)."""


def pytest_addoption(parser):
    parser.addoption(
        "--fast-tier",
        action="store_true",
        help=f"fail a test (not marked smoke) whose setup or call takes over "
        f"{FAST_TIER_BUDGET_S:g} s of CPU time or that starts a Python process, naming it",
    )


SLOWEST_FILES = (
    "test_determinism.py",
    "test_data_parallel_runs.py",
    "test_ray.py",
    "test_vllm_runs.py",
    "test_vllm_servers.py",
    "test_crash.py",
    "test_ray_drain.py",
    "test_partial_crash.py",
    "test_smol_math_example.py",
    "test_chaos.py",
    "test_prepare_model.py",
    "test_episode_crash.py",
    "test_agent_crash.py",
    "test_verifiers_crash.py",
    "test_agent_example.py",
    "test_preemption_waits.py",
    "test_hf_models.py",
    "test_data_parallel.py",
    "test_evaluation.py",
    "test_verifiers_examples.py",
    "test_verifiers_bench.py",
    "test_verifiers_demo.py",
)
"""The files that take longest (test time, `make test` on 2 cores, docs/testing.md), slowest
first: they run first, so `make test`'s workers (a file to each, `--no-loadscope-reorder`) end
close together instead of one running a slow file alone at the end. The rest follow in
collection order. `test_ray.py` starts third, once `make lint` (beside the tests, mypy ~90 s of
a core) is done: a local Ray started while three processes share two cores took 98-109 s to
place its workers in CI (12 s alone; 66 s beside mypy and one busy loop)."""
_missing = [name for name in SLOWEST_FILES if not (Path(__file__).parent / name).exists()]
assert not _missing, f"tests/conftest.py's SLOWEST_FILES names no such file: {_missing}"


def _file_rank(item) -> int:
    name = Path(str(item.fspath)).name
    return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)


def pytest_collection_modifyitems(config, items):
    """The slowest files first (SLOWEST_FILES; a stable sort keeps each file's tests together
    and in order). `gpu` tests run wherever CUDA is present; the suite never depends on them."""
    items.sort(key=_file_rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is false here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_started: list[str] = []
"""Commands started with subprocess.Popen by the running test (the fast tier's guard)."""


def _audit(event: str, args: tuple) -> None:
    """Records each Python process started (the CLI, a script, torchrun): what a library runs
    for itself (`uname -p`, a tracker's service) is not the test's."""
    if event != "subprocess.Popen":
        return
    command = args[1] if isinstance(args[1], (list, tuple)) else str(args[1]).split()
    program = str(args[0] or (command[0] if command else ""))
    if "python" in Path(program).name:
        _started.append(" ".join(str(a) for a in command)[:200])


sys.addaudithook(_audit)  # records only: a hook cannot be removed, and raising in it would fail
# whatever library started the process, not the test


_cpu_s: dict[str, float] = {}
"""CPU seconds of the running test's phases (setup, call), this process's threads together."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    start = time.process_time()
    yield
    _cpu_s["setup"] = time.process_time() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = time.process_time()
    yield
    _cpu_s["call"] = time.process_time() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In the fast tier, a phase that ran past the budget, or a call that started a subprocess,
    turns a pass into a failure that names the test and says what to do."""
    if call.when == "setup":
        _started.clear()
        launcher.LAUNCHED.clear()
    outcome = yield
    report = outcome.get_result()
    if not item.config.getoption("--fast-tier") or "smoke" in item.keywords or not report.passed:
        return
    why = ""
    cpu_s = _cpu_s.pop(call.when, 0.0)
    if call.when in ("setup", "call") and cpu_s > FAST_TIER_BUDGET_S:
        why = (
            f"its {call.when} took {cpu_s:.1f} s of CPU time (the budget is "
            f"{FAST_TIER_BUDGET_S:g} s)"
        )
    elif call.when == "call" and (_started or launcher.LAUNCHED):
        why = f"it started a subprocess ({(_started or launcher.LAUNCHED)[0]})"
    if why:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: {why}, and the fast tier (make test-fast) takes neither: mark it "
            "@pytest.mark.slow, or make it faster"
        )


def pytest_sessionfinish(session, exitstatus):
    launcher.shutdown()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
