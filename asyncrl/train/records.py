"""What a run writes as it goes: JSON-lines files, and optional TensorBoard scalars and
experiment trackers (`asyncrl.train.trackers`).

Each line is flushed when written, so a killed run leaves every completed record on disk.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from asyncrl.algos.grpo import varied_groups
from asyncrl.checkpoint.torn import end_torn_line, is_torn
from asyncrl.config import LoggingConfig
from asyncrl.core.types import Group
from asyncrl.train.trackers import MlflowSink, WandbSink

if TYPE_CHECKING:
    from asyncrl.core.resume import ResumePlan
    from asyncrl.rollout.collector import Chunk


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLog:
    """Appends one JSON object per line; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        end_torn_line(path)  # a kill mid-write left a partial record: it never was one
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return  # a straggling writer after the run ended (e.g. an abandoned batch)
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class EventLog(JsonlLog):
    """`events.jsonl`: each event is `{"event": NAME, "time": unix_s, ...fields}`."""

    def emit(self, event: str, **fields: Any) -> None:
        self.write({"event": event, "time": time.time(), **fields})


class TensorBoardSink:
    """Every numeric field of a step record as a scalar, tagged by name, x = step."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._writer.add_scalar(key, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Reads a JSON-lines file; a torn last line (from a kill mid-write) is ignored, and so is
    any other undecodable line (`read_jsonl_checked` names those)."""
    return list(iter_jsonl(path))


def read_jsonl_checked(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a JSON-lines file, and the problems `iter_jsonl` finds in it."""
    problems: list[str] = []
    return list(iter_jsonl(path, problems)), problems


def iter_jsonl(
    path: Path, problems: list[str] | None = None, torn_last_only: bool = False
) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, one line in memory at a time. Appends to `problems`
    a `FILE:LINE: ...` for every line that is not a JSON object, except a torn one (a record
    cut short by a kill mid-write: the last line, or, in a run dir written before relaunches
    cut them off, a line a relaunch ended; with `torn_last_only`, as in a run dir whose
    `run.json` says `records: 2`, only the last). Lines are counted from 1. No file: no
    records."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)  # ~5x the standard library's json (a pass is O(run))
            except orjson.JSONDecodeError:  # also NaN and Infinity, which `json.dumps` writes
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    _problem(path, number, raw, err, problems, torn_last_only)
                    continue
            if isinstance(record, dict):
                yield record
            elif problems is not None:
                problems.append(f"{path.name}:{number}: not a JSON object")


def _problem(
    path: Path,
    number: int,
    raw: bytes,
    err: Exception,
    problems: list[str] | None,
    torn_last_only: bool = False,
) -> None:
    """Notes an undecodable line, unless it is torn (see `iter_jsonl`)."""
    last_and_torn = not raw.endswith(b"\n")  # only the last line can lack one
    torn_mid_file = not torn_last_only and is_torn(raw.rstrip(b"\n"))
    if problems is not None and not last_and_torn and not torn_mid_file:
        problems.append(f"{path.name}:{number}: not a JSON record ({err})")


def latest_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The record that counts for each step: the last one written (a step retrained after a
    resume appears again with a higher attempt), ordered by step."""
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


_UNIX_OFFSET_S = time.time() - time.perf_counter()


def wall_before(run_dir: Path, step: int) -> float:
    """Wall seconds a run had spent before `step`, so that `wall_s` keeps counting across
    attempts: the `wall_s` of the last step record before it in `metrics.jsonl` (0 at step 0)."""
    if not step:
        return 0.0
    walls = {r["step"]: r["wall_s"] for r in iter_jsonl(run_dir / "metrics.jsonl")}
    return max((w for t, w in walls.items() if t < step), default=0.0)


def unix_time(perf_s: float) -> float:
    """The wall-clock time of a `time.perf_counter()` reading, through one offset fixed per
    process: spans of one launch keep perf_counter's exact order (no jitter from reading two
    clocks per span), and spans of different launches share the Unix clock."""
    return perf_s + _UNIX_OFFSET_S


def generation_span(chunk: Chunk, attempt: int) -> dict[str, Any]:
    """The `timeline.jsonl` row of a batch's consecutive engine passes over the same tickets
    with the same weights (`chunks` of them): per ticket and sample its first new token and
    how many it got."""
    return {
        "kind": "generate",
        "start": unix_time(chunk.start),
        "seconds": chunk.seconds,
        "chunks": chunk.chunks,
        "version": chunk.version,
        "attempt": attempt,
        "ordinals": [t.ordinal for t in chunk.tickets],
        "targets": [t.target_step for t in chunk.tickets],
        # omitted when every sample starts at its first token (a batch not continued)
        **({"token_starts": chunk.token_starts} if any(map(any, chunk.token_starts)) else {}),
        "token_counts": chunk.token_counts,
        "landed": chunk.landed,
    }


def span_token_starts(span: dict[str, Any]) -> list[list[int]]:
    """A `generate` row's token starts per ticket and sample (zeros where it omits them)."""
    if "token_starts" in span:
        return span["token_starts"]
    return [[0] * len(counts) for counts in span.get("token_counts", [])]


def plan_fields(
    plan: ResumePlan, continued: dict[int, tuple[list[int], list[bool]]], episodes: bool = False
) -> dict[str, Any]:
    """The `resume` event's account of a resume plan: what was kept, redone, skipped (and for
    multi-turn episodes, `env.name`: turns kept and regenerated, environment steps repeated)."""
    turns = {
        "turns_kept": plan.turns_kept,
        "turns_regenerated": plan.turns_regenerated,
        "turns_recovered": plan.turns_recovered,
        "tool_calls_repeated": plan.tool_calls_repeated,
        "tokens_regenerated": plan.regenerated_tokens,
    }
    return {
        **(turns if episodes else {}),
        "policy": plan.policy,
        "kept_groups": plan.kept,
        "reissued_ordinals": [k for k, _ in plan.redispatched],
        "skipped_ordinals": plan.skipped,
        "discarded_groups": plan.discarded,
        "refilled_targets": plan.fills,
        "kept_tokens": plan.kept_tokens,
        "regenerated_tokens": plan.regenerated_tokens,
        "continued_partials": {
            str(k): {"lengths": lengths, "finished": finished}
            for k, (lengths, finished) in sorted(continued.items())
            if k in plan.continued  # lossless, and an environment that can come back
        },
    }


def resume_line(step: int, attempt: int, plan: ResumePlan) -> str:
    return (
        f"asyncrl: resumed at step {step} (attempt {attempt}, {plan.policy}): kept "
        f"{len(plan.kept)} buffered groups, re-dispatched {len(plan.redispatched)} in-flight "
        f"prompts, skipped {len(plan.skipped)} prompts, discarded {len(plan.discarded)} "
        f"finished groups; generated tokens kept {plan.kept_tokens}, to regenerate "
        f"{plan.regenerated_tokens}"
    )


def tokens_digest(groups: list[Group]) -> str:
    """SHA-256 (first 16 hex digits) of the step's sampled tokens, in ordinal order: equal
    digests mean the same completions were trained (with segments, `row_samples` too: the
    same rows given to other samples would train other advantages)."""
    digest = hashlib.sha256()
    for group in groups:
        digest.update(group.completion_ids.numpy().tobytes())
        digest.update(group.completion_mask.numpy().tobytes())
        if group.loss_mask is not None:
            digest.update(group.loss_mask.numpy().tobytes())
        if group.row_samples is not None:
            digest.update(group.row_samples.numpy().tobytes())
    return digest.hexdigest()[:16]


def step_record(
    step: int, attempt: int, groups: list[Group], metrics: dict[str, float]
) -> dict[str, Any]:
    """The `metrics.jsonl` record of a trained step (DESIGN.md's contract fields first; the
    trainer adds timing, buffer and engine fields): `metrics` are the algorithm's, with
    `loss` and `reward_mean` among them.

    Where samples have segments (`Group.row_samples`), reward fields (`reward_mean`,
    `reward_std`, `reward/NAME`, `zero_variance_groups`, `skipped_ordinals`) count each sample
    once, and token fields (`num_tokens`, `completion_len`, `token_staleness_mean`,
    `trained_rows`) count rows and their trained tokens, each segment a row."""
    rest = dict(metrics)
    return {
        "step": step,
        "attempt": attempt,
        "prompt_ordinals": [g.ordinal for g in groups],
        "dataset_indices": [g.ticket.dataset_index for g in groups],
        "reward_mean": rest.pop("reward_mean"),
        "loss": rest.pop("loss"),
        "generation_version_min": min(g.version_min for g in groups),
        "generation_version_max": max(g.version_max for g in groups),
        "generation_s": sum(g.generation_s for g in groups),
        "tokens_sha256": tokens_digest(groups),
        "token_staleness_mean": token_staleness(step, groups),
        "mixed_version_groups": sum(1 for g in groups if g.version_min != g.version_max),
        **reward_components(groups),
        **skipped_ordinals(groups, rest),
        **rest,
    }


def skipped_ordinals(groups: list[Group], metrics: dict[str, float]) -> dict[str, list[int]]:
    """`skipped_ordinals`: with `algo.skip_zero_variance_groups` (the algorithm then reports
    `trained_rows`), the groups its passes left out, those whose rewards are all equal."""
    if "trained_rows" not in metrics:
        return {}
    left_out = [g.ordinal for g in groups if not bool(varied_groups(g.rewards.reshape(1, -1)))]
    return {"skipped_ordinals": left_out}


def reward_components(groups: list[Group]) -> dict[str, float]:
    """`reward/NAME`: the mean of each named reward component over the step's samples that
    have it, one value per sample whatever its rows (none when the reward function returns
    plain numbers)."""
    totals: dict[str, list[float]] = {}
    for g in groups:
        for name, values in g.reward_components.items():
            sums = totals.setdefault(name, [0.0, 0])
            sums[0] += float(values.sum())
            sums[1] += values.numel()
    return {f"reward/{name}": total / count for name, (total, count) in sorted(totals.items())}


def token_staleness(step: int, groups: list[Group]) -> float:
    """Mean over the step's generated tokens of (step - the weights version that sampled
    the token): with mid-generation weight updates, lower than the groups' oldest version
    says."""
    total, count = 0, 0
    for g in groups:
        if g.token_versions is None:
            n = int(g.policy_mask.sum())
            total, count = total + n * (step - g.version_max), count + n
        else:
            used = g.token_versions[g.policy_mask]
            total, count = total + int((step - used).sum()), count + used.numel()
    return total / max(count, 1)


class RunLogs:
    """The run's append-only logs: `events.jsonl`, `metrics.jsonl` (plus TensorBoard, W&B and
    MLflow if asked for: `logging.*`) and `timeline.jsonl`. Opened together, closed together
    (also when a launch fails before training starts). `config` is `Config.to_dict()`, which
    the trackers record with their runs."""

    def __init__(
        self, run_dir: Path, logging: LoggingConfig, config: dict[str, Any] | None = None
    ) -> None:
        self.tracker_failures = 0
        opened: list[JsonlLog | MetricsSink] = []
        try:
            self.events = EventLog(run_dir / "events.jsonl")
            opened.append(self.events)
            self.metrics = JsonlLog(run_dir / "metrics.jsonl")
            opened.append(self.metrics)
            self.timeline = JsonlLog(run_dir / "timeline.jsonl")
            opened.append(self.timeline)
            self.sinks: list[MetricsSink] = [self.metrics]
            for wanted, make in (
                (logging.tensorboard, lambda: TensorBoardSink(run_dir / "tensorboard")),
                (logging.wandb, lambda: WandbSink(run_dir, logging, config or {})),
                (logging.mlflow, lambda: MlflowSink(run_dir, logging, config or {})),
            ):
                if wanted:
                    sink = make()
                    opened.append(sink)
                    self.sinks.append(sink)
        except BaseException:
            _close_all(opened)
            raise

    def write_step(self, record: dict[str, Any]) -> None:
        """`metrics.jsonl` first (the record of truth: its error stops the run); a tracker that
        fails (a server gone) is reported once and skipped, and training goes on."""
        self.sinks[0].write(record)
        for sink in self.sinks[1:]:
            try:
                sink.write(record)
            except Exception as err:
                self.tracker_failures += 1
                if self.tracker_failures == 1:
                    print(
                        f"asyncrl: {type(sink).__name__} failed to log step {record.get('step')} "
                        f"({err!r}); training goes on, metrics.jsonl keeps every record (each "
                        "failure is a tracker_failure event)"
                    )
                self.events.emit("tracker_failure", sink=type(sink).__name__, error=repr(err))

    def close(self) -> None:
        _close_all([*self.sinks[1:], self.metrics, self.events, self.timeline])


def _close_all(logs: list[Any]) -> None:
    """Closes each of `logs`, even when one fails (a tracker's server gone): the JSON-lines
    files are always closed; the first error is raised after, unless the launch is already
    failing with another (that one says what went wrong)."""
    first: BaseException | None = None
    for log in logs:
        try:
            log.close()
        except Exception as err:
            first = first or err
    if first is not None and sys.exc_info()[0] is None:
        raise first
