"""Partial generations (`rollout.chunk_tokens`): a sequence generated in chunks is the sequence
generated in one go; a partial survives the ledger's checkpoint round trip; a continued batch
never generates a finished sample again nor a token it already has; mid-generation weight
updates keep each token's version; the resume plans count tokens."""

import threading

import pytest
import torch
from helpers import DIGITS
from test_engine import encode, engine_for

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.core.buffer import ReplayBuffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.partial import Partial
from asyncrl.core.resume import SavedLedger, plan_resume
from asyncrl.core.seeds import noise_seed
from asyncrl.core.stream import PromptStream
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.models.policy import load_policy
from asyncrl.rollout.collector import Collector
from asyncrl.rollout.engine import GenerationRequest
from asyncrl.rollout.rollouts import PassOptions, SingleTurns
from asyncrl.rollout.scorer import Scored

LONG = 30  # max_new_tokens: with a 13-token vocabulary most samples sample EOS before it
G = 6


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(), seed=0, alphabet=DIGITS)


def requests_for(policy):
    prompts = ["3141=", "27182=", "99="]
    return [
        GenerationRequest(encode(policy, p), G, noise_seed=11 + i) for i, p in enumerate(prompts)
    ]


def in_chunks(engine, requests, chunk):
    """Generates `requests` `chunk` tokens at a time, each pass continuing from the last."""
    partials = [Partial.empty(r.num_samples) for r in requests]
    versions_seen = set()
    while not all(p.done for p in partials):
        asked = [
            GenerationRequest(
                r.prompt_ids,
                r.num_samples,
                r.noise_seed,
                p.prefixes() if p.tokens.shape[1] else (),
                tuple(bool(f) for f in p.finished) if p.tokens.shape[1] else (),
            )
            for r, p in zip(requests, partials, strict=True)
        ]
        outs = engine.generate(asked, max_tokens=chunk)
        for i, out in enumerate(outs):
            assert int(out.completion_mask.sum(dim=1).max()) <= chunk
            if partials[i].done:
                assert not out.completion_mask.any()
            partials[i] = partials[i].extend(
                out.completion_ids, out.completion_mask, out.logprobs, out.weights_version,
                out.finished_rows(),
            )  # fmt: skip
            versions_seen.add(out.weights_version)
    return partials


def as_rows(partial, pad_id):
    return torch.where(partial.mask, partial.tokens, pad_id), partial.mask, partial.logprobs


@pytest.mark.parametrize("keep_cache", [True, False], ids=["cache-kept", "re-prefilled"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_sequence_generated_in_chunks_is_the_sequence_generated_in_one_go(
    policy, chunk, keep_cache
):
    engine = engine_for(policy, max_new_tokens=LONG, keep_cache=keep_cache)
    whole = engine.generate(requests_for(policy))
    lengths = torch.cat([o.completion_mask.sum(dim=1) for o in whole])
    assert int(lengths.min()) < int(lengths.max()) <= LONG  # EOS at different places
    assert (lengths == LONG).any()  # and some samples stopped by the length cap
    chunked = in_chunks(engine, requests_for(policy), chunk)
    for one, part in zip(whole, chunked, strict=True):
        tokens, mask, logprobs = as_rows(part, policy.pad_id)
        width = tokens.shape[1]  # the group's longest sample; the batch may run longer
        assert not one.completion_mask[:, width:].any()
        assert torch.equal(tokens, one.completion_ids[:, :width])
        assert torch.equal(mask, one.completion_mask[:, :width])
        torch.testing.assert_close(logprobs, one.logprobs[:, :width], atol=1e-5, rtol=0)
        assert part.finished.all()


def test_chunked_log_probs_are_the_trainers_forward_pass(policy):
    engine = engine_for(policy, max_new_tokens=LONG)
    (part,) = in_chunks(engine, requests_for(policy)[:1], 4)
    prompt = requests_for(policy)[0].prompt_ids
    tokens, mask, logprobs = as_rows(part, policy.pad_id)
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            policy.model, [prompt] * G, tokens, mask, 1.0, policy.pad_id
        )
    torch.testing.assert_close(logprobs[mask], trainer[mask], atol=1e-5, rtol=0)


def test_a_chunked_sequence_stopped_and_continued_elsewhere_is_bitwise_the_same(policy):
    # what a resume does: a new engine (a new process) continues the saved partial; in
    # deterministic mode (deterministic algorithms) the result is bit-for-bit the same
    torch.use_deterministic_algorithms(True)
    try:
        # deterministic mode keeps no cache between chunks (a resumed run has none)
        reference = in_chunks(
            engine_for(policy, max_new_tokens=LONG, keep_cache=False), requests_for(policy), 5
        )
        first = engine_for(policy, max_new_tokens=LONG, keep_cache=False)
        requests = requests_for(policy)
        outs = first.generate(requests, max_tokens=5)
        saved = [
            Partial.from_state(
                Partial.empty(G)
                .extend(o.completion_ids, o.completion_mask, o.logprobs, 0, o.finished_rows())
                .state_dict()
            )
            for o in outs
        ]
        second = engine_for(policy, max_new_tokens=LONG, keep_cache=False)
        partials = saved
        while not all(p.done for p in partials):
            asked = [
                GenerationRequest(
                    r.prompt_ids, G, r.noise_seed, p.prefixes(), tuple(p.finished.tolist())
                )
                for r, p in zip(requests, partials, strict=True)
            ]
            outs = second.generate(asked, max_tokens=5)
            partials = [
                p.extend(o.completion_ids, o.completion_mask, o.logprobs, 0, o.finished_rows())
                for p, o in zip(partials, outs, strict=True)
            ]
        for a, b in zip(reference, partials, strict=True):
            for key in ("tokens", "mask", "logprobs", "finished"):
                assert torch.equal(getattr(a, key), getattr(b, key)), key
    finally:
        torch.use_deterministic_algorithms(False)


def test_partial_extend_appends_each_samples_tokens_after_its_own_and_keeps_versions():
    p = Partial.empty(2)
    p = p.extend(
        torch.tensor([[5, 6], [7, 0]]),
        torch.tensor([[True, True], [True, False]]),
        torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]),
        version=3,
        finished=torch.tensor([False, True]),
    )
    p = p.extend(
        torch.tensor([[8, 0], [0, 0]]),
        torch.tensor([[True, False], [False, False]]),
        torch.tensor([[-4.0, 0.0], [0.0, 0.0]]),
        version=4,
        finished=torch.tensor([True, False]),
    )
    assert p.prefixes() == ((5, 6, 8), (7,))
    assert p.lengths == [3, 1] and p.num_tokens == 4 and p.done
    assert p.versions.tolist() == [[3, 3, 4], [3, -1, -1]]
    assert p.logprobs.tolist() == [[-1.0, -2.0, -4.0], [-3.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="finished sample"):
        p.extend(torch.tensor([[1], [1]]), torch.tensor([[True], [False]]), torch.zeros(2, 1),
                 5, torch.tensor([True, True]))  # fmt: skip


def test_the_ledger_saves_partials_of_in_flight_ordinals_and_lossy_plans_drop_them():
    ledger = Ledger(PromptStream(10, 2, seed=0))
    tickets = ledger.admit(0, 1, 3, 100)
    p = Partial.empty(2).extend(
        torch.tensor([[4, 5], [6, 0]]), torch.tensor([[True, True], [True, False]]),
        torch.zeros(2, 2), 0, torch.tensor([False, True]),
    )  # fmt: skip
    ledger.progress(tickets[1].ordinal, p)
    ledger.complete(tickets[0].ordinal)
    state = ledger.state_dict()
    restored = Ledger(PromptStream(10, 2, seed=0))
    restored.stream.load_state_dict(ledger.stream.state_dict())
    restored.load_state_dict(state)
    assert set(restored.partials) == {tickets[1].ordinal}
    assert restored.partials[tickets[1].ordinal].prefixes() == ((4, 5), (6,))
    saved = restored.saved(1, [(0, 0)], {0: 7})
    assert saved.partial_tokens == {1: 3}
    lossless = plan_resume(saved, "lossless")
    assert (lossless.kept_tokens, lossless.regenerated_tokens) == (10, 0)
    # ordinal 1 continues; ordinal 2 (in flight, no chunk saved yet) starts over
    assert lossless.continued == [1] and lossless.num_regenerated == 1
    restart = plan_resume(saved, "restart_episode")  # its partial samples start over
    assert (restart.kept_tokens, restart.regenerated_tokens, restart.continued) == (7, 3, [])
    lossy = plan_resume(saved, "keep_incomplete")
    assert (lossy.kept_tokens, lossy.regenerated_tokens) == (7, 3)
    assert lossy.continued == [] and lossy.num_regenerated == 2
    again = Ledger(PromptStream(10, 2, seed=0))
    again.stream.load_state_dict(ledger.stream.state_dict())
    again.load_state_dict(state)
    again.apply(restart)  # the plan's word kept: the single-turn samples are dropped
    assert again.partials == {} and [t.ordinal for t in again.redispatch] == [1, 2]
    restored.apply(lossy)
    assert restored.partials == {}
    with pytest.raises(KeyError):
        restored.progress(0, p)  # not in flight


def test_drop_incomplete_counts_the_discarded_groups_tokens_as_regenerated():
    saved = SavedLedger(
        step=0, num_prompts_per_step=2, cursor=3, in_flight=[(2, 1)], buffered=[(0, 0), (1, 0)],
        partial_tokens={2: 5}, buffered_tokens={0: 4, 1: 6},
    )  # fmt: skip
    plan = plan_resume(saved, "drop_incomplete")
    assert plan.discarded == [] and (plan.kept_tokens, plan.regenerated_tokens) == (10, 5)
    saved = SavedLedger(0, 2, 3, [(2, 1)], [(0, 0)], {2: 5}, {0: 4})
    plan = plan_resume(saved, "drop_incomplete")
    assert plan.discarded == [0] and (plan.kept_tokens, plan.regenerated_tokens) == (0, 9)


class RecordingEngine:
    """The real torch engine, recording each call's requests; `gate` can hold a call."""

    def __init__(self, engine):
        self.engine = engine
        self.capabilities = engine.capabilities
        self.calls = []
        self.after_call = None

    def generate(self, requests, version=None, max_tokens=None):
        out = self.engine.generate(requests, version, max_tokens)
        self.calls.append((requests, version, max_tokens, out))
        if self.after_call is not None:
            self.after_call(len(self.calls))
        return out

    def metrics(self):
        return {}


def collector_for(policy, engine, ledger, buffer, chunk, mid=False, stop_after=None):
    prompts = [encode(policy, f"{i}{i + 1}=") for i in range(10)]
    rollout = SingleTurns(
        PassOptions(
            engine, G, seed=0, pad_id=policy.pad_id, chunk_tokens=chunk, mid_generation_updates=mid
        ),
        prompts,
        lambda items: [Scored(torch.zeros(out.completion_ids.shape[0])) for _, out in items],
    )
    collector = Collector(
        ledger=ledger, buffer=buffer, rollout=rollout, window=1, groups_per_batch=2,
        end_target=1,
    )  # fmt: skip
    return collector


def uninterrupted_groups(policy):
    """Target 0's groups from a chunked collector that nothing stops or fails."""
    ledger, buffer = Ledger(PromptStream(10, 2, seed=0)), ReplayBuffer(2, 4)
    collector = collector_for(policy, engine_for(policy, max_new_tokens=LONG), ledger, buffer, 4)
    collector.start()
    groups = buffer.sample(0, check=collector.check)
    collector.stop()
    return groups


def test_a_batch_stopped_between_chunks_continues_without_generating_finished_samples_again(
    policy,
):
    # Today's code (no partials) would generate both groups again from their first token.
    stream = PromptStream(10, 2, seed=0)
    ledger, buffer = Ledger(stream), ReplayBuffer(2, 4)
    engine = RecordingEngine(engine_for(policy, max_new_tokens=LONG))
    collector = collector_for(policy, engine, ledger, buffer, chunk=4)
    stopped = threading.Event()

    def stop_after_two_chunks(n):
        if n == 2:
            collector._stop = True  # as `stop()` does, without joining from inside
            stopped.set()

    engine.after_call = stop_after_two_chunks
    collector.start()
    assert stopped.wait(60)
    collector._thread.join(60)
    assert len(buffer) == 0 and set(ledger.in_flight) == {0, 1}
    saved_state = {"ledger": ledger.state_dict(), "stream": stream.state_dict()}
    partials = {k: ledger.partials[k] for k in (0, 1)}
    assert all(p.finished.any() and not p.done for p in partials.values())  # both kinds

    # "restart": a new ledger from the saved state, a new engine, a new collector
    stream2 = PromptStream(10, 2, seed=0)
    stream2.load_state_dict(saved_state["stream"])
    ledger2, buffer2 = Ledger(stream2), ReplayBuffer(2, 4)
    ledger2.load_state_dict(saved_state["ledger"])
    engine2 = RecordingEngine(engine_for(policy, max_new_tokens=LONG))
    collector2 = collector_for(policy, engine2, ledger2, buffer2, chunk=4)
    collector2.start()
    groups = buffer2.sample(0, check=collector2.check)
    collector2.stop()
    first_requests = engine2.calls[0][0]
    for request, ordinal in zip(first_requests, (0, 1), strict=True):
        saved = partials[ordinal]
        assert request.prefixes == saved.prefixes()  # continued from its last saved token
        assert request.finished == tuple(saved.finished.tolist())
    # the continuation generated exactly the tokens the partials lacked: none for a finished
    # sample, and never one a partial already had
    generated = {}
    for requests, _, _, outs in engine2.calls:
        for request, out in zip(requests, outs, strict=True):
            counts = generated.setdefault(request.noise_seed, torch.zeros(G, dtype=torch.int64))
            counts += out.completion_mask.sum(dim=1)
    for group, ordinal in zip(groups, (0, 1), strict=True):
        saved = partials[ordinal]
        new_tokens = generated[noise_seed(0, ordinal)]
        assert new_tokens.tolist() == [
            int(n) - s for n, s in zip(group.completion_mask.sum(dim=1), saved.lengths, strict=True)
        ]
        assert (new_tokens[saved.finished] == 0).all()
        for i, prefix in enumerate(saved.prefixes()):
            row = group.completion_ids[i][group.completion_mask[i]].tolist()
            assert row[: len(prefix)] == list(prefix)
    # and the result is what one uninterrupted chunked collector produces
    for a, b in zip(groups, uninterrupted_groups(policy), strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.completion_mask, b.completion_mask)


def test_mid_generation_updates_switch_weights_between_chunks_and_keep_each_tokens_version(
    policy,
):
    from asyncrl.rollout.weight_sync import CopyWeightSync

    weights = CopyWeightSync(2)
    weights.publish(0, policy.model.state_dict())
    engine = RecordingEngine(engine_for(policy, max_new_tokens=LONG, weights=weights))
    stream = PromptStream(10, 2, seed=0)
    ledger, buffer = Ledger(stream), ReplayBuffer(2, 4)
    collector = collector_for(policy, engine, ledger, buffer, chunk=3, mid=True)

    def publish_after_first_chunk(n):
        if n == 1:
            changed = {k: v + 0.01 for k, v in policy.model.state_dict().items()}
            weights.publish(1, changed)

    engine.after_call = publish_after_first_chunk
    collector.start()
    groups = buffer.sample(0, check=collector.check)
    collector.stop()
    assert [c[1] for c in engine.calls] == [None] * len(engine.calls)  # always the newest
    mixed = [g for g in groups if g.version_min != g.version_max]
    assert mixed, "a group that outlived the first chunk has tokens of both versions"
    for g in mixed:
        assert (g.version_min, g.version_max) == (0, 1)
        first = g.token_versions[:, :3][g.completion_mask[:, :3]]
        assert (first == 0).all() and (g.token_versions[:, 3:][g.completion_mask[:, 3:]] == 1).all()


def test_without_mid_generation_updates_a_batch_keeps_the_version_it_started_with(policy):
    from asyncrl.rollout.weight_sync import CopyWeightSync

    weights = CopyWeightSync(2)
    weights.publish(0, policy.model.state_dict())
    engine = RecordingEngine(engine_for(policy, max_new_tokens=LONG, weights=weights))
    ledger, buffer = Ledger(PromptStream(10, 2, seed=0)), ReplayBuffer(2, 4)
    collector = collector_for(policy, engine, ledger, buffer, chunk=3)
    engine.after_call = lambda n: n == 1 and weights.publish(1, policy.model.state_dict())
    collector.start()
    groups = buffer.sample(0, check=collector.check)
    collector.stop()
    assert len(engine.calls) > 1 and [c[1] for c in engine.calls[1:]] == [0] * (
        len(engine.calls) - 1
    )
    assert all(g.version_min == g.version_max == 0 and g.token_versions is None for g in groups)


def test_mid_generation_updates_need_chunks_and_are_refused_in_deterministic_mode():
    from helpers import small_config

    with pytest.raises(ConfigError, match=r"rollout\.update_weights_mid_generation.*chunk_tokens"):
        small_config("rollout.update_weights_mid_generation=true")
    with pytest.raises(ConfigError, match=r"run\.deterministic=true: which version"):
        small_config(
            "rollout.chunk_tokens=4", "rollout.update_weights_mid_generation=true",
            "run.deterministic=true",
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"rollout\.chunk_tokens"):
        small_config("rollout.chunk_tokens=-1")


def test_chunks_in_one_process_reuse_the_kv_cache_unless_the_weights_changed(policy):
    from asyncrl.rollout.weight_sync import CopyWeightSync

    weights = CopyWeightSync(2)
    weights.publish(0, policy.model.state_dict())
    engine = engine_for(policy, max_new_tokens=LONG, weights=weights)
    widths = []
    real_forward = engine._model.forward

    def forward(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return real_forward(*args, **kwargs)

    engine._model.forward = forward
    requests = requests_for(policy)[:1]
    outs = engine.generate(requests, max_tokens=4)
    partial = Partial.empty(G).extend(
        outs[0].completion_ids, outs[0].completion_mask, outs[0].logprobs, 0,
        outs[0].finished_rows(),
    )  # fmt: skip
    assert not partial.done
    asked = [
        GenerationRequest(
            requests[0].prompt_ids, G, requests[0].noise_seed, partial.prefixes(),
            tuple(partial.finished.tolist()),
        )
    ]  # fmt: skip
    widths.clear()
    engine.generate(asked, max_tokens=4)
    assert max(widths) == 1  # every forward of the continued chunk was one token wide: no prefill
    # the same request again: the cache now holds later tokens, so it cannot be used
    widths.clear()
    engine.generate(asked, max_tokens=4)
    assert max(widths) > 1
    # new weights: a kept cache (computed with the old ones) is never used
    engine.generate(requests, max_tokens=4)
    weights.publish(1, {k: v + 0.01 for k, v in policy.model.state_dict().items()})
    widths.clear()
    engine.generate(asked, max_tokens=4)
    assert max(widths) > 1


def test_chunked_configs_need_the_engine_to_continue_prefixes_and_pin_versions():
    from helpers import small_config

    from asyncrl.rollout.engine import EngineCapabilities, check_capabilities

    chunked = small_config("rollout.chunk_tokens=4")
    with pytest.raises(ConfigError, match="continue from prefix"):
        check_capabilities(chunked, EngineCapabilities(pinned_versions=True))
    with pytest.raises(ConfigError, match="pinned versions"):
        check_capabilities(chunked, EngineCapabilities(continue_from_prefix=True))
    mid = small_config("rollout.chunk_tokens=4", "rollout.update_weights_mid_generation=true")
    check_capabilities(mid, EngineCapabilities(continue_from_prefix=True))  # newest each chunk


def test_a_prefix_already_at_max_new_tokens_is_finished_not_an_error(policy):
    # max_new_tokens lowered on a forced resume: the saved sample cannot grow
    engine = engine_for(policy, max_new_tokens=3)
    request = requests_for(policy)[0]
    asked = GenerationRequest(
        request.prompt_ids, G, request.noise_seed, ((5, 6, 7),) * G, (False,) * G
    )
    (out,) = engine.generate([asked], max_tokens=2)
    assert out.finished_rows().all() and not out.completion_mask.any()


class FailingOnce(RecordingEngine):
    """Records each call's requests; the `fail_call`-th call raises before generating."""

    def __init__(self, engine, fail_call):
        super().__init__(engine)
        self.fail_call = fail_call
        self.asked = []

    def generate(self, requests, version=None, max_tokens=None):
        self.asked.append(requests)
        if len(self.asked) == self.fail_call:
            raise RuntimeError("engine hiccup")
        return super().generate(requests, version, max_tokens)


def test_a_chunked_batch_that_fails_mid_generation_is_retried_from_its_saved_partials(policy):
    ledger, buffer = Ledger(PromptStream(10, 2, seed=0)), ReplayBuffer(2, 4)
    engine = FailingOnce(engine_for(policy, max_new_tokens=LONG), fail_call=2)
    collector = collector_for(policy, engine, ledger, buffer, chunk=4)
    collector.start()
    groups = buffer.sample(0, check=collector.check)
    collector.stop()
    assert collector.num_failures == 1
    first_out = engine.calls[0][3]  # what the first chunk generated
    failed, retried = engine.asked[1], engine.asked[2]
    assert [r.prefixes for r in retried] == [r.prefixes for r in failed]  # from the partials
    for request, out in zip(retried, first_out, strict=True):
        for prefix, row, mask in zip(
            request.prefixes, out.completion_ids, out.completion_mask, strict=True
        ):
            assert list(prefix) == row[mask].tolist()  # neither lost nor doubled
    for a, b in zip(groups, uninterrupted_groups(policy), strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
