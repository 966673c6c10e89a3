"""Devices and precision: `train.device`/`rollout.device`, bf16 mixed precision with fp32
master weights, the engine's weights in `rollout.dtype` held once.

The `gpu` tests run the same on CUDA wherever it is present (conftest skips them elsewhere);
the rest run on any machine."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from helpers import groups_of, read_records, small_config

from asyncrl.algos.update import ReferencePolicy, stack_groups
from asyncrl.cli.audit import audit_run_dir
from asyncrl.config import ConfigError
from asyncrl.models.device import autocast, resolve_device
from asyncrl.train.components import build_components
from asyncrl.train.trainer import train

SHORT = ("model.hidden_size=32", "model.num_heads=2", "checkpoint.save_period=2")


def safetensors_dtypes(path):
    """The dtypes a safetensors file's header names (reads the header only)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_a_device_this_machine_lacks_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.device: got 'tpu'"):
        small_config("train.device=tpu")
    with pytest.raises(ConfigError, match=r"rollout\.device"):
        small_config("rollout.device=cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train\.device: got 'cuda'.*is_available"):
            resolve_device("train.device", "cuda")
        with pytest.raises(ConfigError, match=r"rollout\.device: got 'cuda:1'"):
            build_components(small_config("rollout.device=cuda:1"))


def test_the_engine_runs_in_rollout_dtype_on_the_published_copy_itself():
    """The sync casts once when it publishes, and the engine takes that copy as its weights:
    one bf16 set of weights for generation, none in fp32 besides the trainer's."""
    parts = build_components(small_config(*SHORT, "rollout.dtype=bfloat16"))
    groups_of(parts, 1)  # the engine loads version 0
    engine_params = dict(parts.engine._model.named_parameters())
    published = parts.weights.get(parts.weights.newest())
    assert {p.dtype for p in engine_params.values()} == {torch.bfloat16}
    name = "model.layers.0.mlp.up_proj.weight"
    assert engine_params[name].data_ptr() == published[name].data_ptr()
    assert {p.dtype for p in parts.policy.model.parameters()} == {torch.float32}


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights():
    """`train.dtype=bfloat16` changes the gradient (autocast is on) but not much, and leaves
    weights, gradients and Adam moments in fp32."""
    fp32 = build_components(small_config(*SHORT, "algo.max_grad_norm=0"))
    groups = groups_of(fp32, 2)
    for g in groups:
        g.rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    bf16 = build_components(small_config(*SHORT, "algo.max_grad_norm=0", "train.dtype=bfloat16"))
    grads = []
    for parts in (fp32, bf16):
        seen = {}

        def record(optimizer, args, kwargs, seen=seen, model=parts.policy.model):
            seen.update({n: p.grad.clone() for n, p in model.named_parameters()})

        parts.algo.optimizer.register_step_pre_hook(record)
        parts.algo.step(groups, 0)
        grads.append(seen)
    name = "model.layers.0.self_attn.q_proj.weight"
    diff = float((grads[0][name] - grads[1][name]).norm() / grads[0][name].norm())
    assert 0 < diff < 0.1, diff
    assert all(g.dtype == torch.float32 for g in grads[1].values())
    assert {p.dtype for p in bf16.policy.model.parameters()} == {torch.float32}
    moments = [t for s in bf16.algo.optimizer.state.values() for t in s.values() if t.dim()]
    assert moments and all(t.dtype == torch.float32 for t in moments)


def test_the_bf16_reference_stores_its_linear_layers_in_bf16_and_scores_the_same_bits():
    """Under bf16 autocast the frozen reference's linear weights are cast once, at build: the
    log-probs equal those of an fp32 copy that autocast casts at every pass, bit for bit."""
    parts = build_components(small_config(*SHORT, "train.dtype=bfloat16", "algo.kl_coef=0.1"))
    reference = parts.algo.reference
    model = reference.model
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    embedding = model.get_input_embeddings().weight
    assert embedding.dtype == torch.float32  # the lookup (and a tied output layer) as loaded
    assert {w.dtype for w in linear if w is not embedding} == {torch.bfloat16}
    fp32 = ReferencePolicy(parts.policy)  # the control: as loaded, cast by autocast
    assert fp32.sha256 == reference.sha256  # what a resume checks: the weights as loaded
    groups = groups_of(parts, 2)
    batch = stack_groups(groups, parts.policy.pad_id)
    with autocast(torch.device("cpu"), "bfloat16"):
        got = reference.logprobs(batch, 1.0, parts.policy.pad_id)
        expected = fp32.logprobs(batch, 1.0, parts.policy.pad_id)
    assert torch.equal(got, expected)
    with torch.no_grad():  # not the same weights as an fp32 pass's: the cast happened
        assert not torch.equal(fp32.logprobs(batch, 1.0, parts.policy.pad_id), expected)


@pytest.mark.slow
def test_a_bf16_run_with_micro_batches_checkpoints_fp32_weights_and_resumes(tmp_path):
    keys = (*SHORT, "train.dtype=bfloat16", "rollout.dtype=bfloat16", "train.micro_batch_size=5")
    run = tmp_path / "run"
    train(small_config(*keys, "run.max_num_steps=4"), run)
    train(small_config(*keys, "run.max_num_steps=6"), run)
    records = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert audit_run_dir(run).ok
    assert safetensors_dtypes(run / "checkpoints" / "step_000006" / "model.safetensors") == {"F32"}


@pytest.mark.gpu
def test_trainer_and_engine_on_cuda_train_checkpoint_and_resume(tmp_path):
    keys = (
        *SHORT,
        "train.device=cuda",
        "rollout.device=cuda",
        "train.dtype=bfloat16",
        "rollout.dtype=bfloat16",
        "train.micro_batch_size=6",
    )
    run = tmp_path / "run"
    train(small_config(*keys, "run.max_num_steps=4"), run)
    train(small_config(*keys, "run.max_num_steps=6"), run)
    records = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    assert audit_run_dir(run).ok
    parts = build_components(small_config(*keys))
    assert next(parts.policy.model.parameters()).is_cuda
    groups = groups_of(parts, 2)
    assert all(g.completion_ids.device.type == "cpu" for g in groups)  # the buffer stays on CPU
    assert next(parts.engine._model.parameters()).is_cuda
    metrics = parts.algo.step(groups, 0)
    assert torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.gpu
def test_ppo_on_cuda_with_micro_batches_steps(tmp_path):
    keys = (*SHORT, "algo.name=ppo", "train.device=cuda", "train.micro_batch_size=3")
    parts = build_components(small_config(*keys, "algo.kl_coef=0.1", "algo.num_minibatches=2"))
    metrics = parts.algo.step(groups_of(parts, 2), 0)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert next(parts.algo.critic.parameters()).is_cuda


def test_train_dtype_auto_is_bf16_only_where_the_device_has_it(monkeypatch):
    """`train.dtype=auto`: bf16 on a device that multiplies it natively, fp32 elsewhere (an
    AVX2-only CPU runs bf16 matmuls through a slow fallback); the start line says which; the
    algorithm's passes use the resolved dtype."""
    from asyncrl.models import device as dev

    cpu = torch.device("cpu")
    assert dev.resolve_train_dtype("bfloat16", cpu) == "bfloat16"
    assert dev.resolve_train_dtype("float32", cpu) == "float32"
    assert dev.dtype_line("float32", cpu) is None
    for flags, chosen, why in (
        ("fpu avx2 avx512f avx512_bf16", "bfloat16", "its flags have avx512_bf16"),
        ("fpu avx2 avx512f avx512bw", "float32", "its flags have no avx512_bf16 or amx_bf16"),
    ):
        monkeypatch.setattr(dev, "read_cpuinfo", lambda f=flags: f"processor : 0\nflags : {f}\n")
        assert dev.resolve_train_dtype("auto", cpu) == chosen
        assert dev.dtype_line("auto", cpu) == f"asyncrl: train.dtype=auto -> {chosen} (cpu: {why})"
    monkeypatch.setattr(dev, "read_cpuinfo", lambda: "flags : fpu avx2\n")
    from helpers import DIGITS

    from asyncrl.algos.grpo import GRPO
    from asyncrl.config.keys import build_config
    from asyncrl.models.policy import load_policy

    config = small_config("train.dtype=auto")
    policy = load_policy(config.model, 0, DIGITS)
    assert GRPO(policy, config).dtype == "float32"
    with pytest.raises(ConfigError, match=r"train\.dtype"):
        build_config({}, ["train.dtype=float16"])


def test_native_bf16_on_a_cpu_is_read_from_its_flags_not_from_onednn():
    """avx512_bf16 or amx_bf16 (x86), bf16 (aarch64's Features): native; AVX-512 without them
    is not (oneDNN's own check says True there and emulates bf16 slowly), nor a CPU whose flags
    cannot be read."""
    from asyncrl.models.device import cpu_bf16

    def info(key: str, words: str) -> str:
        return f"processor\t: 0\nmodel name\t: X\n{key}\t\t: {words}\n\nprocessor\t: 1\n"

    skylake = "fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni"
    assert cpu_bf16(info("flags", skylake)) == (False, "its flags have no avx512_bf16 or amx_bf16")
    assert cpu_bf16(info("flags", "fpu avx2 fma f16c")) == (
        False,
        "its flags have no avx512_bf16 or amx_bf16",
    )
    assert cpu_bf16(info("flags", skylake + " avx512_bf16")) == (
        True,
        "its flags have avx512_bf16",
    )
    assert cpu_bf16(info("flags", skylake + " amx_tile amx_bf16 amx_int8"))[0] is True
    assert cpu_bf16(info("Features", "fp asimd sve bf16 i8mm")) == (True, "its flags have bf16")
    assert cpu_bf16(info("flags", "avx512_bf16_not_a_flag"))[0] is False  # whole words only
    assert cpu_bf16("") == (False, "no CPU flags could be read")


def test_a_onednn_cap_below_bf16_makes_auto_float32(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on an avx512_bf16 CPU (the way to try an AVX2-only machine's
    paths) sends bf16 products to the ~100x slower fallback, so `auto` must say float32 and
    why; caps at or above AVX512_CORE_BF16 leave bf16. Measured on the AMD EPYC (avx512_bf16):
    a [512, 576] x [576, 1536] bf16 product at 217 GFLOP/s, and 2 with the cap."""
    import asyncrl.models.device as device_mod
    from asyncrl.models.device import onednn_cap, resolve_train_dtype

    assert onednn_cap({}) == (True, "")
    assert onednn_cap({"ONEDNN_MAX_CPU_ISA": "avx2"}) == (
        False,
        "ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN below AVX512_CORE_BF16",
    )
    assert onednn_cap({"DNNL_MAX_CPU_ISA": "AVX512_CORE"})[0] is False
    for ok in ("AVX512_CORE_BF16", "avx512_core_amx", "AVX512_CORE_AMX_FP16", "AVX10_1_512", "ALL"):
        assert onednn_cap({"ONEDNN_MAX_CPU_ISA": ok}) == (True, ""), ok
    # the first key set wins, as in oneDNN
    assert onednn_cap({"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"})[0] is True

    monkeypatch.setattr(device_mod, "read_cpuinfo", lambda: "flags\t: avx2 avx512f avx512_bf16\n")
    cpu = device_mod.torch.device("cpu")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert resolve_train_dtype("auto", cpu) == "bfloat16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert resolve_train_dtype("auto", cpu) == "float32"
    assert device_mod.dtype_line("auto", cpu) == (
        "asyncrl: train.dtype=auto -> float32 (cpu: its flags have avx512_bf16, "
        "but ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN below AVX512_CORE_BF16)"
    )


def test_a_run_bounds_onednns_primitive_cache_unless_the_user_set_it(tmp_path, monkeypatch):
    """oneDNN keeps 1024 bf16 kernels by default, one per product shape, and on a CPU with AMX
    each holds memory: a LoRA run's RSS grew by 0.76 GB over 64 bf16 passes (Intel Xeon with
    amx_bf16). A trainer sets the bound before its first pass; the user's value wins."""
    from asyncrl.models.device import ONEDNN_CACHE_KEY, bound_onednn_cache
    from asyncrl.train.rundir import open_run_dir
    from asyncrl.train.trainer import Trainer

    environ: dict[str, str] = {}
    bound_onednn_cache(environ)
    assert environ == {ONEDNN_CACHE_KEY: "128"}
    environ = {ONEDNN_CACHE_KEY: "4096"}
    bound_onednn_cache(environ)
    assert environ == {ONEDNN_CACHE_KEY: "4096"}

    config = small_config(*SHORT)
    # set first, so the teardown gives the suite back its own value: delenv of an absent key
    # records nothing, and the trainer's 128 would stay in os.environ for the tests after
    monkeypatch.setenv(ONEDNN_CACHE_KEY, "0")
    monkeypatch.delenv(ONEDNN_CACHE_KEY)
    Trainer(config, open_run_dir(tmp_path / "a", config)).close()
    assert os.environ[ONEDNN_CACHE_KEY] == "128"
    monkeypatch.setenv(ONEDNN_CACHE_KEY, "7")
    Trainer(config, open_run_dir(tmp_path / "b", config)).close()
    assert os.environ[ONEDNN_CACHE_KEY] == "7"
