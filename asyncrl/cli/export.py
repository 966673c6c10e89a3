"""`asyncrl export DIR [--checkpoint step_N] OUT`: a verified checkpoint's policy as a
`save_pretrained` directory that transformers (`AutoModelForCausalLM`, `AutoTokenizer`) and
vLLM load: model safetensors, config, generation config, and the tokenizer with its chat
template when it has one.

The policy is rebuilt as the run built it, from the config the checkpoint was written with
(the one that trained it; `DIR/config.yaml` is the last launch's): the preset over the task's
alphabet, seeded, or `model.path`. The checkpoint's `model` part is loaded into it: the
trainer's weights at that step, in the dtype it trained them in; a LoRA run's adapters are
merged into its base (`--adapter`: written alone, with their peft config).
Only the checkpoint's `state.json` and `model.safetensors` are read, both checked against
its manifest; nothing from the run dir is executed (DESIGN.md I7; a `data.reward_fn` is not
imported). OUT is written under a temporary name next to it and renamed into place, so an
interrupted export leaves no OUT that looks complete.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import transformers

from asyncrl.checkpoint.run_checkpoints import model_state, verified_checkpoint
from asyncrl.checkpoint.snapshot import read_parts
from asyncrl.checkpoint.store import Verified
from asyncrl.config import Config, DataConfig
from asyncrl.config.keys import build_config
from asyncrl.models.lora import apply_lora, check_base, checkpoint_part, is_lora, save_final
from asyncrl.models.policy import Policy, load_policy
from asyncrl.tasks.examples import alphabet
from asyncrl.tasks.source import task_examples


class ExportError(RuntimeError):
    """Nothing was exported; the message says why and what to do."""


@dataclass
class Exported:
    step: int
    checkpoint: Path
    out: Path
    files: list[tuple[str, int]]
    """Each file written under `out` (relative name) and its size in bytes."""


def _alphabet(data: DataConfig) -> set[str]:
    """The task's characters (the `tiny` preset's vocabulary), read as `load_task` reads them
    but without resolving the reward function (export runs no code of the run's)."""
    return alphabet(task_examples(data))


def checkpoint_policy(verified: Verified) -> tuple[Policy, Config]:
    """The policy as the run built it, with the checkpoint's weights loaded (strictly)."""
    parts, saved = read_parts(verified)
    # the sections the policy is built from; the others may hold keys this asyncrl no longer
    # accepts (a format-1 config lists every algorithm's keys)
    config = build_config({k: v for k, v in saved.items() if k in ("run", "model", "data")})
    alphabet: set[str] = set() if config.model.path else _alphabet(config.data)
    policy = load_policy(config.model, config.run.seed, alphabet)
    apply_lora(policy, config.model, config.run.seed)  # a LoRA run's checkpoint: its adapters
    check_base(parts["trainer"].get("base_sha256"), policy.base_sha256, config.model)
    checkpoint_part(policy.model).load_state_dict(model_state(verified))
    return policy, config


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory; choose another OUT")


def export_checkpoint(
    run_dir: Path, out: Path, checkpoint: str | None = None, adapter: bool = False
) -> Exported:
    """Writes checkpoint `checkpoint` (default: the newest verified) of `run_dir` to `out`: the
    model (a LoRA run's with its adapters merged), or with `adapter` a LoRA run's adapters
    alone (`PeftModel.from_pretrained(base, out)`)."""
    _check_out(out)
    verified = verified_checkpoint(run_dir, checkpoint)
    policy, _ = checkpoint_policy(verified)
    if adapter and not is_lora(policy.model):
        raise ExportError(
            f"{verified.path}: --adapter: the run trained every weight (model.lora.rank=0); "
            "export the model without --adapter"
        )
    transformers.utils.logging.disable_progress_bar()  # a CLI that prints what it wrote
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier export by this pid
    tmp.mkdir()
    try:
        if adapter:  # adapter_config.json (its base: model.path) and adapter_model.safetensors
            policy.model.save_pretrained(tmp)
        else:  # safetensors, config.json, generation_config.json
            save_final(policy.model, tmp, None, with_adapter=False)
        policy.tokenizer.save_pretrained(tmp)  # with its chat template, if it has one
        _check_out(out)  # still free: nothing of someone else's is replaced
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(
        (str(p.relative_to(out)), p.stat().st_size) for p in out.rglob("*") if p.is_file()
    )
    return Exported(verified.step, verified.path, out, files)


def describe(exported: Exported) -> str:
    lines = [f"asyncrl: exported step {exported.step} ({exported.checkpoint}) to {exported.out}"]
    lines += [f"  {name}  {num_bytes} bytes" for name, num_bytes in exported.files]
    return "\n".join(lines)
