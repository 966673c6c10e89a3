"""Checkpoints written by an earlier asyncrl still resume, losslessly.

`tests/fixtures/v1/` holds run dirs written by the code of commit feb4d52 (checkpoint format 1,
before checkpoints became a dict of named parts), `tests/fixtures/v2/` by the code of commit
5df324a (format 2: the ledger and buffer in state.safetensors, before rollout.safetensors),
each SIGKILLed right after its step-6 checkpoint became durable
(`ASYNCRL_FAULT=checkpoint.parent_fsynced:2`), with these keys on `configs/demo.yaml`:

    COMMON below, plus: grpo — nothing; ppo (v1 only) — `algo.name=ppo algo.kl_coef=0.05
    algo.num_minibatches=2 algo.critic_warmup_steps=2` (critic, its optimizer, a KL reference);
    det — `run.deterministic=true` (older weights versions in the checkpoint).

`det_uninterrupted_metrics.jsonl` is the same deterministic run, never killed, by that code:
the oracle the resumed run must match, its samples bit for bit and its losses up to the float
summation order today's code uses (v1) or bit for bit (v2: the training code is unchanged).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import read_records, run_cli

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v1"
FIXTURES_V2 = FIXTURES.parent / "v2"
COMMON = [
    "run.max_num_steps=12", "model.hidden_size=16", "model.num_layers=1", "model.num_heads=2",
    "model.max_seq_len=16", "data.num_examples=64", "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4", "rollout.max_trajectory_age_steps=2",
    "rollout.groups_per_batch=1", "checkpoint.save_period=3", "checkpoint.keep_last=1",
    "logging.progress=false", "logging.plot=false",
    "algo.entropy_coef=0",  # the demo's value when the fixtures were written
]  # fmt: skip
EXTRA = {
    "grpo": [],
    "ppo": [
        "algo.name=ppo", "algo.kl_coef=0.05", "algo.num_minibatches=2",
        "algo.critic_warmup_steps=2",
    ],
    "det": ["run.deterministic=true"],
}  # fmt: skip


def train(run: Path, repo_root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    config = str(repo_root / "configs" / "demo.yaml")
    return run_cli("train", config, "--run-dir", str(run), *COMMON, *extra)


@pytest.mark.parametrize(
    ("fixtures", "name"), [*((FIXTURES, n) for n in sorted(EXTRA)), (FIXTURES_V2, "grpo")]
)
def test_a_format_1_or_2_checkpoint_resumes_losslessly(tmp_path, repo_root, fixtures, name):
    run = tmp_path / name
    shutil.copytree(fixtures / name, run)
    saved = json.loads((run / "checkpoints" / "step_000006" / "state.json").read_text())
    saved = saved.get("parts", saved)  # format 1 had no "parts"
    buffered = sorted(g["ticket"]["ordinal"] for g in saved["buffer"]["groups"])
    in_flight = sorted(k for k, _ in saved["ledger"]["in_flight"])
    assert in_flight, "the fixture was killed with prompts in flight"

    done = train(run, repo_root, *EXTRA[name])
    assert done.returncode == 0, done.stdout + done.stderr

    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 6 and resume["policy"] == "lossless"
    assert resume["kept_groups"] == buffered
    assert sorted(resume["reissued_ordinals"]) == in_flight
    assert resume["skipped_ordinals"] == [] and resume["discarded_groups"] == []
    final = {r["step"]: r for r in read_records(run / "metrics.jsonl")}
    assert sorted(final) == list(range(12))
    for t, record in final.items():
        assert record["prompt_ordinals"] == list(range(t * 4, (t + 1) * 4))  # I1
    regenerated = {
        k
        for span in read_records(run / "timeline.jsonl")
        if span["kind"] == "generate" and span["attempt"] == 1
        for k in span["ordinals"]
    }
    assert not regenerated & set(buffered), "a buffered group was generated again"  # I3
    audit = run_cli("audit", str(run))
    assert audit.returncode == 0 and "I1 ok, I3 ok" in audit.stdout, audit.stdout


@pytest.mark.parametrize("fixtures", [FIXTURES, FIXTURES_V2], ids=["v1", "v2"])
def test_a_deterministic_format_1_or_2_checkpoint_resumes_the_uninterrupted_runs_samples(
    tmp_path, repo_root, fixtures
):
    run = tmp_path / "det"
    shutil.copytree(fixtures / "det", run)
    manifest = json.loads((run / "checkpoints" / "step_000006" / "manifest.json").read_text())
    assert manifest.get("format_version", 1) == (1 if fixtures == FIXTURES else 2)
    done = train(run, repo_root, *EXTRA["det"])
    assert done.returncode == 0, done.stdout + done.stderr
    oracle = {r["step"]: r for r in read_records(fixtures / "det_uninterrupted_metrics.jsonl")}
    resumed = {r["step"]: r for r in read_records(run / "metrics.jsonl") if r["attempt"] == 1}
    assert sorted(resumed) == list(range(6, 12))
    for step, record in resumed.items():
        for key in ("reward_mean", "tokens_sha256", "prompt_ordinals"):
            assert record[key] == oracle[step][key], (step, key)
        # the same samples, and the same losses up to float summation order: the code has
        # since changed how sums are ordered (each prompt run once in the training pass and
        # in the engine's prefill, fused AdamW, and, after the v2 fixtures were written,
        # log-probs from the hidden states with the output layer a chunk of tokens at a
        # time), and I5 is a same-software promise (docs/determinism.md); same-code bitwise
        # resume is tests/test_determinism.py's
        for key in ("loss", "grad_norm"):
            assert record[key] == pytest.approx(oracle[step][key], rel=1e-4), (step, key)
