"""Typed config: YAML + dotted overrides; every bad key or value gets a message that names it."""

import dataclasses

import pytest

from asyncrl.config import (
    SECTIONS,
    Config,
    ConfigError,
    build_config,
    config_keys,
    field_docs,
    load_config,
    reference_markdown,
)
from asyncrl.config import (
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
        (["algo.name=ppoo"], "algo.name: got 'ppoo', allowed values: 'grpo', 'ppo'"),
        (["algo.kl_in_reward=true"], "only `ppo` has per-token rewards"),
        (["algo.tis_cap=0.5"], "algo.tis_cap: got 0.5, must be 0 or >= 1"),
        (["algo.num_minibatches=300"], "at most the N*G=256 samples of a step"),
        (["rollout.num_prompts_per_step=0"], "rollout.num_prompts_per_step: got 0, must be >= 1"),
        (["rollout.num_prompts_per_step=2.5"], "expected int"),
        (["rollout.temperature=hot"], "rollout.temperature: got 'hot'"),
        (["run.max_num_steps=true"], "run.max_num_steps: got True"),
        (["algo.clip_eps=1.5"], "algo.clip_eps: got 1.5, must be in (0, 1)"),
        (["data.task=jsonl"], "data.path: required when data.task=jsonl"),
        (["data.reward_fn=nomodule"], "must look like 'module:function'"),
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
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{name}: fields without a docstring: {missing}"


def test_the_resolved_config_round_trips_through_yaml(tmp_path):
    config = build_config({}, ["rollout.num_prompts_per_step=5", "algo.lr=0.01"])
    path = tmp_path / "config.yaml"
    path.write_text(dump(config))
    assert load_config(path) == config


def test_readme_config_reference_is_generated_from_the_field_docstrings(repo_root):
    readme = (repo_root / "README.md").read_text()
    assert reference_markdown() in readme, "README config reference is stale: run `make docs`"
    for key in config_keys():
        assert f"`{key}`" in readme
