"""Rewards in real runs: a chat dataset through `datasets` with the `math` reward computed in
worker processes, its components logged; a reward that sleeps past its timeout and one that
raises are retried, then reported naming the ordinal, and nothing is lost (`audit` passes)."""

from __future__ import annotations

import json
import time

import datasets
import pytest
from helpers import hung_reward_pids, process_gone, read_records, small_config

from asyncrl.cli.audit import audit_run_dir
from asyncrl.models.scratch import save_scratch_model
from asyncrl.rollout.collector import GenerationFailed
from asyncrl.train.trainer import train

pytestmark = pytest.mark.slow


def digit_rows(tmp_path, reward: str) -> list[str]:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{d}=", "answer": str(d)}) + "\n"
                            for d in range(10)))  # fmt: skip
    return ["data.task=jsonl", f"data.path={path}", f"data.reward_fn=failing_rewards:{reward}"]


def test_chat_dataset_with_the_math_reward_in_worker_processes(tmp_path):
    model = save_scratch_model(tmp_path / "model", arch="qwen2", seed=1)
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b}
        for a in range(4)
        for b in range(4)
    ]
    data = tmp_path / "sums.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    run = tmp_path / "run"
    config = small_config(
        f"model.path={model}",
        "data.task=hf",
        f"data.path={data}",
        "data.messages_key=messages",
        "data.system_prompt=Put the answer in \\boxed{}.",
        "data.reward_fn=math",
        "data.format_reward=0.5",
        "rollout.max_new_tokens=8",
        "rollout.reward_workers=2",
        "rollout.reward_timeout_s=30",
        "run.max_num_steps=4",
    )
    train(config, run)
    records = read_records(run / "metrics.jsonl")
    assert len(records) == 4 and audit_run_dir(run).ok
    for r in records:
        assert {"reward/correct", "reward/format"} <= set(r)
        assert r["reward_mean"] == pytest.approx(r["reward/correct"] + 0.5 * r["reward/format"])
        assert r["reward_failures"] == 0


@pytest.mark.parametrize(
    ("reward", "extra", "message"),
    [
        ("sleeps_on_7", ["rollout.reward_timeout_s=2"], "ran past rollout.reward_timeout_s=2 s"),
        ("raises_sometimes_on_7", [], "raised ValueError('cannot score answer 7 yet')"),
    ],
)
def test_a_slow_or_raising_reward_is_retried_then_reported_and_nothing_is_lost(
    tmp_path, monkeypatch, reward, extra, message
):
    base = [*digit_rows(tmp_path, reward), "rollout.reward_workers=2", *extra]
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_DIR", str(tmp_path / "failures"))
    # fails once: the batch is re-dispatched and scored again, the run goes on
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_TIMES", "1")
    once = tmp_path / "once"
    train(small_config(*base, "run.max_num_steps=6"), once)
    last = read_records(once / "metrics.jsonl")[-1]
    assert last["generation_failures"] == 1 and last["reward_failures"] == 1
    assert audit_run_dir(once).ok
    # fails every time: reported after max_generation_failures tries, naming the ordinal
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_TIMES", "1000")
    always = tmp_path / "always"
    config = small_config(*base, "run.max_num_steps=6", "rollout.max_generation_failures=2")
    with pytest.raises(GenerationFailed) as err:
        train(config, always)
    text = str(err.value)
    assert f"failing_rewards:{reward} on ordinal" in text and "data.jsonl:8" in text
    assert message in text
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_TIMES", "0")  # fixed: the same command resumes
    train(config, always)
    assert len({r["step"] for r in read_records(always / "metrics.jsonl")}) == 6
    assert audit_run_dir(always).ok


def test_reward_components_go_through_a_checkpoint_and_a_preempted_run_resumes_them(
    tmp_path, monkeypatch
):
    import asyncrl.core.buffer as buffer_module
    from asyncrl.train.signals import Preempted, StopRequest
    from asyncrl.train.trainer import Trainer

    def run(name: str, stop_after: int | None = None) -> list[dict]:
        config = small_config(
            "data.reward_fn=failing_rewards:batched_parts", "run.deterministic=true",
            "run.max_num_steps=8", "rollout.groups_per_batch=2", "checkpoint.save_period=100",
        )  # fmt: skip
        stop = StopRequest()
        if stop_after is not None:
            real = Trainer.train_step

            def train_step(self):
                record = real(self)
                if record["step"] == stop_after:  # the cut must hold a buffered group: wait for one
                    deadline = time.monotonic() + 120
                    while not len(self.parts.buffer) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    stop.receive("SIGTERM")  # as the signal handler would
                return record

            monkeypatch.setattr(Trainer, "train_step", train_step)
            with pytest.raises(Preempted):
                train(config, tmp_path / name, stop)
            monkeypatch.setattr(Trainer, "train_step", real)
        train(config, tmp_path / name)
        return {r["step"]: r for r in read_records(tmp_path / name / "metrics.jsonl")}

    def parts(records: dict) -> list[tuple]:
        keys = ("reward/exact", "reward/length", "reward_mean", "tokens_sha256")
        return [tuple(records[t].get(k) for k in keys) for t in sorted(records)]  # may lack parts

    whole = run("whole")
    assert all("reward/exact" in r for r in whole.values())
    resumed = run("resumed", stop_after=3)
    (event,) = [e for e in read_records(tmp_path / "resumed" / "events.jsonl")
                if e["event"] == "resume"]  # fmt: skip
    assert event["kept_groups"], "the preemption checkpoint held buffered groups"
    assert parts(resumed) == parts(whole)
    # negative control: a checkpoint that drops the components is caught by the same comparison
    real_state = buffer_module.group_state
    monkeypatch.setattr(
        buffer_module,
        "group_state",
        lambda g: {k: v for k, v in real_state(g).items() if k != "reward_components"},
    )
    assert parts(run("lossy", stop_after=3)) != parts(whole)


def test_a_reward_that_hangs_without_a_timeout_does_not_hold_up_a_preemption(tmp_path, monkeypatch):
    import threading
    import time

    from asyncrl.train.signals import Preempted, StopRequest

    monkeypatch.setenv("ASYNCRL_TEST_FAIL_DIR", str(tmp_path / "failures"))
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_TIMES", "1000")  # sleeps 120 s on answer 7
    config = small_config(*digit_rows(tmp_path, "sleeps_on_7"), "rollout.reward_workers=1")
    stop = StopRequest()

    def preempt_once_hung() -> None:  # the SIGTERM comes while a reward call hangs
        while not hung_reward_pids(tmp_path / "failures"):
            time.sleep(0.01)
        stop.receive("SIGTERM")  # as the signal handler would

    threading.Thread(target=preempt_once_hung, daemon=True).start()
    with pytest.raises(Preempted):
        train(config, tmp_path / "run", stop)
    (hung,) = set(hung_reward_pids(tmp_path / "failures"))
    assert process_gone(hung), "the stuck call's worker still runs: it was waited out, or left"
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_TIMES", "0")
    train(config, tmp_path / "run")  # resumes and finishes
    assert len({r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl")}) == 6
    assert audit_run_dir(tmp_path / "run").ok
