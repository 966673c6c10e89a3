"""`asyncrl plot`: every picture renders from a short real run with a resume, with the series
and marks the records call for (checked on the figure objects, not just the files)."""

from __future__ import annotations

import shutil
import threading

import matplotlib.image
import pytest
from helpers import read_records, small_config, train_and_report

from asyncrl.cli.plot_data import read_plot_data
from asyncrl.cli.plots import (
    figure_ledger,
    figure_reward_loss,
    figure_staleness,
    figure_timeline,
    write_plots,
)
from asyncrl.rollout.torch_engine import TorchGenerationEngine
from asyncrl.train.records import JsonlLog, read_jsonl
from asyncrl.train.trainer import train

N = 4


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A run trained to step 6 whose final checkpoint was lost, resumed to step 10 under
    keep_incomplete from the checkpoint of step 3, which has prompts in flight that the
    resume skips.

    "In flight" is forced by ordering, not by timing: the batch of target 4 (the collector
    dispatches one target per batch, in order) blocks until the checkpoint of step 3 is
    written, and step 2's record — after which that checkpoint is taken — waits until the
    batch is blocked."""
    run = tmp_path_factory.mktemp("plots") / "run"
    common = ["checkpoint.save_period=3", "rollout.max_trajectory_age_steps=2"]
    entered, release = threading.Event(), threading.Event()
    real_generate, real_write = TorchGenerationEngine.generate, JsonlLog.write

    def gated_generate(self, requests, version=None, max_tokens=None):
        if requests[0].noise_seed in target_4_seeds:
            entered.set()
            assert release.wait(120), "the checkpoint of step 3 was never written"
        return real_generate(self, requests, version, max_tokens)

    def ordered_write(self, record):
        if self.path.name == "metrics.jsonl" and record.get("step") == 2:
            assert entered.wait(120), "generation never reached target 4"
        real_write(self, record)
        if record.get("event") == "checkpoint" and record.get("step") == 3:
            release.set()

    from asyncrl.rollout.collector import noise_seed

    target_4_seeds = {noise_seed(0, k) for k in range(4 * N, 5 * N)}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(TorchGenerationEngine, "generate", gated_generate)
            patch.setattr(JsonlLog, "write", ordered_write)
            train(small_config(*common, "run.max_num_steps=6"), run)
    finally:
        release.set()
    events = read_jsonl(run / "events.jsonl")
    (cut,) = [e for e in events if e["event"] == "checkpoint" and e["step"] == 3]
    assert cut["in_flight"] > 0
    shutil.rmtree(run / "checkpoints" / "step_000006")  # the final checkpoint is lost
    lossy = "checkpoint.resume_policy=keep_incomplete"
    train_and_report(small_config(*common, "run.max_num_steps=10", lossy, "logging.plot=true"), run)
    return run


def records(run):
    return (
        read_jsonl(run / "metrics.jsonl"),
        read_jsonl(run / "events.jsonl"),
        read_jsonl(run / "timeline.jsonl"),
    )


def plot_data(run):
    return read_plot_data(*records(run), N)


def test_the_run_writes_four_valid_pngs(resumed_run):
    paths = sorted((resumed_run / "plots").glob("*.png"))
    assert [p.name for p in paths] == [
        "ledger.png",
        "reward_loss.png",
        "staleness.png",
        "timeline.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = matplotlib.image.imread(path).shape[:2]
        assert width >= 900 and height >= 300
    assert [p.name for p in write_plots(resumed_run)] == [
        "reward_loss.png", "timeline.png", "staleness.png", "ledger.png"
    ]  # fmt: skip


def test_reward_and_loss_mark_every_checkpoint_and_the_resume(resumed_run):
    metrics, events, _ = records(resumed_run)
    fig = figure_reward_loss(plot_data(resumed_run))
    checkpoints = sum(e["event"] == "checkpoint" for e in events)
    assert checkpoints >= 4 and sum(e["event"] == "resume" for e in events) == 1
    for axis in fig.axes:
        vertical = [
            ln for ln in axis.lines if len(set(ln.get_xdata())) == 1 and len(ln.get_xdata()) == 2
        ]
        assert len(vertical) == checkpoints + 1
        (curve,) = [ln for ln in axis.lines if len(ln.get_xdata()) == 10]
        assert list(curve.get_xdata())[:1] in ([0], [metrics[0]["wall_s"]])


def test_the_timeline_has_one_bar_per_generation_batch_and_training_step(resumed_run):
    _, _, timeline = records(resumed_run)
    fig = figure_timeline(plot_data(resumed_run))
    whole = fig.axes[0]
    gen, train_bars = (c for c in whole.collections)
    assert len(gen.get_paths()) == sum(s["kind"] == "generate" for s in timeline)
    assert len(train_bars.get_paths()) == sum(s["kind"] == "train" for s in timeline)
    relaunches = [ln for ln in whole.lines if ln.get_linestyle() == "--"]
    assert len(relaunches) == 1


def test_staleness_counts_every_step_within_the_bound(resumed_run):
    fig = figure_staleness(plot_data(resumed_run), max_age=2)
    bars = fig.axes[0].patches
    assert len(bars) == 3 and sum(b.get_height() for b in bars) == 10


def test_the_ledger_shows_the_skipped_ordinals_of_the_lossy_resume(resumed_run):
    _, events, _ = records(resumed_run)
    (resume,) = [e for e in events if e["event"] == "resume"]
    series = plot_data(resumed_run).ledger
    assert series["skipped"][-1] == len(resume["skipped_ordinals"]) > 0
    assert max(series["trained"]) == 10 * N
    fig = figure_ledger(plot_data(resumed_run))
    axis = fig.axes[0]
    assert len(axis.collections) == 4  # trained, buffered, in flight, pending
    assert [ln.get_label() for ln in axis.lines] == ["skipped (never trained)"]
    assert read_records(resumed_run / "metrics.jsonl")[-1]["attempt"] == 1


def test_plot_data_of_a_killed_run_covers_every_span_and_keeps_spans_out_of_order():
    """The ledger's grid starts from the last event's time and grows to cover spans after it
    (a run SIGKILLed long after its last event); whole-run bars given out of start order are
    not merged into each other; a step retrained without evaluation loses its eval point."""
    from asyncrl.cli.plot_data import Coalesced

    n = 2
    metrics = [{"step": t, "generation_version_min": t, "wall_s": t + 1.0, "reward_mean": 0.5,
                "loss": 0.1, "eval/reward_mean": 0.2} for t in range(40)]  # fmt: skip
    metrics.append({**metrics[3], "eval/reward_mean": None} | {"attempt": 1})
    del metrics[-1]["eval/reward_mean"]
    events = [{"event": "start", "time": 0.0, "attempt": 0, "from_step": 0},
              {"event": "checkpoint", "time": 10.0, "step": 10}]  # fmt: skip
    timeline = []
    for t in range(40):  # spans until t=40, the last event at t=10
        timeline.append({"kind": "generate", "start": t + 0.0, "seconds": 0.5, "attempt": 0,
                         "ordinals": [t * n, t * n + 1], "landed": [t * n, t * n + 1]})  # fmt: skip
        timeline.append({"kind": "train", "start": t + 0.5, "seconds": 0.5, "attempt": 0,
                         "step": t})  # fmt: skip
    data = read_plot_data(metrics, events, timeline, n)
    assert data.ledger["time"][-1] >= 40.0 - 1e-6
    assert data.ledger["trained"][-1] == 40 * n and max(data.ledger["trained"]) == 40 * n
    assert min(data.ledger["time"]) >= 0
    assert 3 not in data.evals.rows and 4 in data.evals.rows
    bars = Coalesced(gap=1.0)
    bars.add(10.0, 5.0)
    bars.add(8.0, 1.0)  # written later, started earlier (a row flushed at a landing)
    assert bars.spans == [(10.0, 5.0), (8.0, 1.0)]
