"""Any Hugging Face causal LM from `model.path`: Qwen2- and Llama-architecture directories saved
by `asyncrl.models.scratch` (a BPE tokenizer trained offline, random init) train with GRPO and
PPO, checkpoint, resume, and leave a `final_model/` that transformers loads with the learned
weights. (tests/test_model.py covers the `tiny` preset and its character tokenizer.)"""

from __future__ import annotations

import pytest
import torch
from helpers import read_records, run_cli, small_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli.audit import audit_run_dir
from asyncrl.models.scratch import (
    Shape,
    build_model,
    count_parameters,
    parse_count,
    save_scratch_model,
    shape_for,
)
from asyncrl.tasks.source import sort_digits_examples
from asyncrl.train.trainer import train

ARCHS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
FAST = [
    "rollout.max_new_tokens=4",
    "rollout.max_trajectory_age_steps=1",
    "data.reward_fn=shaped_rewards:digit_fraction",  # tests/: partial_match is ~0 at init
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """One tiny (~100k-parameter) saved model directory per architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: save_scratch_model(root / arch, arch=arch, seed=1) for arch in ARCHS}


def initial_weights(model_dir):
    return load_file(model_dir / "model.safetensors")


def assert_learned(run_dir, model_dir, arch):
    """final_model/ loads with AutoModelForCausalLM as `arch`, and its weights moved."""
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)
    assert type(final).__name__ == ARCHS[arch]
    before, after = initial_weights(model_dir), final.state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    assert before[name].shape == after[name].shape
    assert not torch.equal(before[name], after[name])
    assert AutoTokenizer.from_pretrained(run_dir / "final_model")("31524=")["input_ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_saved_dir_loads_as_its_architecture_with_a_bpe_tokenizer(model_dirs, arch):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch], local_files_only=True)
    assert type(model).__name__ == ARCHS[arch]
    assert model.config.vocab_size == len(tokenizer)
    assert 50_000 <= model.num_parameters() <= 1_000_000
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("arch", ARCHS)
def test_the_loaded_tokenizer_round_trips_every_task_prompt_and_answer(model_dirs, arch):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch], local_files_only=True)
    examples = [e for n in (1, 5, 12, 40) for e in sort_digits_examples(n, 50)]
    for text in [t for e in examples for t in (e.prompt, e.answer)] + ["Sort: 3 1 2 →?"]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids or tokenizer.unk_token_id is None
        assert tokenizer.decode(ids) == text
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([*tokenizer("12345")["input_ids"], eos], skip_special_tokens=True) == (
        "12345"
    )


def test_the_chat_template_wraps_turns_in_single_special_tokens(model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["qwen2"], local_files_only=True)
    messages = [{"role": "user", "content": "31524="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n31524=<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_the_parameter_formula_counts_what_transformers_builds(arch):
    shape = Shape(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=2, intermediate_size=160)
    model = build_model(arch, shape, 300, 64, 0, seed=0)
    assert count_parameters(arch, shape, 300) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("target", ["1M", "20M", "300M"])
def test_shape_for_lands_within_ten_percent_of_the_target(target):
    num_params = parse_count(target)
    shape = shape_for(num_params, "qwen2", 400)
    assert shape.hidden_size % shape.num_heads == 0 and shape.num_heads % shape.num_kv_heads == 0
    assert abs(count_parameters("qwen2", shape, 400) / num_params - 1) < 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_grpo_trains_a_saved_dir_checkpoints_and_resumes(model_dirs, arch, tmp_path):
    run = tmp_path / "run"
    common = [f"model.path={model_dirs[arch]}", "checkpoint.save_period=2", *FAST]
    train(small_config("run.max_num_steps=3", *common), run)
    train(small_config("run.max_num_steps=5", *common), run)
    metrics = read_records(run / "metrics.jsonl")
    assert [(r["step"], r["attempt"]) for r in metrics] == [
        (0, 0), (1, 0), (2, 0), (3, 1), (4, 1)
    ]  # fmt: skip
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 3
    assert audit_run_dir(run).ok
    assert_learned(run, model_dirs[arch], arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_ppo_builds_its_critic_from_the_same_dir_and_trains(model_dirs, arch, tmp_path):
    run = tmp_path / "run"
    config = small_config(
        "run.max_num_steps=3", "algo.name=ppo", f"model.path={model_dirs[arch]}", *FAST
    )
    train(config, run)
    metrics = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert all("value_loss" in r for r in metrics), sorted(metrics[0])
    assert_learned(run, model_dirs[arch], arch)


@pytest.mark.slow
def test_the_cli_trains_a_qwen2_dir_and_a_sigkilled_run_resumes(
    model_dirs, tmp_path, repo_root, monkeypatch
):
    """The real command twice: the first launch is SIGKILLed right after its checkpoint of
    step 2 is durable (fault injection), the second resumes it to the end."""
    import os

    run = tmp_path / "run"
    args = [
        "train", str(repo_root / "configs/demo.yaml"), "--run-dir", str(run),
        f"model.path={model_dirs['qwen2']}", "run.max_num_steps=4", "checkpoint.save_period=2",
        "rollout.num_prompts_per_step=4", "rollout.num_generations_per_prompt=4",
        "logging.progress=false", "logging.plot=false", *FAST,
    ]  # fmt: skip
    tests_dir = str(repo_root / "tests")  # the reward's module, for the child process
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ASYNCRL_FAULT", "checkpoint.parent_fsynced[step=2]")
    killed = run_cli(*args)
    assert killed.returncode == -9, killed.stderr
    monkeypatch.delenv("ASYNCRL_FAULT")
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 2
    assert audit_run_dir(run).ok
    assert_learned(run, model_dirs["qwen2"], "qwen2")
