"""LoRA adapters (`model.lora.*`, peft): what trains, what is published, what is saved, and
the reference. The runs killed and resumed are in test_determinism.py."""

from __future__ import annotations

import pytest
import torch
from helpers import DIGITS, groups_of, small_config, train_and_report
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from asyncrl.checkpoint.store import CheckpointError
from asyncrl.cli.audit import audit_run_dir
from asyncrl.cli.export import ExportError, export_checkpoint
from asyncrl.config import ConfigError
from asyncrl.config.keys import build_config
from asyncrl.models.lora import (
    AdapterWeights,
    apply_lora,
    generation_weights,
    is_lora,
    merged_weights,
    plain_state_dict,
    trainable_state,
)
from asyncrl.models.policy import load_policy
from asyncrl.rollout.weight_sync import CopyWeightSync
from asyncrl.train.components import build_components

LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def lora_policy(*overrides: str, seed: int = 0):
    config = small_config(*LORA, *overrides)
    policy = load_policy(config.model, seed, DIGITS)
    base = {k: v.clone() for k, v in policy.model.state_dict().items()}
    apply_lora(policy, config.model, seed)
    return policy, base, config


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_keys_are_checked_naming_them():
    for item, key in [
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=", "model.lora.target_modules"),
    ]:
        with pytest.raises(ConfigError, match=key):
            build_config({}, [item])
    with pytest.raises(ConfigError, match=r"train\.num_processes"):
        build_config({}, ["model.lora.rank=8", "train.num_processes=2"])
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout"):
        build_config({}, ["model.lora.dropout=0.1", "run.deterministic=true"])
    config = build_config({}, ["model.lora.target_modules=q_proj, v_proj"])
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]
    from_yaml = build_config({"model": {"lora": {"rank": 2, "target_modules": ["q_proj"]}}})
    assert from_yaml.model.lora.target_modules == ["q_proj"]


def test_a_new_adapter_computes_the_base_and_the_merged_weights_compute_the_adapted_model():
    policy, base, _ = lora_policy()
    model = policy.model
    assert is_lora(model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plain = LlamaForCausalLM(model.get_base_model().config)
    plain.load_state_dict(base)
    assert torch.equal(logits(model, ids), logits(plain, ids))  # B starts at zero
    assert {k: torch.equal(v, base[k]) for k, v in plain_state_dict(model).items()} == {
        k: True for k in base
    }
    with torch.no_grad():  # a trained adapter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    merged = LlamaForCausalLM(model.get_base_model().config)
    merged.load_state_dict(merged_weights(model))
    adapted = logits(model, ids)
    assert torch.allclose(logits(merged, ids), adapted, atol=1e-5)
    assert not torch.allclose(logits(plain, ids), adapted, atol=1e-3)  # the adapter matters
    with model.disable_adapter():  # the KL reference: the base, exactly
        assert torch.equal(logits(model, ids), logits(plain, ids))


def test_the_adapters_are_a_function_of_the_seed():
    a, _, _ = lora_policy()
    b, _, _ = lora_policy()
    c, _, _ = lora_policy(seed=1)
    sa, sb = trainable_state(a.model), trainable_state(b.model)
    assert sa and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.base_sha256 == b.base_sha256 != c.base_sha256
    assert not torch.equal(sa[min(sa)], trainable_state(c.model)[min(sa)])


def test_only_the_adapters_train_and_the_reference_is_the_base_with_them_off(tmp_path):
    config = small_config(*LORA, "algo.kl_coef=0.1", "algo.lr=1e-2")
    parts = build_components(config)
    try:
        model, algo = parts.policy.model, parts.algo
        base = {k: v.clone() for k, v in plain_state_dict(model).items()}
        adapters = {k: v.clone() for k, v in trainable_state(model).items()}
        stepped = [p for group in algo.optimizer.param_groups for p in group["params"]]
        assert {id(p) for p in stepped} == {id(p) for p in model.parameters() if p.requires_grad}
        assert sum(p.numel() for p in stepped) == sum(t.numel() for t in adapters.values())
        assert sum(p.numel() for p in stepped) < 0.2 * sum(p.numel() for p in model.parameters())
        assert algo.reference.model is model  # no copy
        assert algo.reference.sha256 == parts.policy.base_sha256
        groups = groups_of(parts)
        before = algo.reference.logprobs(batch_of(groups, algo), 1.0, parts.policy.pad_id)
        metrics = algo.step(groups, 0)
        assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the first step: adapter == 0
        after = trainable_state(model)
        assert any(not torch.equal(after[k], adapters[k]) for k in adapters)
        assert all(torch.equal(v, base[k]) for k, v in plain_state_dict(model).items())
        ref = algo.reference.logprobs(batch_of(groups, algo), 1.0, parts.policy.pad_id)
        assert torch.equal(ref, before)  # the base did not move
        # the torch engine in this process runs the adapters on the trainer's own base
        published = algo.policy_weights()
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen and all(published[n] is p for n, p in frozen.items())
        assert all(torch.equal(published[n], after[n]) for n in after)
        merged = generation_weights(model, merged=True)  # what vLLM and Ray workers load
        assert set(merged) == set(base)  # the base model's own names
        assert any(not torch.equal(merged[k], base[k]) for k in base)
        assert AdapterWeights(model).state_dict().keys() == adapters.keys()
    finally:
        parts.stop_generation()
        parts.shutdown()


def batch_of(groups, algo):
    from asyncrl.algos.update import stack_groups, to_device

    return to_device(stack_groups(groups, algo.pad_id), algo.device)


def test_a_lora_run_saves_adapters_and_exports_the_merged_model_and_the_adapter(tmp_path):
    run = tmp_path / "run"
    config = small_config(*LORA, "checkpoint.save_period=3")
    report = train_and_report(config, run)
    assert "final_adapter/" in report
    saved = load_file(run / "checkpoints/step_000006/model.safetensors")
    assert saved and all("lora_" in name for name in saved)  # the adapters alone
    final = AutoModelForCausalLM.from_pretrained(run / "final_model")
    initial = load_policy(config.model, config.run.seed, DIGITS).model
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert not torch.allclose(logits(final, ids), logits(initial, ids), atol=1e-4)
    adapter = PeftModel.from_pretrained(initial, run / "final_adapter")
    assert torch.allclose(logits(adapter, ids), logits(final, ids), atol=1e-5)
    exported = export_checkpoint(run, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(exported.out)
    assert torch.allclose(logits(merged, ids), logits(final, ids), atol=1e-6)
    alone = export_checkpoint(run, tmp_path / "adapter", adapter=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {n for n, _ in alone.files}
    base = load_policy(config.model, config.run.seed, DIGITS).model
    reloaded = PeftModel.from_pretrained(base, alone.out)
    assert torch.allclose(logits(reloaded, ids), logits(final, ids), atol=1e-5)


def test_export_adapter_of_a_full_run_is_refused(tmp_path):
    run = tmp_path / "run"
    train_and_report(small_config("run.max_num_steps=2", "checkpoint.save_period=2"), run)
    with pytest.raises(ExportError, match=r"model\.lora\.rank=0"):
        export_checkpoint(run, tmp_path / "out", adapter=True)


def test_a_resume_on_another_base_is_refused_naming_model_path(tmp_path):
    policy = load_policy(small_config().model, 0, DIGITS)
    base = tmp_path / "base"
    policy.model.save_pretrained(base)
    policy.tokenizer.save_pretrained(base)
    run = tmp_path / "run"
    config = small_config(*LORA, f"model.path={base}", "checkpoint.save_period=3")
    train_and_report(config, run)
    with torch.no_grad():
        policy.model.model.embed_tokens.weight.add_(0.01)
    policy.model.save_pretrained(base)  # the files under model.path changed
    longer = small_config(*LORA, f"model.path={base}", "run.max_num_steps=9")
    with pytest.raises(CheckpointError, match=r"model\.path"):
        train_and_report(longer, run)


def test_the_engine_runs_the_adapters_on_the_trainers_base_and_computes_the_merged_model():
    config = small_config(*LORA, "algo.lr=1e-2")
    parts = build_components(config)
    try:
        model, algo = parts.policy.model, parts.algo
        algo.step(groups_of(parts), 0)
        parts.weights.publish(1, algo.policy_weights())
        engine = parts.engine
        engine._load(1)
        mine = dict(engine._model.named_parameters())
        theirs = dict(model.named_parameters())
        for name, param in theirs.items():
            if param.requires_grad:  # its own copy of the adapters, equal to the trainer's
                assert mine[name] is not param and torch.equal(mine[name], param)
            else:  # the frozen base: the same memory
                assert mine[name].data_ptr() == param.data_ptr()
        merged = LlamaForCausalLM(model.get_base_model().config)
        merged.load_state_dict(generation_weights(model, merged=True))
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        assert torch.allclose(logits(engine._model, ids), logits(merged, ids), atol=1e-5)
    finally:
        parts.stop_generation()
        parts.shutdown()


def test_a_weight_sync_shares_frozen_parameters_and_checkpoints_only_what_changes():
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    trained = torch.nn.Parameter(torch.zeros(2))
    sync = CopyWeightSync(max_versions=2)
    for version in (0, 1):
        with torch.no_grad():
            trained.add_(1)
        sync.publish(version, {"base": frozen, "tied": frozen, "adapter": trained.detach()})
    for version, value in ((0, 1.0), (1, 2.0)):
        got = sync.get(version)
        assert got["base"] is frozen and got["tied"] is frozen  # shared, not copied
        assert torch.equal(got["adapter"], torch.full((2,), value))
    assert sync.state_dict() == {"versions": {0: {"adapter": sync.get(0)["adapter"]}}}
    cast = CopyWeightSync(1, dtype=torch.bfloat16)
    cast.publish(0, {"base": frozen})
    cast.publish(1, {"base": frozen})
    assert cast.get(1)["base"].dtype == torch.bfloat16
    assert cast.get(1)["base"] is cast._cast[id(frozen)]  # cast once, then shared


def test_merged_generation_loads_plain_weights_and_the_run_audits(tmp_path):
    run = tmp_path / "run"
    config = small_config(*LORA, "model.lora.merge_for_generation=true", "run.max_num_steps=4")
    parts = build_components(config)
    try:
        assert not is_lora(parts.engine._model)  # the plain model, merged weights loaded
        assert is_lora(parts.policy.model)
    finally:
        parts.stop_generation()
        parts.shutdown()
    train_and_report(config, run)
    assert audit_run_dir(run).ok


def test_an_adapter_on_a_layer_that_is_not_linear_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: .*embed_tokens"):
        lora_policy("model.lora.target_modules=embed_tokens,q_proj")


def test_a_lora_run_may_not_change_its_engine_or_backend_on_resume():
    from asyncrl.config.keys import semantic_differences

    saved = build_config({}, [*LORA]).to_dict()
    now = build_config({}, [*LORA, "rollout.backend=ray"])
    assert any(d.startswith("rollout.backend") for d in semantic_differences(saved, now))
    vllm = build_config({}, [*LORA, "rollout.engine=vllm"])
    requests = build_config({}, [*LORA, "rollout.engine=vllm", "rollout.vllm.lora_requests=true"])
    assert [d.split(":")[0] for d in semantic_differences(vllm.to_dict(), requests)] == [
        "rollout.vllm.lora_requests"  # versions kept as merged weights, or as adapters
    ]
    full = build_config({}, []).to_dict()  # without adapters it may
    assert semantic_differences(full, build_config({}, ["rollout.backend=ray"])) == []


def test_the_engine_keeps_only_the_last_logits_of_a_prompt_with_adapters():
    config = small_config(*LORA)
    parts = build_components(config)
    try:
        assert parts.engine._keeps_logits  # peft's forward passes logits_to_keep through
    finally:
        parts.stop_generation()
        parts.shutdown()


def test_an_adapter_on_a_tied_output_layer_is_refused():
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: the output layer is tied"):
        lora_policy("model.lora.target_modules=lm_head,q_proj")


def test_which_engines_apply_the_adapters_themselves():
    """The torch engine in this process and vLLM (in process or on servers) with LoRA requests
    get the adapters alone (over a base they hold once); vLLM without the key, Ray workers and
    merge_for_generation get merged weights."""
    from asyncrl.models.lora import adapters_in_engine

    cases = {
        (): True,
        ("rollout.engine=vllm",): False,
        ("rollout.engine=vllm", "rollout.vllm.lora_requests=true"): True,
        ("rollout.engine=vllm", "rollout.vllm.lora_requests=true", "rollout.backend=ray"): False,
        ("rollout.engine=vllm_server", "rollout.servers.launch=1"): False,
        (
            "rollout.engine=vllm_server",
            "rollout.servers.launch=1",
            "rollout.vllm.lora_requests=true",
        ): True,
        ("rollout.backend=ray",): False,
        ("model.lora.merge_for_generation=true",): False,
    }
    for extra, expected in cases.items():
        assert adapters_in_engine(build_config({}, [*LORA, *extra])) is expected, extra
    assert not adapters_in_engine(build_config({}, ["rollout.vllm.lora_requests=true"]))


def test_split_generation_weights_gives_the_base_names_and_peft_adapter_names():
    from asyncrl.models.lora import split_generation_weights

    policy, base, _ = lora_policy()
    plain, adapters = split_generation_weights(generation_weights(policy.model, merged=False))
    assert set(plain) == set(base)
    assert all(torch.equal(plain[k], base[k]) for k in base)
    saved = {k for k in policy.model.state_dict() if "lora_" in k}
    assert len(adapters) == len(saved) > 0
    for name in adapters:  # PeftModel.save_pretrained's names: no adapter name in them
        assert name.startswith("base_model.model.") and ".default." not in name
        assert name.endswith((".lora_A.weight", ".lora_B.weight"))


def test_bf16_passes_take_the_frozen_base_cast_once_and_train_the_same_bit_for_bit():
    """`FrozenCasts`: with bf16 autocast, the LoRA base's linear weights are cast once a step
    and swapped in for its passes (and the KL reference's, the same model with its adapters
    off), instead of autocast casting each of them at every forward pass. Two steps (the second
    with non-zero B) give the same metrics and adapters bit for bit as with the casts off,
    which cast the frozen weights at every pass (the control); after a step the model holds
    its own fp32 parameters again, which the engine shares and the publishes read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from asyncrl.algos.grpo import GRPO
    from asyncrl.algos.update import FrozenCasts

    overrides = ("train.dtype=bfloat16", "algo.kl_coef=0.1", "algo.lr=1e-2",
                 "train.micro_batch_size=2")  # fmt: skip
    parts = build_components(small_config(*LORA, *overrides))
    try:
        groups = groups_of(parts)
    finally:
        parts.stop_generation()
        parts.shutdown()

    class FrozenWeightCasts(TorchDispatchMode):
        def __init__(self, pointers: set[int]) -> None:
            super().__init__()
            self.pointers, self.count = pointers, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
                self.count += 1
            return func(*args, **(kwargs or {}))

    results = []
    for casts in (True, False):
        policy, _, config = lora_policy(*overrides)
        algo = GRPO(policy, config)
        model = policy.model
        tied = model.get_input_embeddings().weight  # the output layer's too: left as it is
        frozen = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
                  and not m.weight.requires_grad and m.weight is not tied]  # fmt: skip
        weights = [m.weight for m in frozen]
        assert len(frozen) > 4 and all(w.dtype == torch.float32 for w in weights)
        if casts:
            assert [m for m, _ in algo.frozen_casts.frozen] == frozen
            with algo.frozen_casts:
                assert all(m.weight.dtype == torch.bfloat16 for m in frozen)
        else:
            algo.frozen_casts = FrozenCasts([], None)
        counter = FrozenWeightCasts({w.data_ptr() for w in weights})
        with counter:
            metrics = [algo.step(groups, 0), algo.step(groups, 1)]
        assert [m.weight for m in frozen] == weights  # the fp32 parameters are back
        # once a step each with the casts; the control casts them at every forward pass
        assert (counter.count == 2 * len(frozen)) == casts, counter.count
        assert counter.count >= 2 * len(frozen)
        results.append((metrics, {k: v.clone() for k, v in trainable_state(model).items()}))
    (metrics, adapters), (control_metrics, control_adapters) = results
    assert metrics[1]["kl_ref"] > 0  # the second step's adapters are not the base
    assert metrics == control_metrics
    assert adapters.keys() == control_adapters.keys()
    assert all(torch.equal(adapters[k], control_adapters[k]) for k in adapters)
