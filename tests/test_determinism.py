"""Deterministic mode (I5): a run killed with SIGKILL and resumed is bit-for-bit the run it
would have been — per-step loss, reward, sampled tokens, learning rate and the final weights."""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launcher
import pytest
from helpers import read_complete_records, read_records
from safetensors.torch import load_file

from asyncrl.cli.audit import audit_run_dir
from asyncrl.train.records import span_token_starts

pytestmark = pytest.mark.slow

STEPS = 24
DETERMINISTIC = [
    "run.deterministic=true",
    f"run.max_num_steps={STEPS}",
    "rollout.num_prompts_per_step=4",
    "rollout.num_generations_per_prompt=4",
    "rollout.groups_per_batch=2",
    "rollout.max_trajectory_age_steps=1",
    "checkpoint.save_period=3",
    "checkpoint.when_busy=wait",  # the kills are at step 6's checkpoint, however slow the disk
    "data.num_examples=20",  # an epoch every 5 steps
    "logging.progress=false",
    "logging.plot=false",
]


PPO = [
    "algo.name=ppo", "algo.ppo_epochs=2", "algo.num_minibatches=2", "algo.kl_coef=0.05",
    "algo.critic_warmup_steps=2", "train.micro_batch_size=3",
]  # fmt: skip
"""PPO with every piece that has state or draws randomness: critic, minibatch shuffles,
reference policy, warm-up; and each update accumulated over micro-batches."""


def launch(
    run_dir: Path, repo_root: Path, fault: str = "", skip: str = "", extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "ASYNCRL_FAULT": fault,
        "ASYNCRL_TEST_SKIP_RESTORE": skip,
    }
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml")]
    return launcher.popen(
        [*command, "--run-dir", str(run_dir), *DETERMINISTIC, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


PARTIALS = "checkpoint.parent_fsynced[partial_tokens]"
"""A durable checkpoint whose cut holds partial samples (`asyncrl.faults`)."""


def run_to_kill(run_dir: Path, repo_root: Path, fault: str, extra: tuple[str, ...] = ()) -> None:
    proc = launch(run_dir, repo_root, fault=fault, extra=extra)
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == -signal.SIGKILL, f"{fault} never fired: {out}"


def finish(run_dir: Path, repo_root: Path, skip: str = "", extra: tuple[str, ...] = ()) -> int:
    proc = launch(run_dir, repo_root, skip=skip, extra=extra)
    try:
        proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    return proc.returncode


def fingerprint(run_dir: Path) -> tuple[list[tuple], str]:
    """Per step (the record that counts): loss, reward_mean, sampled-token digest, learning
    rate; and a hash of the final weights, tensor by tensor."""
    final = {r["step"]: r for r in read_records(run_dir / "metrics.jsonl")}
    steps = [
        (t, final[t]["loss"], final[t]["reward_mean"], final[t]["tokens_sha256"], final[t]["lr"])
        for t in sorted(final)
    ]
    weights = load_file(run_dir / "final_model" / "model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].numpy().tobytes())
    return steps, digest.hexdigest()


def uninterrupted(tmp_path_factory, request, extra: tuple[str, ...] = ()) -> tuple[list, str]:
    repo_root = Path(request.config.rootpath)
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert finish(run_dir, repo_root, extra=extra) == 0
    steps, weights = fingerprint(run_dir)
    assert len(steps) == STEPS
    return steps, weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request) -> tuple[list[tuple], str]:
    return uninterrupted(tmp_path_factory, request)


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory, request) -> tuple[list[tuple], str]:
    return uninterrupted(tmp_path_factory, request, tuple(PPO))


def test_one_random_kill_and_resume_is_bitwise_the_uninterrupted_run(
    tmp_path, repo_root, reference
):
    run = tmp_path / "run"
    proc = launch(run, repo_root)
    while len(read_complete_records(run / "metrics.jsonl")) < 9:  # the run is writing it
        assert proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert finish(run, repo_root) == 0
    assert fingerprint(run) == reference


def test_three_kills_mid_checkpoint_at_an_epoch_boundary_and_on_the_last_step(
    tmp_path, repo_root, reference
):
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.file_written[step=6]")  # writing step 6's
    # step 10 trains ordinals 40-43, the first of epoch 2: killed right after its update
    run_to_kill(run, repo_root, "train.weights_published[step=10]")
    # the last step: killed after its optimizer step, before its record and final checkpoint
    run_to_kill(run, repo_root, f"train.optimizer_step[step={STEPS - 1}]")
    assert finish(run, repo_root) == 0
    attempts = {r["attempt"] for r in read_records(run / "metrics.jsonl")}
    assert attempts == {0, 1, 2, 3}
    assert fingerprint(run) == reference


@pytest.mark.parametrize("piece", ["optimizer", "cursor", "buffer"])
def test_a_resume_that_skips_restoring_one_piece_of_state_is_caught(
    tmp_path, repo_root, reference, piece
):
    run = tmp_path / "run"
    # skipping the buffer is seen only where the cut holds buffered groups (step 6's may have
    # none: then the resume is rightly the same run)
    cut = "buffered" if piece == "buffer" else "step=6"
    run_to_kill(run, repo_root, f"checkpoint.parent_fsynced[{cut}]")
    code = finish(run, repo_root, skip=piece)
    # either the run refuses to go on (cursor, buffer: the ledger and buffer disagree) or it
    # finishes with different numbers (optimizer)
    assert code != 0 or fingerprint(run) != reference


def test_the_global_rngs_are_not_part_of_what_a_resume_must_restore(tmp_path, repo_root, reference):
    # The negative control for RNG *passes*: no computation draws from Python's, NumPy's or
    # torch's global generators (sampling noise comes from (seed, ordinal)), so a resume that
    # skips restoring them is still bitwise the reference. They are saved anyway.
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.parent_fsynced[step=6]")
    assert finish(run, repo_root, skip="rng") == 0
    assert fingerprint(run) == reference
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["skipped_restore"] == ["rng"]  # the test switch is on the record


def test_ppo_killed_mid_checkpoint_and_mid_epoch_is_bitwise_the_uninterrupted_run(
    tmp_path, repo_root, ppo_reference
):
    run, extra = tmp_path / "run", tuple(PPO)
    run_to_kill(run, repo_root, "checkpoint.file_written[step=6]", extra)
    run_to_kill(run, repo_root, "train.weights_published[step=10]", extra)
    assert finish(run, repo_root, extra=extra) == 0
    assert {r["attempt"] for r in read_records(run / "metrics.jsonl")} == {0, 1, 2}
    assert fingerprint(run) == ppo_reference


def test_a_ppo_resume_that_skips_restoring_the_critic_is_caught(tmp_path, repo_root, ppo_reference):
    run, extra = tmp_path / "run", tuple(PPO)
    run_to_kill(run, repo_root, "checkpoint.parent_fsynced[step=6]", extra)
    code = finish(run, repo_root, skip="critic", extra=extra)
    assert code == 0 and fingerprint(run) != ppo_reference


COSINE = ("algo.lr_schedule=cosine", "algo.warmup_steps=8")
"""A learning rate that changes every step: warm-up over steps 0-7, then a cosine decay to 0 at
step 24. The first kill below lands mid-warm-up, the second mid-decay."""


@pytest.fixture(scope="module")
def cosine_reference(tmp_path_factory, request) -> tuple[list[tuple], str]:
    return uninterrupted(tmp_path_factory, request, COSINE)


def test_a_cosine_schedule_killed_mid_warmup_and_mid_decay_resumes_the_same_lrs(
    tmp_path, repo_root, cosine_reference
):
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.parent_fsynced[step=6]", COSINE)
    run_to_kill(run, repo_root, "train.weights_published[step=13]", COSINE)
    assert finish(run, repo_root, extra=COSINE) == 0
    assert {r["attempt"] for r in read_records(run / "metrics.jsonl")} == {0, 1, 2}
    lrs = [step[-1] for step in cosine_reference[0]]
    assert lrs[0] == 0 and lrs[8] == max(lrs), "warm-up to the peak at step 8"
    assert all(a != b for a, b in itertools.pairwise(lrs)), "it changes every step"
    assert fingerprint(run) == cosine_reference


def test_a_resume_that_skips_restoring_the_lr_schedule_is_caught(
    tmp_path, repo_root, cosine_reference
):
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.parent_fsynced[step=6]", COSINE)
    assert finish(run, repo_root, skip="algorithm.lr_scheduler", extra=COSINE) == 0
    steps, _ = fingerprint(run)
    # the schedule starts over at step 6: warm-up again, where the reference was at its peak
    assert [s[-1] for s in steps[6:]] != [s[-1] for s in cosine_reference[0][6:]]
    assert steps[6][-1] == 0.0


RAY = ("rollout.backend=ray", "rollout.num_workers=2")


@pytest.fixture(scope="module")
def ray_reference(tmp_path_factory, request) -> tuple[list[tuple], str]:
    return uninterrupted(tmp_path_factory, request, RAY)


def test_on_ray_a_killed_driver_resumes_bitwise_the_uninterrupted_run(
    tmp_path, repo_root, ray_reference
):
    # two kills (each Ray launch starts a cluster and its workers: seconds): mid-checkpoint,
    # writing step 6's (with the workers generating ahead: their groups in flight at the cut
    # are the ones the resume dispatches again); then right after the first update once the
    # checkpoint of step 9 is durable (step 10's, unless its write is slow: placed by state,
    # not by a count), with generation for the next steps on the workers
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.file_written[step=6]", RAY)
    run_to_kill(run, repo_root, "checkpoint.parent_fsynced[step=9]>train.weights_published", RAY)
    assert finish(run, repo_root, extra=RAY) == 0
    assert {r["attempt"] for r in read_records(run / "metrics.jsonl")} == {0, 1, 2}
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert [e["from_step"] for e in resumes] == [3, 9]
    assert fingerprint(run) == ray_reference
    assert audit_run_dir(run).ok


@pytest.fixture(scope="module")
def chunked() -> tuple[str, ...]:
    """Partial generations: completions of up to 40 tokens, generated 4 at a time. The tiny
    vocabulary makes an untrained model's completions vary in length, so a batch's groups land
    at different chunks and a checkpoint can hold a batch half landed, half in flight with
    partial samples (the case whose re-dispatch must repeat the batch exactly)."""
    return ("rollout.max_new_tokens=40", "rollout.chunk_tokens=4")


@pytest.fixture(scope="module")
def chunked_reference(tmp_path_factory, request, chunked) -> tuple[list[tuple], str]:
    return uninterrupted(tmp_path_factory, request, chunked)


def test_killed_mid_chunk_and_resumed_from_partial_samples_is_bitwise_the_uninterrupted_run(
    tmp_path, repo_root, chunked, chunked_reference
):
    run = tmp_path / "run"
    # each a few decode steps after a checkpoint holding partial samples became durable
    run_to_kill(run, repo_root, f"{PARTIALS}>engine.decode_step:2", chunked)
    run_to_kill(run, repo_root, f"{PARTIALS}>engine.decode_step:5", chunked)
    assert finish(run, repo_root, extra=chunked) == 0
    resumes = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) == 2
    continued = [n for e in resumes for p in e["continued_partials"].values() for n in p["lengths"]]
    assert sum(continued) > 0, "no resume continued a partial sample: the test proves nothing"
    assert fingerprint(run) == chunked_reference
    # the continued samples really started at their saved lengths (in deterministic mode a
    # group started over would draw the same tokens: the fingerprint alone cannot tell)
    assert audit_run_dir(run).ok
    spans = [s for s in read_records(run / "timeline.jsonl") if s["kind"] == "generate"]
    for event in resumes:
        for k, saved in event["continued_partials"].items():
            first = next(
                s for s in spans if s["attempt"] == event["attempt"] and int(k) in s["ordinals"]
            )
            starts = span_token_starts(first)[first["ordinals"].index(int(k))]
            assert starts == saved["lengths"]


LORA = ("model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.05", "algo.lr=3e-3")
"""LoRA adapters (peft) with a KL penalty to the base (the adapters switched off)."""


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, request) -> tuple[list[tuple], str]:
    return uninterrupted(tmp_path_factory, request, LORA)


def test_lora_killed_mid_checkpoint_and_after_an_update_is_bitwise_the_uninterrupted_run(
    tmp_path, repo_root, lora_reference
):
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.file_written[step=6]", LORA)
    run_to_kill(run, repo_root, "train.weights_published[step=10]", LORA)
    assert finish(run, repo_root, extra=LORA) == 0
    assert {r["attempt"] for r in read_records(run / "metrics.jsonl")} == {0, 1, 2}
    assert fingerprint(run) == lora_reference
    assert audit_run_dir(run).ok


def test_a_lora_resume_that_skips_restoring_the_adapters_is_caught(
    tmp_path, repo_root, lora_reference
):
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "checkpoint.parent_fsynced[step=6]", LORA)
    assert finish(run, repo_root, skip="model", extra=LORA) == 0
    assert fingerprint(run) != lora_reference


def test_lora_ppo_killed_mid_epoch_is_bitwise_the_uninterrupted_run_and_its_critic_counts(
    tmp_path_factory, tmp_path, repo_root, request
):
    extra = (*LORA, *PPO)
    reference = uninterrupted(tmp_path_factory, request, extra)
    run = tmp_path / "run"
    run_to_kill(run, repo_root, "train.weights_published[step=10]", extra)
    assert finish(run, repo_root, extra=extra) == 0
    assert fingerprint(run) == reference
    skipped = tmp_path / "skipped"
    run_to_kill(skipped, repo_root, "train.weights_published[step=10]", extra)
    assert finish(skipped, repo_root, skip="critic", extra=extra) == 0
    assert fingerprint(skipped) != reference
