"""Multi-turn episodes (`env.name`, DESIGN.md I9): the episode record and partials (pure), the
engine's per-sample turn limits, the collector playing the built-in game — checked against an
independent replay of the game — the log-probs of an episode against one plain forward pass,
and the protocol's errors."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import small_config

from asyncrl.config import ConfigError
from asyncrl.core.episodes import Episode, step_id
from asyncrl.core.partial import Partial
from asyncrl.core.resume import SavedLedger, SavedSample, continued_samples, plan_resume
from asyncrl.rollout.engine import GenerationRequest
from asyncrl.rollout.episodes import EpisodeError, env_seed
from asyncrl.tasks.environments import environment_class
from asyncrl.tasks.games import GuessNumber, guess_number_examples

GAME = (
    "data.task=guess_number",
    "env.name=guess_number",
    "env.max_turns=4",
    "env.max_episode_tokens=16",
    "rollout.max_new_tokens=2",
    "rollout.num_generations_per_prompt=8",
)


# --- pure parts


def test_an_episode_records_its_turns_and_round_trips_through_json():
    e = Episode(({"role": "user", "content": "2-6="},))
    e = e.after_step("4", step_id(7, 1, 0), 0, 2, [{"role": "user", "content": "+"}], None,
                     False, {"secret": 5})  # fmt: skip
    e = e.after_step("5", step_id(7, 1, 1), 3, 5, [], 0.8, True, {"secret": 5})
    assert e.reward == pytest.approx(0.8) and e.num_turns == 2 and e.done
    assert [m["content"] for m in e.history()] == ["2-6=", "4", "+", "5"]
    assert Episode.from_state(e.state_dict()) == e
    assert e.turns[1].step_id == "7:1:1"


def test_a_reply_is_appended_as_tokens_the_policy_did_not_sample():
    start = Partial.episodes_started([Episode(()), Episode(())], limit=2)
    p = start.extend(
        torch.tensor([[5, 1], [6, 0]]),
        torch.tensor([[True, True], [True, False]]),
        torch.tensor([[-0.5, -0.25], [-1.0, 0.0]]),
        version=3,
        finished=torch.tensor([True, False]),
    )
    p = p.with_reply(0, [9, 9, 8], limit=7, episode=Episode((), turn_start=5))
    assert p.lengths == [5, 1] and p.finished.tolist() == [False, False]
    assert p.tokens[0].tolist() == [5, 1, 9, 9, 8]
    assert p.policy_mask[0].tolist() == [True, True, False, False, False]
    assert p.versions[0].tolist() == [3, 3, -1, -1, -1]
    assert p.logprobs[0, 2:].tolist() == [0.0, 0.0, 0.0]
    assert p.limits.tolist() == [7, 2]
    # the next turn continues after the reply, policy tokens again
    q = p.extend(
        torch.tensor([[4], [2]]), torch.tensor([[True], [True]]), torch.tensor([[-0.1], [-0.2]]),
        version=4, finished=torch.tensor([True, True]),
    )  # fmt: skip
    assert q.tokens[0].tolist() == [5, 1, 9, 9, 8, 4]
    assert q.policy_mask[0].tolist() == [True, True, False, False, False, True]
    assert q.policy_mask[1].tolist()[:2] == [True, True]
    back = Partial.from_state(q.state_dict())
    assert torch.equal(back.policy_mask, q.policy_mask) and back.episodes == q.episodes
    assert torch.equal(back.limits, q.limits)
    cut = q.truncated(0, 0, limit=2, episode=Episode((), restarts=1))
    assert cut.lengths == [0, 2] and cut.episodes[0].restarts == 1


def test_resume_plans_count_the_turns_each_policy_keeps_or_redoes_sample_by_sample():
    # ordinal 4: an episode two steps in, one in its first turn (no step asked), one ended;
    # ordinal 5: an episode two steps in, and a sample not started
    samples = {
        4: [SavedSample(10, 2), SavedSample(8, 0), SavedSample(12, 3, ended=True, finished=True)],
        5: [SavedSample(12, 2), SavedSample(0)],
    }
    saved = SavedLedger(
        step=2, num_prompts_per_step=2, cursor=6, in_flight=[(4, 2), (5, 2)], buffered=[],
        partial_tokens={4: 30, 5: 12}, partial_samples=samples,
    )  # fmt: skip

    def counts(plan):
        return (plan.turns_kept, plan.turns_regenerated, plan.tool_calls_repeated,
                plan.kept_tokens, plan.regenerated_tokens, plan.continued)  # fmt: skip

    assert counts(plan_resume(saved, "lossless")) == (7, 0, 0, 42, 0, [4, 5])
    # restart_episode starts every in-flight sample over, ended or not yet stepped
    restart = plan_resume(saved, "restart_episode")
    assert restart.redispatched == [(4, 2), (5, 2)]
    assert counts(restart) == (0, 7, 7, 0, 42, [])
    # an environment that can only restart: the episodes that took a step and have not ended
    # start over (2 + 2 turns, 10 + 12 tokens); the first turn and the ended episode are kept
    assert counts(plan_resume(saved, "lossless", episodes_restart=True)) == (
        3, 4, 4, 20, 22, [4],
    )  # fmt: skip
    assert continued_samples(saved, "lossless", episodes_restart=True) == {
        4: ([0, 8, 12], [False, False, True]),
        5: ([0, 0], [False, False]),
    }
    skipped = plan_resume(saved, "keep_incomplete")
    assert skipped.skipped == [4, 5] and counts(skipped) == (0, 7, 0, 0, 42, [])


# --- the engine: each sample stops at its own limit


def test_the_torch_engine_stops_each_sample_at_its_limit(tiny_engine):
    engine, eos = tiny_engine
    request = GenerationRequest([3, 4, 5], num_samples=4, noise_seed=11, limits=(1, 2, 3, 0))
    out = engine.generate([request])[0]
    lengths = out.completion_mask.sum(1).tolist()
    limits = (1, 2, 3, engine.max_new_tokens)
    for n, limit, row in zip(lengths, limits, out.completion_ids, strict=True):
        assert n <= limit
        assert n == limit or int(row[n - 1]) == eos  # stopped at its limit or at EOS
    assert out.finished.all()
    # a continued sample: the limit counts its prefix
    again = GenerationRequest([3, 4, 5], 1, 11, prefixes=((6, 7),), finished=(False,), limits=(3,))
    assert int(engine.generate([again])[0].completion_mask.sum()) <= 1


@pytest.fixture(scope="module")
def tiny_engine():
    from asyncrl.models.policy import load_policy
    from asyncrl.rollout.engine import EngineSpec
    from asyncrl.rollout.torch_engine import TorchGenerationEngine
    from asyncrl.rollout.weight_sync import CopyWeightSync

    policy = load_policy(small_config().model, 0, set("0123456789="))
    weights = CopyWeightSync(1, "cpu", torch.float32)
    weights.publish(0, policy.model.state_dict())
    spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, 6, 1.0)
    return TorchGenerationEngine(spec, weights), policy.eos_id


# --- the collector plays the game: an independent replay is the oracle


def play_batch(*overrides: str):
    """Components of a game run and one batch of groups generated by its collector."""
    from asyncrl.train.components import build_components

    config = small_config(*GAME, *overrides)
    parts = build_components(config)
    parts.weights.publish(0, parts.algo.policy_weights())
    parts.collector.publish_version(0)
    tickets = parts.ledger.admit(0, 1, config.rollout.num_prompts_per_step, 10)
    parts.collector._generate(tickets)
    groups = parts.buffer.sample(0)
    return config, parts, groups


def replay_game(example, seed: int, guesses: list[str]) -> tuple[list[str], float]:
    """The game by hand: each guess's answer, and the episode's reward."""
    lo, hi = (int(x) for x in example.prompt.rstrip("=").split("-"))
    secret = random.Random(seed).randint(lo, hi)
    answers = []
    for turn, guess in enumerate(guesses):
        g = guess.strip()
        if not (len(g) == 1 and g.isdigit() and lo <= int(g) <= hi):
            answers.append("?")
        elif int(g) == secret:
            return answers, 1.0 - 0.2 * turn
        else:
            answers.append("+" if secret > int(g) else "-")
    return answers, 0.0


def turns_of(ids: list[int], policy: list[bool]) -> list[tuple[list[int], list[int]]]:
    """A sample split into (assistant tokens, environment tokens after them) per turn."""
    out: list[tuple[list[int], list[int]]] = []
    for token, mine in zip(ids, policy, strict=True):
        if mine and (not out or out[-1][1]):
            out.append(([], []))
        (out[-1][0] if mine else out[-1][1]).append(token)
    return out


def test_the_collector_plays_episodes_that_a_replay_of_the_game_confirms():
    config, parts, groups = play_batch()
    tok, eos = parts.policy.tokenizer, parts.policy.eos_id
    examples = parts.task.examples
    assert len(groups) == config.rollout.num_prompts_per_step
    multi_turn = 0
    for g in groups:
        example = examples[g.ticket.dataset_index]
        assert tok.decode(g.prompt_ids) == example.prompt  # the opening, rendered
        for i in range(g.num_generations):
            real = g.completion_mask[i]
            ids = g.completion_ids[i][real].tolist()
            policy = g.loss_mask[i][real].tolist()
            turns = turns_of(ids, policy)
            guesses = [tok.decode(a, skip_special_tokens=True) for a, _ in turns]
            answers, reward = replay_game(example, env_seed(0, g.ordinal, i), guesses)
            assert float(g.rewards[i]) == pytest.approx(reward)
            assert len(turns) <= config.env.max_turns and len(ids) <= config.env.max_episode_tokens
            for (assistant, env), answer in zip(turns, answers, strict=False):
                assert len(assistant) <= config.rollout.max_new_tokens
                if not env:
                    continue  # the last turn: the episode ended
                # an assistant turn cut off before its EOS gets one from the environment
                expected = ([] if assistant[-1] == eos else [eos]) + tok.encode(
                    answer, add_special_tokens=False
                )
                assert env == expected
            multi_turn += len(turns) > 1
            # environment tokens have no log-prob and no version: they are not trained
            assert (g.behaviour_logprobs[i][real & ~g.loss_mask[i]] == 0).all()
    assert multi_turn > 0, "no episode took a second turn: the test proves little"


def test_an_episodes_log_probs_equal_one_plain_forward_pass_over_its_tokens():
    """The trainer's log-probs of a policy token see the environment's tokens before it: the
    oracle is one forward pass over prompt + whole episode, no masks."""
    from asyncrl.algos.update import batch_logprobs, stack_groups

    config, parts, groups = play_batch()
    model = parts.policy.model
    batch = stack_groups(groups, parts.policy.pad_id)
    assert "token_mask" in batch and not torch.equal(batch["token_mask"], batch["completion_mask"])
    with torch.no_grad():
        logprobs, _ = batch_logprobs(model, batch, config.rollout.temperature, parts.policy.pad_id)
    row = 0
    for g in groups:
        for i in range(g.num_generations):
            real = g.completion_mask[i]
            completion = g.completion_ids[i][real].tolist()
            ids = torch.tensor([list(g.prompt_ids) + completion])
            with torch.no_grad():
                reference = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            p = len(g.prompt_ids)
            expected = (
                reference[p - 1 : p - 1 + len(completion)]
                .gather(-1, torch.tensor(completion).unsqueeze(-1))
                .squeeze(-1)
            )
            mine = g.loss_mask[i][real]
            got = logprobs[row][: len(completion)]
            torch.testing.assert_close(got[mine], expected[mine], atol=1e-5, rtol=1e-5)
            # and the engine sampled them with those log-probs (the same weights)
            torch.testing.assert_close(
                g.behaviour_logprobs[i][real][mine], expected[mine], atol=1e-4, rtol=1e-4
            )
            row += 1


# --- the protocol's errors name the key


def test_env_name_that_does_not_load_is_refused_naming_the_key(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"env\.name"):
        environment_class("no_such_module:Game")
    (tmp_path / "half_game.py").write_text(
        "class Game:\n    restore = 'sometimes'\n    def reset(self, e, s): return []\n"
        "    def step(self, t, i): return [], 1.0, True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="restore='sometimes'"):
        environment_class("half_game:Game")
    with pytest.raises(ConfigError, match=r"env\.name"):
        small_config("env.name=guess_nubmer")


def test_what_episodes_do_not_run_with_yet_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"eval\.every_steps"):
        small_config(*GAME, "eval.every_steps=5")
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens"):
        small_config(*GAME, "rollout.max_new_tokens=40")


def test_a_reset_that_opens_samples_differently_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "moody_game.py").write_text(
        "class Game:\n    restore = 'restart'\n"
        "    def reset(self, example, seed): return [{'role': 'user', 'content': str(seed % 7)}]\n"
        "    def step(self, text, step_id): return [], 1.0, True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EpisodeError, match="opened with different messages"):
        play_batch("env.name=moody_game:Game")


def test_the_game_examples_and_environment():
    examples = guess_number_examples(50)
    env = GuessNumber()
    for e in examples:
        lo, hi = (int(x) for x in e.prompt.rstrip("=").split("-"))
        assert 0 <= lo < hi <= 9 and 4 <= hi - lo + 1 <= 10
    env.reset(examples[0], 3)
    secret = env.secret
    assert env.step("x", "0:0:0").messages[0]["content"] == "?"
    state = env.state_dict()
    other = GuessNumber()
    other.reset(examples[0], 999)
    other.load_state_dict(state)
    assert other.secret == secret and other.turns == 1
    assert other.rng.random() == env.rng.random()  # the RNG is part of the state
    result = other.step(str(secret), "0:0:1")
    assert result.done and result.reward == pytest.approx(0.8)


EPISODE_STEP = [
    *GAME,
    "algo.max_grad_norm=0",  # compare the raw accumulated gradients
    "algo.kl_coef=0.1",  # every loss term: surrogate, KL penalty, entropy bonus
    "algo.entropy_coef=0.01",
]


def test_micro_batches_give_an_episode_step_the_one_pass_gradients():
    from helpers import SMALL
    from rank_gradients import step_gradients
    from test_micro_batches import worst_relative_error

    _, _, groups = play_batch()
    whole, metrics = step_gradients(groups, [*SMALL, *EPISODE_STEP])
    assert any(float(g.norm()) > 0 for g in whole[0].values())
    micro = [*SMALL, *EPISODE_STEP, "train.micro_batch_size=3"]
    parts, part_metrics = step_gradients(groups, micro)
    assert worst_relative_error(whole, parts) <= 1e-6
    assert part_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5)


def test_ppo_advantages_over_an_episode_skip_the_environment_tokens():
    """Oracle: GAE by hand over the policy's tokens alone, in order (gamma, lam < 1, so a step
    through an environment token would discount once more and show)."""
    from asyncrl.core.advantages import ppo_advantages

    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [1, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.3, 9.0, 0.2, 0.0],
                           [0.1, 9.0, 0.6, 0.7, 0.0, 0.0, 0.0, 0.0]])  # fmt: skip
    rewards = torch.tensor([1.0, -1.0])
    gamma, lam = 0.9, 0.8
    _, returns, raw = ppo_advantages(rewards, values, mask, gamma, lam, normalize=False)
    for row in range(2):
        where = mask[row].nonzero().squeeze(1).tolist()
        v = [float(values[row, i]) for i in where]
        expected, running = [0.0] * len(v), 0.0
        for t in reversed(range(len(v))):
            last = t == len(v) - 1
            delta = (
                (float(rewards[row]) if last else 0.0) + (0.0 if last else gamma * v[t + 1]) - v[t]
            )
            running = delta + (0.0 if last else gamma * lam * running)
            expected[t] = running
        torch.testing.assert_close(raw[row, where], torch.tensor(expected))
        torch.testing.assert_close(returns[row, where], torch.tensor(expected) + values[row, where])
        assert (raw[row][~mask[row]] == 0).all()


def test_ppo_trains_on_episodes_and_micro_batches_give_the_one_pass_gradients():
    from helpers import SMALL
    from rank_gradients import step_gradients
    from test_micro_batches import worst_relative_error

    _, _, groups = play_batch()
    ppo = [*SMALL, *EPISODE_STEP, "algo.name=ppo", "algo.gamma=0.9", "algo.lam=0.8"]
    whole, metrics = step_gradients(groups, ppo)
    assert len(whole) == 2 and all(any(float(g.norm()) > 0 for g in w.values()) for w in whole)
    parts, part_metrics = step_gradients(groups, [*ppo, "train.micro_batch_size=5"])
    assert worst_relative_error(whole, parts) <= 1e-5
    assert part_metrics["value_loss"] == pytest.approx(metrics["value_loss"], rel=1e-5)
