"""Joining or starting the Ray cluster for `rollout.backend=ray`."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from asyncrl.config import Config

NAMESPACE = "asyncrl"


def start_ray(config: Config) -> bool:
    """Connects to `ray.address`, or starts a local Ray on this machine (node address
    127.0.0.1, no dashboard, quiet; Ray's own servers still listen on all interfaces, see
    docs/ray.md). Returns whether this call started it (then the run shuts it down)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls home
    common: dict[str, Any] = {
        "namespace": NAMESPACE,
        "log_to_driver": True,
        "logging_level": logging.ERROR,
        "include_dashboard": False,
    }
    if config.ray.address:
        ray.init(address=config.ray.address, **common)
    else:
        # "local": a new Ray of this run's own, even where `ray start` left a cluster behind
        ray.init(
            address="local", num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1", **common
        )
    return True
