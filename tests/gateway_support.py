"""Helpers for the gateway tests: configs for a real server on loopback, and small sync/async probes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.config import Config, load_config

# ORPHEUS_ENGINE_PROCESS=1: every test server built from config runs its engine core in a process of its own
# (server.engine_process), so the same tests check the split; servers built around a service object a test
# made itself (fault-injecting engines, token logs) stay in one process.
ENGINE_PROCESS = os.environ.get("ORPHEUS_ENGINE_PROCESS", "") == "1"

# Every gateway test server: loopback only, ephemeral ports, short drain.
_SERVER = {
    "server.host": "127.0.0.1",
    "server.http_port": 0,
    "server.grpc_port": 0,
    "server.shutdown_grace_s": 2.0,
    "server.log_level": "warning",
    "server.engine_process": ENGINE_PROCESS,
}


def tiny_config(tiny_orpheus: Path, tiny_snac: Path, **overrides: Any) -> Config:
    """The torch engine on the tiny random-weight model, SNAC noise off, short utterances."""
    return load_config(overrides={
        **_SERVER,
        "engine.backend": "torch",
        "engine.device": "cpu",
        "engine.model_path": str(tiny_orpheus),
        "codec.path": str(tiny_snac),
        "codec.device": "cpu",
        "codec.noise": False,
        "scheduler.max_concurrent_sessions": 4,
        "scheduler.max_batch_size": 4,
        "sampling.min_tokens": 28,
        "sampling.max_tokens": 56,
        **overrides,
    }, env={})


def sim_config(tiny_orpheus: Path, **overrides: Any) -> Config:
    """The sim engine and sim codec: GPU-like pacing at high concurrency on a CPU (tokenizer from the tiny model)."""
    return load_config(overrides={
        **_SERVER,
        "engine.backend": "sim",
        "engine.model_path": str(tiny_orpheus),
        "codec.decoder": "sim",
        "codec.path": str(tiny_orpheus.parent / "tiny-snac"),  # unused by the sim codec; keeps the tiny fallback quiet
        "scheduler.max_concurrent_sessions": 32,
        "scheduler.max_batch_size": 32,
        "sampling.min_tokens": 28,
        "sampling.max_tokens": 2800,
        **overrides,
    }, env={})


def start_server(config: Config) -> ServerThread:
    return ServerThread(config).start()


def stats(server: ServerThread) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/v1/stats", headers=auth_header(server)).json()


def auth_header(server: ServerThread) -> dict[str, str]:
    keys = server.server.config.server.api_keys
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def wait_for(probe: Callable[[], bool], within_s: float, what: str) -> float:
    """Poll `probe` (each call is a real request) until it holds; the seconds it took. Bounded by time."""
    start = time.perf_counter()
    deadline = start + within_s
    while True:
        if probe():
            return time.perf_counter() - start
        if time.perf_counter() > deadline:
            raise AssertionError(f"{what}: not true within {within_s}s")


def metric_values(text: str, name: str) -> dict[str, float]:
    """`{labels: value}` of one metric family in a Prometheus exposition ('' for no labels)."""
    out: dict[str, float] = {}
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            out[match.group(1) or ""] = float(match.group(2))
    return out


def check_openai_error(response: httpx.Response, status: int, code: str | None = None) -> Mapping[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def request_outcomes(snapshot: Mapping[str, Any]) -> int:
    """Requests the gateway has counted an outcome for, all protocols and statuses."""
    return sum(sum(by_status.values()) for by_status in snapshot["gateway"]["requests"].values())


def settled_stats(get_stats: Callable[[], dict[str, Any]], *, outcomes: int | None = None,
                  within_s: float = 30.0) -> dict[str, Any]:
    """/v1/stats once every session has ended, the codec holds nothing, no stream is open and, if given,
    `outcomes` request outcomes are counted (a dropped connection is noticed a moment after the client
    has moved on). Bounded in time: the caller asserts on what it gets."""
    deadline = time.monotonic() + within_s
    while True:
        snapshot = get_stats()
        busy = (snapshot["scheduler"]["active_sessions"] or snapshot["scheduler"]["pending_sessions"]
                or snapshot["codec"]["queued_sessions"] or snapshot["flow"]["draining_streams"]
                or sum(snapshot["gateway"]["active_streams"].values())
                or (outcomes is not None and request_outcomes(snapshot) < outcomes))
        if not busy or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.2)
