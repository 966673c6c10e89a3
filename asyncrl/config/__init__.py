"""The config schema, torch-free: `import asyncrl.config` loads no torch or transformers (a
test checks), so reading, validating and documenting a config is cheap anywhere.

- `base`: `ConfigError`, the resume metadata of a field, the one-line value check;
- `sections`: one dataclass per section (`run`, `rollout`, `train`, `algo`, ...) and
  `Config`; `data`: the `data.*` and `eval.*` sections; `model`: `model.*` and `model.lora.*`;
- `algos`: every algorithm's own keys (`Options`) and the registry of names;
- `keys`: the flat `section.key` surface: loading YAML with overrides, resume rules, the hash,
  the generated reference.
"""

from __future__ import annotations

from asyncrl.config.algos import algorithm_names, options_class
from asyncrl.config.base import (
    MAY_CHANGE,
    MAY_CHANGE_UNLESS_DETERMINISTIC,
    NEVER_CHANGES,
    ON_RESUME,
    ConfigError,
)
from asyncrl.config.data import (
    BUILTIN_ENVIRONMENTS,
    AgentConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
)
from asyncrl.config.engines import ServersConfig, VLLMConfig
from asyncrl.config.model import LoraConfig, ModelConfig
from asyncrl.config.sections import (
    AlgoConfig,
    CheckpointConfig,
    Config,
    LoggingConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    buffer_capacity,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "MAY_CHANGE",
    "MAY_CHANGE_UNLESS_DETERMINISTIC",
    "NEVER_CHANGES",
    "ON_RESUME",
    "AgentConfig",
    "AlgoConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "ServersConfig",
    "TrainConfig",
    "VLLMConfig",
    "algorithm_names",
    "buffer_capacity",
    "options_class",
]
