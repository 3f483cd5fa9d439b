"""Autoscaling on ongoing requests, min 1 / max 2 replicas, on a real local Ray cluster (CPU).

The replicas run the sim engine and sim codec (GPU-like pacing, little CPU), four slots each, so one
replica's target is four ongoing requests. Twelve streams kept in flight put three times that on the
first replica: Serve starts the second. When the load stops, it goes back to one. Short upscale and
downscale delays keep it CI-sized; the timeline is printed (pytest -s) and docs/SCALING.md quotes one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway_support import sim_config
from tests.ray_support import Endpoint, aggregate, running_replicas, serve_cluster, wait_until

ray = pytest.importorskip("ray")
from orpheus_serve.deploy.ray import RaySettings  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

SLOTS = 4
STREAMS = 12
TOKENS = 420  # ~5 s of audio per stream at the sim engine's pace


@pytest.fixture(scope="module")
def cluster(tiny_orpheus: Path):
    config = sim_config(tiny_orpheus, **{"scheduler.max_concurrent_sessions": SLOTS, "scheduler.max_batch_size": SLOTS,
                                         "scheduler.max_queue": 16, "scheduler.admission": "slots",
                                         "server.shutdown_grace_s": 1.0})
    settings = RaySettings(min_replicas=1, max_replicas=2, num_cpus=1, upscale_delay_s=1.0, downscale_delay_s=3.0,
                           metrics_interval_s=0.5, look_back_period_s=2.0, health_check_period_s=2.0)
    with serve_cluster(settings, config) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def endpoint(cluster: Endpoint) -> str:
    return cluster.base_url


def test_load_starts_a_second_replica_and_its_end_scales_back_to_one(endpoint: str) -> None:
    t0 = time.monotonic()
    timeline: list[tuple[float, str]] = []

    def mark(event: str) -> None:
        timeline.append((time.monotonic() - t0, event))
        print(f"{timeline[-1][0]:6.1f}s  {event}", flush=True)

    assert len(running_replicas()) == 1
    stop = threading.Event()
    outcomes: list[int] = []

    async def stream_forever(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            response = await client.post(f"{endpoint}/v1/audio/speech",
                                         json={"input": "Keep the replicas busy.", "response_format": "pcm",
                                               "max_tokens": TOKENS})
            outcomes.append(response.status_code)

    async def load() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=STREAMS)) as client:
            await asyncio.gather(*(stream_forever(client) for _ in range(STREAMS)))

    loader = threading.Thread(target=asyncio.run, args=(load(),), name="load")
    mark(f"load starts: {STREAMS} streams kept in flight (target {SLOTS} ongoing requests per replica)")
    loader.start()
    try:
        two = wait_until(lambda: (rs := running_replicas()) and len(rs) == 2 and rs, 120, "a second replica",
                         every_s=0.5)
        mark(f"second replica running: {sorted(r['replica_id'] for r in two)}")

        def both_serving() -> bool:
            rows = aggregate(endpoint)["replicas"]
            return len(rows) == 2 and all(row.get("stats", {}).get("scheduler", {}).get("total_sessions", 0) > 0
                                          for row in rows)

        wait_until(both_serving, 60, "both replicas serving", every_s=0.5)
        mark("both replicas serving streams")
    finally:
        stop.set()
        loader.join(timeout=120)
    assert not loader.is_alive()
    mark(f"load stops: {len(outcomes)} requests, statuses {sorted(set(outcomes))}")
    assert outcomes and set(outcomes) == {200}, sorted(set(outcomes))

    one = wait_until(lambda: (rs := running_replicas()) and len(rs) == 1 and rs, 120, "back to one replica",
                     every_s=0.5)
    mark(f"scaled back to one replica: {one[0]['replica_id']}")
    response = httpx.post(f"{endpoint}/v1/audio/speech", timeout=60,
                          json={"input": "Still serving.", "response_format": "pcm", "max_tokens": 28})
    assert response.status_code == 200 and response.content
    mark("a request after scale-down is served")
    assert [event for _, event in timeline][-2].startswith("scaled back")
