"""Why a run is not learning (`asyncrl.train.learning`): the shares of a step's samples cut at
the length limit and paid partial rewards, counted by hand on small groups; the watch that
says each once, with the knob, when its mean over 5 steps reaches its threshold; the summary's
lines."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import read_records, small_config, train_and_report

import asyncrl.train.trainer as trainer_module
from asyncrl.cli.report import end_of_run_report
from asyncrl.config import ConfigError
from asyncrl.core.types import Group, PromptTicket
from asyncrl.train.learning import (
    Knobs,
    LearningWatch,
    learning_fields,
    partial_reward_share,
    truncated_reward_gap,
    truncated_share,
    zero_reward_groups,
)

EOS = 2
PAD = 0


def group(rows, rewards, correct=None, loss_mask=None, row_samples=None) -> Group:
    """Rows of tokens (right-padded with PAD, which the mask leaves out)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return Group(
        ticket=PromptTicket(0, 0, 0, 0, 0),
        prompt_ids=[5],
        completion_ids=ids,
        completion_mask=mask,
        behaviour_logprobs=torch.zeros(ids.shape),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        version_min=0,
        version_max=0,
        reward_components={} if correct is None else {"correct": torch.tensor(correct)},
        loss_mask=loss_mask,
        row_samples=row_samples,
    )


def test_a_sample_is_cut_when_its_last_token_is_not_the_end_of_its_turn():
    # 4 samples: ended, cut (no eos, full width), ended early, cut mid-way of a shorter row
    g = group([[7, 8, EOS], [7, 8, 9], [7, EOS], [9, 9]], [1.0, 0.0, 1.0, 0.0])
    assert truncated_share([g], EOS) == 0.5
    assert truncated_share([g], 9) == 0.5  # another end token: the other two are the cut ones
    # over two groups: 2 + 0 of 4 + 2
    ended = group([[7, EOS], [8, EOS]], [1.0, 1.0])
    assert truncated_share([g, ended], EOS) == pytest.approx(2 / 6)
    assert truncated_share([], EOS) == 0.0


def test_an_episodes_last_turn_counts_not_the_environments_tokens_after_it():
    # the policy's turn ended (EOS), then the environment's tokens (not trained) follow: not
    # cut; the second sample's last trained token is 8, cut at the limit before its EOS
    rows = [[7, EOS, 30, 31], [7, 8, 30, 31]]
    loss = torch.tensor([[True, True, False, False], [True, True, False, False]])
    assert truncated_share([group(rows, [0.0, 1.0], loss_mask=loss)], EOS) == 0.5
    # a sample of two segments: only its last segment's end counts (row 0 cut, row 1 ended)
    seg = group([[7, 8], [9, EOS], [7, 7]], [1.0, 0.0], row_samples=torch.tensor([0, 0, 1]))
    assert truncated_share([seg], EOS) == 0.5


def test_partial_rewards_are_those_paid_while_correct_is_zero():
    # rewards correct + 0.1 format: right (1.1), format only (0.1), nothing (0), right unboxed
    g = group([[EOS]] * 4, [1.1, 0.1, 0.0, 1.0], correct=[1.0, 0.0, 0.0, 1.0])
    assert partial_reward_share([g]) == 0.25
    assert partial_reward_share([group([[EOS]] * 2, [1.0, 0.0])]) is None  # no `correct` part
    fields = learning_fields([g], EOS)
    assert fields == {"truncated_share": 0.0, "zero_reward_groups": 0.0,
                      "partial_reward_share": 0.25}  # fmt: skip
    assert "partial_reward_share" not in learning_fields([group([[EOS]], [1.0])], EOS)


def test_what_being_cut_costs_and_the_groups_that_earned_nothing():
    # 2 groups: (ended 1.0, cut 0.0), (ended 0.5, cut 0.0, cut 0.0): gap 0.75 - 0 = 0.75
    a = group([[7, EOS], [7, 7]], [1.0, 0.0])
    b = group([[7, EOS], [7, 7], [8, 8]], [0.5, 0.0, 0.0])
    assert truncated_reward_gap([a, b], EOS) == pytest.approx(0.75)
    # every sample cut, or none: no gap to tell
    assert truncated_reward_gap([group([[7, 7], [8, 8]], [1.0, 0.0])], EOS) is None
    assert truncated_reward_gap([group([[EOS], [EOS]], [1.0, 0.0])], EOS) is None
    # groups that earned nothing: every task reward 0 or below (the overlong penalty aside)
    nothing = group([[EOS], [EOS]], [0.0, 0.0])
    penalized = group([[EOS], [EOS]], [-0.5, 0.0])
    penalized.reward_components["overlong"] = torch.tensor([-0.5, 0.0])
    paid_but_penalized = group([[EOS], [EOS]], [-0.2, 0.0])
    paid_but_penalized.reward_components["overlong"] = torch.tensor([-0.7, 0.0])  # task: 0.5
    assert zero_reward_groups([nothing, penalized, paid_but_penalized, a]) == 0.5


KNOBS = Knobs(max_new_tokens=80, num_generations=8, temperature=0.5, format_reward=0.1)


def test_the_watch_says_each_signal_once_when_its_mean_over_the_window_reaches_it():
    watch = LearningWatch(KNOBS, window=5)
    said = []
    shares = [0.9, 0.9, 0.9, 0.9, 0.3, 0.7, 0.8, 0.9, 0.9, 0.9]  # mean 0.78 at the 5th
    for step, share in enumerate(shares):
        record = {"truncated_share": share, "truncated_reward_gap": 0.2, "reward_mean": 0.1}
        said += [(step, *s) for s in watch.observe(record)]
    assert [(step, field) for step, field, _, _ in said] == [(4, "truncated_share")]
    step, _, share, message = said[0]
    assert share == pytest.approx(sum(shares[:5]) / 5)
    assert message == (
        "78% of completions hit rollout.max_new_tokens=80: raise it, or add a length penalty "
        "(rollout.overlong_buffer)"
    )


def test_cut_samples_are_said_only_where_being_cut_costs_reward():
    # the built-in digits task: every sample cut (its answers fill the limit) and learning
    learning = LearningWatch(KNOBS, window=3)
    for reward in (0.2, 0.5, 0.9, 0.95):
        assert learning.observe({"truncated_share": 1.0, "reward_mean": reward}) == []
    # cut samples earning more than those that ended: not the limit's fault
    better = LearningWatch(KNOBS, window=3)
    for _ in range(4):
        record = {"truncated_share": 0.8, "truncated_reward_gap": -0.3, "reward_mean": 0.4}
        assert better.observe(record) == []
    # every sample cut and nothing earned: said
    stuck = LearningWatch(KNOBS, window=3)
    said = [stuck.observe({"truncated_share": 1.0, "reward_mean": 0.0}) for _ in range(3)]
    assert [[field for field, _, _ in s] for s in said] == [[], [], ["truncated_share"]]


def test_below_a_threshold_nothing_is_said_and_each_signal_has_its_own():
    watch = LearningWatch(KNOBS, window=3)
    said = []
    for _ in range(10):  # 49% cut, 89% earned nothing, 49% partial: all just under
        said += watch.observe({"truncated_share": 0.49, "zero_reward_groups": 0.89,
                               "partial_reward_share": 0.49, "reward_mean": 0.0})  # fmt: skip
    assert said == []
    for _ in range(3):
        said += watch.observe({"zero_reward_groups": 1.0, "partial_reward_share": 0.6})
    messages = {field: message for field, _, message in said}
    assert set(messages) == {"zero_reward_groups", "partial_reward_share"}
    assert messages["zero_reward_groups"].startswith("93% of groups earned nothing")
    assert (
        "rollout.num_generations_per_prompt=8 or rollout.temperature=0.5"
        in messages["zero_reward_groups"]
    )
    # (0.49 + 0.49 + 0.6) / 3
    assert messages["partial_reward_share"].startswith("53% of rewards were partial")
    assert "(data.format_reward=0.1)" in messages["partial_reward_share"]
    # without a format bonus (a rubric's parts), the message names those instead
    other = LearningWatch(Knobs(64, 4, 1.0), window=1)
    [(_, _, text)] = other.observe({"partial_reward_share": 0.5})
    assert "the reward's parts other than `correct`" in text


def test_the_summary_shows_the_last_steps_shares_and_what_the_run_said(tmp_path):
    lines = []
    for step in range(20):
        lines.append({"step": step, "reward_mean": 0.1, "generation_version_min": step,
                      "generation_s": 1.0, "train_s": 1.0, "wait_s": 0.0, "wall_s": step + 1.0,
                      "truncated_share": 0.5 if step < 18 else 0.75,
                      "zero_variance_groups": 0.25})  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    message = (
        "74% of completions hit rollout.max_new_tokens=80: raise it, or add a length penalty "
        "(rollout.overlong_buffer)"
    )
    events = [{"event": "start"},
              {"event": "not_learning", "step": 4, "signal": "truncated_share", "share": 0.74,
               "message": message}]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    report = end_of_run_report(tmp_path, plot=False).splitlines()
    # the last 10% of 20 steps: steps 18 and 19
    assert (
        "  learning      last 10%: cut at the length limit 75%, groups with no variance 25%"
        in report
    )
    assert f"  not learning? {message}" in report
    # a run that recorded none of them (older metrics) has no such lines
    for r in lines:
        del r["truncated_share"], r["zero_variance_groups"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    assert not any(
        "learning" in line for line in end_of_run_report(tmp_path, plot=False).splitlines()
    )


def test_a_run_cut_at_its_length_limit_says_so_once_and_its_summary_names_the_knob(
    tmp_path, monkeypatch
):
    """The built-in task's answers need more than 3 tokens: most completions are cut at
    rollout.max_new_tokens=3, and none is right (`exact_match`). Each record's share is
    checked against the trained groups counted another way (a row is cut when no eos is among
    its tokens); after the 5th step the run says so once, in events.jsonl and the summary."""

    trained: list[tuple[list[Group], int]] = []
    fields = trainer_module.learning_fields

    def recorded(groups: list[Group], end_id: int) -> dict[str, float]:
        trained.append((groups, end_id))
        return fields(groups, end_id)

    monkeypatch.setattr(trainer_module, "learning_fields", recorded)
    config = small_config("run.max_num_steps=7", "rollout.max_new_tokens=3",
                          "data.reward_fn=exact_match")  # fmt: skip
    summary = train_and_report(config, tmp_path / "run")
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    oracle = []
    for groups, end_id in trained:
        rows = [g.completion_ids[r][g.completion_mask[r]].tolist() for g in groups
                for r in range(g.num_rows)]  # fmt: skip
        oracle.append(sum(end_id not in row for row in rows) / len(rows))
    assert len(trained) == 7
    assert [r["truncated_share"] for r in records] == pytest.approx(oracle)
    assert 0.5 <= sum(oracle[:5]) / 5 < 1.0  # the case is the one meant: mostly cut, not all
    share = sum(oracle[:5]) / 5
    message = (
        f"{share:.0%} of completions hit rollout.max_new_tokens=3: raise it, or add a length "
        "penalty (rollout.overlong_buffer)"
    )
    events = [e for e in read_records(tmp_path / "run" / "events.jsonl")
              if e["event"] == "not_learning" and e["signal"] == "truncated_share"]  # fmt: skip
    assert [(e["step"], e["message"]) for e in events] == [(4, message)]
    assert f"  not learning? {message}" in summary.splitlines()
    last = oracle[-1]  # the last 10% of 7 steps: the last step
    assert f"cut at the length limit {last:.0%}" in summary


def test_the_window_is_a_tenth_of_the_run_at_least_five_steps():
    from asyncrl.train.learning import learning_window

    assert [learning_window(n) for n in (1, 7, 59, 60, 1000)] == [5, 5, 5, 6, 100]


def test_the_overlong_penalty_is_dapos_soft_band_below_the_limit():
    from asyncrl.rollout.overlong import overlong_penalty

    # limit 80, band 20: 0 up to 60 tokens, then -1/20 a token, -1 at 80 (x the penalty 0.5)
    lengths = torch.tensor([10, 60, 61, 70, 79, 80])
    got = overlong_penalty(lengths, 80, 20, 0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.025, -0.25, -0.475, -0.5])
    assert got.dtype == torch.float32
    assert overlong_penalty(lengths, 80, 0, 1.0).tolist() == [0.0] * 6  # off


def test_the_penalty_is_added_to_the_tasks_reward_and_kept_as_its_own_part():
    from asyncrl.rollout.engine import GenerationOutput
    from asyncrl.rollout.overlong import with_overlong_penalty
    from asyncrl.rollout.scorer import Scored

    mask = torch.tensor([[True] * 2 + [False] * 2, [True] * 4])  # 2 tokens, 4 (the limit)
    output = GenerationOutput(torch.zeros(2, 4, dtype=torch.long), mask, torch.zeros(2, 4), 0)
    ticket = PromptTicket(0, 0, 0, 0, 0)

    def task_score(items):
        return [Scored(torch.tensor([1.0, 1.0]), {"correct": torch.tensor([1.0, 1.0])})]

    (scored,) = with_overlong_penalty(task_score, 4, 2, 1.0)([(ticket, output)])
    assert scored.rewards.tolist() == [1.0, 0.0]
    assert scored.components["overlong"].tolist() == [0.0, -1.0]
    assert scored.components["correct"].tolist() == [1.0, 1.0]


def test_a_run_with_the_penalty_logs_it_and_its_evaluation_scores_answers_alone(tmp_path):
    """rollout.overlong_buffer=2 of max_new_tokens=6: the records' reward/overlong is the
    mean penalty (0 or below), reward_mean the task's reward plus it; the evaluation's reward
    has no penalty in it (its completions are as long, its reward is the task's)."""

    config = small_config("rollout.max_new_tokens=6", "rollout.overlong_buffer=2",
                          "eval.every_steps=3", "eval.max_examples=8")  # fmt: skip
    train_and_report(config, tmp_path / "run")
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    penalties = [r["reward/overlong"] for r in records]
    assert all(-1.0 <= p <= 0.0 for p in penalties) and min(penalties) < 0.0
    for r in records:  # the task's partial_match reward is in [0, 1]: the sum shifts it down
        assert -1.0 <= r["reward_mean"] <= 1.0
    evaluated = [r for r in records if "eval/reward_mean" in r]
    assert evaluated and all(r["eval/reward_mean"] >= 0.0 for r in evaluated)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.max_new_tokens=8", "rollout.overlong_buffer=8"], "rollout.overlong_buffer"),
        (["rollout.overlong_buffer=-1"], "rollout.overlong_buffer"),
        (["rollout.overlong_penalty=-0.5"], "rollout.overlong_penalty"),
    ],
)
def test_bad_overlong_settings_are_refused_naming_the_key(overrides, message):

    with pytest.raises(ConfigError, match=message):
        small_config(*overrides).validate()
