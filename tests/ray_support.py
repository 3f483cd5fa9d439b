"""Helpers for the Ray Serve tests: one local Ray cluster per module, the aggregate stats, the replicas."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from orpheus_serve.config import Config
from orpheus_serve.deploy.ray import RaySettings, grpc_options, list_replicas, run_apps


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    grpc_address: str


@contextmanager
def serve_cluster(settings: RaySettings, config: Config, *, num_cpus: int = 3) -> Iterator[Endpoint]:
    """A local Ray cluster (no dashboard) with Serve's HTTP and gRPC proxies on loopback ports running both
    applications. Logical CPUs: the replicas' plus one; they share the machine's cores."""
    import ray
    from ray import serve

    port, grpc_port = free_port(), free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options(grpc_port))
        run_apps(settings, config)
        yield Endpoint(f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def aggregate(base_url: str) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/v1/stats", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def rest_outcomes(row: dict[str, Any]) -> dict[str, int]:
    return row["stats"]["gateway"]["requests"]["rest"] if "stats" in row else {}


def running_replicas() -> list[dict[str, Any]]:
    # The controller call is async (the aggregator awaits it); from a test, on a loop of our own.
    return [r for r in asyncio.run(list_replicas()) if r["state"] == "RUNNING"]


def wait_until(probe: Callable[[], Any], within_s: float, what: str, every_s: float = 0.25) -> Any:
    """Poll `probe` (each call a real query) until it returns something truthy; bounded by time."""
    deadline = time.monotonic() + within_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true within {within_s}s")
        time.sleep(every_s)
