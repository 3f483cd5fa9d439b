"""API keys, admission limits and graceful shutdown, against real servers (sim engine) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import websockets
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc
from tests.gateway_support import ENGINE_PROCESS, check_openai_error, sim_config, start_server, wait_for
from tests.pace import MachinePace

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["key-one", "key-two"]
GOOD = {"Authorization": f"Bearer {KEYS[1]}"}
LONG = {"max_tokens": 1400}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path):
    """Keys on, one KV slot and no queue (the second stream is refused), three connections at most."""
    srv = start_server(sim_config(tiny_orpheus, **{
        "server.api_keys": KEYS, "server.max_connections": 3, "scheduler.max_concurrent_sessions": 1,
        "scheduler.max_batch_size": 1, "scheduler.max_queue": 0, "server.max_ws_requests_per_connection": 2}))
    yield srv
    srv.stop()


def _sessions(server: ServerThread) -> int:
    return httpx.get(f"{server.base_url}/v1/stats", headers=GOOD).json()["scheduler"]["total_sessions"]


def _idle(server: ServerThread) -> bool:
    snapshot = httpx.get(f"{server.base_url}/v1/stats", headers=GOOD).json()
    return snapshot["scheduler"]["active_sessions"] == 0 and snapshot["gateway"]["open_connections"] == 0


def test_wrong_or_missing_key_is_refused_on_every_protocol_and_never_reaches_the_service(server: ServerThread) -> None:
    base = server.base_url
    sessions = _sessions(server)
    speech = f"{base}/v1/audio/speech"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
                    {"Authorization": "Bearer"}):
        response = httpx.post(speech, json={"input": "hi"}, headers=headers)
        check_openai_error(response, 401)
        assert response.headers["www-authenticate"] == "Bearer"
    # Checked before the body is read: a bad key with a bad body is still a 401.
    check_openai_error(httpx.post(speech, content=b"{broken", headers={"Authorization": "Bearer nope"}), 401)
    check_openai_error(httpx.get(f"{base}/v1/stats"), 401)
    check_openai_error(httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"}), 401)

    with pytest.raises(websockets.InvalidStatus) as info:
        ws_connect(api_client.stream_url(base), additional_headers={"Authorization": "Bearer nope"})
    assert info.value.response.status_code == 401

    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.SynthesizerStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as rpc:
                list(stub.Synthesize(pb.SynthesizeRequest(text="hi"), metadata=metadata))
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as rpc:
            stub.ListVoices(pb.ListVoicesRequest())
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _sessions(server) == sessions  # none of it reached the engine

    # Probes and scrapers need no key.
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/ready").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200


def test_the_right_key_works_on_every_protocol(server: ServerThread) -> None:
    async def all_three():
        results = []
        for protocol in ("rest", "ws", "grpc"):  # one at a time: this server has a single slot
            results.append(await api_client.synthesize(protocol, "Hello.", url=server.base_url,
                                                       grpc_addr=server.grpc_address, api_key=KEYS[0],
                                                       max_tokens=28))
        return results

    for result in asyncio.run(all_three()):
        assert result.ok, (result.protocol, result.error)
        assert result.audio and len(result.audio) % (2048 * 2) == 0
    with grpc.insecure_channel(server.grpc_address) as channel:
        voices = pb_grpc.SynthesizerStub(channel).ListVoices(pb.ListVoicesRequest(),
                                                             metadata=(("authorization", f"Bearer {KEYS[0]}"),))
        assert len(voices.voices) == 8


@pytest.mark.core_in_process
def test_full_service_answers_503_with_retry_after_and_resource_exhausted(server: ServerThread,
                                                                           pace: MachinePace) -> None:
    base = server.base_url
    with httpx.Client(timeout=30, headers=GOOD) as http, http.stream(
            "POST", f"{base}/v1/audio/speech", json={"input": "Hold the only slot.", "response_format": "pcm",
                                                     **LONG}) as holder:
        assert holder.status_code == 200
        body = holder.iter_raw()
        next(body)
        refused = httpx.post(f"{base}/v1/audio/speech", json={"input": "Me too."}, headers=GOOD)
        check_openai_error(refused, 503, "server_busy")
        assert int(refused.headers["retry-after"]) >= 1
        with grpc.insecure_channel(server.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as rpc:
                list(pb_grpc.SynthesizerStub(channel).Synthesize(
                    pb.SynthesizeRequest(text="Me too."), metadata=(("authorization", f"Bearer {KEYS[0]}"),)))
            assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with ws_connect(api_client.stream_url(base), additional_headers=GOOD) as ws:
            ws.send(json.dumps({"text": "Me too."}))
            reply = json.loads(ws.recv(timeout=30))
            assert reply["error"]["code"] == "server_busy"
    wait_for(lambda: _idle(server), pace.window(1.0), "slot and connections freed")


def test_connection_limit_covers_all_protocols(server: ServerThread, pace: MachinePace) -> None:
    base = server.base_url
    url = api_client.stream_url(base)
    with contextlib.ExitStack() as sockets:
        for _ in range(3):
            sockets.enter_context(ws_connect(url, additional_headers=GOOD))
        wait_for(lambda: httpx.get(f"{base}/v1/stats", headers=GOOD).json()["gateway"]["open_connections"] == 3,
                 pace.window(2.0), "three WebSockets counted")
        check_openai_error(httpx.post(f"{base}/v1/audio/speech", json={"input": "hi"}, headers=GOOD), 503,
                           "too_many_connections")
        with ws_connect(url, additional_headers=GOOD) as extra:
            reply = json.loads(extra.recv(timeout=30))
            assert reply["error"]["code"] == "too_many_connections"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                extra.recv(timeout=30)
            assert closed.value.rcvd.code == 1013
        with grpc.insecure_channel(server.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as rpc:
                list(pb_grpc.SynthesizerStub(channel).Synthesize(
                    pb.SynthesizeRequest(text="hi"), metadata=(("authorization", f"Bearer {KEYS[0]}"),)))
            assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    wait_for(lambda: _idle(server), pace.window(2.0), "connections released")
    assert httpx.post(f"{base}/v1/audio/speech", json={"input": "hi", "max_tokens": 28},
                      headers=GOOD).status_code == 200


def test_websocket_requests_per_connection_are_capped(server: ServerThread) -> None:
    with ws_connect(api_client.stream_url(server.base_url), additional_headers=GOOD) as ws:
        for i in range(2):
            ws.send(json.dumps({"text": f"Request {i}.", "max_tokens": 28}))
            while isinstance(message := ws.recv(timeout=30), bytes):
                pass
            assert json.loads(message)["done"] is True
        ws.send(json.dumps({"text": "One too many.", "max_tokens": 28}))
        assert json.loads(ws.recv(timeout=30))["error"]["code"] == "too_many_requests"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1008


@pytest.mark.core_in_process
def test_not_ready_until_warmed_up(tiny_orpheus: Path) -> None:
    srv = ServerThread(sim_config(tiny_orpheus))
    try:
        srv.call(srv.server.open_listeners())
        base = srv.base_url
        assert httpx.get(f"{base}/health").status_code == 200  # alive while warming up
        ready = httpx.get(f"{base}/ready")
        assert (ready.status_code, ready.json()["status"]) == (503, "warming_up")
        check_openai_error(httpx.post(f"{base}/v1/audio/speech", json={"input": "hi"}), 503, "unavailable")
        with grpc.insecure_channel(srv.grpc_address) as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="orpheus.v1.Synthesizer")
            assert health_stub.Check(check).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as rpc:
                list(pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(text="hi")))
            assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
            srv.start()
            assert httpx.get(f"{base}/ready").json() == {"status": "ready"}
            assert health_stub.Check(check).status == health_pb2.HealthCheckResponse.SERVING
            assert health_stub.Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(0)


@pytest.mark.core_in_process
def test_graceful_shutdown_lets_in_flight_streams_finish_and_refuses_new_ones(tiny_orpheus: Path,
                                                                              pace: MachinePace) -> None:
    # The drain window the stream needs on the reference machine, stretched to this one (tests/pace.py).
    srv = ServerThread(sim_config(tiny_orpheus, **{"server.shutdown_grace_s": pace.window(10.0)})).start()
    base = srv.base_url
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{base}/v1/audio/speech",
            json={"input": "Finish me.", "response_format": "pcm", "max_tokens": 350}) as response:
        body = response.iter_raw()
        received = len(next(body))
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        wait_for(lambda: httpx.get(f"{base}/ready").status_code == 503, pace.window(5.0), "/ready turns 503")
        check_openai_error(httpx.post(f"{base}/v1/audio/speech", json={"input": "Too late."}), 503, "unavailable")
        # A stream cut short would end without the chunked terminator and raise here.
        for chunk in body:
            received += len(chunk)
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert received % (2048 * 2) == 0 and received // (2048 * 2) >= 25  # the whole utterance (25..49 frames)


def _read_until(process: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    """stderr lines of `process` until one contains `needle` (bounded by time)."""
    lines: list[str] = []
    selector = selectors.DefaultSelector()
    assert process.stderr is not None
    selector.register(process.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not logged within {timeout_s}s:\n{''.join(lines)}")


@pytest.mark.core_in_process
def test_sigterm_during_streams_lets_them_finish_whole_then_the_process_exits(tiny_orpheus: Path,
                                                                             pace: MachinePace) -> None:
    grace_s = pace.window(15.0)  # the drain window, stretched to this machine (tests/pace.py)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p),
           "CUDA_VISIBLE_DEVICES": ""}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "production_server.py"), "--host", "127.0.0.1", "--port", "0", "--grpc-port",
         "0", "--set", "engine.backend=sim", "--set", "codec.decoder=sim", "--set",
         f"engine.model_path={tiny_orpheus}", "--set", f"codec.path={tiny_orpheus.parent / 'tiny-snac'}",
         "--set", f"server.shutdown_grace_s={grace_s}",
         # Both streams admitted at once (by slots), not one after the other while capacity is measured.
         "--set", "scheduler.admission=slots", "--set", f"server.engine_process={ENGINE_PROCESS}"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    try:
        lines = _read_until(process, "ready to serve", 90)
        listening = next(line for line in lines if "listening:" in line)
        http_port = int(listening.split("HTTP/WebSocket on ")[1].split(",")[0].rsplit(":", 1)[1])
        grpc_port = int(listening.split("gRPC on ")[1].split(" ")[0].rsplit(":", 1)[1])
        base = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{base}/ready").status_code == 200

        async def streams_across_sigterm() -> tuple[float, list[api_client.ClientResult]]:
            # Seconds of audio each (25..50 frames at the sim engine's GPU-like pace).
            ws = asyncio.create_task(api_client.synthesize_ws(base, "Finish me.", max_tokens=350, seed=1))
            grpc_call = asyncio.create_task(api_client.synthesize_grpc(f"127.0.0.1:{grpc_port}", "Me too.",
                                                                       max_tokens=350, seed=2))
            deadline = time.monotonic() + 60
            def going(snapshot: dict) -> bool:
                # Both admitted and ten frames each generated: their first pushes (three frames) are long out and
                # at the clients, and 40 frames each are still to come.
                return snapshot["scheduler"]["active_sessions"] == 2 and snapshot["total_tokens"] > 140

            while not going(stats_of(base)):
                assert time.monotonic() < deadline, "the two streams never got going"
                await asyncio.sleep(0.05)
            signalled, signalled_at = time.monotonic(), time.perf_counter()
            process.send_signal(signal.SIGTERM)
            while httpx.get(f"{base}/ready").status_code != 503:
                assert time.monotonic() - signalled < pace.window(5.0), "/ready did not turn 503 after SIGTERM"
                await asyncio.sleep(0.02)
            refused = httpx.post(f"{base}/v1/audio/speech", json={"input": "Too late."})
            check_openai_error(refused, 503, "unavailable")
            results = await asyncio.gather(ws, grpc_call)
            assert time.monotonic() - signalled < grace_s
            return signalled_at, results

        signalled_at, results = asyncio.run(streams_across_sigterm())
        for result in results:
            assert result.ok, (result.protocol, result.error)
            # Whole: every sample the server generated reached the client, and it ended normally.
            assert result.metrics is not None and result.metrics["finish_reason"] in ("stop", "length")
            assert len(result.audio) == 2 * result.metrics["samples"] > 2 * 2048 * 20, result.protocol
            assert result.chunks[0][0] < signalled_at < result.chunks[-1][0]  # audio before and after the signal
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def stats_of(base: str) -> dict:
    return httpx.get(f"{base}/v1/stats").json()


def test_production_server_with_tensorrt_here_exits_at_once_naming_what_is_missing() -> None:
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(root / "production_server.py"), "--set", "engine.backend=tensorrt",
                           "--port", "0", "--grpc-port", "0"], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(root / "src")})
    assert proc.returncode != 0
    assert "TensorRT-LLM" in proc.stderr and ("CUDA" in proc.stderr or "GPU" in proc.stderr)
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60
