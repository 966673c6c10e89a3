"""A checkpoint is a dict of named stateful parts: every part of a real cut round-trips through
the files bit for bit, loads back into a freshly built run, nothing in it is a pickle, and a
cut whose parts do not fit together is refused."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
from typing import Any

import pytest
import torch
from helpers import small_config
from safetensors import safe_open

from asyncrl.checkpoint.snapshot import Snapshot, check_cut, decode, encode, read_parts
from asyncrl.checkpoint.store import CheckpointError, CheckpointStore
from asyncrl.rollout.collector import make_group, noise_seed
from asyncrl.rollout.engine import GenerationRequest
from asyncrl.rollout.scorer import Scorer
from asyncrl.train.rundir import open_run_dir
from asyncrl.train.trainer import Trainer


def tiny_trainer(tmp_path, algo: str = "grpo") -> Trainer:
    """A trainer mid-run: optimizers with state, groups of two targets buffered, tickets in
    flight, an older weights version kept (deterministic mode)."""
    config = small_config(
        "rollout.max_trajectory_age_steps=1", f"algo.name={algo}", "run.deterministic=true"
    )
    trainer = Trainer(config, open_run_dir(tmp_path / "run", config))
    parts = trainer.parts
    for name, part in (("model", parts.policy.model), ("critic", getattr(parts.algo, "critic", 0))):
        if isinstance(part, torch.nn.Module):  # give each optimizer exp_avg, exp_avg_sq, step
            part(input_ids=torch.tensor([[4, 5, 6]])).logits.mean().backward()
            optimizer = "optimizer" if name == "model" else "critic_optimizer"
            getattr(parts.algo, optimizer).step()
    tickets = parts.ledger.admit(weights_version=0, window=1, max_count=7, end_target=100)
    scorer = Scorer(parts.task, parts.policy.tokenizer)
    for ticket in tickets[:5]:
        ids = parts.policy.tokenizer(parts.task.examples[ticket.dataset_index].prompt)
        ids = ids["input_ids"]
        out = parts.engine.generate([GenerationRequest(ids, 4, noise_seed(0, ticket.ordinal))])[0]
        parts.buffer.add(make_group(ticket, ids, out, scorer(ticket, out), 0.01))
        parts.ledger.complete(ticket.ordinal)
    parts.weights.publish(1, parts.algo.policy_weights())  # version 0 is now an older one
    return trainer


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal trees: same keys and types, tensors bitwise equal with the same dtype."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for key in want:
            assert_same(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}/{i}")
    else:
        assert got == want and type(got) is type(want), (path, got, want)


@pytest.mark.parametrize("algo", ["grpo", "ppo", "rloo"])
def test_every_part_of_a_real_cut_round_trips_through_the_files_bit_for_bit(tmp_path, algo):
    trainer = tiny_trainer(tmp_path, algo)
    snapshot = trainer.capture()[0].snapshot()
    assert list(snapshot.parts) == [
        "trainer", "model", "algorithm", "rng", "stream", "ledger", "buffer", "generation",
    ]  # fmt: skip
    assert len(snapshot.parts["buffer"]["groups"]) == 5
    assert len(snapshot.parts["ledger"]["in_flight"]) == 2
    assert list(snapshot.parts["generation"]["versions"]) == [0]
    assert ("critic" in snapshot.parts["algorithm"]) == (algo == "ppo")
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    store.save(3, encode(snapshot), "h")
    written = store.latest()[0]
    assert written is not None
    with safe_open(written.path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: once
    back = decode(written)
    assert_same(back.parts, snapshot.parts)
    assert back.config == snapshot.config
    tied = back.parts["model"]["model.embed_tokens.weight"], back.parts["model"]["lm_head.weight"]
    assert tied[0].data_ptr() == tied[1].data_ptr()


def test_a_snapshot_loaded_into_a_fresh_run_captures_the_same_state(tmp_path):
    trainer = tiny_trainer(tmp_path / "a", "ppo")
    trainer.step = 1  # as after step 0: version 1 is the newest, version 0 an older one
    snapshot = trainer.capture()[0].snapshot()
    config = trainer.config
    fresh = Trainer(config, open_run_dir(tmp_path / "b", config))
    fresh.restore(snapshot)
    again = fresh.capture()[0].snapshot()
    for name in ("model", "algorithm", "stream", "buffer", "generation"):
        assert_same(again.parts[name], snapshot.parts[name], name)
    # in-flight tickets went to the re-dispatch queue, and are saved as in flight again
    assert again.parts["ledger"] == snapshot.parts["ledger"]


def test_the_snapshot_owns_a_copy_of_what_the_next_step_updates_in_place(tmp_path):
    trainer = tiny_trainer(tmp_path, "ppo")
    snapshot = trainer.capture()[0].snapshot()
    frozen = copy.deepcopy(snapshot.parts)
    with torch.no_grad():
        for model in (trainer.parts.policy.model, trainer.parts.algo.critic):
            for p in model.parameters():
                p.add_(1.0)
    assert_same(snapshot.parts, frozen)


def test_a_planted_pickle_payload_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    store.save(3, tiny_trainer(tmp_path).capture()[0].files(), "h")
    step_dir = tmp_path / "ckpt" / "step_000003"
    # An attacker swaps the weights for a pickle and fixes up the manifest to match.
    evil = pickle.dumps(Payload())
    (step_dir / "model.safetensors").write_bytes(evil)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {
        "bytes": len(evil),
        "sha256": hashlib.sha256(evil).hexdigest(),
    }
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    latest, _ = store.latest()
    assert latest is not None
    with pytest.raises(CheckpointError, match="tensors unreadable"):
        decode(latest)
    assert not marker.exists()
    # the control: the same payload does run when unpickled, so the test could fail
    pickle.loads(evil)
    assert marker.exists()


def test_a_cut_whose_parts_do_not_fit_together_is_refused(tmp_path):
    snapshot: Snapshot = tiny_trainer(tmp_path).capture()[0].snapshot()
    parts = snapshot.parts
    check_cut(parts, num_prompts_per_step=4, capacity=8)  # the real cut is coherent
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    store.save(0, encode(snapshot), "h")
    latest = store.latest()[0]
    assert latest is not None
    check_cut(read_parts(latest)[0], num_prompts_per_step=4, capacity=8)  # JSON view: same
    in_flight = parts["ledger"]["in_flight"]
    parts["ledger"]["in_flight"] = [*in_flight, [0, 0]]  # ordinal 0 is also buffered
    with pytest.raises(CheckpointError, match=r"both buffered and in flight: \[0\]"):
        check_cut(parts, num_prompts_per_step=4, capacity=8)
    parts["ledger"]["in_flight"] = in_flight
    parts["trainer"]["step"] = 1
    with pytest.raises(CheckpointError, match="groups for targets before step 1"):
        check_cut(parts, num_prompts_per_step=4, capacity=8)
    parts["trainer"]["step"] = 0
    with pytest.raises(CheckpointError, match="5 buffered groups, capacity 4"):
        check_cut(parts, num_prompts_per_step=4, capacity=4)


def test_the_ledger_and_buffer_have_a_file_of_their_own_that_inspect_reads_alone(
    tmp_path, monkeypatch
):
    """Format 4: `rollout.safetensors` holds the ledger's and buffer's tensors and nothing
    else, so `inspect` reads (and hashes) kilobytes instead of a state file that holds the
    optimizer's moments (in format 2 it read all of state.safetensors)."""
    from asyncrl.checkpoint.snapshot import ROLLOUT_FILE, STATE_FILE, decode_parts
    from asyncrl.checkpoint.store import Verified

    trainer = tiny_trainer(tmp_path)
    snapshot = trainer.capture()[0].snapshot()
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    store.save(3, encode(snapshot), "h")
    written = store.latest()[0]
    assert written is not None and written.format_version == 4
    with safe_open(written.path / ROLLOUT_FILE, "pt") as f:
        rollout = set(f.keys())
    with safe_open(written.path / STATE_FILE, "pt") as f:
        state = set(f.keys())
    assert rollout and {name.split("/")[0] for name in rollout} == {"buffer"} | (
        {"ledger"} if any(n.startswith("ledger/") for n in rollout) else set()
    )
    assert not {n for n in state if n.split("/")[0] in ("ledger", "buffer")}
    assert any(n.startswith("algorithm/optimizer/") for n in state)
    read: list[str] = []
    real = Verified.read_with

    def recording(self, name, reader):
        read.append(name)
        return real(self, name, reader)

    monkeypatch.setattr(Verified, "read_with", recording)
    parts = decode_parts(written, ("ledger", "buffer"))
    assert [n for n in read if n.endswith(".safetensors")] == [ROLLOUT_FILE]
    assert_same(parts["buffer"], snapshot.parts["buffer"])
    assert_same(parts["ledger"], snapshot.parts["ledger"])
    read.clear()
    assert_same(decode(written).parts, snapshot.parts)  # and a resume reads every file
    tensor_files = sorted(n for n in read if n.endswith(".safetensors"))
    assert tensor_files == sorted(["model.safetensors", ROLLOUT_FILE, STATE_FILE])
