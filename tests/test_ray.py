"""The Ray backend on a local Ray: an end-to-end run on two worker actors, a worker actor
killed mid-run, workers that die at every batch, a SIGKILLed driver resumed, and one
checkpoint resumed across backends. Each test checks I1 and I3 from the run's own records."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

import launcher
import pytest
import ray
import torch
from helpers import (
    assert_exact_run,
    landed_per_ordinal,
    read_complete_records,
    read_records,
    small_config,
)

from asyncrl.cli.inspect import inspect_run_dir
from asyncrl.distributed.cluster import NAMESPACE
from asyncrl.distributed.worker import worker_name
from asyncrl.rollout.collector import GenerationFailed
from asyncrl.train.records import span_token_starts
from asyncrl.train.trainer import train

pytestmark = pytest.mark.slow

N = 4
RAY = ["rollout.backend=ray", "rollout.num_workers=2", f"rollout.num_prompts_per_step={N}"]


def assert_schedule_and_exactly_once(run: Path, steps: int) -> list[dict]:
    return assert_exact_run(run, steps, N)


def test_an_end_to_end_run_on_two_worker_actors_passes_the_audit(tmp_path):
    run = tmp_path / "run"
    train(small_config(*RAY, "run.max_num_steps=10"), run)
    records = assert_schedule_and_exactly_once(run, 10)
    assert set(landed_per_ordinal(run).values()) == {1}
    assert records[-1]["workers_replaced"] == 0 and records[-1]["weights_load_s"] > 0
    # I2 with A=1. Not "== 1": whether some step trained on older weights depends on timing
    assert all(0 <= r["step"] - r["generation_version_min"] <= 1 for r in records)
    assert not ray.is_initialized()  # the run shut down the local Ray it started


def test_workers_that_die_at_every_batch_stop_the_run_with_the_cause(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_FAULT", "worker.generate:1")  # read by each worker process
    run = tmp_path / "run"
    config = small_config(*RAY, "rollout.max_generation_failures=2")
    with pytest.raises(GenerationFailed, match=r"generation worker \d died during a batch"):
        train(config, run)
    assert not ray.is_initialized()
    # the cut is consistent: the same run resumes and finishes once workers stop dying
    monkeypatch.setenv("ASYNCRL_FAULT", "")
    train(small_config(*RAY, "run.max_num_steps=6"), run)
    assert_schedule_and_exactly_once(run, 6)


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray for the in-process tests below (each `train` then joins it instead of
    starting and stopping its own: seconds each). The tests above start their own: one checks
    that a run stops the Ray it started, the other that its workers read the environment it
    set. Ray is started as `start_ray` starts it."""
    from asyncrl.distributed.cluster import start_ray

    assert start_ray(small_config(*RAY))
    yield
    ray.shutdown()


def test_chunked_generation_on_worker_actors_continues_each_sample_where_it_stopped(
    tmp_path, shared_ray
):
    run = tmp_path / "run"
    chunked = ["rollout.max_new_tokens=12", "rollout.chunk_tokens=4"]
    train(small_config(*RAY, *chunked, "run.max_num_steps=6"), run)
    assert_schedule_and_exactly_once(run, 6)
    assert set(landed_per_ordinal(run).values()) == {1}
    spans = [s for s in read_records(run / "timeline.jsonl") if s["kind"] == "generate"]
    # several engine passes continued the same samples (a row holds a run of them, `chunks`;
    # or starts past the first token when an earlier row was written at a landing or a cut)
    assert any(s["chunks"] > 1 or any(map(any, span_token_starts(s))) for s in spans), (
        "no sample was generated in more than one chunk"
    )
    assert all(sum(row) <= 12 * len(row) for s in spans for row in s["token_counts"])


def test_worker_actors_continue_prefixes_as_the_local_engine_generates_in_one_go(shared_ray):
    from test_partial import in_chunks

    from asyncrl.distributed.cluster import start_ray
    from asyncrl.distributed.weights import ObjectStoreWeightSync
    from asyncrl.distributed.worker import build_ray_engine
    from asyncrl.rollout.engine import EngineSpec, GenerationRequest
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync
    from asyncrl.train.components import build_components

    config = small_config(*RAY)
    policy = build_components(small_config()).policy  # a threads build: just the model
    spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 20, 1.0)
    local = CopyWeightSync()
    local.publish(0, policy.model.state_dict())
    requests = [GenerationRequest([5, 6, 7, 1][: 2 + i], 4, noise_seed=7 + i) for i in range(3)]
    whole = TorchGenerationEngine(spec, local).generate(requests)
    started = start_ray(config)
    try:
        weights = ObjectStoreWeightSync(max_versions=1)
        weights.publish(0, policy.model.state_dict())
        engine = build_ray_engine(config, spec, weights)
        chunked = in_chunks(engine, requests, 3)  # 3 requests split over 2 actors, per chunk
        engine.shutdown()
    finally:
        if started:
            ray.shutdown()
    for one, part in zip(whole, chunked, strict=True):
        width = part.tokens.shape[1]
        assert torch.equal(part.tokens * part.mask, one.completion_ids[:, :width] * part.mask)
        assert torch.equal(part.mask, one.completion_mask[:, :width])
        torch.testing.assert_close(part.logprobs, one.logprobs[:, :width], atol=1e-5, rtol=0)


@pytest.mark.parametrize("stop_early", [True, False], ids=["default", "deterministic"])
def test_a_retired_worker_hands_its_call_back_and_the_samples_come_out_the_same(
    shared_ray, stop_early
):
    """`RayEngine.retire` (a drained node, tests/test_ray_drain.py) on a worker in a call: by
    default the call ends at once and hands its samples back unfinished, and the next passes
    (on the replacement) continue them; in deterministic mode the call runs to its end. Either
    way the samples are what one uninterrupted local call samples, and the worker is
    replaced."""
    from asyncrl.core.partial import Partial
    from asyncrl.distributed.weights import ObjectStoreWeightSync
    from asyncrl.distributed.worker import build_ray_engine
    from asyncrl.rollout.engine import EngineSpec, GenerationRequest
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync
    from asyncrl.train.components import build_components

    config = small_config(*RAY, "rollout.num_workers=1", f"run.deterministic={not stop_early}")
    policy = build_components(small_config()).policy
    spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 40, 1.0,
                      keep_cache_between_chunks=False)  # fmt: skip
    local = CopyWeightSync()
    local.publish(0, policy.model.state_dict())
    requests = [GenerationRequest([5, 6, 7, 1, 2][: 2 + i % 4], 8, noise_seed=i) for i in range(16)]
    whole = TorchGenerationEngine(spec, local).generate(requests)
    weights = ObjectStoreWeightSync(max_versions=1)
    weights.publish(0, policy.model.state_dict())
    engine = build_ray_engine(config, spec, weights)
    events: list[tuple[str, dict]] = []
    engine.on_event = lambda name, **fields: events.append((name, fields))
    try:
        node = engine.worker_nodes()[0]
        drained = "f" * 56  # Ray's node ids: 56 hex digits; one node here, so not its own
        first: list = []
        call = threading.Thread(target=lambda: first.extend(engine.generate(requests)))
        call.start()
        while not engine._busy:  # the call is dispatched
            time.sleep(0.001)
        assert engine.retire([0], drained, 0) == [0]
        call.join()
        partials = [
            Partial.empty(8).extend(o.completion_ids, o.completion_mask, o.logprobs,
                                    o.weights_version, o.finished_rows())
            for o in first
        ]  # fmt: skip
        while not all(p.done for p in partials):  # the replacement continues them
            asked = [
                dataclasses.replace(r, prefixes=p.prefixes(), finished=tuple(map(bool, p.finished)))
                for r, p in zip(requests, partials, strict=True)
            ]
            outs = engine.generate(asked)
            partials = [
                p.extend(o.completion_ids, o.completion_mask, o.logprobs, o.weights_version,
                         o.finished_rows())
                for p, o in zip(partials, outs, strict=True)
            ]  # fmt: skip
        while not engine.worker_nodes()[0]:  # the replacement is placed
            time.sleep(0.01)
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    ((_, handback),) = [e for e in events if e[0] == "drain_handback"]
    assert handback["node"] == drained and engine.drained == {drained}
    assert handback["in_call"] and handback["requests"] == 16
    assert handback["stopped_early"] is stop_early
    finished = sum(int(o.finished_rows().sum()) for o in first)
    if stop_early:
        assert handback["unfinished_samples"] > 0 and finished < 16 * 8
    else:  # ran to its end: nothing left to continue
        assert handback["unfinished_samples"] == 0 and finished == 16 * 8
    assert metrics["workers_retired"] == 1 and metrics["workers_replaced"] == 0
    placed = [f for name, f in events if name == "generation_worker" and f["incarnation"] == 1]
    assert [(f["worker"], f["node"]) for f in placed] == [(0, node)] and placed[0]["pid"] > 0
    for one, part in zip(whole, partials, strict=True):
        width = part.tokens.shape[1]
        assert torch.equal(part.mask, one.completion_mask[:, :width])
        assert torch.equal(part.tokens * part.mask, one.completion_ids[:, :width] * part.mask)
        torch.testing.assert_close(part.logprobs, one.logprobs[:, :width], atol=1e-5, rtol=0)


def kill_worker_when(run: Path, steps_done: int, killed: list[str]) -> threading.Thread:
    def kill() -> None:
        metrics = run / "metrics.jsonl"
        while len(read_complete_records(metrics)) < steps_done:  # the run is writing it
            time.sleep(0.01)
        actor = ray.get_actor(worker_name(0, 0), namespace=NAMESPACE)
        ray.kill(actor)  # the actor's process is killed, like a lost node
        killed.append(worker_name(0, 0))

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_killing_a_worker_actor_mid_run_redispatches_its_batch_and_loses_nothing(
    tmp_path, shared_ray
):
    run = tmp_path / "run"
    killed: list[str] = []
    thread = kill_worker_when(run, 4, killed)
    train(small_config(*RAY, "run.max_num_steps=16"), run)
    thread.join(5)
    assert killed
    records = assert_schedule_and_exactly_once(run, 16)
    assert records[-1]["workers_replaced"] >= 1 and records[-1]["generation_failures"] >= 1
    assert set(landed_per_ordinal(run).values()) == {1}  # the dead batch landed nothing


def test_a_sigkilled_driver_resumes_on_ray_and_loses_nothing(tmp_path, repo_root):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(repo_root / "configs/demo.yaml")]
    args = [
        *command, "--run-dir", str(run), *RAY, "rollout.num_generations_per_prompt=4",
        "run.max_num_steps=20", "checkpoint.save_period=3", "checkpoint.when_busy=wait",
        "logging.progress=false",
        "logging.plot=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # killed two steps after the checkpoint of step 6 became durable (fault injection)
    fault = "checkpoint.parent_fsynced[step=6]>train.weights_published:2"
    killed = launcher.run(
        args, env={**env, "ASYNCRL_FAULT": fault}, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    newest = inspect_run_dir(run)["step"]
    assert newest >= 6
    done = launcher.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed at step {newest}" in done.stdout
    assert_schedule_and_exactly_once(run, 20)
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    landed_after = {}
    for span in read_records(run / "timeline.jsonl"):
        if span["kind"] == "generate" and span["attempt"] == 1:
            for k in span["ordinals"]:
                landed_after[k] = True
    assert not set(resume["kept_groups"]) & set(landed_after)  # I3: kept groups not regenerated


def test_one_checkpoint_resumes_under_either_backend(tmp_path, shared_ray):
    run = tmp_path / "run"
    threads = [f"rollout.num_prompts_per_step={N}"]
    train(small_config(*threads, "run.max_num_steps=5", "checkpoint.save_period=2"), run)
    train(small_config(*RAY, "run.max_num_steps=10", "checkpoint.save_period=2"), run)
    train(small_config(*threads, "run.max_num_steps=14", "checkpoint.save_period=2"), run)
    assert_schedule_and_exactly_once(run, 14)
    attempts = {r["attempt"] for r in read_records(run / "metrics.jsonl")}
    assert attempts == {0, 1, 2}
    backends = [
        e["config"]["rollout"]["backend"]
        for e in read_records(run / "events.jsonl")
        if e["event"] == "start"
    ]
    assert backends == ["threads", "ray", "threads"]


def test_a_replaced_worker_generates_with_the_weights_of_the_version_asked_for(shared_ray):
    """A worker replaced after training began must not take the live (trained) model for
    version 0: deterministic mode pins early targets to version 0."""
    from asyncrl.distributed.cluster import start_ray
    from asyncrl.distributed.weights import ObjectStoreWeightSync
    from asyncrl.distributed.worker import WorkerDied, build_ray_engine
    from asyncrl.rollout.engine import EngineSpec, GenerationRequest
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync
    from asyncrl.train.components import build_components

    config = small_config(*RAY, "rollout.num_workers=1", "run.deterministic=true")
    policy = build_components(small_config()).policy  # a threads build: just the model
    spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 5, 1.0)
    initial = CopyWeightSync()
    initial.publish(0, policy.model.state_dict())
    oracle = TorchGenerationEngine(spec, initial)
    started = start_ray(config)
    try:
        weights = ObjectStoreWeightSync(max_versions=2)
        weights.publish(0, policy.model.state_dict())
        engine = build_ray_engine(config, spec, weights)
        with torch.no_grad():  # "training": the live model moves on, version 1 is published
            for p in policy.model.parameters():
                p.add_(0.5)
        weights.publish(1, policy.model.state_dict())
        ray.kill(engine.workers[0])
        request = [GenerationRequest([1, 2, 3], 4, noise_seed=7)]
        with pytest.raises(WorkerDied):
            engine.generate(request, 0)
        (out,) = engine.generate(request, 0)  # the replacement
        (want,) = oracle.generate(request)  # version 0 = the weights before "training"
        assert out.weights_version == 0 and torch.equal(out.completion_ids, want.completion_ids)
        assert torch.allclose(out.logprobs, want.logprobs)
        engine.shutdown()
    finally:
        if started:
            ray.shutdown()
