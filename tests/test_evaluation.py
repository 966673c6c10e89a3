"""Evaluation: greedy decoding equals `transformers`' own, pass@k and pass@1 by hand, a failing
reward is counted and never stops training, eval prompts come from the split asked for, and a
deterministic run trains the same bits with evaluation on or off."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import read_records, small_config
from test_determinism import fingerprint

from asyncrl.cli.audit import audit_run_dir
from asyncrl.config import ConfigError
from asyncrl.config.keys import build_config
from asyncrl.rollout.engine import GenerationRequest
from asyncrl.rollout.evaluation import Evaluator, PromptResult, eval_examples
from asyncrl.tasks.source import sort_digits_examples
from asyncrl.train.components import build_components
from asyncrl.train.trainer import train


def evaluator_of(*overrides: str) -> tuple[Evaluator, object]:
    parts = build_components(small_config("eval.every_steps=1", *overrides))
    assert parts.evaluator is not None
    return parts.evaluator, parts


def test_greedy_decoding_is_transformers_greedy_generate():
    evaluator, parts = evaluator_of("eval.max_examples=6", "eval.batch_prompts=4")
    model = parts.policy.model
    with evaluator._temperature(0.0):
        evaluator.weights.publish(1, parts.algo.policy_weights())
        ours = evaluator.engine.generate([GenerationRequest(p, 1, 0) for p in evaluator.prompts])
    for prompt, out in zip(evaluator.prompts, ours, strict=True):
        expected = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=5,
            eos_token_id=parts.policy.eos_id,
            pad_token_id=parts.policy.pad_id,
        )[0, len(prompt) :]
        got = out.completion_ids[0][out.completion_mask[0]]
        assert got.tolist() == expected[: len(got)].tolist()
        assert len(got) == len(expected) or got[-1] == parts.policy.eos_id


def test_pass_at_k_and_pass_at_1_by_hand():
    evaluator, _ = evaluator_of("eval.num_samples=3", "eval.pass_threshold=0.5")
    results = [
        PromptResult(torch.tensor([1.0, 0.0, 0.0]), {"c": torch.tensor([1.0, 0.0, 0.0])}, 6),
        PromptResult(torch.tensor([0.2, 0.4, 0.0]), {"c": torch.tensor([0.0, 0.0, 0.0])}, 3),
        PromptResult(torch.tensor([0.5, 1.0, 0.9]), {"c": torch.tensor([1.0, 1.0, 1.0])}, 9),
        PromptResult(torch.zeros(3), {}, 3, failed=True),
    ]
    metrics = evaluator._summary(results, 3)
    assert metrics["eval/pass@3"] == pytest.approx(2 / 4)  # prompts 0 and 2
    assert metrics["eval/pass@1"] == pytest.approx((1 + 0 + 3 + 0) / 12)
    assert metrics["eval/reward_mean"] == pytest.approx(4.0 / 12)
    assert metrics["eval/reward/c"] == pytest.approx(4 / 9)  # the failed prompt has no parts
    assert metrics["eval/completion_tokens"] == pytest.approx(21 / 12)
    assert metrics["eval/reward_failures"] == 1
    # with a `correct` component, passing is being correct: a format bonus is no pass
    bonus = PromptResult(
        torch.tensor([1.1, 1.0, 0.1]), {"correct": torch.tensor([1.0, 0.0, 0.0])}, 3
    )
    evaluator.config.pass_threshold = 1.0
    assert evaluator._passes(bonus).tolist() == [True, False, False]


def test_a_failing_reward_is_counted_and_training_goes_on(tmp_path):
    for name, modulo in (("train", 7), ("eval", 10)):  # answer 7 only in eval
        lines = [
            json.dumps({"prompt": f"{d}=", "answer": str(d % modulo)}) + "\n" for d in range(10)
        ]
        (tmp_path / f"{name}.jsonl").write_text("".join(lines))
    config = small_config(
        "data.task=jsonl",
        f"data.path={tmp_path / 'train.jsonl'}",
        "data.reward_fn=failing_rewards:raises_on_7",
        f"eval.path={tmp_path / 'eval.jsonl'}",
        "eval.every_steps=2",
        "eval.num_samples=2",
        "run.max_num_steps=2",
    )
    train(config, tmp_path / "run")
    (last,) = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1]
    assert last["eval/num_examples"] == 10
    assert last["eval/reward_failures"] == 2  # row 7, sampled and greedy
    events = [e for e in read_records(tmp_path / "run" / "events.jsonl") if e["event"] == "eval"]
    assert [(e["step"], e["version"]) for e in events] == [(-1, 0), (1, 2)]  # at start, end


def test_eval_prompts_come_from_the_path_or_split_asked_for(tmp_path):
    import datasets

    rows = [{"prompt": f"{d}=", "answer": str(d)} for d in range(10)]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:3])}
    ).save_to_disk(str(saved))
    hf = ["data.task=hf", f"data.path={saved}"]
    assert len(eval_examples(build_config({}, [*hf, "eval.split=test"]))) == 3
    assert len(eval_examples(build_config({}, [*hf, "eval.split=train", "eval.max_examples=4"])))
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"eval\.path: data\.path .* is one file"):
        eval_examples(build_config({}, ["data.task=hf", f"data.path={one}"]))
    held_out = [e.prompt for e in eval_examples(build_config({}, ["eval.max_examples=50"]))]
    training = [e.prompt for e in sort_digits_examples(5, 4096)]
    assert len(held_out) == 50 and not set(held_out) & set(training)
    assert held_out == [e.prompt for e in eval_examples(build_config({}, ["eval.max_examples=50"]))]


@pytest.mark.slow
def test_a_deterministic_run_trains_the_same_bits_with_evaluation_on_or_off(tmp_path, monkeypatch):
    common = [
        "run.deterministic=true", "run.max_num_steps=8", "rollout.groups_per_batch=2",
        "checkpoint.save_period=3", "data.num_examples=20",
    ]  # fmt: skip
    train(small_config(*common), tmp_path / "off")
    train(small_config(*common, "eval.every_steps=3", "eval.max_examples=16"), tmp_path / "on")
    evaluated = [r for r in read_records(tmp_path / "on" / "metrics.jsonl") if "eval/pass@4" in r]
    assert [r["step"] for r in evaluated] == [2, 5, 7]
    assert fingerprint(tmp_path / "on") == fingerprint(tmp_path / "off")
    assert audit_run_dir(tmp_path / "on").ok
    # negative control: an evaluation that touches the trainer's weights is caught
    real = Evaluator.evaluate

    def meddling(self, version, weights):
        with torch.no_grad():
            next(iter(weights.values())).add_(1e-3)
        return real(self, version, weights)

    monkeypatch.setattr(Evaluator, "evaluate", meddling)
    train(small_config(*common, "eval.every_steps=3", "eval.max_examples=16"), tmp_path / "bad")
    assert fingerprint(tmp_path / "bad") != fingerprint(tmp_path / "off")


def test_the_eval_plot_draws_each_evaluated_step(tmp_path):
    from asyncrl.cli.plots import figure_eval, run_plot_data, write_plots
    from asyncrl.cli.report import end_of_run_report

    run = tmp_path / "run"
    config = small_config("eval.every_steps=2", "eval.max_examples=8", "run.max_num_steps=5")
    train(config, run)
    records = read_records(run / "metrics.jsonl")
    (initial,) = [e for e in read_records(run / "events.jsonl") if e.get("version") == 0]
    assert initial["event"] == "eval" and initial["step"] == -1  # eval.at_start, the default
    figure = figure_eval(run_plot_data(run)[0])
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    # against the steps trained: the initial weights at 0, those after step t at t + 1
    assert list(lines["pass@4"].get_xdata()) == [0, 2, 4, 5]
    expected = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    assert list(lines["reward_mean"].get_ydata()) == [initial["eval/reward_mean"], *expected]
    assert len(figure.axes[1].get_lines()) == len(figure.axes[0].get_lines())  # wall time
    summary = end_of_run_report(run, plot=False)
    assert f"reward {initial['eval/reward_mean']:.3f}" in summary and "before training" in summary
    assert run / "plots" / "eval.png" in write_plots(run)
    assert (run / "plots" / "eval.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_asyncrl_eval_of_a_checkpoint_reproduces_the_evaluation_the_run_made(tmp_path):
    import json as jsonlib

    from helpers import run_cli

    run = tmp_path / "run"
    config = small_config(
        "eval.every_steps=3", "eval.max_examples=12", "run.max_num_steps=6",
        "checkpoint.save_period=3", "checkpoint.keep_last=5",
    )  # fmt: skip
    train(config, run)
    during = {r["step"]: r for r in read_records(run / "metrics.jsonl") if "eval/pass@4" in r}
    for name, step in ((None, 6), ("step_3", 3)):
        done = run_cli("eval", str(run), "--json", *(["--checkpoint", name] if name else []))
        assert done.returncode == 0, done.stderr
        result = jsonlib.loads(done.stdout)
        assert result["step"] == step
        made = during[step - 1]  # the weights after step t-1 are checkpoint step_t's
        for key, value in result.items():
            if key.startswith("eval/") and key != "eval/seconds":
                assert value == pytest.approx(made[key], abs=1e-6), key
    assert result != jsonlib.loads(run_cli("eval", str(run), "--json").stdout)  # other weights
    wider = run_cli("eval", str(run), "--json", "eval.num_samples=2", "eval.max_examples=5")
    assert "eval/pass@2" in jsonlib.loads(wider.stdout)
    assert jsonlib.loads(wider.stdout)["eval/num_examples"] == 5
    bad = run_cli("eval", str(run), "--checkpoint", "step_4")
    assert bad.returncode == 2 and "step_000004 does not exist" in bad.stderr
    assert run_cli("eval", str(run), "rollout.temperature=2").returncode == 2


@pytest.mark.slow
def test_asyncrl_eval_imports_no_reward_module_the_run_dir_names(tmp_path, monkeypatch):
    """I7: a run dir never runs code. The run's reward module writes a marker when imported:
    `asyncrl eval` refuses to import it unless the command line names it."""
    from helpers import run_cli

    (tmp_path / "marker_reward.py").write_text(
        "import os, pathlib\n"
        "pathlib.Path(os.environ['ASYNCRL_TEST_MARKER']).write_text('imported')\n"
        "from asyncrl.tasks.rewards import partial_match as reward\n"
    )
    marker = tmp_path / "imported"
    monkeypatch.setenv("ASYNCRL_TEST_MARKER", str(marker))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    config = small_config(
        "data.reward_fn=marker_reward:reward", "eval.every_steps=2", "eval.max_examples=4",
        "run.max_num_steps=2",
    )  # fmt: skip
    train(config, run)
    assert marker.exists()  # training imports it, as it should
    marker.unlink()
    refused = run_cli("eval", str(run))
    assert refused.returncode == 2, refused.stderr
    assert "'marker_reward:reward' is not built in" in refused.stderr
    assert "data.reward_fn=marker_reward:reward" in refused.stderr  # the way to allow it
    assert not marker.exists(), "eval imported a module the run dir named"
    named = run_cli("eval", str(run), "--json", "data.reward_fn=marker_reward:reward")
    assert named.returncode == 0, named.stderr
    assert marker.exists()  # the control: named on the command line, it is imported
    made = read_records(run / "metrics.jsonl")[-1]
    assert json.loads(named.stdout)["eval/reward_mean"] == pytest.approx(made["eval/reward_mean"])


def test_a_deterministic_resume_on_other_evaluation_prompts_is_refused(tmp_path):
    """I8 for eval data: in deterministic mode the eval figures are part of the run, so a
    resume whose eval prompts changed is refused naming `eval.path` (it used to resume and
    evaluate other prompts silently); without deterministic mode the change is noted in the
    resume event's `config_changes`."""
    from asyncrl.train.rundir import RunDirError

    eval_file = tmp_path / "eval.jsonl"

    def write(count):
        rows = [{"prompt": f"{d}{d + 1}", "answer": f"{d}{d + 1}"} for d in range(count)]
        eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(steps, *extra):
        common = ["eval.every_steps=2", f"eval.path={eval_file}", "eval.num_samples=2"]
        return small_config(*common, f"run.max_num_steps={steps}", *extra)

    det = tmp_path / "det"
    write(6)
    train(config(2, "run.deterministic=true"), det)
    write(8)
    with pytest.raises(RunDirError) as err:
        train(config(4, "run.deterministic=true"), det)
    assert f"on other eval data (eval.path={eval_file})" in str(err.value)
    assert "cut evaluating 6 examples" in str(err.value) and "now has 8" in str(err.value)
    write(6)  # negative control: the same prompts resume
    train(config(4, "run.deterministic=true"), det)
    assert [r["step"] for r in read_records(det / "metrics.jsonl")] == [0, 1, 2, 3]

    loose = tmp_path / "loose"
    train(config(2), loose)
    write(7)
    train(config(4), loose)
    (resume,) = [e for e in read_records(loose / "events.jsonl") if e["event"] == "resume"]
    saved, now = resume["config_changes"]["eval data"]
    assert (saved["num_rows"], now["num_rows"]) == (6, 7)


def test_greedy_only_evaluation_decodes_once_and_the_run_reports_and_plots_it(tmp_path):
    """`eval.num_samples=0`: each prompt is decoded greedily once (half of k=1's cost), the
    record has the greedy figures and no sampled ones, and the summary, the terminal line and
    the plot read it; `num_samples=0` without greedy is refused naming the key."""
    from asyncrl.cli.plots import figure_eval, run_plot_data
    from asyncrl.cli.report import end_of_run_report
    from asyncrl.rollout.evaluation import eval_line

    with pytest.raises(ConfigError, match=r"eval\.num_samples"):
        build_config({}, ["eval.num_samples=0", "eval.greedy=false"])
    evaluator, parts = evaluator_of("eval.num_samples=0", "eval.max_examples=6")
    calls: list[tuple[int, float]] = []
    run = evaluator._run
    evaluator._run = lambda v, k, t: calls.append((k, t)) or run(v, k, t)  # type: ignore[method-assign]
    metrics = evaluator.evaluate(1, parts.algo.policy_weights())
    assert calls == [(1, 0.0)]  # one greedy pass, nothing sampled
    assert "eval/reward_mean" not in metrics and not any("pass@" in k for k in metrics)
    assert metrics["eval/num_examples"] == 6 and metrics["eval/greedy_pass"] >= 0
    assert metrics["eval/completion_tokens"] > 0
    assert "greedy=" in eval_line({"step": 3, **metrics})

    out = tmp_path / "run"
    config = small_config(
        "eval.every_steps=2", "eval.max_examples=8", "eval.num_samples=0", "run.max_num_steps=3"
    )
    train(config, out)
    records = [r for r in read_records(out / "metrics.jsonl") if "eval/num_examples" in r]
    assert [r["step"] for r in records] == [1, 2]
    figure = figure_eval(run_plot_data(out)[0])
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["greedy_pass"].get_xdata()) == [0, 2, 3]  # the initial weights too
    assert "reward_mean" not in lines
    summary = end_of_run_report(out, plot=False)
    assert "greedy" in summary and "before training" in summary
