"""`make bench-verifiers` at its smallest (`--quick`: no vLLM, the instant engines only, one
round of 2 episodes a side): it runs, says that vLLM was left out, and every figure of its last
line is there and positive. How large they are is the benchmark's to say, not a test's."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from helpers import built_once

from asyncrl.examples.agent_math import prepare

pytestmark = pytest.mark.slow

NUMBER = r"([-+0-9.e]+|nan|inf)"
LAST = re.compile(
    rf"verifiers: ours/vf-eval rollouts/s tiny={NUMBER}( smol={NUMBER})?, overhead {NUMBER} "
    rf"ms/rollout \(ours\) vs {NUMBER} ms/rollout \(verifiers' harness\)"
)


def test_the_quick_bench_prints_its_last_line_with_positive_figures(tmp_path_factory, repo_root):
    data = built_once(tmp_path_factory, "agent_math", prepare)
    done = subprocess.run(
        [sys.executable, str(repo_root / "benchmarks/verifiers_runs.py"), "--quick", "--data",
         str(data)],
        capture_output=True, text=True, timeout=600, cwd=repo_root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("cpu: ") and "torch threads" in lines[0], lines[0]
    assert any(line.startswith("overhead 2 at once: ") for line in lines), lines
    assert any(line.startswith("quick: vLLM not started") for line in lines), lines
    last = LAST.fullmatch(lines[-1])
    assert last is not None, lines[-1]
    tiny, _, smol, added, harness = last.groups()
    assert smol is None  # no vLLM, no smol shape in the quick mode
    for figure in (tiny, harness):
        assert math.isfinite(float(figure)) and float(figure) > 0, (figure, lines)
    # what ours adds is a difference of two timings: finite, and small beside the harness's
    assert math.isfinite(float(added)) and abs(float(added)) < float(harness), lines[-1]
