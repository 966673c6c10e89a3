"""The vLLM engines' requests (`asyncrl/rollout/jobs.py`), the servers' config, what a killed
launch left (`asyncrl/rollout/servers.py`'s `stop_stale`) and what an attached server must be
(`attach_problems`): plain data, hand-counted, and real processes standing in for servers (no
vLLM)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from helpers import process_gone, small_config

from asyncrl.config import ConfigError
from asyncrl.config.engines import url_problem
from asyncrl.core.seeds import continued_seed
from asyncrl.faults import parse
from asyncrl.rollout.engine import GenerationRequest
from asyncrl.rollout.jobs import (
    Job,
    assemble_output,
    continue_job,
    merge_pieces,
    plan_jobs,
    sample_ended,
)
from asyncrl.rollout.lifeline import start_time
from asyncrl.rollout.server_attach import attach_problems
from asyncrl.rollout.servers import MARK, RECORD, stop_stale


def test_a_fresh_request_is_one_job_and_continued_samples_one_each():
    fresh = GenerationRequest([5, 6], 3, noise_seed=11)
    cont = GenerationRequest([7], 3, noise_seed=12, prefixes=((1, 2), (), (3,)),
                             finished=(False, False, True))  # fmt: skip
    jobs, done = plan_jobs([fresh, cont], max_new_tokens=4, max_tokens=None)
    assert jobs[0] == Job(0, (0, 1, 2), (5, 6), (), 11, 4, 11, 4)
    assert [j.samples for j in jobs[1:]] == [(0,), (1,)]  # sample 2 finished: no job
    assert jobs[1].prompt == [7, 1, 2] and jobs[1].max_tokens == 2  # 4 - 2 so far
    assert jobs[1].seed == continued_seed(12, 0, 2)
    assert jobs[2].prompt == [7] and jobs[2].seed == continued_seed(12, 1, 0)
    assert done == [[False] * 3, [False, False, True]]
    chunk, _ = plan_jobs([fresh, cont], max_new_tokens=4, max_tokens=1)
    assert [j.max_tokens for j in chunk] == [1, 1, 1]


def test_an_episode_turn_ends_each_sample_at_its_own_limit():
    """Turn limits (`GenerationRequest.limits`, the length with the prefix at which the turn
    ends): each sample's budget is its limit less its episode so far, capped by max_new_tokens
    and by a chunk; a sample at its limit gets no job; it ends (finished) at its limit."""
    first = GenerationRequest([5], 2, noise_seed=3, limits=(6, 6))  # a first turn, one limit
    later = GenerationRequest([5], 3, noise_seed=4, prefixes=((1, 2, 9, 9), (1,), (1, 2, 3)),
                              limits=(7, 5, 3))  # fmt: skip
    jobs, done = plan_jobs([first, later], max_new_tokens=8, max_tokens=None)
    assert [(j.samples, j.max_tokens, j.end) for j in jobs] == [
        ((0, 1), 6, 6),
        ((0,), 3, 7),  # 7 - 4 so far
        ((1,), 4, 5),
    ]
    assert done == [[False, False], [False, False, True]]  # sample 2 is at its limit
    assert sample_ended([4, 4, 4], 4, eos_id=2, end=jobs[1].end)  # its limit: finished
    assert not sample_ended([4, 4], 4, eos_id=2, end=jobs[1].end)
    assert sample_ended([2], 4, eos_id=2, end=jobs[1].end)  # EOS: its turn ends sooner
    # first turns with different limits: one job each, seeded as continued from nothing
    mixed = GenerationRequest([5], 2, noise_seed=3, limits=(2, 9))
    jobs, _ = plan_jobs([mixed], max_new_tokens=8, max_tokens=1)
    assert [(j.samples, j.max_tokens, j.end) for j in jobs] == [((0,), 1, 2), ((1,), 1, 8)]
    assert jobs[1].seed == continued_seed(3, 1, 0)
    # broken mid-turn, a job continues to the same end
    jobs, _ = plan_jobs([mixed], max_new_tokens=8, max_tokens=None)
    (rest,) = continue_job(jobs[1], {1: ([4], [-0.1], False)})
    assert (rest.prefix, rest.max_tokens, rest.end) == ((4,), 7, 8)


def test_a_broken_job_continues_each_unfinished_sample_from_its_last_received_token():
    """The tokens that arrived are the continued jobs' prefixes (never asked for again), each
    seeded as a partial generation cut there, with the rest of the budget; ended samples and
    samples at their budget get no job."""
    job = Job(3, (0, 1, 2, 3), (9, 9), (), 40, 6, 40, 6)
    received = {0: ([1, 2], [-0.1, -0.2], False), 1: ([4], [-0.4], True),
                3: ([1] * 6, [-0.5] * 6, False)}  # fmt: skip
    rest = continue_job(job, received)
    assert [(j.samples, j.prefix, j.max_tokens) for j in rest] == [
        ((0,), (1, 2), 4),
        ((2,), (), 6),  # nothing arrived: it starts over, at its first token's seed
    ]
    assert rest[0].seed == continued_seed(40, 0, 2) and rest[0].prompt == [9, 9, 1, 2]
    assert rest[1].seed == continued_seed(40, 2, 0)
    # a continued job broken again: its prefix grows, its budget shrinks
    again = continue_job(rest[0], {0: ([5], [-0.6], False)})
    assert again[0].prefix == (1, 2, 5) and again[0].max_tokens == 3
    assert again[0].seed == continued_seed(40, 0, 3)


def test_pieces_merge_in_order_into_one_padded_output():
    first = ([1, 2], [-0.1, -0.2], False)
    merged = merge_pieces(first, ([3], [-0.3], True))
    assert merged == ([1, 2, 3], [-0.1, -0.2, -0.3], True)
    request = GenerationRequest([0], 2, noise_seed=1)
    out = assemble_output(request, {0: merged}, [False, True], 4, pad_id=0)
    assert out.completion_ids.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert out.completion_mask.tolist() == [[True] * 3, [False] * 3]
    assert out.finished.tolist() == [True, True] and out.weights_version == 4


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:8000", ""),
        ("https://node7:443/v1", ""),
        ("127.0.0.1:8000", "an http://HOST:PORT URL"),
        ("http://node7", "with its port"),
        ("http://node7:99999", "Port out of range"),
        ("http://node7:80/generate", "no path but /v1"),
    ],
)
def test_server_urls_are_checked_naming_what_is_wrong(url, problem):
    assert (problem in url_problem(url)) and (bool(problem) == bool(url_problem(url)))


def test_the_servers_config_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.servers\.urls: got 'localhost:1'"):
        small_config("rollout.engine=vllm_server", "rollout.servers.urls=localhost:1")
    with pytest.raises(ConfigError, match=r"rollout\.servers\.launch: got 0"):
        small_config("rollout.engine=vllm_server")
    with pytest.raises(ConfigError, match=r"rollout\.servers\.launch: got 2"):
        small_config("rollout.engine=vllm_server", "rollout.servers.launch=2",
                     "rollout.servers.urls=http://127.0.0.1:8000")  # fmt: skip
    with pytest.raises(ConfigError, match=r"rollout\.backend: got 'ray'"):
        small_config("rollout.engine=vllm_server", "rollout.servers.launch=1",
                     "rollout.backend=ray")  # fmt: skip
    config = small_config(
        "rollout.engine=vllm_server", "rollout.servers.urls=http://a:1,http://b:2"
    )
    assert config.rollout.servers.urls == ["http://a:1", "http://b:2"]


def test_server_fault_specs_name_their_variable():
    (stage,) = parse("server.tokens_received[server=1]:20", "ASYNCRL_SERVER_FAULT")
    assert (stage.point, stage.conditions, stage.count) == ("server.tokens_received",
                                                             (("server", 1),), 20)  # fmt: skip
    with pytest.raises(ValueError, match=r"ASYNCRL_SERVER_FAULT: server\.tokens_received knows"):
        parse("server.tokens_received[step=1]", "ASYNCRL_SERVER_FAULT")


def _group(*argv: str) -> subprocess.Popen[bytes]:
    """A process group of a shell and a sleeper, the shell's command line holding `argv`."""
    return subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60; :", *argv], start_new_session=True)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_killed_launchs_servers_are_stopped_at_the_next_and_nothing_else(tmp_path):
    """`launched.json` names the process groups a launch started, with each leader's start
    time; the next launch kills each group whose leader is still that process (the whole
    group: its engine and worker with it), and leaves alone a recorded pid that is now another
    process (pids are reused: its start time differs)."""
    server = _group(MARK, "--port", "1")
    other = _group("not-a-server")
    try:
        for proc in (server, other):
            for _ in range(200):
                if len(_children(proc.pid)) == 3:  # the shell and its two sleepers
                    break
                time.sleep(0.05)
        members = _children(server.pid)
        assert len(members) == 3
        started = [start_time(server.pid), start_time(other.pid)]
        assert all(started)
        rows = [{"index": 0, "pid": server.pid, "started": started[0], "url": "x"},
                {"index": 1, "pid": other.pid, "started": started[1] + 1, "url": "y"}]  # fmt: skip
        (tmp_path / RECORD).write_text(json.dumps(rows))
        assert stop_stale(tmp_path) == [server.pid]
        assert all(process_gone(pid, 10) for pid in members)  # the whole group
        assert other.poll() is None  # the pid of another process now: left alone
        assert not (tmp_path / RECORD).exists()
        assert stop_stale(tmp_path) == []  # nothing recorded: nothing to do
    finally:
        for proc in (server, other):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SERVED = {"model": "/models/m", "dtype": "torch.float32", "logprobs_mode": "processed_logprobs"}
INFO = {"vllm_config": {"model_config": SERVED, "lora_config": None}, "vllm_env": {}}
OURS = {"architectures": ["LlamaForCausalLM"], "vocab_size": 15, "hidden_size": 128,
        "num_hidden_layers": 2, "num_key_value_heads": 4}  # fmt: skip


def info(**model_config):
    return {**INFO, "vllm_config": {"model_config": {**SERVED, **model_config}}}


def test_an_attached_server_of_this_runs_model_dtype_and_log_probs_is_taken():
    assert attach_problems(INFO, dict(OURS), OURS, "float32") == []
    # a model this machine cannot read: only what the server says is checked
    assert attach_problems(INFO, None, OURS, "float32") == []
    # fields one side lacks are not compared
    assert attach_problems(INFO, {"vocab_size": 15, "rope_theta": 1.0}, OURS, "float32") == []
    # a LoRA run: LoRA on, of a rank that holds the adapters, loadable at run time
    lora = {"vllm_config": {"model_config": SERVED, "lora_config": {"max_lora_rank": 16}},
            "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}}  # fmt: skip
    assert attach_problems(lora, None, OURS, "float32", lora_rank=8) == []


def test_an_attached_server_of_another_model_dtype_or_log_probs_is_refused_naming_each():
    other = {**OURS, "vocab_size": 49152, "num_hidden_layers": 30}
    problems = attach_problems(INFO, other, OURS, "float32")
    assert len(problems) == 2
    assert "vocab_size 49152, this run's 15" in problems[0]
    assert "num_hidden_layers 30, this run's 2" in problems[1]
    raw = info(logprobs_mode="raw_logprobs", dtype="torch.bfloat16")
    problems = attach_problems(raw, None, OURS, "float32")
    assert "--logprobs-mode processed_logprobs" in problems[0] and "raw_logprobs" in problems[0]
    assert "--dtype float32" in problems[1] and "rollout.dtype=bfloat16" in problems[1]
    # a LoRA run on a server without LoRA, or of too small a rank, or without run-time loads
    problems = attach_problems(INFO, None, OURS, "float32", lora_rank=8)
    assert "--enable-lora --max-lora-rank 8" in problems[0]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in problems[1]
    small = {"vllm_config": {"model_config": SERVED, "lora_config": {"max_lora_rank": 4}},
             "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}  # fmt: skip
    (problem,) = attach_problems(small, None, OURS, "float32", lora_rank=8)
    assert "(it has 4)" in problem
