"""The trainer ranks' messages without pickle (`asyncrl.distributed.wire`): the codec
round-trips a step command bit for bit, and two real gloo ranks exchange it with unpickling
switched off on the receiving side (torch's `*_object` collectives, the negative control,
fail there)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import launcher
import pytest
import torch
from wire_peer import command, digest, share_digest, shares

from asyncrl.distributed import wire

PEER = Path(__file__).with_name("wire_peer.py")


def test_a_step_command_round_trips_through_the_codec_bit_for_bit():
    cmd = command()
    header, tensors = wire.pack(cmd)
    assert b"__tensor__" in header and all(t.is_contiguous() for t in tensors)
    received = [buf.copy_(t) for buf, t in zip(wire.buffers(header, torch.device("cpu")), tensors,
                                                strict=True)]  # fmt: skip
    assert digest(wire.unpack(header, received)) == digest(cmd)
    values = {"t": (1, 2.5, None), "by_int": {3: "x"}, "nan": math.nan, "flag": True}
    back = wire.unpack(*wire.pack(values))
    assert back["t"] == (1, 2.5, None) and back["by_int"] == {3: "x"} and back["flag"] is True
    assert math.isnan(back["nan"])
    with pytest.raises(TypeError, match="complex64"):
        wire.pack({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="cannot go into"):
        wire.pack({"object": object()})  # only data: nothing a peer could make us run


def run_peers(tmp_path: Path, transport: str) -> list[subprocess.CompletedProcess[str]]:
    env = {
        **os.environ,
        "ASYNCRL_RENDEZVOUS": str(tmp_path / f"rendezvous-{transport}"),
        "WORLD_SIZE": "2",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": str(PEER.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONWARNINGS": "ignore",
    }
    procs = [
        launcher.popen(
            [sys.executable, str(PEER), str(tmp_path), transport],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        p.communicate(timeout=300)
    return procs


@pytest.mark.slow
def test_two_gloo_ranks_exchange_a_step_command_with_unpickling_switched_off(tmp_path):
    procs = run_peers(tmp_path, "wire")
    assert [p.returncode for p in procs] == [0, 0]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank1["received"] == rank0["received"] == digest(command())
    assert rank0["gathered"] == rank1["gathered"]
    assert "'loss': 1.5" in rank0["gathered"] and "nan" in rank0["gathered"]
    sent = shares(2)
    assert rank0["scattered"] == share_digest(sent[0]) != share_digest(sent[1])
    assert rank1["scattered"] == share_digest(sent[1])  # its own, and only its own
    # negative control: torch's pickle-based collectives unpickle on the receiving ranks
    (tmp_path / "rank0.json").unlink()
    (tmp_path / "rank1.json").unlink()
    procs = run_peers(tmp_path, "objects")
    assert any(p.returncode != 0 for p in procs)
    assert not (tmp_path / "rank1.json").exists()
