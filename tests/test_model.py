"""The model path: a real HF causal LM, the tiny preset, and loading a save_pretrained dir."""

from __future__ import annotations

from helpers import DIGITS, read_records, small_config

from asyncrl.config import ModelConfig
from asyncrl.models.policy import load_policy
from asyncrl.train.trainer import train


def test_tiny_preset_is_a_llama_with_half_a_million_parameters():
    policy = load_policy(ModelConfig(), seed=0, alphabet=DIGITS)
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert 500_000 <= policy.num_parameters() <= 3_000_000
    assert type(policy.tokenizer).__name__ in {"PreTrainedTokenizerFast", "TokenizersBackend"}


def test_tiny_init_is_a_function_of_the_seed():
    a, b, c = (
        load_policy(ModelConfig(), seed=s, alphabet=DIGITS).model.state_dict() for s in (1, 1, 2)
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    assert a[name].equal(b[name]) and not a[name].equal(c[name])


def test_training_from_a_saved_model_dir_equals_training_from_the_preset(tmp_path):
    policy = load_policy(ModelConfig(), seed=0, alphabet=DIGITS)
    saved = tmp_path / "tiny"
    policy.model.save_pretrained(saved)
    policy.tokenizer.save_pretrained(saved)

    # deterministic: which version generates each target is pinned, not a race of two threads
    plan = ("run.max_num_steps=3", "run.seed=0", "run.deterministic=true")
    train(small_config(*plan), tmp_path / "preset")
    train(small_config(*plan, f"model.path={saved}"), tmp_path / "dir")
    preset = read_records(tmp_path / "preset" / "metrics.jsonl")
    loaded = read_records(tmp_path / "dir" / "metrics.jsonl")
    assert [r["loss"] for r in loaded] == [r["loss"] for r in preset]
    assert [r["reward_mean"] for r in loaded] == [r["reward_mean"] for r in preset]
    # and the final model it writes loads back as a model dir
    reloaded = load_policy(
        ModelConfig(path=str(tmp_path / "dir" / "final_model")), seed=99, alphabet=""
    )
    assert reloaded.num_parameters() == policy.num_parameters()


def test_the_character_tokenizer_round_trips_and_saves_like_any_hf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("=0123456789")
    assert len(tokenizer) == 15
    ids = tokenizer("31524=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "31524="
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == "31524="
    assert tokenizer("7x", add_special_tokens=False)["input_ids"][1] == tokenizer.unk_token_id
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("31524=", add_special_tokens=False)["input_ids"] == ids
