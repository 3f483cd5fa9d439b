"""Concurrency, cancellation and bad input against a real server running the sim engine and sim codec.

The sim backend paces tokens like a GPU without a model, so many streams run
at once on two CPU cores; everything between the socket and the scheduler is
the real code.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from orpheus_serve.client.records import summarize
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc
from orpheus_serve.request.types import PROTOCOLS
from orpheus_serve.token_format import SAMPLES_PER_FRAME
from tests.gateway_support import check_openai_error, metric_values, sim_config, start_server, stats, wait_for
from tests.pace import MachinePace

MAX_TEXT = 4096  # the conversational profile's max_text_chars (OpenAI's limit)
# The sim engine ends an utterance after a seeded pseudo-random count between half and all of the frames
# max_tokens allows: 4..7 frames here.
SHORT = {"max_tokens": 56}
SHORT_FRAMES = range(4, 8)
LONG = {"max_tokens": 1400}  # 100..199 frames: seconds under the sim's pacing
FRAME_BYTES = SAMPLES_PER_FRAME * 2


def _whole_frames(audio: bytes | bytearray, frames: range) -> bool:
    return len(audio) % FRAME_BYTES == 0 and len(audio) // FRAME_BYTES in frames


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path):
    srv = start_server(sim_config(tiny_orpheus))
    yield srv
    srv.stop()


def _active_sessions(server: ServerThread) -> int:
    snapshot = stats(server)
    return snapshot["scheduler"]["active_sessions"] + snapshot["scheduler"]["pending_sessions"]


def test_twenty_concurrent_clients_over_three_protocols(server: ServerThread) -> None:
    before_stats = stats(server)
    before_metrics = httpx.get(f"{server.base_url}/metrics").text
    protocols = ["rest", "ws", "grpc"] * 7
    protocols = protocols[:20]

    async def run_all():
        return await asyncio.gather(*(
            api_client.synthesize(p, f"Client number {i} says hello.", url=server.base_url,
                                  grpc_addr=server.grpc_address, voice="leo", fmt="pcm", **SHORT)
            for i, p in enumerate(protocols)))

    started = time.perf_counter()
    results = asyncio.run(run_all())
    wall = time.perf_counter() - started
    failures = [(r.protocol, r.error) for r in results if not r.ok]
    assert not failures, failures
    # The client's results are the benchmark's stream records as they are.
    summary = summarize(results, wall)
    assert summary["succeeded"] == 20 and summary["ttfb_p50_ms"] > 0
    assert all(_whole_frames(r.audio, SHORT_FRAMES) for r in results), [len(r.audio) for r in results]
    assert all(r.metrics["samples"] * 2 == len(r.audio) for r in results if r.protocol != "rest")
    assert all(r.ttfb_s is not None and r.ttfb_s > 0 for r in results)
    frames = sum(len(r.audio) // FRAME_BYTES for r in results)

    after = stats(server)
    assert after["scheduler"]["total_sessions"] - before_stats["scheduler"]["total_sessions"] >= 20
    assert after["total_tokens"] - before_stats["total_tokens"] >= frames * 7
    for protocol in ("rest", "ws", "grpc"):
        delta = after["gateway"]["requests"][protocol].get("ok", 0) - \
            before_stats["gateway"]["requests"][protocol].get("ok", 0)
        assert delta == protocols.count(protocol), (protocol, delta)
    assert after["gateway"]["open_connections"] == 0
    assert after["process"]["cpu_s"] >= before_stats["process"]["cpu_s"] > 0
    assert after["gateway"]["active_streams"] == dict.fromkeys(PROTOCOLS, 0)

    after_metrics = httpx.get(f"{server.base_url}/metrics").text
    for protocol in ("rest", "ws", "grpc"):
        label = f'{{protocol="{protocol}",status="ok"}}'
        grown = metric_values(after_metrics, "orpheus:requests_total").get(label, 0) - \
            metric_values(before_metrics, "orpheus:requests_total").get(label, 0)
        assert grown == protocols.count(protocol)
    ttfb_count = metric_values(after_metrics, "orpheus:time_to_first_audio_seconds_count")[""] - \
        metric_values(before_metrics, "orpheus:time_to_first_audio_seconds_count").get("", 0)
    assert ttfb_count >= 20
    audio_s = metric_values(after_metrics, "orpheus:audio_seconds_total")[""] - \
        metric_values(before_metrics, "orpheus:audio_seconds_total").get("", 0)
    assert audio_s == pytest.approx(frames * SAMPLES_PER_FRAME / 24000)
    assert metric_values(after_metrics, "orpheus:num_requests_running")[""] == 0
    assert "orpheus:kv_cache_usage_perc" in after_metrics
    assert "orpheus:e2e_request_latency_seconds_bucket" in after_metrics
    assert "orpheus:request_queue_time_seconds_count" in after_metrics
    assert "orpheus:request_real_time_factor_count" in after_metrics


def test_rest_client_disconnect_frees_its_slot_within_a_second(server: ServerThread, pace: MachinePace) -> None:
    before = stats(server)["gateway"]["requests"]["rest"].get("cancelled", 0)
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{server.base_url}/v1/audio/speech",
            json={"input": "A long story.", "response_format": "pcm", **LONG}) as response:
        assert response.status_code == 200
        body = response.iter_raw()  # kept referenced: a dropped iterator closes the connection
        next(body)
        assert _active_sessions(server) >= 1
    # Leaving the block closed the connection mid-stream.
    # Within a second on the reference machine (tests/pace.py): a bounded wait fails past it.
    wait_for(lambda: _active_sessions(server) == 0, pace.window(1.0), "slot freed after disconnect")
    wait_for(lambda: stats(server)["gateway"]["requests"]["rest"].get("cancelled", 0) == before + 1,
             pace.window(1.0), "cancellation counted")


def test_grpc_cancel_propagates_to_the_session(server: ServerThread, pace: MachinePace) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        call = pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(
            text="A long story.", sampling=pb.SamplingOptions(max_tokens=LONG["max_tokens"])))
        first = next(call)
        assert first.HasField("audio")
        assert _active_sessions(server) >= 1
        call.cancel()
    wait_for(lambda: _active_sessions(server) == 0, pace.window(1.0), "slot freed after gRPC cancel")


def test_websocket_cancel_then_the_socket_serves_the_next_request(server: ServerThread, pace: MachinePace) -> None:
    url = api_client.stream_url(server.base_url)
    with ws_connect(url) as ws:
        ws.send(json.dumps({"text": "A long story.", "request_id": "long-1", **LONG}))
        assert isinstance(ws.recv(timeout=30), bytes)
        ws.send(json.dumps({"cancel": True}))
        while True:  # audio already in flight may arrive before the acknowledgement
            reply = ws.recv(timeout=30)
            if isinstance(reply, str):
                break
        assert json.loads(reply) == {"cancelled": True, "request_id": "long-1"}
        wait_for(lambda: _active_sessions(server) == 0, pace.window(1.0), "slot freed after WebSocket cancel")
        # Two requests back to back on the same socket, served in order.
        ws.send(json.dumps({"text": "First.", "request_id": "a", **SHORT}))
        ws.send(json.dumps({"text": "Second.", "request_id": "b", **SHORT}))
        finished = []
        audio = 0
        while len(finished) < 2:
            message = ws.recv(timeout=30)
            if isinstance(message, bytes):
                audio += len(message)
            else:
                body = json.loads(message)
                assert body.get("done"), body
                finished.append(body["request_id"])
                assert body["metrics"]["samples"] * 2 == audio and audio // FRAME_BYTES in SHORT_FRAMES
                audio = 0
        assert finished == ["a", "b"]
        ws.send(json.dumps({"cancel": True}))
        assert json.loads(ws.recv(timeout=30))["cancelled"] is False


def test_websocket_disconnect_mid_stream_frees_the_slot(server: ServerThread, pace: MachinePace) -> None:
    with ws_connect(api_client.stream_url(server.base_url)) as ws:
        ws.send(json.dumps({"text": "A long story.", **LONG}))
        assert isinstance(ws.recv(timeout=30), bytes)
        assert _active_sessions(server) >= 1
    # Leaving the block closed the socket mid-stream.
    wait_for(lambda: _active_sessions(server) == 0, pace.window(1.0), "slot freed after WebSocket disconnect")



def test_websocket_disconnect_counts_the_requests_queued_behind_the_running_one(server: ServerThread,
                                                                                 pace: MachinePace) -> None:
    before = stats(server)["gateway"]["requests"]["ws"].get("cancelled", 0)
    with ws_connect(api_client.stream_url(server.base_url)) as ws:
        for i in range(3):  # one runs, two wait their turn on this socket
            ws.send(json.dumps({"text": f"A long story, part {i}.", **LONG}))
        assert isinstance(ws.recv(timeout=30), bytes)
    # All three were accepted; the disconnect cancelled them all, and each is counted.
    wait_for(lambda: stats(server)["gateway"]["requests"]["ws"].get("cancelled", 0) == before + 3, pace.window(2.0),
             "every request on the socket counted as cancelled")
    wait_for(lambda: _active_sessions(server) == 0, pace.window(1.0), "slot freed after WebSocket disconnect")


# ------------------------------------------------------------------ bad input


def _http_cases(base: str) -> list[tuple[str, dict[str, Any], int, str, str | None]]:
    """(name, request, HTTP status, error code, error param)."""
    speech = f"{base}/v1/audio/speech"
    json_headers = {"Content-Type": "application/json"}
    invalid = "invalid_request"

    def post(body: Any) -> dict[str, Any]:
        return {"method": "POST", "url": speech, "json": body}

    def raw(content: bytes) -> dict[str, Any]:
        return {"method": "POST", "url": speech, "content": content, "headers": json_headers}

    return [
        ("empty input", post({"input": ""}), 400, invalid, "input"),
        ("whitespace input", post({"input": "  \n\t "}), 400, invalid, "input"),
        ("input too long for the profile", post({"input": "a" * (MAX_TEXT + 1)}), 400, invalid, "input"),
        ("unknown voice", post({"input": "hi", "voice": "bob"}), 400, invalid, "voice"),
        ("unknown response_format", post({"input": "hi", "response_format": "ogg"}), 400, invalid, "response_format"),
        ("speed too low", post({"input": "hi", "speed": 0.1}), 400, invalid, "speed"),
        ("speed too high", post({"input": "hi", "speed": 10}), 400, invalid, "speed"),
        ("speed is a string", post({"input": "hi", "speed": "fast"}), 400, invalid, "speed"),
        ("speed is NaN", raw(b'{"input": "hi", "speed": NaN}'), 400, invalid, "speed"),
        ("malformed JSON", raw(b'{"input": "hi"'), 400, invalid, None),
        ("body is not JSON at all", raw(b"\x00\xff\xfe garbage"), 400, invalid, None),
        ("body is a JSON array", post(["hi"]), 400, invalid, None),
        ("empty body", raw(b""), 400, invalid, None),
        ("input is a number", post({"input": 42}), 400, invalid, "input"),
        ("voice is a list", post({"input": "hi", "voice": []}), 400, invalid, "voice"),
        ("seed is a float", post({"input": "hi", "seed": 1.5}), 400, invalid, "seed"),
        ("missing input", post({"model": "tts-1", "voice": "tara"}), 400, invalid, "input"),
        ("input and text differ", post({"input": "a", "text": "b"}), 400, invalid, "text"),
        ("unknown field", post({"input": "hi", "volume": 11}), 400, invalid, "volume"),
        ("unknown stream_format", post({"input": "hi", "stream_format": "chunks"}), 400, invalid, "stream_format"),
        ("temperature negative", post({"input": "hi", "temperature": -1}), 400, invalid, "temperature"),
        ("top_p above one", post({"input": "hi", "top_p": 1.5}), 400, invalid, "top_p"),
        ("max_tokens negative", post({"input": "hi", "max_tokens": -7}), 400, invalid, "max_tokens"),
        ("huge body", raw(b'{"input": "' + b"a" * 70_000 + b'"}'), 413, "request_too_large", None),
        ("GET on the speech endpoint", {"method": "GET", "url": speech}, 405, "method_not_allowed", None),
        ("unknown path", {"method": "POST", "url": f"{base}/v1/audio/sing", "json": {"input": "hi"}}, 404,
         "not_found", None),
    ]


def _ws_cases() -> list[tuple[str, str | bytes, str | None]]:
    """(name, message, error param); every reply is an invalid_request error message."""
    return [
        ("binary garbage", b"\x00\x01\xfe\xff" * 64, None),
        ("invalid JSON", "{not json", None),
        ("JSON array", '["hello"]', None),
        ("empty text", json.dumps({"text": ""}), "input"),
        ("unknown voice", json.dumps({"text": "hi", "voice": "bob"}), "voice"),
        ("bad speed", json.dumps({"text": "hi", "speed": 9}), "speed"),
        ("bad sample rate", json.dumps({"text": "hi", "sample_rate": 1000}), "sample_rate"),
        ("opus at 44.1 kHz", json.dumps({"text": "hi", "response_format": "opus", "sample_rate": 44100}),
         "sample_rate"),
        ("unknown field", json.dumps({"text": "hi", "loudness": 3}), "loudness"),
        ("malformed cancel", json.dumps({"cancel": "yes"}), "cancel"),
    ]


def _grpc_cases() -> list[tuple[str, bytes, grpc.StatusCode, str | None]]:
    """(name, serialized request, status, error param in the trailing metadata). The size limit is gRPC's own:
    no error metadata."""
    def req(**kwargs: Any) -> bytes:
        return pb.SynthesizeRequest(**kwargs).SerializeToString()

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    return [
        ("empty text", req(text=""), invalid, "input"),
        ("whitespace text", req(text="   "), invalid, "input"),
        ("text too long", req(text="a" * (MAX_TEXT + 1)), invalid, "input"),
        ("unknown voice", req(text="hi", voice="bob"), invalid, "voice"),
        ("unknown fields", req(text="hi") + b"\x98\x06\x01", invalid, "SynthesizeRequest"),
        ("unknown format value", req(text="hi") + b"\x18\x63", invalid, "format"),
        ("sample rate too low", req(text="hi", sample_rate=1000), invalid, "sample_rate"),
        ("opus at 44.1 kHz", req(text="hi", format=pb.AUDIO_FORMAT_OPUS, sample_rate=44100), invalid, "sample_rate"),
        ("speed too high", req(text="hi", speed=9.0), invalid, "speed"),
        ("bad top_p", req(text="hi", sampling=pb.SamplingOptions(top_p=2.0)), invalid, "top_p"),
        ("message over server.max_body_bytes", req(text="a" * 70_000), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    ]


def test_bad_input_gets_the_right_4xx_while_a_good_stream_is_untouched(server: ServerThread) -> None:
    base = server.base_url
    good_request = {"text": "The good stream keeps going.", "max_tokens": 350, "seed": 11}
    http_cases, ws_cases, grpc_cases = _http_cases(base), _ws_cases(), _grpc_cases()

    async def good_stream() -> api_client.ClientResult:
        return await api_client.synthesize_ws(base, good_request["text"], max_tokens=good_request["max_tokens"],
                                              seed=good_request["seed"])

    async def http_suite() -> list[str]:
        problems = []
        async with httpx.AsyncClient(timeout=30) as http:
            for name, spec, status, code, param in http_cases:
                response = await http.request(**spec)
                error = response.json().get("error", {})
                got = (response.status_code, error.get("code"), error.get("param"))
                if got != (status, code, param):
                    problems.append(f"HTTP {name}: {got}, expected {(status, code, param)}: {response.text[:200]}")
                elif set(error) != {"message", "type", "param", "code"} or not error["message"]:
                    problems.append(f"HTTP {name}: not an OpenAI error body: {response.text[:200]}")
        return problems

    async def ws_suite() -> list[str]:
        from websockets.asyncio.client import connect

        problems = []
        async with connect(api_client.stream_url(base)) as ws:
            for name, message, param in ws_cases:
                await ws.send(message)
                reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
                error = reply.get("error", {})
                if (error.get("code"), error.get("param")) != ("invalid_request", param) or not error.get("message"):
                    problems.append(f"WS {name}: {reply}, expected param {param!r}")
            # Still open and serving after every bad message.
            await ws.send(json.dumps({"text": "Still here.", **SHORT}))
            audio = 0
            while True:
                message = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(message, bytes):
                    audio += len(message)
                    continue
                reply = json.loads(message)
                if not reply.get("done") or audio != reply["metrics"]["samples"] * 2 or not audio:
                    problems.append(f"WS after bad input: {reply}, {audio} bytes")
                break
        return problems

    async def grpc_suite() -> list[str]:
        problems = []
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            # Raw bytes in, so requests a stub could not build (unknown fields) go over the wire as sent.
            synthesize = channel.unary_stream("/orpheus.v1.Synthesizer/Synthesize",
                                              response_deserializer=pb.SynthesizeResponse.FromString)
            for name, payload, code, param in grpc_cases:
                try:
                    async for _ in synthesize(payload, timeout=30):
                        pass
                    problems.append(f"gRPC {name}: succeeded")
                except grpc.aio.AioRpcError as exc:
                    trailing = dict(exc.trailing_metadata() or ())
                    expected_code = None if param is None else "invalid_request"
                    got = (exc.code(), trailing.get("error-code"), trailing.get("error-param"))
                    if got != (code, expected_code, param) or not exc.details():
                        problems.append(f"gRPC {name}: {got} {exc.details()}, expected {(code, expected_code, param)}")
        return problems

    async def everything():
        good = asyncio.create_task(good_stream())
        suites = await asyncio.gather(http_suite(), ws_suite(), grpc_suite())
        return await good, [p for suite in suites for p in suite]

    alone = asyncio.run(api_client.synthesize_ws(base, good_request["text"], max_tokens=good_request["max_tokens"],
                                                 seed=good_request["seed"]))
    good, problems = asyncio.run(everything())
    assert not problems, "\n".join(problems)
    assert alone.ok and good.ok, (alone.error, good.error)
    # Same seed, same utterance: the stream that ran beside the bad input is bit-identical to one run alone.
    assert len(good.audio) > 0 and good.audio == alone.audio
    assert good.metrics["samples"] == alone.metrics["samples"]
    assert good.metrics["finish_reason"] == alone.metrics["finish_reason"] == "stop"
    # No 500 was ever counted.
    outcomes = stats(server)["gateway"]["requests"]
    assert not any(status in ("internal_error", "engine_error") for p in outcomes.values() for status in p)


def test_error_bodies_name_the_parameter(server: ServerThread) -> None:
    speech = f"{server.base_url}/v1/audio/speech"
    assert check_openai_error(httpx.post(speech, json={"input": "hi", "speed": 9}), 400)["param"] == "speed"
    assert check_openai_error(httpx.post(speech, json={"input": "a" * (MAX_TEXT + 1)}), 400)["param"] == "input"
    assert check_openai_error(httpx.post(speech, json={"input": "hi", "response_format": "x"}),
                              400)["param"] == "response_format"
    check_openai_error(httpx.post(speech, content=b"x" * 70_000), 413, "request_too_large")
    response = httpx.delete(speech)
    check_openai_error(response, 405, "method_not_allowed")


def test_grpc_errors_carry_code_and_parameter_in_trailing_metadata(server: ServerThread) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel, pytest.raises(grpc.RpcError) as rpc:
        list(pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(text="hi", voice="bob")))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown voice" in rpc.value.details()
    trailing = dict(rpc.value.trailing_metadata())
    assert trailing["error-code"] == "invalid_request" and trailing["error-param"] == "voice"
