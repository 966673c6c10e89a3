"""The torch generation engine: KV-cache sampling, EOS, behaviour log-probs, weight versions
through the weight sync; engine capabilities refused at start."""

import dataclasses

import pytest
import torch
from helpers import DIGITS, small_config

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.models.policy import load_policy
from asyncrl.rollout import engine as engines
from asyncrl.rollout.engine import EngineCapabilities, EngineSpec, GenerationRequest
from asyncrl.rollout.torch_engine import TorchGenerationEngine, sample_inverse_cdf
from asyncrl.rollout.weight_sync import CopyWeightSync


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(), seed=0, alphabet=DIGITS)


def engine_for(policy, max_new_tokens=6, temperature=1.0, weights=None, keep_cache=True):
    if weights is None:
        weights = CopyWeightSync()
        weights.publish(0, policy.model.state_dict())
    spec = EngineSpec(
        policy.model, policy.eos_id, policy.pad_id, max_new_tokens, temperature,
        keep_cache_between_chunks=keep_cache,
    )  # fmt: skip
    return TorchGenerationEngine(spec, weights)


def encode(policy, text):
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_inverse_cdf_sampling_picks_the_first_token_whose_cdf_reaches_u():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4)
    u = torch.tensor([0.05, 0.1, 0.31, 0.99])
    assert sample_inverse_cdf(probs, u).tolist() == [0, 0, 2, 3]


def test_behaviour_logprobs_match_a_full_forward_pass(policy):
    engine = engine_for(policy, temperature=0.8)
    requests = [
        GenerationRequest(encode(policy, p), 4, seed) for seed, p in enumerate(["12=", "98765="])
    ]
    outputs = engine.generate(requests)
    prompts = [r.prompt_ids for r in requests for _ in range(4)]
    ids = torch.cat([o.completion_ids for o in outputs])
    mask = torch.cat([o.completion_mask for o in outputs])
    sampled = torch.cat([o.logprobs for o in outputs])
    with torch.no_grad():
        full, _ = completion_logprobs(policy.model, prompts, ids, mask, 0.8, policy.pad_id)
    assert torch.allclose(full[mask], sampled[mask], atol=1e-5)
    assert (sampled[mask] < 0).all() and (sampled[~mask] == 0).all()


def test_a_request_samples_the_same_tokens_whatever_batch_it_is_in(policy):
    engine = engine_for(policy)
    alone = engine.generate([GenerationRequest(encode(policy, "31524="), 3, noise_seed=7)])[0]
    mixed = engine.generate(
        [
            GenerationRequest(encode(policy, "1="), 2, noise_seed=1),
            GenerationRequest(encode(policy, "31524="), 3, noise_seed=7),
        ]
    )[1]
    assert torch.equal(alone.completion_ids, mixed.completion_ids)
    other = engine.generate([GenerationRequest(encode(policy, "31524="), 3, noise_seed=8)])[0]
    assert not torch.equal(alone.completion_ids, other.completion_ids)


def test_tokens_after_eos_are_padding_and_masked(policy):
    # A random-init model emits EOS ~1% of the time; with fixed noise seeds this batch of 512
    # samples is deterministic and contains early EOS (asserted, so the branch is exercised).
    engine = engine_for(policy, max_new_tokens=5, temperature=3.0)
    out = engine.generate([GenerationRequest(encode(policy, "5="), 512, noise_seed=3)])[0]
    ended_early = 0
    for row, mask in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), strict=True):
        if policy.eos_id in row:
            end = row.index(policy.eos_id)
            assert mask == [True] * (end + 1) + [False] * (len(row) - end - 1)
            assert all(t == policy.pad_id for t in row[end + 1 :])
            ended_early += end < len(row) - 1
        else:
            assert all(mask)
    assert ended_early >= 3


def test_new_weights_are_used_from_the_next_batch_and_reported_as_their_version(policy):
    weights = CopyWeightSync(max_versions=2)
    weights.publish(0, policy.model.state_dict())
    engine = engine_for(policy, weights=weights)
    request = [GenerationRequest(encode(policy, "4321="), 4, noise_seed=11)]
    before = engine.generate(request)[0]
    assert before.weights_version == 0
    changed = {k: v + 0.5 * torch.randn_like(v) for k, v in policy.model.state_dict().items()}
    weights.publish(3, changed)
    assert weights.newest() == 3
    after = engine.generate(request)[0]
    assert after.weights_version == 3
    assert not torch.equal(before.logprobs, after.logprobs)
    pinned = engine.generate(request, version=0)[0]  # an older kept version, on request
    assert torch.equal(pinned.logprobs, before.logprobs) and pinned.weights_version == 0
    weights.publish(4, policy.model.state_dict())
    again = engine.generate(request)[0]
    assert torch.equal(again.logprobs, before.logprobs) and again.weights_version == 4
    with pytest.raises(
        RuntimeError, match=r"weights version 0 is no longer kept \(have \[3, 4\]\)"
    ):
        engine.generate(request, version=0)


def test_published_weights_whose_keys_do_not_match_the_model_are_an_error(policy):
    weights = CopyWeightSync()
    state = dict(policy.model.state_dict())
    state.pop("model.norm.weight")
    weights.publish(0, state)  # a sync that lost a tensor: loading must not skip it silently
    with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
        engine_for(policy, weights=weights).generate([GenerationRequest([1, 2], 1, 0)])


def test_the_weight_sync_saves_only_the_versions_older_than_the_newest(policy):
    weights = CopyWeightSync(max_versions=3)
    for version in range(5):
        weights.publish(version, {"w": torch.full((2,), float(version))})
    state = weights.state_dict()
    assert sorted(state["versions"]) == [2, 3]  # kept 2, 3, 4; 4 is the trainer's own
    restored = CopyWeightSync(max_versions=3)
    restored.load_state_dict(state)
    assert torch.equal(restored.get(3)["w"], torch.full((2,), 3.0))
    single = CopyWeightSync(max_versions=1)
    single.publish(0, {"w": torch.zeros(2)})
    single.publish(1, {"w": torch.ones(2)})
    assert single.state_dict() == {"versions": {}}  # not deterministic: nothing older to save


class NoPinning(TorchGenerationEngine):
    """The torch engine, declaring that it cannot generate with a pinned older version."""

    capabilities = dataclasses.replace(TorchGenerationEngine.capabilities, pinned_versions=False)


def test_a_config_that_needs_a_capability_the_engine_lacks_is_refused_naming_both(monkeypatch):
    from asyncrl.train.components import build_components

    monkeypatch.setitem(engines.ENGINES, "torch", f"{__name__}:NoPinning")
    with pytest.raises(ConfigError) as err:
        build_components(small_config("run.deterministic=true"))
    message = str(err.value)
    assert "run.deterministic=true needs an engine with pinned versions" in message
    assert "rollout.engine=torch does not have it" in message
    build_components(small_config())  # control: nothing needs pinning without determinism
    assert EngineCapabilities().pinned_versions is False


def test_a_stopped_call_hands_back_its_tokens_and_another_engine_continues_them(policy):
    """`stop_generating` (a Ray worker on a drained node) ends the call in progress after the
    token being sampled, its samples unfinished; another engine continues them from their
    prefixes and samples what one uninterrupted call samples (noise per request and token)."""
    request = GenerationRequest(encode(policy, "31524="), 4, noise_seed=3)
    whole = engine_for(policy, max_new_tokens=12, keep_cache=False).generate([request])[0]
    engine = engine_for(policy, max_new_tokens=12, keep_cache=False)
    forwards = []

    def stop_after_three_decode_steps(module, args, kwargs, output):
        forwards.append(1)
        if len(forwards) == 4:  # the prefill and two tokens' passes: three tokens sampled
            engine.stop_generating()  # as the drain watcher's remote call would, mid-call

    hook = engine._model.register_forward_hook(stop_after_three_decode_steps, with_kwargs=True)
    cut = engine.generate([request])[0]
    hook.remove()
    lengths = whole.completion_mask.sum(dim=1)
    ended = lengths <= 3  # sampled EOS within those three tokens
    assert int((~ended).sum()) > 0 and torch.equal(cut.finished_rows(), ended)
    assert cut.completion_mask.sum(dim=1).tolist() == lengths.clamp(max=3).tolist()
    assert torch.equal(cut.completion_ids, whole.completion_ids[:, :3])
    # stopped for good: a later call hands its requests straight back, with no token
    again = engine.generate([request])[0]
    assert again.completion_ids.shape == (4, 0) and not again.finished_rows().any()
    prefixes = tuple(
        tuple(row[mask].tolist())
        for row, mask in zip(cut.completion_ids, cut.completion_mask, strict=True)
    )
    rest = engine_for(policy, max_new_tokens=12, keep_cache=False).generate(
        [dataclasses.replace(request, prefixes=prefixes, finished=tuple(ended.tolist()))]
    )[0]
    for i in range(4):  # each sample: its cut tokens, then the rest, as in the whole call
        tokens = torch.cat([cut.completion_ids[i][cut.completion_mask[i]],
                            rest.completion_ids[i][rest.completion_mask[i]]])  # fmt: skip
        logprobs = torch.cat([cut.logprobs[i][cut.completion_mask[i]],
                              rest.logprobs[i][rest.completion_mask[i]]])  # fmt: skip
        assert torch.equal(tokens, whole.completion_ids[i][whole.completion_mask[i]])
        assert torch.allclose(logprobs, whole.logprobs[i][whole.completion_mask[i]], atol=1e-5)
