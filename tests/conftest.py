import sys
from pathlib import Path

import launcher
import pytest
import torch

FAST_TIER_BUDGET_S = 5.0
"""`make test-fast` (`pytest --fast-tier`): a test's setup or call past this fails, naming it."""


def pytest_addoption(parser):
    parser.addoption(
        "--fast-tier",
        action="store_true",
        help=f"fail a test (not marked smoke) whose setup or call takes over "
        f"{FAST_TIER_BUDGET_S:g} s or that starts a Python process, naming it",
    )


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run wherever CUDA is present; the suite never depends on them."""
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
    if call.when in ("setup", "call") and report.duration > FAST_TIER_BUDGET_S:
        why = (
            f"its {call.when} took {report.duration:.1f} s (the budget is {FAST_TIER_BUDGET_S:g} s)"
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
