"""`asyncrl export DIR [--checkpoint step_N] OUT`: a verified checkpoint's policy as a
`save_pretrained` directory that transformers loads.

Oracle: the run's own `final_model/`, which the trainer saves from its live model after the
last step, the same weights the last checkpoint holds. Negative controls: the export of an
earlier checkpoint and the initial weights both differ from it, so a comparison that passed
for a wrong checkpoint (or for weights never loaded) would be caught."""

from __future__ import annotations

import json
import os
import shutil
import sys

import launcher
import pytest
import torch
from helpers import DIGITS, run_cli, small_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli.export import export_checkpoint
from asyncrl.cli.main import main
from asyncrl.models.policy import load_policy
from asyncrl.models.scratch import save_scratch_model
from asyncrl.train.trainer import train

pytestmark = pytest.mark.slow

PROMPTS = ["31524=", "90817=", "55123="]
STEPS = ["run.max_num_steps=4", "checkpoint.save_period=2"]  # checkpoints of steps 2 and 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 4-step run of the `tiny` preset with checkpoints of steps 2 and 4
    (deterministic: the same weights at every run of the test)."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    train(small_config(*STEPS, "algo.lr=1e-2", "run.deterministic=true"), run_dir)
    return run_dir


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)


def greedy(path, prompts=PROMPTS, max_new_tokens=6) -> list[list[int]]:
    model, tokenizer = load(path)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


def weights(path) -> dict[str, torch.Tensor]:
    return load(path)[0].state_dict()


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_export_of_the_last_checkpoint_is_the_trainers_final_model(run, tmp_path):
    out = tmp_path / "exported"
    done = run_cli("export", str(run), str(out))
    assert done.returncode == 0, done.stderr
    assert f"exported step 4 ({run / 'checkpoints' / 'step_000004'}) to {out}" in done.stdout
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert name in done.stdout and (out / name).is_file()
    final = run / "final_model"
    assert same_weights(weights(out), weights(final))
    assert greedy(out) == greedy(final)
    _, tokenizer = load(out)
    assert tokenizer.decode(tokenizer("31524=")["input_ids"]) == "31524="
    # negative control: the comparisons above tell the trained model from the initial one
    initial = load_policy(small_config().model, 0, DIGITS)
    initial.model.save_pretrained(tmp_path / "initial")
    initial.tokenizer.save_pretrained(tmp_path / "initial")
    assert not same_weights(weights(out), weights(tmp_path / "initial"))
    assert greedy(out) != greedy(tmp_path / "initial")


def test_an_earlier_checkpoint_exports_its_own_weights(run, tmp_path):
    exported = export_checkpoint(run, tmp_path / "step2", "step_2")
    assert exported.step == 2
    assert not same_weights(weights(tmp_path / "step2"), weights(run / "final_model"))
    assert not same_weights(
        weights(tmp_path / "step2"), load_policy(small_config().model, 0, DIGITS).model.state_dict()
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A Qwen2 dir with a BPE tokenizer and a chat template (head_dim 32: vLLM's CPU attention
    takes no smaller), a 4-step run on it, and the export of its last checkpoint."""
    root = tmp_path_factory.mktemp("qwen2")
    base = save_scratch_model(root / "base", arch="qwen2", seed=1, hidden_size=128)
    keys = ("rollout.max_new_tokens=4", "data.reward_fn=shaped_rewards:digit_fraction")
    train(small_config(*STEPS, f"model.path={base}", *keys), root / "run")
    export_checkpoint(root / "run", root / "exported")
    return base, root / "run", root / "exported"


def test_a_model_path_run_exports_with_its_chat_template(qwen2):
    base, run_dir, out = qwen2
    model, tokenizer = load(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    _, original = load(base)
    assert original.chat_template and tokenizer.chat_template == original.chat_template
    chat = [{"role": "user", "content": "Sort 31524"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == original.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert same_weights(model.state_dict(), weights(run_dir / "final_model"))
    assert not same_weights(model.state_dict(), weights(base))  # it trained
    assert greedy(out, ["31524=", "Sort 9 1 5"]) == greedy(
        run_dir / "final_model", ["31524=", "Sort 9 1 5"]
    )


def export_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["export", *map(str, args)])
    return code, capsys.readouterr().err


def test_bad_exports_are_refused_with_exit_2_naming_what_exists(run, tmp_path, capsys):
    code, err = export_cli(capsys, tmp_path, tmp_path / "out")
    assert code == 2 and "not a run dir" in err

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, err = export_cli(capsys, run, busy)
    assert code == 2 and "exists and is not an empty directory" in err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]

    code, err = export_cli(capsys, run, "--checkpoint", "step_9", tmp_path / "out")
    assert code == 2
    assert "step_000009 does not exist; verified checkpoints: step_000002, step_000004" in err
    code, err = export_cli(capsys, run, "--checkpoint", "latest", tmp_path / "out")
    assert code == 2 and "must look like step_N" in err

    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    (damaged / "checkpoints" / "step_000002" / "model.safetensors").write_bytes(b"torn")
    code, err = export_cli(capsys, damaged, "--checkpoint", "step_000002", tmp_path / "out")
    assert code == 2 and "step_000002 is not verified" in err
    assert "verified checkpoints: step_000004" in err
    for manifest in (damaged / "checkpoints").glob("step_*/manifest.json"):
        manifest.write_text("{}")
    code, err = export_cli(capsys, damaged, tmp_path / "out")
    assert code == 2 and "no verified checkpoint to export" in err
    assert not (tmp_path / "out").exists()


def test_an_empty_out_directory_is_filled(run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    export_checkpoint(run, out)
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # no temporary left behind


def test_a_format_1_checkpoint_exports_its_weights(tmp_path, repo_root):
    # tests/fixtures/v1: run dirs written before checkpoints were named parts
    run_dir = tmp_path / "v1"
    shutil.copytree(repo_root / "tests" / "fixtures" / "v1" / "grpo", run_dir)
    exported = export_checkpoint(run_dir, tmp_path / "out")
    assert exported.step == 6
    saved = load_file(run_dir / "checkpoints" / "step_000006" / "model.safetensors")
    got = weights(tmp_path / "out")
    assert saved and all(torch.equal(got[name], tensor) for name, tensor in saved.items())


VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(
    model=sys.argv[1], dtype="float32", kv_cache_memory_bytes=64 << 20, seed=0, enforce_eager=True
)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[2]), params)
chat = [{"role": "user", "content": "Sort 31524"}]
template = llm.get_tokenizer().apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "chat": template}))
"""


def test_vllm_loads_the_export_and_decodes_greedily_as_transformers_does(qwen2, tmp_path):
    if os.environ.get("CI") != "true":  # CI installs vLLM: there the test must run, not skip
        pytest.importorskip("vllm")
    _, _, out = qwen2
    script = tmp_path / "vllm_greedy.py"  # a script (not -c): the test launcher forks it
    script.write_text(VLLM_GREEDY)
    prompts = ["31524=", "Sort 9 1 5"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    done = launcher.run(
        [sys.executable, str(script), str(out), json.dumps(prompts)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] == greedy(out, prompts)
    _, tokenizer = load(out)
    chat = [{"role": "user", "content": "Sort 31524"}]
    assert got["chat"] == tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
