"""Atomic, verified checkpoints (I4) and safe loading (I7)."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.checkpoint.store import CheckpointError, CheckpointStore


def edit_manifest(step_dir, **changes) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest.update(changes)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def save_steps(store: CheckpointStore, *steps: int) -> None:
    for step in steps:
        store.save(step, {"a.bin": f"step {step}".encode(), "b.bin": b"\x00" * step}, "hash")


def test_a_saved_checkpoint_verifies_and_has_a_manifest_of_every_file(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    saved = store.save(7, {"a.bin": b"hello", "b.bin": b"world!"}, config_hash="c0ffee")
    assert saved.path == tmp_path / "step_000007" and saved.num_bytes == 11
    manifest = json.loads((saved.path / "manifest.json").read_text())
    assert manifest["run_id"] == "r1" and manifest["step"] == 7
    assert manifest["files"]["a.bin"]["bytes"] == 5
    latest, rejected = store.latest()
    assert latest is not None and latest.step == 7 and rejected == []
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing (torn write)"),
        (lambda d: (d / "manifest.json").write_text("{"), "manifest.json: not valid JSON"),
        (lambda d: (d / "a.bin").unlink(), "a.bin: missing (step 2)"),
        (lambda d: (d / "b.bin").write_bytes(b"\x00"), "b.bin: size 1 bytes, manifest expects 2"),
        (lambda d: (d / "a.bin").write_bytes(b"step 3"), "a.bin: SHA-256"),
        (lambda d: edit_manifest(d, files=None), "manifest.json: malformed file list"),
        (lambda d: edit_manifest(d, files={"a.bin": 3}), "manifest.json: malformed file list"),
        (lambda d: edit_manifest(d, files={}), "manifest.json: does not list a.bin, b.bin"),
    ],
)
def test_a_damaged_newest_checkpoint_is_rejected_and_the_previous_one_loads(
    tmp_path, damage, reason
):
    store = CheckpointStore(tmp_path, run_id="r1", required_files=("a.bin", "b.bin"))
    save_steps(store, 1, 2)
    damage(tmp_path / "step_000002")
    latest, rejected = store.latest()
    assert latest is not None and latest.step == 1
    assert len(rejected) == 1 and reason in rejected[0]


def test_a_checkpoint_of_another_run_or_step_is_never_loaded(tmp_path):
    save_steps(CheckpointStore(tmp_path, run_id="other"), 5)
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 3)
    latest, rejected = store.latest()
    assert latest.step == 3 and "belongs to run 'other'" in rejected[0]
    os.rename(tmp_path / "step_000003", tmp_path / "step_000004")
    latest, rejected = store.latest()
    assert latest is None and "says step 3, directory says step 4" in rejected[1]


def test_a_leftover_temp_dir_is_never_counted_as_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1)
    torn = tmp_path / ".tmp-step_000002-r1"
    torn.mkdir()
    (torn / "a.bin").write_bytes(b"half")
    assert store.latest()[0].step == 1
    store.retain(keep_last=3)
    assert not torn.exists()


def test_retention_keeps_the_newest_verified_and_never_touches_other_directories(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1, 2, 3, 4)
    save_steps(CheckpointStore(tmp_path, run_id="other"), 9)
    (tmp_path / "step_000004" / "a.bin").write_bytes(b"broken")  # newest is corrupt
    deleted = store.retain(keep_last=2)
    assert sorted(p.name for p in deleted) == ["step_000001"]
    remaining = sorted(p.name for p in tmp_path.iterdir())
    assert remaining == ["step_000002", "step_000003", "step_000004", "step_000009"]


def test_an_existing_checkpoint_is_never_overwritten_and_a_torn_one_is_set_aside(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1)
    with pytest.raises(CheckpointError, match="a verified checkpoint already exists"):
        save_steps(store, 1)
    (tmp_path / "step_000001" / "a.bin").write_bytes(b"rotten")
    save_steps(store, 1)  # the unverifiable one is in the way: moved aside, not deleted
    assert store.latest()[0].step == 1
    (aside,) = tmp_path.glob(".rejected-step_000001-*")
    assert (aside / "a.bin").read_bytes() == b"rotten"
