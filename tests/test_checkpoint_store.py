"""Atomic, verified checkpoints (I4) and safe loading (I7)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers import small_config

from asyncrl.checkpoint.store import (
    FORMAT_VERSION,
    SUPPORTED_FORMAT_VERSIONS,
    CheckpointError,
    CheckpointStore,
    UnsupportedCheckpointFormat,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v1"


def edit_manifest(step_dir, **changes) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest.update(changes)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def list_in_manifest(step_dir, name: str, data: bytes) -> None:
    """Adds (or fixes up) the manifest entry `name` with `data`'s true size and SHA-256: what an
    attacker who can write the directory does."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
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


SECRET = b"not part of any checkpoint"


@pytest.mark.parametrize(
    "entry",
    ["../../secret.txt", "../" * 10 + "{secret}", "{secret}", "../step_000001/a.bin"],
)
def test_a_manifest_entry_outside_the_checkpoint_makes_it_unverifiable(tmp_path, entry):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    save_steps(store, 1, 2)
    entry = entry.format(secret=secret)
    target = (tmp_path / "ckpt" / "step_000002" / entry).resolve()
    assert target.is_file(), "the entry names a real file: only its place makes it wrong"
    list_in_manifest(tmp_path / "ckpt" / "step_000002", entry, target.read_bytes())
    latest, rejected = store.latest()
    assert latest is not None and latest.step == 1
    assert len(rejected) == 1 and entry in rejected[0] and "not a plain file name" in rejected[0]
    with pytest.raises(CheckpointError, match="not a plain file name"):
        store.verify(tmp_path / "ckpt" / "step_000002", 2)


@pytest.mark.parametrize("entry", ["link.bin", "a.bin"])
def test_a_symlink_entry_in_a_checkpoint_makes_it_unverifiable(tmp_path, entry):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1", required_files=("a.bin",))
    save_steps(store, 1, 2)
    step_dir = tmp_path / "ckpt" / "step_000002"
    (step_dir / entry).unlink(missing_ok=True)
    (step_dir / entry).symlink_to(secret)  # inside the directory, pointing out of it
    list_in_manifest(step_dir, entry, SECRET)
    latest, rejected = store.latest()
    assert latest is not None and latest.step == 1
    assert len(rejected) == 1 and f"{step_dir / entry}: a symbolic link" in rejected[0]


def test_a_checkpoint_directory_that_is_a_symlink_is_never_loaded(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    save_steps(store, 1)
    save_steps(CheckpointStore(tmp_path / "elsewhere", run_id="r1"), 2)
    (tmp_path / "ckpt" / "step_000002").symlink_to(tmp_path / "elsewhere" / "step_000002")
    latest, rejected = store.latest()
    assert latest.step == 1 and "step_000002: a symbolic link" in rejected[0]


def test_a_verified_checkpoint_reads_only_the_files_its_manifest_lists(tmp_path):
    (tmp_path / "secret.txt").write_bytes(SECRET)
    store = CheckpointStore(tmp_path / "ckpt", run_id="r1")
    save_steps(store, 1)
    latest = store.latest()[0]
    assert latest.read_bytes("a.bin") == b"step 1"
    for name in ("../../secret.txt", "manifest.json", "c.bin"):
        with pytest.raises(CheckpointError, match=f"{name}: not a file the manifest lists"):
            latest.read_bytes(name)


def test_a_new_checkpoint_records_the_format_version_it_was_written_in(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1)
    manifest = json.loads((tmp_path / "step_000001" / "manifest.json").read_text())
    assert manifest["format"] == "asyncrl-checkpoint" and manifest["format_version"] == 4
    assert FORMAT_VERSION == 4 and SUPPORTED_FORMAT_VERSIONS == (1, 2, 3, 4, 5)
    assert store.latest()[0].format_version == 4


def test_a_checkpoint_written_before_format_versions_reads_as_version_1(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1)
    manifest = json.loads((tmp_path / "step_000001" / "manifest.json").read_text())
    manifest["format"] = "asyncrl-checkpoint/1"
    del manifest["format_version"]
    (tmp_path / "step_000001" / "manifest.json").write_text(json.dumps(manifest))
    assert store.latest()[0].format_version == 1
    # and one really written by the code of that time (see tests/test_checkpoint_compat.py)
    run_id = json.loads((FIXTURES / "grpo" / "run.json").read_text())["run_id"]
    old = CheckpointStore(FIXTURES / "grpo" / "checkpoints", run_id)
    latest, rejected = old.latest()
    assert latest is not None and latest.step == 6 and rejected == []
    assert latest.format_version == 1 and "format_version" not in latest.manifest


def test_a_checkpoint_of_an_unknown_format_version_stops_the_search_instead_of_falling_back(
    tmp_path,
):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1, 2)
    newer = tmp_path / "step_000002"
    edit_manifest(newer, format_version=99)
    with pytest.raises(UnsupportedCheckpointFormat) as err:
        store.latest()  # falling back to step 1 would throw away the newer run's work
    message = str(err.value)
    assert str(newer / "manifest.json") in message and "format version 99" in message
    assert "reads versions 1, 2" in message and "upgrade asyncrl to resume it" in message
    with pytest.raises(UnsupportedCheckpointFormat):
        save_steps(store, 2)  # never set aside, never overwritten
    assert store.retain(keep_last=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
    edit_manifest(newer, format_version="2")  # not a version at all: just a broken manifest
    latest, rejected = store.latest()
    assert latest.step == 1 and "format_version '2' is not an integer" in rejected[0]


def make_incoherent(step_dir) -> None:
    """Rewrites state.json so that its checksums hold but its parts do not fit together:
    ordinal 0 is in flight for target 0, before the checkpoint's step."""
    state = json.loads((step_dir / "state.json").read_text())
    state["parts"]["ledger"]["in_flight"].append([0, 0])
    data = json.dumps(state).encode()
    (step_dir / "state.json").write_bytes(data)
    list_in_manifest(step_dir, "state.json", data)


def test_an_incoherent_newest_checkpoint_is_neither_kept_as_newest_nor_in_the_way_of_training(
    tmp_path,
):
    from helpers import read_records, train_and_report

    from asyncrl.cli.audit import audit_run_dir
    from asyncrl.train.rundir import open_run_dir
    from asyncrl.train.trainer import train

    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    train(small_config("run.max_num_steps=4", "checkpoint.save_period=2"), run)
    make_incoherent(checkpoints / "step_000004")
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    CheckpointStore(checkpoints, run_id).verify(checkpoints / "step_000004", 4)  # checksums hold
    opened = open_run_dir(run, small_config("run.max_num_steps=6", "checkpoint.save_period=2"))
    try:
        assert opened.latest.step == 2
        assert opened.store.retain(keep_last=1) == []  # step 2 is the newest loadable one
    finally:
        opened.lock.close()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004"]

    summary = train_and_report(small_config("run.max_num_steps=6", "checkpoint.save_period=2"), run)
    assert "6 steps in" in summary
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 2
    assert "incoherent checkpoint of step 4" in resume["rejected_checkpoints"][0]
    (aside,) = checkpoints.glob(".rejected-step_000004-*")
    aside_state = json.loads((aside / "state.json").read_text())
    assert [0, 0] in aside_state["parts"]["ledger"]["in_flight"]
    store = CheckpointStore(checkpoints, run_id)
    for step in (4, 6):
        store.verify(checkpoints / f"step_{step:06d}", step)
        state = json.loads((checkpoints / f"step_{step:06d}" / "state.json").read_text())
        assert [0, 0] not in state["parts"]["ledger"]["in_flight"]
    assert audit_run_dir(run).ok


def count_hashed_files(monkeypatch) -> list[str]:
    """Records every file the store re-reads to hash (not the manifests it parses)."""
    import asyncrl.checkpoint.store as store_module

    hashed: list[str] = []
    real = store_module._hash_regular

    def spy(file):
        hashed.append(f"{file.parent.name}/{file.name}")
        return real(file)

    monkeypatch.setattr(store_module, "_hash_regular", spy)
    return hashed


def test_retention_does_not_rehash_the_checkpoints_this_store_wrote(tmp_path, monkeypatch):
    hashed = count_hashed_files(monkeypatch)
    store = CheckpointStore(tmp_path, run_id="r1")
    for step in (1, 2, 3):
        save_steps(store, step)
        store.verify_saved(tmp_path / f"step_{step:06d}", step)
        store.retain(keep_last=5)
    assert hashed == []  # each file was hashed while it was written, and never read back
    CheckpointStore(tmp_path, run_id="r1").retain(keep_last=5)  # unknown: hashed once
    assert sorted(hashed) == [f"step_00000{s}/{f}" for s in (1, 2, 3) for f in ("a.bin", "b.bin")]
    assert store.latest()[0].step == 3  # a resume still re-hashes what it loads
    assert hashed[-2:] == ["step_000003/a.bin", "step_000003/b.bin"]


def test_retention_stops_trusting_a_kept_checkpoint_whose_manifest_or_files_changed(tmp_path):
    store = CheckpointStore(tmp_path, run_id="r1")
    save_steps(store, 1, 2, 3, 4)
    step3 = tmp_path / "step_000003"
    list_in_manifest(step3, "a.bin", b"something else")  # a manifest edited behind our back
    (tmp_path / "step_000004" / "b.bin").write_bytes(b"\x01" * 4)  # same size, new bytes
    os.utime(tmp_path / "step_000004" / "b.bin", ns=(1, 1))  # and a new mtime
    deleted = store.retain(keep_last=1)  # neither 4 nor 3 verifies: 2 is the newest kept
    assert sorted(p.name for p in deleted) == ["step_000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000002",
        "step_000003",
        "step_000004",
    ]
