"""Typed config: YAML + dotted overrides; every bad key or value gets a message that names it."""

import dataclasses

import pytest

from asyncrl.config import (
    Config,
    ConfigError,
    ServersConfig,
    VLLMConfig,
    algorithm_names,
    options_class,
)
from asyncrl.config.keys import (
    SECTIONS,
    build_config,
    config_keys,
    field_docs,
    load_config,
    reference_markdown,
    resume_rule,
    semantic_differences,
)
from asyncrl.config.keys import (
    dump_config as dump,
)


def test_defaults_validate_and_demo_config_loads(repo_root):
    Config().validate()
    config = load_config(repo_root / "configs" / "demo.yaml")
    assert config.rollout.max_trajectory_age_steps == 1
    assert config.algo.name == "grpo"


def test_overrides_are_typed_like_yaml_scalars():
    config = build_config(
        {},
        [
            "rollout.num_prompts_per_step=8",
            "rollout.temperature=0.7",
            "algo.lr=1e-3",
            "logging.progress=false",
            "data.task=jsonl",
            "data.path=x.jsonl",
        ],
    )
    assert config.rollout.num_prompts_per_step == 8
    assert config.rollout.temperature == 0.7
    assert config.algo.lr == 1e-3 and isinstance(config.algo.lr, float)
    assert config.logging.progress is False


def test_an_int_field_accepts_an_int_given_for_a_float():
    assert build_config({"algo": {"lr": 1}}).algo.lr == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.num_prompt_per_step=8"], "did you mean rollout.num_prompts_per_step"),
        (["rolout.temperature=1"], "did you mean rollout.temperature"),
        (["algo.name=ppoo"], "algo.name: got 'ppoo', allowed values: 'grpo', 'ppo', 'rloo'"),
        (
            ["algo.kl_in_reward=true"],
            "algo.kl_in_reward: a key of algo.name=ppo, and this config has algo.name=grpo",
        ),
        (["algo.name=rloo", "algo.gamma=0.9"], "algo.gamma: a key of algo.name=ppo"),
        (["algo.name=ppo", "algo.tis_cap=0.5"], "algo.tis_cap: got 0.5, must be 0 or >= 1"),
        (["algo.name=ppo", "algo.num_minibatches=300"], "at most the N*G=256 samples of a step"),
        (["algo.name=rloo", "rollout.num_generations_per_prompt=1"], "algo.name=rloo needs >= 2"),
        (["rollout.engine=sglang"], "got 'sglang', allowed values: 'torch', 'vllm'"),
        (["rollout.vllm.kv_cache_byte=1"], "did you mean rollout.vllm.kv_cache_bytes"),
        (["rollout.vllm.max_num_seqs=0"], "rollout.vllm.max_num_seqs: got 0, must be >= 1"),
        (["algo.mismatch_tis_cap=0.5"], "algo.mismatch_tis_cap: got 0.5, must be 0 (off) or >= 1"),
        (["rollout.num_prompts_per_step=0"], "rollout.num_prompts_per_step: got 0, must be >= 1"),
        (["rollout.num_prompts_per_step=2.5"], "expected int"),
        (["rollout.temperature=hot"], "rollout.temperature: got 'hot'"),
        (["run.max_num_steps=true"], "run.max_num_steps: got True"),
        (["algo.clip_eps=1.5"], "algo.clip_eps: got 1.5, must be in (0, 1)"),
        (["data.task=jsonl"], "data.path: required when data.task=jsonl"),
        (["data.reward_fn=nomodule"], "or look like 'module:function'"),
        (["model.hidden_size=100", "model.num_heads=3"], "a multiple of model.num_heads=3"),
        (["rollout.backend=mpi"], "allowed values: 'threads', 'ray'"),
        (["rollout.num_workers=0"], "rollout.num_workers: got 0, must be >= 1"),
        (["seed=3"], "must look like section.key=value"),
        (["rollout.groups_per_batch=3"], "0 or a divisor of rollout.num_prompts_per_step=16"),
        (
            ["run.deterministic=true", "checkpoint.resume_policy=keep_incomplete"],
            "lossless when run.deterministic=true",
        ),
    ],
)
def test_bad_keys_and_values_are_rejected_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert message in str(err.value)


def test_errors_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  max_new_tokns: 4\n")
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: unknown config key 'rollout\.max_new_tokns'"
    ):
        load_config(path)
    path.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("training:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'training'"):
        load_config(path)


def test_every_config_field_has_a_docstring():
    classes = {**SECTIONS, **{f"algo.name={n}": options_class(n) for n in algorithm_names()}}
    classes["rollout.vllm"] = VLLMConfig
    classes["rollout.servers"] = ServersConfig
    for name, cls in classes.items():
        docs = field_docs(cls)
        missing = [
            f.name for f in dataclasses.fields(cls) if not docs.get(f.name) and f.name != "options"
        ]
        assert not missing, f"{name}: fields without a docstring: {missing}"


def test_an_algorithms_own_keys_are_grouped_with_it_and_round_trip():
    config = build_config({"algo": {"name": "ppo", "gamma": 0.9, "lr": 0.01}})
    assert config.algo.options.gamma == 0.9 and config.algo.lr == 0.01
    assert "gamma" not in vars(config.algo)  # not a field of the shared section
    flat = config.to_dict()["algo"]
    assert flat["gamma"] == 0.9 and "options" not in flat
    assert "gamma" not in Config().to_dict()["algo"]  # grpo has no gamma
    assert build_config({"algo": flat}) == config


def test_which_keys_may_change_on_resume_is_read_from_the_fields():
    assert resume_rule("run.max_num_steps") == "may_change"
    assert resume_rule("run.torch_threads") == "may_change_unless_deterministic"
    assert resume_rule("model.hidden_size") == "never"
    assert resume_rule("algo.lr") == resume_rule("algo.gamma") == "semantic"
    saved = build_config({}, ["run.deterministic=true"]).to_dict()
    del saved["rollout"]["engine"]  # a checkpoint written before the key existed
    now = build_config({}, ["run.deterministic=true", "run.torch_threads=2"])
    assert semantic_differences(saved, now) == ["run.torch_threads: checkpoint=1, now=2"]


def test_the_resolved_config_round_trips_through_yaml(tmp_path):
    config = build_config({}, ["rollout.num_prompts_per_step=5", "algo.lr=0.01"])
    path = tmp_path / "config.yaml"
    path.write_text(dump(config))
    assert load_config(path) == config


def test_docs_config_reference_is_generated_from_the_field_docstrings(repo_root):
    reference = (repo_root / "docs" / "config.md").read_text()
    assert reference_markdown() in reference, (
        "docs/config.md config reference is stale: run `make docs` (scripts/update_docs.py)"
    )
    for key in config_keys():
        assert f"`{key}`" in reference


def test_each_algorithms_options_are_the_registered_ones():
    """`config/algos.py` registers every algorithm's keys torch-free; the class a run builds
    must carry the same `Options`, or a config would validate other keys than it trains."""
    from asyncrl.algos import algorithm_class

    for name in algorithm_names():
        assert algorithm_class(name).Options is options_class(name), name
