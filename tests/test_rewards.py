"""Rewards: the built-in `math` reward (math-verify) on hand-made cases, the reward-call
contract (numbers, dicts of components, batched functions, bad returns) and the worker pool
with its timeout."""

from __future__ import annotations

import pytest
from helpers import hung_reward_pids, process_gone

from asyncrl.rollout.reward_pool import RewardJob, RewardPool
from asyncrl.tasks.reward_calls import GroupScores, RewardFailure, score_group
from asyncrl.tasks.rewards import boxed_contents, math_reward, reference_answer

MATH_CASES = [
    # (reference, completion, correct, boxed)
    ("42", "The answer is \\boxed{42}.", 1, 1),
    ("42", "40 + 2 = 42", 1, 0),  # the last number
    ("#### 42", "so it is 42", 1, 0),  # GSM8K's reference format
    ("\\frac{1}{2}", "\\boxed{0.5}", 1, 1),
    ("0.5", "$\\frac{1}{2}$", 1, 0),
    ("1/2", "\\boxed{\\frac{2}{4}}", 1, 1),
    ("1,000", "\\boxed{1000}", 1, 1),
    ("$x^2+1$", "\\boxed{1+x^2}", 1, 1),
    ("-3", "the result is -3", 1, 0),
    ("12", "12.0", 1, 0),
    ("42", "I think 41", 0, 0),  # wrong
    ("12", "\\boxed{13}", 0, 1),  # wrong, well formatted
    ("42", "no idea", 0, 0),  # no answer
    ("42", "", 0, 0),  # empty completion
    ("7", "\\boxed{7} and then 9", 1, 1),  # the boxed answer wins over the last number
    ("3", "\\boxed{}\\boxed{} 3 \\boxed{}", 1, 0),  # empty boxes: no format bonus
    ("3", "\\boxed{3} so \\boxed{3}", 1, 0),  # two boxes: no format bonus
    ("3", "\\boxed{ }", 0, 0),
]


@pytest.mark.parametrize(("reference", "completion", "correct", "boxed"), MATH_CASES)
def test_math_reward_on_hand_made_cases(reference, completion, correct, boxed):
    scores = math_reward(completion, reference)
    assert scores == {"reward": float(correct), "correct": float(correct), "format": float(boxed)}


def test_math_reward_format_bonus_adds_to_the_reward():
    assert math_reward("\\boxed{13}", "12", format_reward=0.1)["reward"] == pytest.approx(0.1)
    assert math_reward("\\boxed{12}", "12", format_reward=0.1)["reward"] == pytest.approx(1.1)
    assert math_reward("12", "12", format_reward=0.1)["reward"] == 1.0


def test_boxed_contents_balance_braces_and_keep_an_unclosed_rest():
    assert boxed_contents("a \\boxed{\\frac{1}{2}} b \\boxed {7}") == ["\\frac{1}{2}", "7"]
    assert boxed_contents("\\boxed{}\\boxed{") == ["", ""]
    assert boxed_contents("no box") == []


def test_reference_answer_takes_what_follows_gsm8k_marks():
    assert reference_answer("3 + 4 = 7\n#### 7") == "7"
    assert reference_answer(" 7 ") == "7"


def test_score_group_numbers_and_components():
    plain = score_group("asyncrl.tasks.rewards:exact_match", {}, ["7", "8"], "7")
    assert plain == GroupScores([1.0, 0.0], {})
    parts = score_group("asyncrl.tasks.rewards:math_reward", {}, ["\\boxed{7}", "8"], "7")
    assert parts.rewards == [1.0, 0.0]
    assert parts.components == {"correct": [1.0, 0.0], "format": [1.0, 0.0]}
    summed = score_group("failing_rewards:batched_parts", {}, ["7", "12"], "7")
    assert summed.rewards == pytest.approx([1.1, 0.2])  # no `reward` entry: the sum
    assert summed.components == {"exact": [1.0, 0.0], "length": [0.1, 0.2]}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("failing_rewards:raises_on_7", "raised ValueError('cannot score answer 7')"),
        ("failing_rewards:nan_on_7", "returned nan as reward"),
    ],
)
def test_score_group_failures_name_the_completion(target, message):
    with pytest.raises(RewardFailure, match="completion '7'") as err:
        score_group(target, {}, ["7"], "7")
    assert message in str(err.value)


def test_pool_in_worker_processes_matches_the_calling_thread():
    jobs = [RewardJob(["\\boxed{3}", "4", "x"], "3"), RewardJob(["1/2", "0.5"], "\\frac{1}{2}")]
    here = RewardPool("asyncrl.tasks.rewards:math_reward", {"format_reward": 0.5})
    pool = RewardPool("asyncrl.tasks.rewards:math_reward", {"format_reward": 0.5}, workers=2)
    try:
        assert pool.score(jobs) == here.score(jobs)
        assert here.score(jobs)[0].rewards == [1.5, 0.0, 0.0]
    finally:
        pool.close()


def test_a_call_past_the_timeout_is_stopped_and_reported_and_the_pool_goes_on(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_DIR", str(tmp_path / "failures"))
    monkeypatch.setenv("ASYNCRL_TEST_FAIL_TIMES", "1000")  # sleeps 120 s on answer 7
    pool = RewardPool("failing_rewards:sleeps_on_7", {}, workers=2, timeout_s=1.5)
    try:
        slow, fast = pool.score([RewardJob(["x"], "7"), RewardJob(["3"], "3")])
        (hung,) = hung_reward_pids(tmp_path / "failures")
        assert process_gone(hung), "the call past its timeout was waited out, not stopped"
        assert isinstance(slow, RewardFailure) and "reward_timeout_s=1.5" in str(slow)
        assert fast == GroupScores([1.0], {})
        assert pool.score([RewardJob(["3"], "3")]) == [GroupScores([1.0], {})]  # replaced
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("failing_rewards:uneven_parts", "returned components ['b'] for completion 'x'"),
        ("failing_rewards:empty_parts", "returned an empty dict"),
        ("failing_rewards:text_part", "returned 'fine' as note"),
        ("failing_rewards:batched_short", "returned 1 values for a group of 2 completions"),
    ],
)
def test_rewards_that_break_the_contract_are_refused_saying_how(target, message):
    with pytest.raises(RewardFailure) as err:
        score_group(target, {}, ["7", "x"], "7")
    assert message in str(err.value)


def test_a_batched_reward_that_raises_is_a_failure_here_and_in_a_worker():
    jobs = [RewardJob(["7"], "7")]
    for workers in (0, 1):
        pool = RewardPool("failing_rewards:batched_raises", {}, workers=workers)
        try:
            (result,) = pool.score(jobs)
        finally:
            pool.close()
        assert isinstance(result, RewardFailure)
        assert "the grader is down" in str(result)


def test_a_closed_pool_fails_every_call_instead_of_running_it_here(tmp_path):
    """After `close()` (the run is ending) a call must not run in the calling thread, where
    a hanging reward would hold up the exit with no timeout."""
    pool = RewardPool("asyncrl.tasks.rewards:exact_match", {}, workers=0)
    job = RewardJob(["12"], "12")
    assert pool.score([job])[0].rewards == [1.0]  # open: scored here
    pool.close()
    (result,) = pool.score([job])
    assert isinstance(result, RewardFailure) and "reward pool closed" in str(result)
