"""STYLE.md rule 1: the core and the threads backend never import Ray; only
`asyncrl/distributed/` does, and only when `rollout.backend=ray` asks for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE_AND_THREADS = [
    "asyncrl.core.buffer", "asyncrl.core.ledger", "asyncrl.core.stream", "asyncrl.core.window",
    "asyncrl.core.advantages", "asyncrl.core.losses", "asyncrl.core.resume",
    "asyncrl.rollout.collector", "asyncrl.rollout.engine", "asyncrl.rollout.torch_engine",
    "asyncrl.rollout.weight_sync", "asyncrl.rollout.scorer", "asyncrl.algos.grpo",
    "asyncrl.algos.ppo", "asyncrl.algos.rloo", "asyncrl.checkpoint.snapshot",
    "asyncrl.train.trainer", "asyncrl.train.components", "asyncrl.cli",
]  # fmt: skip


def run_without_ray(code: str) -> subprocess.CompletedProcess[str]:
    prelude = "import sys; sys.modules['ray'] = None\n"  # any `import ray` now raises
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_the_core_and_the_threads_backend_import_without_ray():
    imports = "\n".join(f"import {name}" for name in CORE_AND_THREADS)
    done = run_without_ray(imports + "\nprint('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.slow
def test_the_check_itself_catches_a_ray_import():  # negative control
    done = run_without_ray("import asyncrl.distributed.worker")
    assert done.returncode != 0 and "ray" in done.stderr


def test_the_trainer_names_no_algorithm_and_no_engine_class():
    """STYLE.md rule 13: the loop never branches on the algorithm; which algorithm and which
    engine a run uses is decided in one place (train/components.py, through the registries)."""
    from pathlib import Path

    import asyncrl.train.trainer as trainer

    source = Path(trainer.__file__).read_text()
    for name in (
        "GRPO",
        "PPO",
        "RLOO",
        "grpo",
        "ppo",
        "rloo",
        "TorchGenerationEngine",
        "RayEngine",
    ):
        assert name not in source, name
