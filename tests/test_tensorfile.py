"""Tensor files are streamed: written from the tensors without a whole-file `bytes`, in the
safetensors format the real library reads (and byte for byte what it writes), and read back
into fresh tensors while the very bytes parsed are hashed."""

from __future__ import annotations

import hashlib
import io
import struct
import tracemalloc

import pytest
import safetensors.torch
import torch

from asyncrl.checkpoint.snapshot import Snapshot, decode, encode
from asyncrl.checkpoint.store import CheckpointError, CheckpointStore
from asyncrl.checkpoint.tensorfile import read_tensors, write_bytes


def many_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "half": torch.randn(4, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f64": torch.randn(2, generator=g).double(),
        "ids": torch.arange(7),
        "i32": torch.arange(-3, 3, dtype=torch.int32),
        "i16": torch.tensor([-2, 9], dtype=torch.int16),
        "i8": torch.tensor([-1, 5, 7], dtype=torch.int8),
        "bytes": torch.arange(11, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "step": torch.tensor(3.0, dtype=torch.float32),
        "a/b/c": torch.ones(1, 1),
    }


def test_a_streamed_file_is_byte_for_byte_what_safetensors_writes_and_loads_back():
    tensors = many_dtypes()
    ours = write_bytes(tensors)
    assert ours == safetensors.torch.save(tensors)
    back = safetensors.torch.load(ours)
    assert set(back) == set(tensors)
    for name, want in tensors.items():
        assert back[name].dtype == want.dtype and back[name].shape == want.shape, name
        assert torch.equal(back[name], want), name


def test_our_reader_loads_the_librarys_files_and_hashes_exactly_the_bytes_it_read():
    tensors = many_dtypes()
    data = safetensors.torch.save(tensors)
    back, digest = read_tensors(io.BytesIO(data), len(data))
    assert digest == hashlib.sha256(data).hexdigest()
    for name, want in tensors.items():
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: d[:-1], "the tensors cover 209 data bytes, the file holds 208"),
        (lambda d: d + b"\0", "the file holds 210"),
        (lambda d: struct.pack("<Q", 1 << 40) + d[8:], "header length"),
        (lambda d: d[:8] + b"[" + d[9:], "not JSON"),
        (lambda d: d.replace(b'"F32"', b'"X99"', 1), "malformed entry"),
        (lambda d: d.replace(b'"shape":[3,5]', b'"shape":[5,5]', 1), "does not fit"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_problem(damage, reason):
    data = damage(write_bytes(many_dtypes()))
    with pytest.raises(ValueError, match=reason):
        read_tensors(io.BytesIO(data), len(data))


def test_a_save_streams_its_tensors_without_building_a_file_in_memory(tmp_path, monkeypatch):
    def whole_file(*args, **kwargs):
        raise AssertionError("a save built a whole file in memory")

    monkeypatch.setattr(safetensors.torch, "save", whole_file)
    weights = {"w": torch.randn(12_500_000)}  # 50 MB
    snapshot = Snapshot({"model": weights, "trainer": {"step": 1}}, {})
    store = CheckpointStore(tmp_path, run_id="r1")
    files = encode(snapshot)
    tracemalloc.start()
    try:
        saved = store.save(1, files, "h")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert saved.num_bytes > 50_000_000
    assert peak_bytes < 2_000_000, peak_bytes  # Python objects only: chunks are views
    tracemalloc.start()
    try:
        latest = store.latest()[0]
        _, verify_peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        back = decode(latest)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verify_peak_bytes < 20_000_000, verify_peak_bytes  # hashed in 16 MiB chunks
    assert peak_bytes < 2_000_000, peak_bytes  # read into the tensors, no bytes in between
    assert torch.equal(back.parts["model"]["w"], weights["w"])


def test_a_tensor_file_changed_after_verification_is_refused_when_it_is_loaded(tmp_path):
    snapshot = Snapshot({"model": {"w": torch.zeros(8)}, "trainer": {"step": 1}}, {})
    store = CheckpointStore(tmp_path, run_id="r1")
    store.save(1, encode(snapshot), "h")
    verified = store.latest()[0]
    path = tmp_path / "step_000001" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, one flipped byte in the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: changed after verification"):
        decode(verified)


def test_a_selective_read_keeps_only_the_tensors_asked_for_and_still_hashes_every_byte(
    monkeypatch,
):
    """`inspect` reads the ledger's and buffer's tensors out of a state file that also holds
    the optimizer's moments: those are hashed through one chunk and never held."""
    import asyncrl.checkpoint.tensorfile as tensorfile

    big = torch.randn(1 << 22)  # 16 MiB: the optimizer's moments, say
    data = write_bytes({"exp_avg": big, "partial.tokens": torch.arange(6)})
    allocated: list[list[int]] = []
    real_empty = torch.empty

    def counting_empty(shape, *args, **kwargs):
        allocated.append(list(shape))
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(tensorfile.torch, "empty", counting_empty)
    tensors, digest = read_tensors(io.BytesIO(data), len(data), {"partial.tokens"})
    monkeypatch.undo()
    assert list(tensors) == ["partial.tokens"] and tensors["partial.tokens"].tolist() == [*range(6)]
    assert digest == hashlib.sha256(data).hexdigest()  # the whole file, as the manifest has it
    assert [1 << 22] not in allocated, allocated  # the big tensor was never allocated
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1  # a byte of the tensor not asked for
    _, changed = read_tensors(io.BytesIO(bytes(flipped)), len(data), {"partial.tokens"})
    assert changed != digest
