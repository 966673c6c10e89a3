"""Rollouts kept at a preemption notice beside the newest verified checkpoint (issue 43, I10):
what is kept (the tokens weights the checkpoint holds sampled, less what it holds already),
the ledger putting them back, and the file (whole, this run's, this checkpoint's, or ignored).
Hand-built cases, no model, no process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from asyncrl.checkpoint.kept import (
    KeptFileError,
    kept_path,
    read_kept,
    remove_stale,
    write_kept,
)
from asyncrl.core.kept import KeptRollout, group_partial, keep, up_to_version
from asyncrl.core.ledger import Ledger
from asyncrl.core.partial import Partial
from asyncrl.core.stream import PromptStream
from asyncrl.core.types import Group, PromptTicket


def partial(rows: list[list[tuple[int, int]]], finished: list[bool]) -> Partial:
    """Samples of (token, version) pairs; log-prob of a token = -token / 10."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    versions = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        for j, (token, version) in enumerate(row):
            tokens[i, j], mask[i, j], versions[i, j] = token, True, version
    logprobs = torch.where(mask, -tokens.float() / 10, 0.0)
    return Partial(tokens, mask, logprobs, versions, torch.tensor(finished))


def test_a_sample_keeps_the_tokens_up_to_the_first_newer_one_and_is_unfinished_if_cut():
    p = partial([[(11, 3), (12, 3), (13, 4), (14, 4)], [(21, 2), (22, 3)], [(31, 5)]],
                [True, True, False])  # fmt: skip
    kept = up_to_version(p, 3)
    assert kept.lengths == [2, 2, 0]
    assert kept.prefixes() == ((11, 12), (21, 22), ())
    assert kept.finished.tolist() == [False, True, False]  # the first lost its end
    assert kept.versions.tolist() == [[3, 3], [2, 3], [-1, -1]]
    assert torch.allclose(kept.logprobs, torch.tensor([[-1.1, -1.2], [-2.1, -2.2], [0.0, 0.0]]))
    assert up_to_version(p, 5).prefixes() == p.prefixes()  # nothing newer: all kept
    assert up_to_version(p, 5).finished.tolist() == [True, True, False]


def group(ordinal: int, target: int, rows: list[list[tuple[int, int]]]) -> Group:
    p = partial(rows, [True] * len(rows))
    ticket = PromptTicket(ordinal, target, 0, ordinal, ordinal)
    return Group(ticket, [1, 2], p.tokens, p.mask, p.logprobs, torch.zeros(len(rows)),
                 int(p.versions[p.mask].min()), int(p.versions[p.mask].max()),
                 token_versions=p.versions)  # fmt: skip


def test_the_account_counts_what_the_checkpoint_lacks_and_what_newer_weights_sampled():
    """Checkpoint of step 6 (versions <= 6 kept). Ordinal 8 was buffered there (nothing new);
    ordinal 12 was in flight there with 1 token a sample (1 new each, then a version-7 token
    lost); ordinal 13 finished after it on version 6 (kept whole); ordinal 14 is version 7's
    (lost whole)."""
    items = [
        (8, 2, group_partial(group(8, 2, [[(1, 5), (2, 5)], [(3, 5)]]))),
        (12, 3, partial([[(1, 6), (2, 6), (3, 7)], [(4, 6), (5, 6)]], [True, False])),
        (13, 3, group_partial(group(13, 3, [[(6, 6)], [(7, 6), (8, 6)]]))),
        (14, 3, group_partial(group(14, 3, [[(9, 7)], [(9, 7)]]))),
    ]
    held = {8: [2, 1], 12: [1, 1]}
    kept, account = keep(items, 6, held, cut_step=8)
    assert [k.ordinal for k in kept] == [12, 13] == account.ordinals
    assert (account.groups, account.partial_groups) == (1, 1)
    assert account.tokens == (2 - 1) + (2 - 1) + 3
    assert account.lost_tokens == 1 + 2
    assert (account.step, account.lost_steps, account.fields()["lost_steps"]) == (6, 2, 2)
    assert kept[0].partial.finished.tolist() == [False, False]
    assert kept[1].partial.done


def stream(num_rows: int = 40) -> PromptStream:
    return PromptStream(num_rows, num_prompts_per_step=4, seed=0)


def test_the_ledger_puts_kept_rollouts_where_each_ordinal_is_and_hands_the_rest_out_later():
    s = stream()
    ledger = Ledger(s)
    for _ in range(10):  # ordinals 0-9 handed out; 8 and 9 in flight at the "checkpoint"
        s.take()
    ledger.fail([s.ticket(8), s.ticket(9)])
    ledger.partials[9] = partial([[(1, 2)]], [False])
    p = partial([[(1, 2), (2, 2)]], [True])
    kept = [KeptRollout(k, k // 4, p) for k in (5, 7, 8, 9, 12)]
    applied = ledger.keep(kept, buffered={7})
    # 5: trained by the checkpoint (below the cursor, not queued); 7: buffered there
    assert [k.ordinal for k in applied] == [8, 9, 12]
    assert ledger.partials[8] is p and ledger.partials[9] is p and ledger.kept == {12: p}
    redispatched = ledger.admit(weights_version=2, window=1, max_count=2, end_target=100)
    assert [t.ordinal for t in redispatched] == [8, 9]
    fresh = ledger.admit(weights_version=2, window=1, max_count=4, end_target=100)
    assert [t.ordinal for t in fresh] == [10, 11, 12, 13]
    assert ledger.partials[12] is p and not ledger.kept


def test_a_kept_ordinal_of_another_target_is_refused_and_nothing_changes():
    s = stream()
    ledger = Ledger(s)
    p = partial([[(1, 0)]], [True])
    with pytest.raises(ValueError, match="kept ordinal 6 has target step 2; the schedule gives 1"):
        ledger.keep([KeptRollout(5, 1, p), KeptRollout(6, 2, p)], buffered=set())
    assert not ledger.kept and not ledger.partials


def test_a_checkpoint_cut_after_the_resume_holds_the_kept_rollouts_not_yet_handed_out():
    s = stream()
    ledger = Ledger(s)
    p = partial([[(1, 0), (2, 0)]], [True])
    ledger.keep([KeptRollout(6, 1, p)], buffered=set())
    state = ledger.state_dict()
    again = Ledger(stream())
    again.load_state_dict(state)
    assert again.kept[6].prefixes() == p.prefixes()
    assert "kept" not in Ledger(stream()).state_dict()  # a run without: its state as before


def written(tmp_path: Path) -> tuple[Path, list[KeptRollout]]:
    items = [(4, 1, partial([[(5, 0), (6, 0)], [(7, 0)]], [True, False]))]
    kept, account = keep(items, 0, {}, cut_step=2)
    path, nbytes = write_kept(tmp_path, "run-a", kept, account)
    assert path == kept_path(tmp_path, 0) and nbytes == path.stat().st_size
    return path, kept


def test_the_file_reads_back_what_was_kept_and_the_account(tmp_path):
    _, kept = written(tmp_path)
    found = read_kept(tmp_path, 0, "run-a")
    assert found is not None
    back, account = found
    assert [(k.ordinal, k.target_step) for k in back] == [(4, 1)]
    assert back[0].partial.prefixes() == kept[0].partial.prefixes()
    assert torch.equal(back[0].partial.logprobs, kept[0].partial.logprobs)
    assert account == {"cut_step": 2, "groups": 0, "partial_groups": 1, "tokens": 3,
                       "lost_tokens": 0}  # fmt: skip
    assert read_kept(tmp_path, 1, "run-a") is None  # none beside another checkpoint


@pytest.mark.parametrize("damage", ["torn", "flipped", "other_run", "metadata"])
def test_a_file_that_is_not_whole_or_not_this_runs_is_refused_by_name(tmp_path, damage):
    path, _ = written(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "torn":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flipped":
        data[-3] ^= 0xFF  # in the tensors: the checksum catches it
        path.write_bytes(bytes(data))
    elif damage == "metadata":  # a header that still parses, an ordinal with no tensors
        at = data.index(b'{\\"4\\": 1}')
        data[at + 3] = ord("5")
        path.write_bytes(bytes(data))
    run_id = "run-b" if damage == "other_run" else "run-a"
    with pytest.raises(KeptFileError, match=str(path)):
        read_kept(tmp_path, 0, run_id)


def test_a_newer_verified_checkpoint_makes_older_kept_files_stale(tmp_path):
    written(tmp_path)
    torn = tmp_path / f".kept-tmp-0-run-a-{os.getpid()}"  # an earlier process with our pid's
    torn.write_bytes(b"torn")
    removed = remove_stale(tmp_path, newest_step=0)
    assert removed == [torn]  # step 0's file is still current
    assert remove_stale(tmp_path, newest_step=3) == [kept_path(tmp_path, 0)]


def test_a_keep_beside_a_newer_checkpoint_deletes_the_one_beside_an_older(tmp_path):
    """A notice while step 6's write is in flight keeps beside 3; the keep may end after 6's
    retain looked for stale files, and the run keeps again beside 6 once it is verified: that
    second keep leaves one kept file, its own (stop 60's CI run left two)."""
    written(tmp_path)  # beside step 0
    items = [(4, 1, partial([[(5, 0), (6, 0)]], [True]))]
    kept, account = keep(items, 3, {}, cut_step=4)
    path, _ = write_kept(tmp_path, "run-a", kept, account)
    assert sorted(tmp_path.iterdir()) == [path] and path == kept_path(tmp_path, 3)
    kept, account = keep(items, 1, {}, cut_step=4)  # an older one after it: both stay
    older, _ = write_kept(tmp_path, "run-a", kept, account)
    assert sorted(tmp_path.iterdir()) == [older, path]
