"""`rollout.engine=vllm_server` on real vLLM servers (the CPU build `make setup` installs),
launched on 127.0.0.1: log-probs against the trainer's forward pass of the same weights,
weights pushed through vLLM's RL routes, a server SIGKILLed mid-stream and one hung
(SIGSTOP), each placed by state (`server.tokens_received`: the N-th token that arrived from
that server); and whole runs whose trainer is SIGKILLed, relaunched and stopped.

The oracle of "no received token is generated again": the engine counts every token that
arrives on a stream, and every such token must be in the batch's outputs exactly once; a
failover that asked again for what had arrived would receive more tokens than it returns
(the negative control drops what arrived, and is caught)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import launcher
import pytest
import torch
from helpers import DIGITS, new_adapters, process_gone, read_records

from asyncrl import faults
from asyncrl.cli.audit import audit_run_dir
from asyncrl.config import ModelConfig
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.models.policy import load_policy
from asyncrl.rollout import server_stream, vllm_server
from asyncrl.rollout.engine import EngineSpec, GenerationRequest
from asyncrl.rollout.jobs import continue_job
from asyncrl.rollout.server_auth import SECRET_ENV
from asyncrl.rollout.server_leases import RELEASED, parse_tag, write_tag
from asyncrl.rollout.weight_sync import CopyWeightSync

if os.environ.get("CI") != "true":  # CI installs vLLM: there the tests must run, not skip
    pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 12


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(), seed=0, alphabet=DIGITS)


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    weights = CopyWeightSync(max_versions=2)
    weights.publish(0, policy.model.state_dict())
    run_dir = tmp_path_factory.mktemp("servers")
    options = {
        # LoRA enabled, for the LoRA run that attaches to them (its requests alone use it)
        "vllm": {"kv_cache_bytes": 32 << 20, "max_num_seqs": 64, "max_lora_rank": 8},
        "servers": {"launch": 2, "max_restarts": 12, "health_timeout_s": 20.0},
        "run_dir": str(run_dir),
    }
    spec = EngineSpec(policy.model, policy.eos_id, policy.pad_id, MAX_NEW, 0.8,
                      options=options, scratch_dir=str(run_dir / ".scratch"))  # fmt: skip
    engine = vllm_server.VLLMServerEngine(spec, weights)
    yield engine
    pids = [s.process.pid for s in engine.servers if s.process is not None]
    engine.shutdown()
    assert all(process_gone(pid, 30) for pid in pids)


def requests(policy, count=4, samples=4, seed=0):
    prompts = [policy.tokenizer(f"{i}+{i}=", add_special_tokens=False)["input_ids"]
               for i in range(count)]  # fmt: skip
    return [GenerationRequest(p, samples, noise_seed=seed + i) for i, p in enumerate(prompts)]


def logprob_gap(policy, batch, outputs) -> float:
    """The largest |engine - trainer| log-prob over the batch's sampled tokens (the trainer's
    forward pass of the same weights over prompt + the whole completion)."""
    gap = 0.0
    with torch.no_grad():
        for request, output in zip(batch, outputs, strict=True):
            prompt = [list(request.prompt_ids)] * request.num_samples
            full, _ = completion_logprobs(policy.model, prompt, output.completion_ids,
                                          output.completion_mask, 0.8, 0)  # fmt: skip
            diff = (full - output.logprobs)[output.completion_mask].abs()
            gap = max(gap, float(diff.max()) if diff.numel() else 0.0)
    return gap


def received_equals_returned(engine, outputs, before):
    got = engine.metrics()["server_tokens_received"] - before
    returned = sum(int(o.completion_mask.sum()) for o in outputs)
    return got, returned


def test_servers_sample_with_the_trainers_log_probs_and_answer_each_seed_alike(engine, policy):
    """fp32 on both sides: each sampled token's log-prob within 1e-4 of the trainer's
    forward pass of the same weights; a request sent to either server draws the same tokens
    (per-request seeds); both servers got version 0 through the RL routes."""
    batch = requests(policy)
    before = engine.metrics()["server_tokens_received"]
    outputs = engine.generate(batch)
    assert all(s.version == 0 for s in engine.servers)
    got, returned = received_equals_returned(engine, outputs, before)
    assert got == returned > 0
    assert logprob_gap(policy, batch, outputs) <= 1e-4
    # the same request on each server alone: the same tokens
    one = batch[:1]
    alive = list(engine.servers)
    tokens = []
    for server in alive:
        for other in alive:
            other.alive = other is server
        tokens.append(engine.generate(one)[0].completion_ids.tolist())
    for server in alive:
        server.alive = True
    assert tokens[0] == tokens[1]


def test_a_server_killed_mid_stream_hands_its_requests_on_from_the_tokens_received(
    engine, policy, monkeypatch
):
    """Server 0 is SIGKILLed at the 3rd token it streamed, with ~100 samples to generate (far more
    than it sends before this thread reads its 3rd token): its requests continue on server 1
    from the tokens that arrived, and server 0 is restarted. Every token received is returned
    once, each sample within its budget, and each token's log-prob is the trainer's given the
    tokens before it (a continuation that did not start from the received tokens would not
    be: the controls below)."""
    monkeypatch.setattr(faults, "_SERVER_SIGNAL", signal.SIGKILL)
    stages = faults.parse("server.tokens_received[server=0]:3", "ASYNCRL_SERVER_FAULT")
    batch = requests(policy, count=12, samples=8, seed=100)
    # the state: server 0 killed while it still streams. A server that had already sent its
    # all when this thread read its 3rd token dies with nothing to hand on: another batch
    for _attempt in range(3):
        monkeypatch.setattr(faults, "_SERVER_TRIGGER", faults.Trigger(stages))
        pid = engine.servers[0].process.pid
        before = engine.metrics()
        outputs = engine.generate(batch)
        after = engine.metrics()
        for restart in list(engine._restarts):
            restart.join(300)  # the restart, in the background
        if after["server_tokens_kept"] > before["server_tokens_kept"]:
            break
    else:
        pytest.fail("server 0 had sent all its tokens before each of 3 kills")
    assert after["server_failovers"] > before["server_failovers"]
    assert all(bool(o.finished_rows().all()) for o in outputs)  # every sample to its end
    got, returned = received_equals_returned(engine, outputs, before["server_tokens_received"])
    assert got == returned and logprob_gap(policy, batch, outputs) <= 1e-4
    assert all(int(o.completion_mask.sum(dim=1).max()) <= MAX_NEW for o in outputs)
    assert process_gone(pid, 30)
    assert engine.servers[0].alive and engine.servers[0].process.pid != pid


def test_an_episodes_turn_continues_its_tokens_and_stops_at_its_own_limit(engine, policy):
    """A multi-turn episode's next turn on a server: each sample continues its episode's token
    ids (earlier turns and the environment's replies, never re-tokenized), stops at its own
    limit (`GenerationRequest.limits`, the length with the episode so far) or sooner at EOS,
    reported finished (its turn ended), with each token's log-prob the trainer's given the
    whole episode before it."""
    ids = policy.tokenizer
    prompt = ids("3+4=", add_special_tokens=False)["input_ids"]
    prefixes = tuple(tuple(ids(text, add_special_tokens=False)["input_ids"])
                     for text in ("7=1", "2", "45=09"))  # fmt: skip
    limits = (5, 4, 7)  # 2, 3 and 2 tokens more
    request = GenerationRequest(prompt, 3, noise_seed=5, prefixes=prefixes, limits=limits)
    (out,) = engine.generate([request])
    assert bool(out.finished.all())
    for i, prefix in enumerate(prefixes):
        got = out.completion_ids[i][out.completion_mask[i]].tolist()
        room = limits[i] - len(prefix)
        assert len(got) == room or (0 < len(got) < room and got[-1] == policy.eos_id), (i, got)
        with torch.no_grad():
            mask = torch.ones(1, len(got), dtype=torch.bool)
            full, _ = completion_logprobs(policy.model, [prompt + list(prefix)],
                                          torch.tensor([got]), mask, 0.8, 0)  # fmt: skip
        assert float((full[0] - out.logprobs[i, : len(got)]).abs().max()) <= 1e-4


@pytest.mark.parametrize("control", ["", "drops", "starts-over"])
def test_the_oracles_catch_a_failover_that_asks_again_or_ignores_what_arrived(
    engine, policy, monkeypatch, control
):
    """The same hand-on, on a stream that breaks client-side at server 0's 3rd token (a read
    error; the server lives, so no restart): with the engine's failover every oracle holds;
    a failover that drops what arrived (asked for again) receives more than it returns, and
    one that keeps it but continues from the job's start samples tokens whose log-probs are
    not the trainer's given the tokens before them."""
    if control == "drops":
        monkeypatch.setattr(engine, "_hand_on", lambda job, got: ({}, continue_job(job, {})))
    if control == "starts-over":
        monkeypatch.setattr(engine, "_hand_on", lambda job, got: (got, continue_job(job, {})))
    trigger = faults.Trigger(faults.parse("server.tokens_received[server=0]:3", "test"))

    lock = threading.Lock()  # streams are read on several threads

    def read_error(name, send, **facts):
        with lock:
            reached = trigger.passed(name, facts)
        if reached:
            raise httpx.ReadError("the stream broke (test)")

    monkeypatch.setattr(server_stream, "server_fault_point", read_error)
    batch = requests(policy, count=12, samples=8, seed=300)
    before = engine.metrics()
    outputs = engine.generate(batch)
    after = engine.metrics()
    assert after["server_failovers"] == before["server_failovers"] + 1
    assert after["server_tokens_kept"] > before["server_tokens_kept"]
    assert after["server_restarts"] == before["server_restarts"]  # it answered /health
    assert all(bool(o.finished_rows().all()) for o in outputs)
    got, returned = received_equals_returned(engine, outputs, before["server_tokens_received"])
    gap = logprob_gap(policy, batch, outputs)
    if control == "drops":
        assert got > returned  # the dropped tokens were generated again
    elif control == "starts-over":
        assert gap > 1e-3  # tokens sampled without the ones before them
    else:
        assert got == returned and gap <= 1e-4


def test_a_busy_servers_silent_streams_are_kept_while_it_answers_its_health(engine, policy,
                                                                          monkeypatch):  # fmt: skip
    """Server 1 paused (`/pause?mode=keep`: its requests accepted and frozen, its /health
    answering, as a server whose queue is full) until the watchdog, which asks once a second
    while streams are open, has asked its /health six times: its streams are open and silent
    for over twice the health timeout (2 s here), the watchdog asks its /health, and it answers, so
    none is cut or handed on and nothing is restarted; every token arrives once, from the
    server that sampled it, after the resume. (Streams read with the health timeout as their
    read timeout break after 2 s of silence and are handed on: the control, 19 failovers.)"""
    monkeypatch.setattr(engine, "health_timeout", 2.0)
    server = engine.servers[1]
    engine.generate(requests(policy, count=2, samples=1, seed=600))  # both hold the version
    asked = []
    healthy = server.healthy
    monkeypatch.setattr(server, "healthy", lambda timeout: asked.append(1) or healthy(timeout))
    before = engine.metrics()
    server.post("/pause", mode="keep")
    open_at_resume = []

    def resume_once_asked_often():  # by state: its streams silent past two health timeouts
        deadline = time.monotonic() + 120
        while not (server.streams and len(asked) >= 6) and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        open_at_resume.append(len(server.streams))
        server.post("/resume")

    resumer = threading.Thread(target=resume_once_asked_often, daemon=True)
    resumer.start()
    try:
        batch = requests(policy, count=12, samples=8, seed=700)
        outputs = engine.generate(batch)
    finally:
        resumer.join(180)
    after = engine.metrics()
    assert open_at_resume[0] > 0 and len(asked) >= 6  # its streams were open, silent, watched
    assert after["server_failovers"] == before["server_failovers"]
    assert after["server_restarts"] == before["server_restarts"]
    assert all(bool(o.finished_rows().all()) for o in outputs)
    got, returned = received_equals_returned(engine, outputs, before["server_tokens_received"])
    assert got == returned and logprob_gap(policy, batch, outputs) <= 1e-4


def test_hung_servers_are_found_by_their_health_before_their_reply_and_mid_stream(
    engine, policy, monkeypatch
):
    """Two hangs (SIGSTOP), each placed by state, in one batch: server 0 stopped between
    batches, so its requests get no reply at all (their headers must come within the health
    timeout, 3 s here), and server 1 paused and then stopped once its streams are open (silent,
    read without a timeout: the watchdog finds that its /health does not answer and cuts them).
    Both are found dead, killed and restarted, and the batch finishes on their restarts, every
    token received returned once. (A stream without any timeout, before its headers, waited
    forever for a server stopped between batches: `make test` hung on it once.)"""
    monkeypatch.setattr(engine, "health_timeout", 3.0)
    first, second = engine.servers
    engine.generate(requests(policy, count=2, samples=1, seed=800))  # both hold the version
    pids = [first.process.pid, second.process.pid]
    restarts = engine.metrics()["server_restarts"]
    first.signal(signal.SIGSTOP)
    second.post("/pause", mode="keep")
    open_at_stop = []

    def stop_once_streaming():
        while not second.streams:  # by state: its streams open (headers in, no token)
            threading.Event().wait(0.01)
        open_at_stop.append(len(second.streams))
        second.signal(signal.SIGSTOP)

    stopper = threading.Thread(target=stop_once_streaming, daemon=True)
    stopper.start()
    before = engine.metrics()["server_tokens_received"]
    batch = requests(policy, count=12, samples=8, seed=900)
    outputs = engine.generate(batch)
    stopper.join(60)
    for restart in list(engine._restarts):
        restart.join(300)
    assert open_at_stop and open_at_stop[0] > 0
    assert engine.metrics()["server_restarts"] == restarts + 2
    assert all(bool(o.finished_rows().all()) for o in outputs)
    got, returned = received_equals_returned(engine, outputs, before)
    assert got == returned
    assert all(process_gone(pid, 30) for pid in pids)
    assert all(s.alive and s.process.pid not in pids for s in engine.servers)


def release(engine, monkeypatch):
    """The fixture's servers freed for another run (as docs/servers.md says to free a server a
    killed run held), and their secret given to it (`ASYNCRL_SERVER_SECRET`)."""
    for server in engine.servers:
        write_tag(server, RELEASED)
    monkeypatch.setenv(SECRET_ENV, engine._secret)


def test_launched_servers_refuse_every_route_asyncrl_uses_without_the_launchs_secret(engine):
    """vLLM's `--api-key` guards `/v1` alone; the launch's middleware guards the rest, the
    dev-mode routes that change a server's weights among them. The secret is in no server's
    command line (`/proc/PID/cmdline` is every user's to read), and servers listen on
    127.0.0.1 only."""
    routes = [("POST", "/collective_rpc"), ("POST", "/v1/load_lora_adapter"),
              ("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weight_version"),
              ("POST", "/abort_requests"), ("GET", "/server_info"), ("GET", "/is_paused"),
              ("GET", "/weight_info"), ("GET", "/health"), ("GET", "/v1/models"),
              ("POST", "/v1/completions")]  # fmt: skip
    for server in engine.servers:
        assert server.url.startswith("http://127.0.0.1:")
        for method, route in routes:
            bare = httpx.request(method, server.url + route, json={}, timeout=30)
            assert bare.status_code == 401, (route, bare.status_code, bare.text[:200])
        assert server.control.get(server.url + "/weight_info").status_code == 200
        command = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert engine._secret.encode() not in command


def test_a_lora_runs_adapters_reach_attached_servers_per_version_over_its_base_loaded_once(
    engine, tmp_path, monkeypatch
):
    """`rollout.vllm.lora_requests` on servers (this file's two, attached by URL): each gets
    the run's frozen base once (`reload_weights`: a base of another seed than the servers'),
    then each version's adapters through `/v1/load_lora_adapter`, and the requests name the
    version's adapter. Log-probs are the adapted model's (1e-4), not the base's alone nor the
    previous version's (controls)."""
    from asyncrl.config import LoraConfig
    from asyncrl.models.lora import apply_lora, generation_weights

    config = ModelConfig(lora=LoraConfig(rank=4, alpha=8))
    lora = load_policy(ModelConfig(), seed=1, alphabet=DIGITS)
    apply_lora(lora, config, 1)
    model = lora.model

    weights = CopyWeightSync(max_versions=2)
    new_adapters(model, 1)
    weights.publish(0, generation_weights(model, merged=False))
    urls = [s.url for s in engine.servers]
    release(engine, monkeypatch)
    options = {"vllm": {"kv_cache_bytes": 32 << 20}, "servers": {"urls": urls},
               "run_dir": str(tmp_path)}  # fmt: skip
    spec = EngineSpec(model, lora.eos_id, lora.pad_id, MAX_NEW, 0.8, options=options,
                      scratch_dir=str(tmp_path / ".scratch"))  # fmt: skip
    attached = vllm_server.VLLMServerEngine(spec, weights)
    try:
        batch = requests(lora, count=4, samples=4, seed=400)
        first = attached.generate(batch)
        assert logprob_gap(lora, batch, first) <= 1e-4
        with model.disable_adapter():
            assert logprob_gap(lora, batch, first) > 1e-2  # the adapters were applied
        v0 = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
        new_adapters(model, 2)
        weights.publish(1, generation_weights(model, merged=False))
        second = attached.generate(batch)
        assert all(o.weights_version == 1 for o in second)
        assert logprob_gap(lora, batch, second) <= 1e-4
        model.load_state_dict(v0, strict=False)  # version 0's adapters back ...
        assert logprob_gap(lora, batch, second) > 1e-2  # ... do not explain version 1's
        assert all(s.base and s.version == 1 for s in attached.servers)
        assert attached.metrics()["engine_weight_updates"] == 2
    finally:
        attached.shutdown()  # released: the fixture's next batch reads that back and reloads
        for server in engine.servers:
            with contextlib.suppress(Exception):
                server.post("/v1/unload_lora_adapter", {"lora_name": "v1"})


def cli(run: Path, *extra: str, fault: str = "", fault_signal: str = "",
        servers: str = "rollout.servers.launch=1"):  # fmt: skip
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "configs/demo.yaml"),
               "--run-dir", str(run), "rollout.engine=vllm_server", servers,
               "rollout.vllm.kv_cache_bytes=33554432", "run.max_num_steps=8",
               "checkpoint.save_period=2", "rollout.chunk_tokens=2",
               "rollout.num_prompts_per_step=8", "rollout.num_generations_per_prompt=4",
               "logging.progress=false", "logging.plot=false", *extra]  # fmt: skip
    env = {**os.environ, "ASYNCRL_FAULT": fault, "ASYNCRL_FAULT_SIGNAL": fault_signal}
    return launcher.run(command, env=env, capture_output=True, text=True, timeout=600)


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line holds `text` (a launched server's names its model folder,
    under the run dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(
                errors="replace"
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def launched_pids(run: Path) -> list[int]:
    return [row["pid"] for row in json.loads((run / "servers/launched.json").read_text())]


def test_a_killed_trainers_servers_are_stopped_at_the_relaunch_and_sigterm_stops_its_own(
    tmp_path,
):
    """The trainer SIGKILLed mid-generation after its first checkpoint: its launched servers
    (their own process groups) are ended by its lifeline, not left to the relaunch; the
    relaunch launches its own, resumes (the partials continued) and, at SIGTERM, checkpoints
    and stops its servers (exit 75). No server process is left; `audit` passes."""
    run = tmp_path / "run"
    done = cli(run, fault="checkpoint.parent_fsynced>engine.decode_step:2")
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-3000:]
    first = launched_pids(run)
    assert all(process_gone(pid, 60) for pid in first)  # ended by the killed launch's lifeline
    done = cli(run, fault="train.weights_published[step=6]", fault_signal="SIGTERM")
    assert done.returncode == 75, done.stdout[-2000:] + done.stderr[-3000:]
    assert not (run / "servers/launched.json").exists()  # its own: stopped at exit
    assert not processes_mentioning(str(run))  # no server of either launch is left
    logs = sorted(p.name for p in (run / "servers").iterdir() if p.name.startswith("server_"))
    assert logs == ["server_0.log"]  # both launches' server 0, one after the other
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] >= 1
    assert resume["regenerated_tokens"] == 0  # lossless: the checkpoint's partials continued
    assert audit_run_dir(run).ok, audit_run_dir(run).violations


def test_a_killed_trainer_reattaches_loads_the_checkpoints_weights_first_and_ctrl_c_leaves_them(
    engine, tmp_path, monkeypatch
):
    """Servers the user runs (this file's two, attached by URL): the trainer SIGKILLed at its
    publish of step 7, after its checkpoint of step 4, leaves them holding newer weights (what
    `/weight_info` says). The relaunch attaches, aborts what was left running, loads the
    checkpoint's weights into each before its first request (each resumed step's tokens sampled
    with the trainer's weights have the trainer's log-probs: a server still on newer weights
    would not), resumes losslessly, and at Ctrl-C (SIGINT) checkpoints and exits 75 with both
    servers left running. Runs last: the servers then hold the run's weights, not the
    fixture's."""
    urls = "rollout.servers.urls=" + ",".join(s.url for s in engine.servers)
    release(engine, monkeypatch)
    run = tmp_path / "run"
    # A = 0: every step's tokens are sampled with the weights it trains (a resumed step's after
    # the reload), so each step has tokens whose log-probs can be compared, however fast the
    # servers are (with A = 1 a checkpoint may hold step 4's batch finished on older weights)
    plan = ("run.max_num_steps=12", "checkpoint.save_period=4",
            "rollout.max_trajectory_age_steps=0")  # fmt: skip
    # killed once step 4's checkpoint is durable, however slow the disk (a stage, not a count)
    killed = "checkpoint.parent_fsynced[step=4]>train.weights_published[step=7]"
    done = cli(run, *plan, fault=killed, servers=urls)
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-3000:]
    held = [engine.servers[i].control.get(engine.servers[i].url + "/weight_info").json()
            for i in (0, 1)]  # fmt: skip
    newest = max(parse_tag(h["weight_version"]).version for h in held)
    done = cli(run, *plan, fault="train.weights_published[step=7]", fault_signal="SIGINT",
               servers=urls)  # fmt: skip
    assert done.returncode == 75, done.stdout[-2000:] + done.stderr[-3000:]
    assert "attached to 2 vLLM server(s)" in done.stdout
    assert "request(s) left running aborted" in done.stdout
    (resume,) = [e for e in read_records(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["from_step"] == 4 < newest  # the servers held newer weights than step 4's
    assert resume["regenerated_tokens"] == 0
    resumed = [r for r in read_records(run / "metrics.jsonl") if r["attempt"] == 1]
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    assert all(r["mismatch_tokens"] > 0 for r in resumed), resumed
    assert all(r.get("mismatch_max_abs_diff", 0.0) <= 1e-3 for r in resumed), resumed
    assert all(s.healthy(timeout=10) for s in engine.servers)  # attached: left running
    assert not (run / "servers" / "launched.json").exists()
    assert audit_run_dir(run).ok, audit_run_dir(run).violations
    # another model on the same servers: refused at attach, in one line naming the key
    done = cli(tmp_path / "other", "model.hidden_size=64", servers=urls)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if "rollout.servers.urls" in x]
    assert "hidden_size 128, this run's 64: it serves another model" in line
