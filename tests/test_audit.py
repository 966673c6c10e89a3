"""`asyncrl audit` on hand-written records: it passes a clean history and names the ordinals
of every kind of violation."""

from asyncrl.cli.audit import audit_records

N = 2


def step(t: int, ordinals: list[int], attempt: int = 0) -> dict:
    return {"step": t, "attempt": attempt, "prompt_ordinals": ordinals}


def gen(ordinals: list[int], attempt: int) -> dict:
    return {"kind": "generate", "attempt": attempt, "ordinals": ordinals}


def test_a_clean_history_with_a_retrained_step_passes():
    metrics = [step(0, [0, 1]), step(1, [2, 3]), step(1, [2, 3], attempt=1), step(2, [4, 5], 1)]
    report = audit_records(metrics, [], [], N)
    assert report.ok and report.num_steps == 3 and report.num_ordinals == 6


def test_skipped_ordinals_and_a_broken_schedule_are_named():
    metrics = [step(0, [0, 1]), step(1, [4, 5]), step(2, [6, 7])]
    report = audit_records(metrics, [], [], N)
    assert report.violations[0] == "I3: 2 ordinals below the frontier never trained: 2-3"
    assert "I1: step 1 trained ordinals [4-5], schedule says [2-3]" in report.violations


def test_an_ordinal_trained_twice_and_a_missing_step_are_named():
    metrics = [step(0, [0, 1]), step(2, [1, 5])]
    report = audit_records(metrics, [], [], N)
    assert "I1: steps never trained: 1" in report.violations
    assert "I3: ordinal 1 trained by steps [0, 2]" in report.violations


def resume_event(kept: list[int], reissued: list[int]) -> dict:
    return {
        "event": "resume", "attempt": 1, "from_step": 1, "cursor": 6,
        "kept_groups": kept, "reissued_ordinals": reissued,
    }  # fmt: skip


def test_after_a_resume_only_the_reissued_ordinals_may_be_generated_again():
    metrics = [step(0, [0, 1]), step(1, [2, 3], attempt=1), step(2, [4, 5], attempt=1)]
    before = [gen([0, 1, 2, 3, 4, 5], attempt=0)]
    resume = resume_event(kept=[2, 3, 4], reissued=[5])
    assert audit_records(metrics, [resume], [*before, gen([5, 6, 7], attempt=1)], N).ok
    report = audit_records(metrics, [resume], [*before, gen([3, 5], attempt=1)], N)
    assert report.violations == [
        "I3: attempt 1 generated kept buffered groups from step 1's checkpoint again: 3"
    ]
    report = audit_records(metrics, [resume], [*before, gen([1, 5], attempt=1)], N)
    assert report.violations == [
        "I3: attempt 1 generated ordinals from step 1's checkpoint again: 1"
    ]


def test_a_record_appended_after_a_torn_last_line_is_not_lost(tmp_path):
    from asyncrl.train.records import JsonlLog, read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "loss": 0.')  # SIGKILLed mid-write
    log = JsonlLog(path)
    log.write({"step": 1, "loss": 0.5})
    log.close()
    assert read_jsonl(path) == [{"step": 0}, {"step": 1, "loss": 0.5}]


def test_a_damaged_record_fails_the_audit_naming_its_line_and_a_torn_last_line_does_not(
    tmp_path,
):
    """A damaged `resume` line used to be dropped silently, and with it that resume's I3
    check: the audit passed. Only a torn last line (a kill mid-write) is tolerated."""
    from helpers import small_config

    from asyncrl.cli.audit import audit_run_dir
    from asyncrl.train.trainer import train

    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    train(small_config("run.max_num_steps=4"), run)  # a resume
    assert audit_run_dir(run).ok
    events = run / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    (number,) = [i for i, line in enumerate(lines, start=1) if '"event":"resume"' in line]
    torn = events.read_text() + '{"event":"sig'  # a kill mid-write: tolerated
    events.write_text(torn)
    assert audit_run_dir(run).ok
    lines[number - 1] = lines[number - 1].replace('"kept_groups"', '"kept_groups', 1)
    events.write_text("".join(lines))
    report = audit_run_dir(run)
    assert not report.ok
    assert report.violations[0].startswith(f"damaged record: events.jsonl:{number}: not a JSON")


def test_a_log_reopened_after_a_kill_mid_write_drops_the_torn_record(tmp_path):
    from asyncrl.train.records import JsonlLog, read_jsonl_checked

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":0}\n{"step":1,"lo')  # killed while writing step 1
    log = JsonlLog(path)
    log.write({"step": 1})
    log.close()
    assert path.read_text() == '{"step":0}\n{"step":1}\n'
    assert read_jsonl_checked(path) == ([{"step": 0}, {"step": 1}], [])
    path.write_text('{"step":0}\n{"step":1}')  # whole, killed before its newline: kept
    JsonlLog(path).close()
    assert path.read_text() == '{"step":0}\n{"step":1}\n'
    # a run dir written before relaunches cut torn records off: one ended by a newline
    path.write_text('{"step":0}\n{"step":1,"lo\n{"step":1}\n')
    assert read_jsonl_checked(path) == ([{"step": 0}, {"step": 1}], [])


def test_a_record_with_nan_or_infinity_is_read_not_called_damaged(tmp_path):
    """`json.dumps` writes NaN and Infinity (a metric can overflow: `offpolicy_kl`); the fast
    reader (orjson) rejects them, so the line is read again with `json` instead of being
    reported as damaged (and the step as never trained)."""
    from asyncrl.train.records import iter_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "offpolicy_kl": Infinity, "loss": NaN}\n{"step": 1}\n')
    problems: list[str] = []
    records = list(iter_jsonl(path, problems))
    assert problems == [] and [r["step"] for r in records] == [0, 1]
    assert records[0]["offpolicy_kl"] == float("inf")


def test_two_resumes_of_one_attempt_are_both_checked():
    """A kill between a resume's event and the launch count's update makes the next launch
    reuse the attempt: both resumes' checks apply to that attempt's spans."""
    metrics = [step(0, [0, 1]), step(1, [2, 3], attempt=1), step(2, [4, 5], attempt=1)]
    first = {**resume_event(kept=[2, 3], reissued=[4, 5]), "cursor": 6}
    second = {**resume_event(kept=[4], reissued=[5]), "cursor": 6}
    report = audit_records(metrics, [first, second], [gen([4, 5], attempt=1)], N)
    assert report.violations == [
        "I3: attempt 1 generated kept buffered groups from step 1's checkpoint again: 4"
    ]


def test_a_resume_record_torn_mid_file_fails_the_audit_of_a_run_dir_of_this_version(tmp_path):
    """Issue 44: a `resume` record cut in half mid-file was taken for a line an old relaunch
    left, the resume dropped from the audit: "0 resumes: I1 ok, I3 ok". A run dir whose
    run.json says `records: 2` (this version cuts torn lines at each relaunch) tolerates a torn
    last line only; one of an older version (no `records`) keeps the old tolerance."""
    import json

    from helpers import small_config

    from asyncrl.cli.audit import audit_run_dir
    from asyncrl.train.trainer import train

    run = tmp_path / "run"
    train(small_config("run.max_num_steps=2"), run)
    train(small_config("run.max_num_steps=4"), run)  # a resume
    assert json.loads((run / "run.json").read_text())["records"] == 2
    events = run / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    (number,) = [i for i, line in enumerate(lines, start=1) if '"event":"resume"' in line]
    whole = "".join(lines)
    events.write_text(whole + '{"event":"sig')  # a torn last line: tolerated
    assert audit_run_dir(run).ok
    lines[number - 1] = lines[number - 1][: len(lines[number - 1]) // 2] + "\n"  # torn mid-file
    events.write_text("".join(lines))
    report = audit_run_dir(run)
    assert not report.ok and report.num_resumes == 0
    assert report.violations[0].startswith(f"damaged record: events.jsonl:{number}:")
    record = json.loads((run / "run.json").read_text())
    del record["records"]  # as an older version wrote it
    (run / "run.json").write_text(json.dumps(record))
    assert audit_run_dir(run).ok  # the old tolerance, for old run dirs
    train(small_config("run.max_num_steps=5"), run)  # resumed by this version: stays old
    assert "records" not in json.loads((run / "run.json").read_text())
