"""The flat `section.key` surface of the config schema (`asyncrl.config`): every key, loading
from YAML with dotted overrides (an unknown key names the nearest known keys, a bad value names
the key and what is allowed), what a resume may change, the config hash, and the config
reference (docs/config.md) generated from the field docstrings.
"""

from __future__ import annotations

import ast
import collections
import copy
import dataclasses
import difflib
import functools
import hashlib
import inspect
import itertools
import json
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncrl.config import (
    ON_RESUME,
    AlgoConfig,
    Config,
    ConfigError,
    algorithm_names,
    options_class,
)


def _algo_fields() -> list[tuple[str, dataclasses.Field[Any], type]]:
    """(owner, field, class) of every `algo.*` key: the shared ones (owner ""), then each
    algorithm's own, in registry order."""
    shared = [("", f, AlgoConfig) for f in dataclasses.fields(AlgoConfig) if f.name != "options"]
    own = [
        (name, f, options_class(name))
        for name in algorithm_names()
        for f in dataclasses.fields(options_class(name))
    ]
    return shared + own


SECTIONS: dict[str, type] = dict(typing.get_type_hints(Config))
"""Section name -> its dataclass, in declaration order."""


@functools.cache
def key_fields() -> dict[str, dataclasses.Field[Any]]:
    """`section.key` -> its dataclass field, for every key, in declaration order (the
    algorithm's own keys after `algo`'s shared ones; a subsection's as `section.sub.key`)."""
    out: dict[str, dataclasses.Field[Any]] = {}
    for name, cls in SECTIONS.items():
        if cls is AlgoConfig:
            out.update({f"algo.{f.name}": f for _, f, _ in _algo_fields()})
        else:
            out.update(_fields(name, cls))
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _subsection(cls: type, name: str) -> type | None:
    """The dataclass a field of `cls` holds, if it is a subsection (`rollout.vllm`)."""
    hint = _hints(cls).get(name)
    return hint if dataclasses.is_dataclass(hint) and isinstance(hint, type) else None


def _fields(prefix: str, cls: type) -> dict[str, dataclasses.Field[Any]]:
    out: dict[str, dataclasses.Field[Any]] = {}
    for f in dataclasses.fields(cls):
        sub = _subsection(cls, f.name)
        if sub is not None:
            out.update(_fields(f"{prefix}.{f.name}", sub))
        else:
            out[f"{prefix}.{f.name}"] = f
    return out


def resume_rule(key: str) -> str:
    """What a resume may do with `key`: `may_change`, `may_change_unless_deterministic`,
    `never` or `semantic` (refused unless --force-config). Read from the field's metadata."""
    found = key_fields().get(key)
    return found.metadata.get(ON_RESUME, "semantic") if found is not None else "semantic"


def _benign_keys(deterministic: bool) -> set[str]:
    allowed = {"may_change"} if deterministic else {"may_change", "may_change_unless_deterministic"}
    return {key for key in key_fields() if resume_rule(key) in allowed}


def _default(key: str) -> Any:
    return _field_default(key_fields()[key])


def _field_default(found: dataclasses.Field[Any]) -> Any:
    return found.default_factory() if callable(found.default_factory) else found.default


def flatten(config: Config | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"section.key": value}` for every key (`section.sub.key` in a subsection)."""
    nested = config.to_dict() if isinstance(config, Config) else config
    out: dict[str, Any] = {}
    for name, value in nested.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


PREDATED: dict[str, Callable[[dict[str, Any]], Any]] = {
    # RLOO's entropy bonus was `algo.entropy_coef` as given until the key came; with no
    # bonus at all the two are the same, so only a run with one predates it as `none`
    "algo.entropy_scale": lambda before: (
        "none" if before.get("algo.entropy_coef") else _default("algo.entropy_scale")
    ),
}
"""Keys whose behaviour before they existed is not their default: what a checkpoint's
config that predates the key counts as (a function of that config's other keys)."""


def _saved_value(before: dict[str, Any], key: str) -> Any:
    if key in before:
        return before[key]
    return PREDATED[key](before) if key in PREDATED else _default(key)


LORA_FIXED = ("rollout.engine", "rollout.backend", "rollout.vllm.lora_requests")
"""Keys that may change on resume, but not in a LoRA run: the older weights versions its
checkpoint keeps are in the form that engine and backend load (the adapters alone, or merged
weights under the base model's names; `asyncrl.models.lora.adapters_in_engine`)."""


def semantic_differences(saved: dict[str, dict[str, Any]], now: Config) -> list[str]:
    """`key: checkpoint=X, now=Y` for every semantics-bearing key that differs. A key the
    checkpoint's config predates counts as its default there (or as `PREDATED` says)."""
    before, after = flatten(saved), flatten(now)
    benign = _benign_keys(bool(before.get("run.deterministic")))
    if before.get("model.lora.rank"):
        benign -= set(LORA_FIXED)
    return [
        f"{key}: checkpoint={_saved_value(before, key)!r}, now={after[key]!r}"
        for key in after
        if key not in benign and _saved_value(before, key) != after[key]
    ]


def benign_differences(saved: dict[str, dict[str, Any]], now: Config) -> dict[str, list[Any]]:
    before, after = flatten(saved), flatten(now)
    return {
        k: [before.get(k), after[k]]
        for k in sorted(_benign_keys(False))
        if k in after and before.get(k) != after[k]
    }


def config_hash(config: Config) -> str:
    """SHA-256 of the semantics-bearing keys: equal hashes train the same steps."""
    benign = _benign_keys(False)
    semantic = {k: v for k, v in flatten(config).items() if k not in benign}
    return hashlib.sha256(json.dumps(semantic, sort_keys=True).encode()).hexdigest()


def config_keys() -> list[str]:
    """Every accepted `section.key`, in declaration order: the frozen config surface."""
    return list(key_fields())


def field_docs(cls: type) -> dict[str, str]:
    """Maps each field of a config dataclass to the docstring written under it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Checks `value` against the field's type hint; returns it converted (int -> float)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(f"{key}: got {value!r}, allowed values: {choices}")
        return value
    if origin is dict:  # a YAML mapping, or `{a: 1}` / `section.key.name=1` on the command line
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        raise ConfigError(f"{key}: got {value!r}, expected a mapping of names to values")
    if origin is list:  # of str: a YAML list, or `a,b` on the command line
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(i, str) for i in items):
            return [i.strip() for i in items]
        raise ConfigError(f"{key}: got {value!r}, expected a list of names (or `a,b`)")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
    raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}), expected {hint.__name__}")


def _unknown(key: str, known: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(near)}?" if near else f"; known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def build_config(raw: dict[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Builds a validated Config from a nested dict plus `section.key=value` overrides.
    Override values are parsed as YAML scalars (`8` is an int, `true` a bool)."""
    merged: dict[str, dict[str, Any]] = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    for section, values in raw.items():
        if section not in SECTIONS:
            raise _unknown(str(section), list(SECTIONS))
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping of keys, got {values!r}")
        merged.setdefault(section, {}).update(copy.deepcopy(values))
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if section not in SECTIONS:
            raise _unknown(key, config_keys())
        target = merged.setdefault(section, {})
        *subs, name = name.split(".")
        for sub in subs:  # rollout.vllm.kv_cache_bytes=...
            if target.get(sub) is None:
                target[sub] = {}
            target = target[sub]
            if not isinstance(target, dict):
                raise _unknown(key, config_keys())
        target[name] = yaml.safe_load(text) if text else ""
    kwargs: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        if cls is AlgoConfig:
            kwargs[section] = _build_algo(merged.get(section, {}))
            continue
        kwargs[section] = _build_section(section, cls, merged.get(section, {}))
    config = Config(**kwargs)
    config.validate()
    return config


def _build_section(prefix: str, cls: type, raw: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}"
        if name not in hints:
            raise _unknown(key, config_keys())
        sub = _subsection(cls, name)
        if sub is not None:
            value = {} if value is None else value
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: must be a mapping of keys, got {value!r}")
            values[name] = _build_section(key, sub, value)
        else:
            values[name] = _coerce(key, value, hints[name])
    return cls(**values)


def _build_algo(raw: dict[str, Any]) -> AlgoConfig:
    """The `algo` section: the shared keys, and the keys of the algorithm `name` picks. A key
    of another algorithm is refused naming the algorithm it belongs to."""
    names = algorithm_names()
    name = raw.get("name", AlgoConfig.name)
    if name not in names:
        choices = ", ".join(repr(n) for n in names)
        raise ConfigError(f"algo.name: got {name!r}, allowed values: {choices}")
    shared = {k: v for k, v in typing.get_type_hints(AlgoConfig).items() if k != "options"}
    options_cls = options_class(name)
    own = typing.get_type_hints(options_cls)
    owners: dict[str, list[str]] = {}
    for owner, f, _ in _algo_fields():
        if owner:
            owners.setdefault(f.name, []).append(owner)
    common: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in raw.items():
        if key in shared:
            common[key] = _coerce(f"algo.{key}", value, shared[key])
        elif key in own:
            options[key] = _coerce(f"algo.{key}", value, own[key])
        elif key in owners:
            owning = " or ".join(owners[key])
            raise ConfigError(
                f"algo.{key}: a key of algo.name={owning}, and this config has "
                f"algo.name={name}; remove it, or set algo.name={owning}"
            )
        else:
            raise _unknown(f"algo.{key}", config_keys())
    return AlgoConfig(**common, options=options_cls(**options))


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config file and applies overrides; errors name the file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    try:
        return build_config(raw, overrides)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def reference_markdown() -> str:
    """The config reference (docs/config.md): one table row per key, from the field docstrings; an
    algorithm's own keys say which algorithm they belong to."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    defaults = Config().to_dict()
    for name, cls in SECTIONS.items():
        if cls is AlgoConfig:
            fields_ = _algo_fields()
            owners = collections.Counter(f.name for owner, f, _ in fields_ if owner)
            for owner, f, owner_cls in fields_:
                doc = field_docs(owner_cls).get(f.name, "")
                shown = json.dumps(_field_default(f))
                alone = " only" if owners[f.name] == 1 else ""  # else: one row per algorithm
                prefix = f"`{owner}`{alone}: " if owner else ""
                rows.append(f"| `algo.{f.name}` | `{shown}` | {prefix}{doc} |")
            continue
        rows.extend(_reference_rows(name, cls, defaults[name]))
    return "\n".join(rows)


def _reference_rows(prefix: str, cls: type, defaults: dict[str, Any]) -> list[str]:
    rows = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        sub = _subsection(cls, f.name)
        if sub is not None:
            rows.extend(_reference_rows(f"{prefix}.{f.name}", sub, defaults[f.name]))
            continue
        shown = json.dumps(defaults[f.name])
        rows.append(f"| `{prefix}.{f.name}` | `{shown}` | {docs.get(f.name, '')} |")
    return rows
