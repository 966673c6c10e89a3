"""The vLLM engine (`rollout.engine=vllm`) on the CPU build that `make setup` installs: its
log-probs against the trainer's forward pass of the same weights, before and after an in-place
weight update; seeds; EOS; continued samples; deterministic mode refused with the reason."""

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DIGITS, new_adapters, small_config

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.models.policy import load_policy
from asyncrl.rollout.engine import EngineSpec, GenerationRequest, check_engine
from asyncrl.rollout.weight_sync import CopyWeightSync

if os.environ.get("CI") != "true":  # CI installs vLLM: there the tests must run, not skip
    pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(), seed=0, alphabet=DIGITS)


@pytest.fixture(scope="module")
def engine(policy):
    from asyncrl.rollout.vllm_engine import VLLMGenerationEngine

    weights = CopyWeightSync(max_versions=2)
    weights.publish(0, policy.model.state_dict())
    # an instruct model's generation config often lists more end tokens than the tokenizer's
    # eos (Qwen2.5, Llama 3): asyncrl's samples must still end at eos only
    extra_end = encode(policy, "1")[0]
    policy.model.generation_config.eos_token_id = [policy.eos_id, extra_end]
    spec = EngineSpec(
        policy.model, policy.eos_id, policy.pad_id, 8, 0.8,
        options={"kv_cache_bytes": 32 << 20, "max_num_seqs": 64},
    )  # fmt: skip
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    engine = VLLMGenerationEngine(spec, weights)
    STARTUP["rng_kept"] = (
        torch.equal(rng[0], torch.get_rng_state())
        and rng[1] == random.getstate()
        and (rng[2] == np.random.get_state()[1]).all()
    )
    return engine


STARTUP: dict[str, bool] = {}


def test_starting_vllm_in_process_leaves_the_runs_random_state_alone(engine):
    """vLLM seeds the global RNGs when it starts in the calling process; the engine puts the
    run's back (torch, Python, NumPy)."""
    assert STARTUP["rng_kept"]
    torch.set_num_threads(1)  # and vLLM's no-op replacement was undone
    assert torch.get_num_threads() == 1


def encode(policy, text):
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"]


def trainer_logprobs(model, prompts, output):
    with torch.no_grad():
        full, _ = completion_logprobs(
            model, prompts, output.completion_ids, output.completion_mask, 0.8, 0
        )
    return full


def max_gap(model, prompts, outputs):
    gap = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        full = trainer_logprobs(model, [prompt] * output.completion_ids.shape[0], output)
        mask = output.completion_mask
        assert mask.any()
        gap = max(gap, float((full - output.logprobs)[mask].abs().max()))
    return gap


def test_logprobs_match_the_trainer_before_and_after_a_weight_update(policy, engine):
    prompts = [encode(policy, "31524="), encode(policy, "90817=")]
    requests = [GenerationRequest(p, 4, noise_seed=11 + i) for i, p in enumerate(prompts)]
    before = engine.generate(requests)
    assert all(o.weights_version == 0 for o in before)
    assert max_gap(policy.model, prompts, before) <= 1e-4

    changed = load_policy(ModelConfig(), seed=1, alphabet=DIGITS).model
    engine.weights.publish(1, changed.state_dict())
    after = engine.generate(requests)
    assert all(o.weights_version == 1 for o in after)
    # the new weights are used (the old model no longer explains the log-probs) ...
    assert max_gap(changed, prompts, after) <= 1e-4
    assert max_gap(policy.model, prompts, after) > 1e-2
    # ... and an older kept version is loaded back on request (pinned versions)
    pinned = engine.generate(requests, version=0)
    assert all(o.weights_version == 0 for o in pinned)
    assert max_gap(policy.model, prompts, pinned) <= 1e-4
    assert engine.metrics()["engine_weight_updates"] == 3


def test_the_same_seed_samples_the_same_tokens_in_another_batch(policy, engine):
    prompt = encode(policy, "55123=")
    alone = engine.generate([GenerationRequest(prompt, 4, noise_seed=7)], version=0)[0]
    others = [
        GenerationRequest(encode(policy, f"{i}4321="), 4, noise_seed=100 + i) for i in range(5)
    ]
    crowd = engine.generate([*others, GenerationRequest(prompt, 4, noise_seed=7)], version=0)[-1]
    assert torch.equal(alone.completion_ids, crowd.completion_ids)
    assert torch.allclose(alone.logprobs, crowd.logprobs, atol=1e-5)
    other_seed = engine.generate([GenerationRequest(prompt, 4, noise_seed=8)], version=0)[0]
    assert not torch.equal(alone.completion_ids, other_seed.completion_ids)


def test_eos_ends_a_sample_and_what_follows_is_padding(policy, engine):
    outputs = engine.generate(
        [GenerationRequest(encode(policy, "12345="), 16, noise_seed=s) for s in range(4)]
    )
    ended, went_past_extra_end = 0, 0
    extra_end = encode(policy, "1")[0]  # an end token of the generation config, not eos
    for out in outputs:
        for ids, mask in zip(out.completion_ids, out.completion_mask, strict=True):
            n = int(mask.sum())
            went_past_extra_end += int(ids[: n - 1].eq(extra_end).any())
            assert mask[:n].all() and not mask[n:].any()  # one contiguous run from the start
            assert (ids[n:] == policy.pad_id).all()
            if n < 8:
                assert int(ids[n - 1]) == policy.eos_id  # EOS is included and ends it
                ended += 1
            assert int(ids[: n - 1].eq(policy.eos_id).sum()) == 0
        assert out.finished_rows().all()
    assert ended > 0  # the random-init model does sample EOS early sometimes
    assert went_past_extra_end > 0


def test_a_chunked_sample_is_continued_from_its_prefix(policy, engine):
    prompt = encode(policy, "31524=")
    first = engine.generate([GenerationRequest(prompt, 4, noise_seed=3)], 0, max_tokens=3)[0]
    assert first.completion_ids.shape[1] <= 3
    prefixes = tuple(
        tuple(int(t) for t in ids[mask])
        for ids, mask in zip(first.completion_ids, first.completion_mask, strict=True)
    )
    finished = tuple(bool(f) for f in first.finished_rows())
    for i, prefix in enumerate(prefixes):  # finished: it ended at EOS within the chunk
        assert finished[i] == (prefix[-1:] == (policy.eos_id,)), (prefix, finished)
        assert finished[i] or len(prefix) == 3
    assert not all(finished), "the test needs samples left to continue"
    rest = engine.generate(
        [GenerationRequest(prompt, 4, noise_seed=3, prefixes=prefixes, finished=finished)], 0
    )[0]
    assert rest.finished_rows().all()
    for i in range(4):
        new = int(rest.completion_mask[i].sum())
        assert new == 0 if finished[i] else new > 0 and len(prefixes[i]) + new <= 8
        if not finished[i] and new:  # the continuation's log-probs are the trainer's too
            ids = torch.tensor([list(prefixes[i]) + rest.completion_ids[i, :new].tolist()])
            full = trainer_logprobs(
                policy.model,
                [prompt],
                type(rest)(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(ids.shape), 0),
            )
            assert torch.allclose(full[0, len(prefixes[i]) :], rest.logprobs[i, :new], atol=1e-4)


def test_deterministic_mode_is_refused_at_start_with_the_reason():
    with pytest.raises(ConfigError, match=r"batch invariant noise.*batch it lands in"):
        check_engine(small_config("rollout.engine=vllm", "run.deterministic=true"))
    check_engine(small_config("rollout.engine=vllm"))  # the same without determinism is fine


def test_lora_requests_serve_each_versions_adapters_over_a_base_loaded_once():
    """`rollout.vllm.lora_requests`: the engine loads the frozen base once and each version's
    adapters as a LoRA request. Its log-probs are the adapted model's (fp32 tolerance), not
    the base's (negative control); a new version's adapters replace the old; an older kept
    version is served again on request; the adapters on disk are peft's format, one version."""
    from asyncrl.models.lora import apply_lora, generation_weights
    from asyncrl.rollout.vllm_engine import VLLMGenerationEngine

    config = small_config("model.lora.rank=4", "model.lora.alpha=8")
    policy = load_policy(config.model, seed=0, alphabet=DIGITS)
    apply_lora(policy, config.model, 0)
    model = policy.model

    weights = CopyWeightSync(max_versions=2)
    new_adapters(model, 1)
    weights.publish(0, generation_weights(model, merged=False))
    spec = EngineSpec(
        model, policy.eos_id, policy.pad_id, 8, 0.8,
        options={"kv_cache_bytes": 32 << 20, "max_num_seqs": 64},
    )  # fmt: skip
    engine = VLLMGenerationEngine(spec, weights)
    prompts = [encode(policy, "31524="), encode(policy, "90817=")]
    requests = [GenerationRequest(p, 4, noise_seed=11 + i) for i, p in enumerate(prompts)]

    def gap_to(version_outputs, adapters_on=True):
        if adapters_on:
            return max_gap(model, prompts, version_outputs)
        with model.disable_adapter():
            return max_gap(model, prompts, version_outputs)

    first = engine.generate(requests)
    assert all(o.weights_version == 0 for o in first)
    assert gap_to(first) <= 1e-4
    assert gap_to(first, adapters_on=False) > 1e-2  # the adapters were applied
    assert engine._lora is not None
    root = Path(engine._lora.root)
    assert sorted(p.name for p in root.iterdir()) == ["v0"]
    files = {f.name for f in (root / "v0").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files

    v0 = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    new_adapters(model, 2)
    weights.publish(1, generation_weights(model, merged=False))
    second = engine.generate(requests)
    assert all(o.weights_version == 1 for o in second)
    assert gap_to(second) <= 1e-4
    model.load_state_dict(v0, strict=False)  # the trainer's adapters back at version 0 ...
    assert gap_to(second) > 1e-2  # ... do not explain version 1's samples
    pinned = engine.generate(requests, version=0)  # an older kept version, served again
    assert all(o.weights_version == 0 for o in pinned)
    assert gap_to(pinned) <= 1e-4
    # three versions loaded, the base reloaded into vLLM once (the adapters are files)
    assert engine.metrics()["engine_weight_updates"] == 3
    assert engine._lora.base_loaded
