"""What `asyncrl plot` draws, read from a run's records in one pass over each file and in
memory bounded by the picture, not by the run: per-step series keep at most `MAX_POINTS`
steps (every k-th step, k doubling as the run grows), the whole-run timeline coalesces spans
closer than a pixel, the ledger is sampled on a fixed grid of times. A run of a thousand
steps is drawn exactly (every step, every span); one of a million in the same few MB
(`benchmarks/records.py`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_POINTS = 4096
"""Steps a per-step series keeps, and spans a row of the whole-run timeline keeps."""
GRID = 2048
"""Times at which the ledger's counts are sampled."""
STEP_FIELDS = ("wall_s", "reward_mean", "loss", "generation_version_min", "generation_version_max")


@dataclass
class Decimated:
    """The last value recorded for every `stride`-th key (a step; a later record of a step
    replaces the earlier, as `latest_records` does), at most `limit` of them: past that the
    stride doubles and the keys it no longer divides are dropped."""

    limit: int = MAX_POINTS
    stride: int = 1
    rows: dict[int, Any] = field(default_factory=dict)

    def add(self, key: int, row: Any) -> None:
        if key % self.stride:
            return
        self.rows[key] = row
        while len(self.rows) > self.limit:
            self.stride *= 2
            self.rows = {k: v for k, v in self.rows.items() if k % self.stride == 0}

    def items(self) -> list[tuple[int, Any]]:
        return sorted(self.rows.items())


@dataclass
class Coalesced:
    """Intervals `(start, seconds)` in the order given, adjacent ones merged when the gap
    between them is under `gap` (0: none merged); past `limit` intervals the gap doubles
    (starting from the mean interval's length) and they are merged again."""

    limit: int = MAX_POINTS
    gap: float = 0.0
    spans: list[tuple[float, float]] = field(default_factory=list)

    def add(self, start: float, seconds: float) -> None:
        if self.spans:
            last_start, last_seconds = self.spans[-1]
            if last_start <= start and start - (last_start + last_seconds) < self.gap:
                end = max(last_start + last_seconds, start + seconds)
                self.spans[-1] = (last_start, end - last_start)
                return
        self.spans.append((start, seconds))
        if len(self.spans) > self.limit:
            mean = sum(s for _, s in self.spans) / len(self.spans)
            self.gap = max(2 * self.gap, mean, 1e-9)
            spans, self.spans = self.spans, []
            for s in spans:
                self.add(*s)


@dataclass
class PlotData:
    """Everything the figures draw."""

    n: int
    steps: Decimated = field(default_factory=Decimated)
    """step -> the `STEP_FIELDS` of its last record."""
    evals: Decimated = field(default_factory=Decimated)
    """evaluated step -> its `eval/...` fields."""
    initial_eval: dict[str, Any] | None = None
    """The initial weights' `eval/...` fields (`eval.at_start`: the last such event)."""
    oldest_age: bytearray = field(default_factory=bytearray)
    """Per step, 1 + how old its oldest group's weights were (0: no record); 255 caps it."""
    last_step: int = -1
    checkpoints: Decimated = field(default_factory=lambda: Decimated(128))
    """The n-th checkpoint event -> its step."""
    num_checkpoints: int = 0
    resumes: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    """Each launch's `start` event: time, attempt, from_step."""
    t0: float = math.inf
    """The first span's start (Unix s): time 0 of the timeline and ledger."""
    gen: Coalesced = field(default_factory=Coalesced)
    train: Coalesced = field(default_factory=Coalesced)
    close_up: list[dict[str, Any]] = field(default_factory=list)
    """Whole spans around the train span of the step a quarter into the run, first launch."""
    close_up_window: tuple[float, float] | None = None
    ledger: dict[str, list[float]] = field(default_factory=dict)

    def step_series(self, key: str) -> tuple[list[int], list[float]]:
        index = STEP_FIELDS.index(key)
        pairs = [(s, row[index]) for s, row in self.steps.items() if row[index] is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def wall_at(self, steps: list[int]) -> list[float]:
        """The wall time of each of `steps`' records (interpolated between the steps kept)."""
        kept, walls = self.step_series("wall_s")
        if not kept:
            return [0.0] * len(steps)
        return [float(w) for w in np.interp(steps, kept, walls)]


def read_plot_data(
    metrics: Iterable[dict[str, Any]],
    events: Iterable[dict[str, Any]],
    timeline: Iterable[dict[str, Any]],
    n: int,
) -> PlotData:
    """One pass over each record (metrics, then events, then the timeline)."""
    data = PlotData(n)
    for r in metrics:
        t = int(r["step"])
        data.steps.add(t, tuple(r.get(k) for k in STEP_FIELDS))
        if any(key.startswith("eval/") for key in r):  # an evaluated step
            data.evals.add(t, {k: v for k, v in r.items() if k.startswith("eval/")})
        else:  # a step retrained without evaluation: its last record counts
            data.evals.rows.pop(t, None)
        if t >= len(data.oldest_age):
            data.oldest_age.extend(bytes(t + 1 - len(data.oldest_age)))
        data.oldest_age[t] = min(255, 1 + t - int(r["generation_version_min"]))
        data.last_step = max(data.last_step, t)
    last_time = -math.inf
    for e in events:
        name = e.get("event")
        last_time = max(last_time, float(e.get("time", last_time)))
        if name == "checkpoint":  # keyed by their count: one step may be saved twice
            data.checkpoints.add(data.num_checkpoints, int(e["step"]))
            data.num_checkpoints += 1
        elif name == "resume":
            keep = ("attempt", "from_step", "kept_groups", "skipped_ordinals")
            data.resumes.append(
                {k: len(e[k]) if isinstance(e.get(k), list) else e.get(k) for k in keep}
            )
        elif name == "eval" and e.get("version") == 0:
            data.initial_eval = {k: v for k, v in e.items() if k.startswith("eval/")}
        elif name == "start":
            data.starts.append(
                {"time": e["time"], "attempt": e["attempt"], "from_step": e["from_step"]}
            )
    _read_timeline(data, timeline, last_time)
    return data


class Grid:
    """Counts of events at `GRID` times from the first span on, `dt` apart: `at[a][i]` holds
    what attempt index `a` did in ((i-1)·dt, i·dt] (and `i = 0` what came before). When a span
    ends past the last time, `dt` doubles and the bins merge in pairs, which gives exactly the
    counts of the coarser grid: the grid always covers every span."""

    def __init__(self, lo: float, hi: float, num_attempts: int) -> None:
        self.lo, self.dt = lo, max(hi - lo, 1e-3) / (GRID - 1)
        self.series = {name: [[0] * (GRID + 1) for _ in range(num_attempts)] for name in
                       ("trained", "landed", "flying")}  # fmt: skip

    def index(self, t: float) -> int:
        """The first grid time at or after `t` (0 for a time before the first span)."""
        i = max(0, math.ceil((t - self.lo) / self.dt - 1e-9))
        while i > GRID - 1:
            self._coarsen()
            i = max(0, math.ceil((t - self.lo) / self.dt - 1e-9))
        return i

    def _coarsen(self) -> None:
        self.dt *= 2
        for rows in self.series.values():
            for row in rows:
                merged = [row[0]] + [row[2 * j - 1] + row[2 * j] for j in range(1, GRID // 2 + 1)]
                row[:] = merged + [0] * (GRID + 1 - len(merged))


def _read_timeline(data: PlotData, timeline: Iterable[dict[str, Any]], last_time: float) -> None:
    """The whole-run rows, the close-up and the ledger grid, in one pass over the spans."""
    starts = sorted(data.starts, key=lambda e: e["time"])
    attempts = {e["attempt"]: i for i, e in enumerate(starts)}
    grid: Grid | None = None
    middle_step = data.last_step // 4
    recent: deque[dict[str, Any]] = deque(maxlen=64)
    first_train_s: list[float] = []
    for span in timeline:
        kind, start, seconds = span.get("kind"), float(span["start"]), float(span["seconds"])
        if kind not in ("generate", "train"):
            continue
        data.t0 = min(data.t0, start)
        if grid is None:  # from the first span to the last event, to begin with
            grid = Grid(start, last_time, len(starts))
        (data.gen if kind == "generate" else data.train).add(start, seconds)
        a = attempts.get(span.get("attempt", -1))
        if a is not None:
            end = grid.index(start + seconds)
            if kind == "train":
                grid.series["trained"][a][end] += 1
            else:
                landed = span["landed"] if "landed" in span else span["ordinals"]
                grid.series["landed"][a][end] += len(landed)
                begin = grid.index(start)
                if begin < end:  # in flight at the grid times in [start, end)
                    grid.series["flying"][a][begin] += len(span["ordinals"])
                    grid.series["flying"][a][end] -= len(span["ordinals"])
        _close_up(data, span, middle_step, recent, first_train_s)
    if data.close_up_window is None and recent:  # the first launch never got that far
        data.close_up = list(recent)
        data.close_up_window = (
            min(s["start"] for s in recent),
            max(s["start"] + s["seconds"] for s in recent),
        )
    if grid is not None:
        data.ledger = _ledger_series(data, starts, grid)


def _close_up(
    data: PlotData,
    span: dict[str, Any],
    middle_step: int,
    recent: deque[dict[str, Any]],
    first_train_s: list[float],
) -> None:
    """Keeps the spans within three mean train spans (of the first launch, up to the middle)
    of the middle step's train span: the close-up of a few steps."""
    window = data.close_up_window
    if window is not None and (window[1] < span["start"] or len(data.close_up) >= 1000):
        return  # past the close-up
    first_attempt = data.starts[0]["attempt"] if data.starts else 0
    slim = {"kind": span["kind"], "start": span["start"], "seconds": span["seconds"]}
    if window is None:
        recent.append(slim)
        if span["kind"] != "train" or span.get("attempt") != first_attempt:
            return
        first_train_s.append(float(span["seconds"]))
        if span.get("step") != middle_step:
            return
        middle = float(span["start"])
        width = 6 * max(sum(first_train_s) / len(first_train_s), 1e-3)
        data.close_up_window = (middle - width / 2, middle + width / 2)
        lo = middle - width / 2
        data.close_up = [s for s in recent if s["start"] + s["seconds"] >= lo]
    else:
        data.close_up.append(slim)


def _ledger_series(
    data: PlotData, starts: list[dict[str, Any]], grid: Grid
) -> dict[str, list[float]]:
    """Ordinal counts at the grid times: trained (steps of the current launch's lineage, so
    a resume from an older checkpoint drops back), buffered, in flight (generation batches
    running), pending (the rest of the run's final schedule) and skipped (cumulative, from
    lossy resumes). The launch at a grid time is the last one started by then (the first
    before any)."""
    keys = ("time", "trained", "buffered", "in_flight", "pending", "skipped")
    out: dict[str, list[float]] = {k: [] for k in keys}
    if not starts:
        return out
    n = data.n
    resumes = {e["attempt"]: e for e in data.resumes}
    frontier = (data.last_step + 1) * n
    sums = [[0, 0, 0] for _ in starts]  # running trained spans, landed groups, in flight
    trained_at, landed_at, flying = (grid.series[k] for k in ("trained", "landed", "flying"))
    launch = 0
    for g in range(GRID):
        now = grid.lo + g * grid.dt
        while launch + 1 < len(starts) and starts[launch + 1]["time"] <= now:
            launch += 1
        for a in range(len(starts)):
            sums[a][0] += trained_at[a][g]
            sums[a][1] += landed_at[a][g]
            sums[a][2] += flying[a][g]
        attempt = starts[launch]["attempt"]
        base = starts[launch]["from_step"] * n
        kept = resumes[attempt]["kept_groups"] if attempt in resumes else 0
        trained = base + n * sums[launch][0]
        buffered = max(0, kept + sums[launch][1] - (trained - base))
        in_flight = sums[launch][2]
        out["time"].append(now - data.t0)
        out["trained"].append(trained)
        out["buffered"].append(buffered)
        out["in_flight"].append(in_flight)
        out["pending"].append(max(0, frontier - trained - buffered - in_flight))
        out["skipped"].append(
            sum(e["skipped_ordinals"] or 0 for a, e in resumes.items() if a <= attempt)
        )
    return out
