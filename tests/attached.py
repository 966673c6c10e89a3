"""An engine attached to stand-ins of vLLM servers (`fake_vllm.py`), built in this process with
no lifeline process: the fixtures of tests/test_server_leases.py and tests/test_server_auth.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_vllm import FakeVLLM
from helpers import DIGITS

from asyncrl.config import ModelConfig
from asyncrl.models.policy import load_policy
from asyncrl.rollout import vllm_server
from asyncrl.rollout.engine import EngineSpec, GenerationRequest
from asyncrl.rollout.weight_sync import CopyWeightSync


class NoLifeline:
    """In-process stand-in for the lifeline's guard process (tests/test_lifeline.py tests it):
    these tests start no process."""

    def __init__(self, log: Path | None = None) -> None:
        self.paths: list[str] = []

    def watch_group(self, pid: int, started: int) -> None:
        raise AssertionError("no server is launched here")

    def watch_path(self, path: str) -> None:
        self.paths.append(str(path))

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(), seed=0, alphabet=DIGITS)


@pytest.fixture
def fakes():
    started = [FakeVLLM().start(), FakeVLLM().start()]
    yield started
    for fake in started:
        fake.stop()


@pytest.fixture
def attach_to(policy, tmp_path, monkeypatch):
    """Builds an engine of run `run_id` attached to `fakes` (its run dir's run.json names it)."""
    monkeypatch.setattr(vllm_server, "Lifeline", NoLifeline)
    built = []

    def build(fakes, run_id="run-a"):
        run_dir = tmp_path / run_id
        run_dir.mkdir(exist_ok=True)
        (run_dir / "run.json").write_text(f'{{"run_id": "{run_id}", "launches": 0}}\n')
        weights = CopyWeightSync(max_versions=2)
        weights.publish(0, policy.model.state_dict())
        options = {"servers": {"urls": [f.url for f in fakes], "health_timeout_s": 5.0},
                   "run_dir": str(run_dir)}  # fmt: skip
        spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 4, 1.0, options=options,
                          scratch_dir=str(run_dir / ".scratch"))  # fmt: skip
        engine = vllm_server.VLLMServerEngine(spec, weights)
        built.append(engine)
        return engine, weights

    yield build
    for engine in built:
        engine.shutdown()


def batch(count: int = 4) -> list[GenerationRequest]:
    return [GenerationRequest([1, 2], 2, noise_seed=i) for i in range(count)]
