"""Which run a vLLM server serves, and which of its weights it holds, read back from the server
itself: vLLM keeps one free-form string per server (`/update_weight_version` sets it,
`/weight_info` reads it; "default" at its start), and asyncrl writes there

    asyncrl:RUN:LAUNCH:VERSION   held by run RUN; launch LAUNCH of it loaded VERSION
    asyncrl:RUN:LAUNCH:          held by run RUN; its weights are changing (or none of ours yet)
    asyncrl:                     released (a run that ended left it)
    anything else ("default")    free: never ours, or restarted since (its initial weights)

so that nothing about a server is assumed: before each batch the engine reads the string back
(`read_back`), and a server restarted by its supervisor, or reloaded by someone else, is
reloaded before it samples; a server another run holds is never used (one server serves one
run). The launch id tells two launches of one run apart: a relaunch's version 7 is not the
killed launch's version 7 (other weights after a resume).

The functions on strings are pure; those taking a `Server` make one HTTP call each.
"""

from __future__ import annotations

from typing import NamedTuple

from asyncrl.config import ConfigError
from asyncrl.rollout.servers import Server, ServerError

PREFIX = "asyncrl:"
RELEASED = PREFIX
"""What a run writes on an attached server when it ends: free for another run."""


class Tag(NamedTuple):
    run_id: str
    launch: str
    version: int | None


def make_tag(run_id: str, launch: str, version: int | None) -> str:
    return f"{PREFIX}{run_id}:{launch}:{'' if version is None else version}"


def parse_tag(text: str) -> Tag | None:
    """The holder and version a server's string names; None when it is free or released."""
    if not text.startswith(PREFIX):
        return None
    parts = text[len(PREFIX) :].split(":")
    if len(parts) != 3 or not parts[0]:
        return None
    run_id, launch, version = parts
    return Tag(run_id, launch, int(version) if version.isdigit() else None)


def holder(text: str) -> str | None:
    """The run that holds a server (None: free)."""
    tag = parse_tag(text)
    return tag.run_id if tag is not None else None


def loaded_version(text: str, run_id: str, launch: str) -> int | None:
    """The weights version of this launch the server holds (None: another launch's, changing,
    or not ours: it must be loaded before it samples)."""
    tag = parse_tag(text)
    if tag is None or tag.run_id != run_id or tag.launch != launch:
        return None
    return tag.version


def lease_problem(text: str, run_id: str, url: str = "URL") -> str:
    """Why this run may not use a server whose string is `text` ("" when it may)."""
    other = holder(text)
    if other is None or other == run_id:
        return ""
    return (
        f"it serves run {other} (its /weight_info says {text!r}); one server serves one run. "
        "If that run ended without releasing it (killed), free it: curl -X POST "
        f'{url}/update_weight_version -H "Content-Type: application/json" -d '
        f'\'{{"new_version": "{RELEASED}"}}\' (docs/servers.md)'
    )


def read_tag(server: Server, timeout: float) -> str:
    """The server's string (`GET /weight_info`); ServerDown when it does not answer."""
    return str((server.get("/weight_info", timeout=timeout) or {}).get("weight_version", ""))


def write_tag(server: Server, text: str, timeout: float = 30.0) -> None:
    server.post("/update_weight_version", {"new_version": text}, timeout=timeout)


def read_back(server: Server, run_id: str, launch: str, timeout: float) -> int | None:
    """The version of this launch `server` holds now, read from it (None: load one first);
    ServerError when another run holds it."""
    text = read_tag(server, timeout)
    problem = lease_problem(text, run_id, server.url)
    if problem:
        raise ServerError(f"{server.name()}: {problem}")
    return loaded_version(text, run_id, launch)


def release(server: Server, run_id: str, timeout: float = 10.0) -> None:
    """Frees an attached server this run holds (at its end); one another run holds is left."""
    if holder(read_tag(server, timeout)) == run_id:
        write_tag(server, RELEASED, timeout)


def claim(server: Server, run_id: str, launch: str, timeout: float) -> int:
    """Takes an attached server for this run, at attach: ConfigError (naming
    `rollout.servers.urls` and the URL, in one line) where another run holds it. Where this run
    holds it already (a killed launch of it), the requests that launch left are aborted (how
    many is returned) and a pause it left mid-load is resumed; on a server no run holds,
    nothing is aborted (its requests are not this run's). Then it is marked held by this
    launch, with no version of it: the first batch loads one."""
    text = read_tag(server, timeout)
    problem = lease_problem(text, run_id, server.url)
    if problem:
        raise ConfigError(f"rollout.servers.urls: {server.url} cannot serve this run: {problem}")
    aborted = 0
    if holder(text) == run_id:
        aborted = int((server.post("/abort_requests", {}) or {}).get("aborted", 0))
        if (server.get("/is_paused", timeout) or {}).get("is_paused"):
            server.post("/resume")
    write_tag(server, make_tag(run_id, launch, None), timeout)
    return aborted
