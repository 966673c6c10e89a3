"""The collector's timeline rows (`timeline.jsonl`, `kind: generate`): one row per run of
consecutive engine passes over the same tickets and weights, each generated token once, in
the order the passes ran, written before its groups can be checkpointed and at every cut."""

from __future__ import annotations

from test_engine import engine_for
from test_partial import LONG, G, RecordingEngine, collector_for
from test_partial import policy as policy

from asyncrl.core.buffer import ReplayBuffer
from asyncrl.core.ledger import Ledger
from asyncrl.core.stream import PromptStream


def test_the_timeline_has_one_row_per_run_of_chunks_and_each_token_once(policy):
    """A batch's consecutive engine passes over the same tickets and weights are one timeline
    row (`chunks` of them; it used to be one row of N·G token starts and counts per pass):
    per sample the rows' token ranges are contiguous, each generated token once, and a cut
    writes the pending row first, so a checkpoint's partial tokens are on the record."""
    ledger, buffer = Ledger(PromptStream(10, 2, seed=0)), ReplayBuffer(2, 4)
    engine = RecordingEngine(engine_for(policy, max_new_tokens=LONG))
    rows: list = []
    collector = collector_for(policy, engine, ledger, buffer, chunk=4)
    collector.on_batch = rows.append
    cut_rows: list[int] = []

    def cut_after_two_chunks(n):
        if n == 2:
            with collector.cut():  # what a checkpoint holds: the rows so far are recorded
                cut_rows.append(sum(r.chunks for r in rows))

    engine.after_call = cut_after_two_chunks
    collector.start()
    groups = buffer.sample(0, check=collector.check)
    collector.stop()
    # inside the second pass, at its end: the first pass (nothing landed) was pending until
    # the cut wrote it (without that: no row yet)
    assert cut_rows == [1]
    assert sum(r.chunks for r in rows) == len(engine.calls) > len(rows)
    generated: dict = {}
    for row in rows:  # in order: each row continues where the sample's last row stopped
        for k, starts, counts in zip(row.ordinals, row.token_starts, row.token_counts, strict=True):
            ends = generated.setdefault(k, [0] * G)
            assert starts == ends, f"ordinal {k}: tokens from {starts}, generated up to {ends}"
            generated[k] = [s + c for s, c in zip(starts, counts, strict=True)]
    for group in groups:
        assert generated[group.ordinal] == group.completion_mask.sum(dim=1).tolist()
    assert sorted(k for r in rows for k in r.landed) == sorted(g.ordinal for g in groups)


def test_timeline_rows_merge_only_consecutive_passes_and_stay_in_order(policy):
    """Passes over other tickets or weights in between end a row (with pinned versions a
    batch's tickets can alternate X, Y, X: three rows, not X's passes merged across Y's), and
    a long run of passes is written every `MAX_MERGED` of them."""
    from asyncrl.core.types import PromptTicket
    from asyncrl.rollout.collector import MAX_MERGED, MAX_MERGED_S, Chunk

    collector = collector_for(
        policy, engine_for(policy), Ledger(PromptStream(10, 2, 0)), ReplayBuffer(2, 4), 4
    )
    rows: list = []
    collector.on_batch = rows.append
    tickets = {k: PromptTicket(k, 0, 0, k, k) for k in (0, 1)}

    def chunk(k, version, start, seconds=0.01):
        return Chunk(start, seconds, version, [tickets[k]], [[start] * 2], [[1, 1]])

    with collector.cut():  # the collector's lock, as `_generate` holds it
        for i, (k, v) in enumerate([(0, 0), (1, 1), (0, 0), (0, 0)]):
            collector._add_span(chunk(k, v, start=i))
        collector._record_spans()
    assert [(r.ordinals, r.start, r.chunks) for r in rows] == [
        ((0,), 0, 1), ((1,), 1, 1), ((0,), 2, 2)
    ]  # fmt: skip
    rows.clear()
    with collector.cut():
        for i in range(MAX_MERGED + 1):
            collector._add_span(chunk(0, 0, start=i))
        collector._record_spans()
        assert [r.chunks for r in rows] == [MAX_MERGED, 1]
        rows.clear()
        for i in range(3):  # or every `MAX_MERGED_S` seconds
            collector._add_span(chunk(0, 0, start=i, seconds=MAX_MERGED_S / 2))
    assert [r.chunks for r in rows] == [2]
