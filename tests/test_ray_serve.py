"""Two replicas of the server behind Ray Serve's proxy, on a real local Ray cluster (CPU, tiny model).

One cluster for the module: two `OrpheusReplica`s (the torch engine on the tiny random-weight model,
one logical CPU each) and the stats aggregator. Requests go through Serve's HTTP proxy on loopback,
as a client would send them: REST, the openai SDK, the WebSocket. Fail-over kills a replica's actor
last, since it changes the cluster.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from orpheus_serve.client import protocols as api_client
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc
from orpheus_serve.token_format import SAMPLES_PER_FRAME
from tests.gateway_support import metric_values, tiny_config
from tests.ray_support import Endpoint, aggregate, rest_outcomes, running_replicas, serve_cluster, wait_until

ray = pytest.importorskip("ray")
from orpheus_serve.deploy.ray import RaySettings  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

SHORT = {"temperature": 0.0, "max_tokens": 28}
# Long enough to be mid-stream when the test acts on it: hundreds of frames on the tiny model.
LONG_TOKENS = 1400


@pytest.fixture(scope="module")
def cluster(tiny_orpheus: Path, tiny_snac: Path):
    # Admission by slots: on two shared cores the measured capacity would queue streams the tests want running.
    config = tiny_config(tiny_orpheus, tiny_snac, **{"sampling.max_tokens": LONG_TOKENS, "scheduler.admission": "slots",
                                                     "server.shutdown_grace_s": 1.0})
    settings = RaySettings(replicas=2, num_cpus=1, health_check_period_s=1.0, health_check_timeout_s=10.0)
    with serve_cluster(settings, config) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def endpoint(cluster: Endpoint) -> str:
    return cluster.base_url


def test_sixteen_concurrent_requests_are_spread_over_both_replicas(endpoint: str) -> None:
    before = {row["replica_id"]: rest_outcomes(row).get("ok", 0) for row in aggregate(endpoint)["replicas"]}

    async def sixteen() -> list[api_client.ClientResult]:
        async with api_client.http_client(endpoint, timeout_s=120) as client:
            return await asyncio.gather(*(
                api_client.synthesize_rest(endpoint, f"Hello number {i}.", voice="tara", client=client, **SHORT)
                for i in range(16)))

    results = asyncio.run(sixteen())
    for result in results:
        assert result.ok, (result.code, result.error)
        assert len(result.audio) > 0 and len(result.audio) % (2 * SAMPLES_PER_FRAME) == 0
    snapshot = aggregate(endpoint)
    assert snapshot["num_replicas"] == snapshot["running_replicas"] == 2
    served = {row["replica_id"]: rest_outcomes(row).get("ok", 0) - before.get(row["replica_id"], 0)
              for row in snapshot["replicas"]}
    print(f"16 requests over 2 replicas: {served}")
    assert sum(served.values()) == 16
    assert all(count > 0 for count in served.values()), served
    assert {row["stats"]["replica"]["replica_id"] for row in snapshot["replicas"]} == set(served)


def test_openai_sdk_streams_audio_through_serve(endpoint: str) -> None:
    client = openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0, timeout=120)
    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="alloy", input="Hello there.", response_format="pcm",
            extra_body=SHORT) as response:
        assert response.headers["content-type"] == "audio/pcm"
        chunks = list(response.iter_bytes())
    audio = b"".join(chunks)
    assert len(audio) > 0 and len(audio) % (2 * SAMPLES_PER_FRAME) == 0


def test_websocket_request_through_the_serve_ingress(endpoint: str) -> None:
    result = asyncio.run(api_client.synthesize_ws(endpoint, "Hello there.", voice="tara", **SHORT))
    assert result.ok, (result.code, result.error)
    assert len(result.audio) > 0 and result.metrics is not None
    assert result.metrics["samples"] == len(result.audio) // 2


def test_grpc_through_serves_grpc_proxy(cluster: Endpoint) -> None:
    metadata = (("application", "orpheus"),)

    async def call() -> tuple[list[pb.SynthesizeResponse], list[str], grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
            stub = pb_grpc.SynthesizerStub(channel)
            voices = await stub.ListVoices(pb.ListVoicesRequest(), metadata=metadata, timeout=60)
            replies = [reply async for reply in stub.Synthesize(
                pb.SynthesizeRequest(text="Hello there.", voice="tara", sampling=pb.SamplingOptions(max_tokens=28)),
                metadata=metadata, timeout=120)]
            try:
                async for _ in stub.Synthesize(pb.SynthesizeRequest(text="", voice="tara"), metadata=metadata,
                                               timeout=60):
                    pass
            except grpc.aio.AioRpcError as exc:
                return replies, [v.id for v in voices.voices], exc.code(), exc.details() or ""
            raise AssertionError("an empty text was accepted")

    replies, voices, code, details = asyncio.run(call())
    assert "tara" in voices
    audio = b"".join(r.audio.audio for r in replies if r.HasField("audio"))
    assert len(audio) > 0 and len(audio) % (2 * SAMPLES_PER_FRAME) == 0
    assert replies[-1].HasField("metrics") and replies[-1].metrics.samples == len(audio) // 2
    # A refusal keeps the server's own status code and message through the proxy.
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "text" in details


def test_aggregate_metrics_carry_a_replica_label(endpoint: str) -> None:
    text = httpx.get(f"{endpoint}/v1/stats/metrics", timeout=30).text
    slots = metric_values(text, "orpheus:max_concurrent_sessions")
    ids = {row["replica_id"] for row in aggregate(endpoint)["replicas"]}
    assert {f'{{replica="{i}"}}' for i in ids} == set(slots), slots
    assert all(value == 4 for value in slots.values())


def _cancelled(snapshot: dict[str, Any]) -> int:
    return sum(row["stats"]["scheduler"]["cancelled"] for row in snapshot["replicas"] if "stats" in row)


def test_client_disconnect_through_the_proxy_frees_the_slot(endpoint: str) -> None:
    cancelled_before = _cancelled(aggregate(endpoint))
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{endpoint}/v1/audio/speech",
            json={"input": "A long utterance to walk away from.", "response_format": "pcm",
                  "max_tokens": LONG_TOKENS}) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        received = 0
        while received < 2 * 24000:  # reading, as a player does, until a second of audio is in
            received += len(next(chunks))
        assert aggregate(endpoint)["totals"]["active_sessions"] == 1
        chunks.close()  # httpx closes the connection under a stream dropped mid-body
    # The client left mid-body: the proxy cancels the replica's request.
    started = time.monotonic()
    settled = wait_until(lambda: (s := aggregate(endpoint))["totals"]["active_sessions"] == 0 and s, 30,
                         "the slot is freed")
    print(f"slot freed {time.monotonic() - started:.2f}s after the client left")
    assert _cancelled(settled) == cancelled_before + 1
    assert settled["totals"]["requests"]["rest"].get("cancelled", 0) >= 1


def test_killed_replica_fails_its_streams_and_the_other_takes_new_requests(endpoint: str) -> None:
    """Runs last: it kills a replica. Streams on the dead replica end with an error the client sees (an
    incomplete chunked body), the rest finish, new requests are served, and Serve starts a replacement."""
    streams = 4  # the router (two replicas: it compares both) sends two to each
    original = {r["replica_id"] for r in running_replicas()}
    assert len(original) == 2

    progress = [0] * streams

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
        """SSE, so a whole stream is known by its `speech.audio.done` event, whatever its length."""
        done = False
        try:
            async with client.stream("POST", f"{endpoint}/v1/audio/speech",
                                     json={"input": f"Stream number {i} keeps going.", "response_format": "pcm",
                                           "stream_format": "sse", "max_tokens": LONG_TOKENS}) as response:
                if response.status_code != 200:
                    return f"http {response.status_code}", progress[i]
                async for line in response.aiter_lines():
                    progress[i] += len(line)
                    done = done or line.startswith('data: {"type":"speech.audio.done"')
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}", progress[i]
        return ("ok" if done else "ended without speech.audio.done"), progress[i]

    def busy_rows() -> list[dict[str, Any]] | None:
        # Every stream has audio on its way (mid-body), and both replicas have some.
        rows = [r for r in aggregate(endpoint)["replicas"] if r.get("stats", {}).get("scheduler", {})
                .get("active_sessions")]
        return rows if len(rows) == 2 and all(progress) else None

    def replacement_running() -> list[dict[str, Any]] | None:
        replicas = running_replicas()
        ids = {r["replica_id"] for r in replicas}
        return replicas if len(ids) == 2 and victim["replica_id"] not in ids else None

    async def load_and_kill() -> dict[str, Any]:
        nonlocal victim
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(streams)]
            rows = await asyncio.to_thread(wait_until, busy_rows, 60, "every stream under way on both replicas")
            victim = max(rows, key=lambda r: r["stats"]["scheduler"]["active_sessions"])
            in_flight = victim["stats"]["scheduler"]["active_sessions"]
            ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"))
            killed_at = time.monotonic()
            # New requests at once, while the dead replica's streams are failing and the other's still run.
            async with api_client.http_client(endpoint, timeout_s=120) as fresh:
                new = await asyncio.gather(*(api_client.synthesize_rest(endpoint, "Still here.", client=fresh,
                                                                        **SHORT) for _ in range(4)))
            new_s = time.monotonic() - killed_at
            replaced = await asyncio.to_thread(wait_until, replacement_running, 120, "Serve replaces the replica")
            replaced_s = time.monotonic() - killed_at
            return {"outcomes": list(await asyncio.gather(*tasks)), "in_flight": in_flight, "new": new,
                    "new_s": new_s, "replaced": replaced, "replaced_s": replaced_s}

    victim: dict[str, Any] = {}
    run = asyncio.run(load_and_kill())
    outcomes, in_flight = run["outcomes"], run["in_flight"]
    failed = [o for o in outcomes if o[0] != "ok"]
    print(f"killed replica {victim['replica_id']} with {in_flight} streams in flight; outcomes {outcomes}")
    print(f"{len(run['new'])} new requests sent at the kill: {sum(r.ok for r in run['new'])} served, "
          f"done {run['new_s']:.1f}s after it; replacement running {run['replaced_s']:.1f}s after it: "
          f"{[r['replica_id'] for r in run['replaced']]}")
    # Exactly the victim's streams fail, each with an error the client sees mid-body (the chunked body
    # ends without its last chunk), never a body that ends as if complete; the others finish whole.
    assert len(failed) == in_flight, outcomes
    assert all(reason == "RemoteProtocolError" and received > 0 for reason, received in failed), failed
    # New requests are served (by the surviving replica: the replacement is still starting).
    assert all(r.ok for r in run["new"]), [(r.code, r.error) for r in run["new"]]
    assert len({r["replica_id"] for r in run["replaced"]} - original) == 1
    assert aggregate(endpoint)["running_replicas"] == 2
