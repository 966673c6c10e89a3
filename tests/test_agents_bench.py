"""`make bench-agents` at its smallest (`--quick`: the demo shape, one round): it runs, and every
figure its lines name is there, positive and finite. How large they are is the benchmark's to
say, not a test's."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from helpers import built_once

from asyncrl.examples.math_chat import prepare

pytestmark = pytest.mark.slow

NUMBER = r"([-+0-9.e]+|nan|inf)"
LAST = re.compile(
    rf"agents: endpoint/direct tokens/s demo={NUMBER} \(aim >= 0\.9\), overhead {NUMBER} "
    rf"ms/call \(1 run\), {NUMBER} \(16 runs\), replay {NUMBER} calls/s"
)
THROUGHPUT = re.compile(
    rf"throughput demo: 4 prompts x 4 samples x 48 tokens, .* endpoint {NUMBER} tok/s, "
    rf"direct {NUMBER} tok/s, ratio {NUMBER} "
)


def test_the_quick_bench_prints_each_figure_positive_and_finite(tmp_path_factory, repo_root):
    data = built_once(tmp_path_factory, "math_chat", prepare)
    done = subprocess.run(
        [sys.executable, str(repo_root / "benchmarks/agent_runs.py"), "--quick", "--data",
         str(data)],
        capture_output=True, text=True, timeout=300, cwd=repo_root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("cpu: ") and "torch threads" in lines[0], lines[0]
    assert sum(line.startswith("overhead ") for line in lines) == 2, lines
    assert sum(line.startswith("replay: ") for line in lines) == 1, lines
    (throughput,) = [m for m in map(THROUGHPUT.match, lines) if m]
    last = LAST.fullmatch(lines[-1])
    assert last is not None, lines[-1]
    for figure in [*throughput.groups(), *last.groups()]:
        assert math.isfinite(float(figure)) and float(figure) > 0, (figure, lines)
