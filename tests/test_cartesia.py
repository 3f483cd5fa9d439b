"""The Cartesia-compatible WebSocket (/tts/websocket) on the wire: a real server on loopback, tiny models, greedy.

The agent frameworks' own clients are driven in test_cartesia_clients.py; here a plain WebSocket client
checks the message shapes, the contexts multiplexed on one socket, errors, auth and cancellation.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from websockets.asyncio.client import connect

from orpheus_serve.api.cartesia import MAX_CONTEXTS_PER_CONNECTION
from orpheus_serve.api.launch import ServerThread
from orpheus_serve.audio.encoding import decode_audio
from orpheus_serve.client import protocols as api_client
from orpheus_serve.request.types import PROTOCOLS
from orpheus_serve.service.build import build_service
from orpheus_serve.service.word_timings import words_of
from tests.cartesia_support import (
    INTERRUPTED,
    REPLY,
    ContextLog,
    Stop,
    assert_same_audio,
    await_stop,
    before_cancel,
    cancelled_streams,
    generation,
    receive_until,
    ws_url,
)
from tests.gateway_support import metric_values, settled_stats, sim_config, stats, tiny_config

KEPT = "The weather today is sunny, with a light breeze."
CHUNK_FIELDS = {"type", "data", "done", "status_code", "context_id", "step_time"}
ERROR_FIELDS = {"type", "error", "message", "title", "error_code", "status_code", "done", "context_id"}


def greedy_server(tiny_orpheus: Path, tiny_snac: Path, **overrides: object) -> ServerThread:
    config = tiny_config(tiny_orpheus, tiny_snac, **{"sampling.temperature": 0.0, "scheduler.admission": "slots",
                                                     **overrides})
    return ServerThread(config, build_service(config, record_tokens=True)).start()


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    srv = greedy_server(tiny_orpheus, tiny_snac)
    yield srv
    srv.stop()


async def one_context(server: ServerThread, transcript: str, **options: object) -> ContextLog:
    logs: dict[str, ContextLog] = {}
    async with connect(ws_url(server)) as ws:
        await ws.send(generation("solo", transcript, **options))
        await receive_until(ws, logs, {"solo"})
    return logs["solo"]


def test_a_context_streams_chunks_then_done_and_sounds_like_rest(server: ServerThread) -> None:
    log = asyncio.run(one_context(server, REPLY, add_timestamps=True))
    assert log.final == {"type": "done", "done": True, "status_code": 206, "context_id": "solo"}
    chunks = [m for _, m in log.messages if m["type"] == "chunk"]
    assert chunks and all(set(m) == CHUNK_FIELDS and m["done"] is False and m["status_code"] == 206
                          for m in chunks)
    assert all(m["step_time"] >= 0 for m in chunks)
    # The same text over REST, where nothing is incremental: the same greedy speech.
    rest = httpx.post(f"{server.base_url}/v1/audio/speech",
                      json={"input": REPLY, "voice": "tara", "response_format": "pcm"}, timeout=120)
    assert rest.status_code == 200
    assert_same_audio(bytes(log.audio), rest.content)
    # Timestamps: every word, in order, monotonic, within the audio; each after its chunk's audio.
    stamps = [m["word_timestamps"] for _, m in log.messages if m["type"] == "timestamps"]
    words = [w for s in stamps for w in s["words"]]
    assert words == words_of(REPLY)
    starts = [t for s in stamps for t in s["start"]]
    ends = [t for s in stamps for t in s["end"]]
    assert all(a <= b for a, b in zip(starts, ends, strict=True))
    assert all(b <= c for b, c in zip(ends, starts[1:], strict=False))
    assert starts[0] >= 0 and ends[-1] <= len(log.audio) / 2 / 24000 + 1e-3
    assert log.kinds[0] == "chunk"


def test_float_resampled_and_telephony_encodings(server: ServerThread) -> None:
    text = "The weather today is sunny."
    encodings = {"s24": ("pcm_s16le", 24000), "s16": ("pcm_s16le", 16000), "f32": ("pcm_f32le", 16000),
                 "s8": ("pcm_s16le", 8000), "ulaw": ("pcm_mulaw", 8000), "alaw": ("pcm_alaw", 8000)}

    async def scenario() -> dict[str, ContextLog]:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            for name, (encoding, rate) in encodings.items():
                await ws.send(generation(name, text, encoding=encoding, sample_rate=rate))
            await receive_until(ws, logs, set(encodings))
        return logs

    logs = asyncio.run(scenario())
    assert all(logs[name].final["type"] == "done" for name in ("s24", "s16", "f32", "s8"))
    ints = np.frombuffer(bytes(logs["s16"].audio), "<i2")
    floats = np.frombuffer(bytes(logs["f32"].audio), "<f4")
    assert len(floats) == len(ints) > 0
    assert np.max(np.abs(floats * 32768.0 - ints)) <= 2  # the same speech (codec batching aside), as floats
    assert np.all(np.abs(floats) <= 1.0)
    assert abs(len(ints) - len(logs["s24"].audio) // 2 * 2 / 3) <= 16  # resampled from the model's 24 kHz
    s8 = np.frombuffer(bytes(logs["s8"].audio), "<i2").astype(np.float64)
    for name, fmt in (("ulaw", "mulaw"), ("alaw", "alaw")):  # one byte a sample, within companding error
        log = logs[name]
        assert log.final["type"] == "done" and len(log.audio) == len(s8)
        decoded, _ = decode_audio(bytes(log.audio), fmt, sample_rate=8000)
        noise = np.sum((decoded.astype(np.float64) - s8) ** 2)
        assert 10 * np.log10(np.sum(s8**2) / max(noise, 1.0)) > 25


@pytest.mark.parametrize(("frame", "context_id", "says"), [
    ("not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    (json.dumps({"transcript": "Hello.", "continue": False}), None, "context_id"),
    (json.dumps({"context_id": "x", "transcript": 5}), "x", "transcript"),
    (json.dumps({"context_id": "x", "transcript": "Hi.", "continue": "yes"}), "x", "continue"),
    (json.dumps({"context_id": "x", "transcript": "Hi.", "add_timestamps": 1}), "x", "add_timestamps"),
    (generation("x", "Hi.", encoding="mp3"), "x", "encoding"),
    (generation("x", "Hi.", sample_rate=12345), "x", "sample_rate"),
    (json.dumps({"context_id": "x", "transcript": "Hi.", "output_format": {"container": "wav"}}), "x", "container"),
    (json.dumps({"context_id": "x", "transcript": "Hi.", "voice": 5}), "x", "voice"),
    (json.dumps({"context_id": "x", "transcript": "Hi.", "voice": "nobody"}), "x", "unknown voice"),
    (generation("x", "Hi.", voice="nobody"), "x", "unknown voice"),
    (generation("x", "Hi.", max_buffer_delay_ms=-1), "x", "max_buffer_delay_ms"),
    (json.dumps({"context_id": "x", "cancel": "please"}), "x", "cancel"),
    (json.dumps({"context_id": 7, "transcript": "Hi."}), None, "context_id"),
    (generation("x", "bad \ud800 surrogate"), "x", "text"),
])
def test_bad_frames_get_a_cartesia_error_and_the_socket_stays_open(server: ServerThread, frame: str,
                                                                    context_id: str | None, says: str) -> None:
    async def scenario() -> tuple[dict, ContextLog]:
        async with connect(ws_url(server)) as ws:
            await ws.send(frame)
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            logs: dict[str, ContextLog] = {}
            await ws.send(generation("after", "Still here.", more=False))
            await receive_until(ws, logs, {"after"})
        return error, logs["after"]

    error, after = asyncio.run(scenario())
    assert set(error) == ERROR_FIELDS, error
    assert error["type"] == "error" and error["done"] is True and error["status_code"] == 400
    assert error["context_id"] == context_id
    assert says in error["error"], error
    assert after.final["type"] == "done" and len(after.audio) > 0


def test_binary_frames_are_refused_and_the_socket_stays_open(server: ServerThread) -> None:
    async def scenario() -> dict:
        async with connect(ws_url(server)) as ws:
            await ws.send(b"\x00\x01")
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    error = asyncio.run(scenario())
    assert error["type"] == "error" and error["status_code"] == 400 and error["context_id"] is None


def test_a_cartesia_voice_id_speaks_with_the_default_voice(server: ServerThread) -> None:
    uuid_voice = asyncio.run(one_context(server, "Hello there.", voice="a0e99841-438c-4a64-b679-ae501e7d6091"))
    tara = asyncio.run(one_context(server, "Hello there.", voice="tara"))
    alias = asyncio.run(one_context(server, "Hello there.", voice="alloy"))  # OpenAI's name for tara
    assert_same_audio(bytes(uuid_voice.audio), bytes(tara.audio))
    assert_same_audio(bytes(alias.audio), bytes(tara.audio))


def test_flush_is_answered_after_its_audio(server: ServerThread) -> None:
    async def scenario() -> ContextLog:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("f", "A first thought without an end", more=True, flush=True))
            await ws.send(generation("f", " and then the rest of it.", more=False))
            await receive_until(ws, logs, {"f"})
        return logs["f"]

    log = asyncio.run(scenario())
    kinds = log.kinds
    flush = kinds.index("flush_done")
    message = log.messages[flush][1]
    assert message == {"type": "flush_done", "context_id": "f", "done": False, "flush_done": True, "flush_id": 1,
                       "status_code": 206}
    assert "chunk" in kinds[:flush] and "chunk" in kinds[flush:] and kinds[-1] == "done"
    # As Cartesia numbers them: the audio of the text sent after the first flush carries flush_id 1.
    chunks = [(k, m) for k, (_, m) in enumerate(log.messages) if m["type"] == "chunk"]
    assert all("flush_id" not in m for k, m in chunks if k < flush)
    assert all(m["flush_id"] == 1 and set(m) == CHUNK_FIELDS | {"flush_id"} for k, m in chunks if k > flush)


@pytest.fixture(scope="module")
def long_server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    """Chunks of up to 50 frames (4 s): a context is still generating when its first audio plays."""
    srv = greedy_server(tiny_orpheus, tiny_snac, **{"sampling.max_tokens": 350})
    yield srv
    srv.stop()


def test_cancel_stops_one_context_and_leaves_the_other_on_the_socket_untouched(long_server: ServerThread) -> None:
    server = long_server

    async def scenario() -> tuple[bytes, ContextLog, ContextLog, Stop, int, int]:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("alone", KEPT))
            await receive_until(ws, logs, {"alone"})
            alone = bytes(logs["alone"].audio)

            await ws.send(generation("stop", INTERRUPTED, more=True))
            await ws.send(generation("keep", KEPT))
            # Barge-in once the interrupted answer is playing.
            while "stop" not in logs or not logs["stop"].audio:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                log = logs.setdefault(message["context_id"], ContextLog())
                log.messages.append((0.0, message))
                if message["type"] == "chunk":
                    log.audio += base64.b64decode(message["data"])
            at_cancel = before_cancel(server, INTERRUPTED[:20])
            await ws.send(json.dumps({"context_id": "stop", "cancel": True}))
            stopped = await await_stop(server, INTERRUPTED[:20], at_cancel)
            cancelled = cancelled_streams(server) - at_cancel.cancelled
            received_at_cancel = len(logs["stop"].messages)
            await ws.send(generation("stop", "Text sent after the cancel is dropped.", more=False))
            await receive_until(ws, logs, {"keep"})
        return alone, logs["stop"], logs["keep"], stopped, cancelled, received_at_cancel

    alone, stop, keep, stopped, cancelled, received_at_cancel = asyncio.run(scenario())
    # How soon the server stops, in milliseconds and engine steps, is scripts/bench_barge_in.py's figure.
    print(f"after the cancel's sending: {stopped}")
    stopped.check()
    assert cancelled == 1
    assert "done" not in stop.kinds and "error" not in stop.kinds
    # What was on its way when the cancel left may still arrive; nothing is generated for it after.
    assert len(stop.messages) - received_at_cancel <= 2
    assert keep.final["type"] == "done"
    assert_same_audio(bytes(keep.audio), alone)
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0
    assert snapshot["gateway"]["active_streams"]["cartesia"] == 0


def test_a_cancel_stops_generation_between_gpu_like_steps(tiny_orpheus: Path) -> None:
    """Engine steps of 25 ms (the sim engine, pacing like a GPU under load): the cancel stops the context
    while its answer has most of its frames left, and nothing of it is generated on."""
    config = sim_config(tiny_orpheus, **{"engine.sim.step_base_ms": 25.0})
    server = ServerThread(config, build_service(config, record_tokens=True)).start()

    async def scenario() -> tuple[Stop, ContextLog]:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("stop", INTERRUPTED, more=True))
            while "stop" not in logs or not logs["stop"].audio:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                log = logs.setdefault(message["context_id"], ContextLog())
                log.messages.append((0.0, message))
                if message["type"] == "chunk":
                    log.audio += base64.b64decode(message["data"])
            at_cancel = before_cancel(server, INTERRUPTED[:20])
            await ws.send(json.dumps({"context_id": "stop", "cancel": True}))
            return await await_stop(server, INTERRUPTED[:20], at_cancel), logs["stop"]

    try:
        stopped, stop = asyncio.run(scenario())
        print(f"after the cancel's sending: {stopped}")
        stopped.check()
        snapshot = settled_stats(lambda: stats(server))
        assert snapshot["kv_cache"]["used_slots"] == 0
        assert "done" not in stop.kinds
    finally:
        server.stop()


def test_disconnect_cancels_every_context_of_the_socket(server: ServerThread) -> None:
    before = stats(server)["gateway"]["requests"]["cartesia"].get("cancelled", 0)

    async def scenario() -> None:
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("one", INTERRUPTED, more=True))
            await ws.send(generation("two", REPLY, more=True))  # neither can finish before the socket goes
            chunks = 0
            while chunks < 2:
                if json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] == "chunk":
                    chunks += 1

    asyncio.run(scenario())
    snapshot = settled_stats(lambda: stats(server), outcomes=None)
    assert snapshot["scheduler"]["active_sessions"] == 0 and snapshot["kv_cache"]["used_slots"] == 0
    assert snapshot["gateway"]["active_streams"]["cartesia"] == 0
    assert snapshot["gateway"]["open_connections"] == 0
    assert snapshot["gateway"]["requests"]["cartesia"].get("cancelled", 0) - before == 2


def test_cartesia_is_counted_in_stats_and_metrics(server: ServerThread) -> None:
    """Exact counts on the shared server: the other tests' requests are in the figures before and after."""
    ok_metric = '{protocol="cartesia",status="ok"}'

    def metric_ok() -> float:
        return metric_values(httpx.get(f"{server.base_url}/metrics").text, "orpheus:requests_total").get(ok_metric, 0)

    ok_before = stats(server)["gateway"]["requests"].get("cartesia", {}).get("ok", 0)
    metric_before = metric_ok()
    asyncio.run(one_context(server, "Counted."))
    snapshot = settled_stats(lambda: stats(server))
    assert set(PROTOCOLS) <= set(snapshot["gateway"]["requests"]) and "cartesia" in PROTOCOLS
    assert snapshot["gateway"]["requests"]["cartesia"]["ok"] - ok_before == 1
    assert metric_ok() - metric_before == 1


@pytest.fixture(scope="module")
def keyed_server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    srv = greedy_server(tiny_orpheus, tiny_snac, **{"server.api_keys": ["sk-cartesia"]})
    yield srv
    srv.stop()


@pytest.mark.parametrize(("headers", "query"), [
    ({"X-API-Key": "sk-cartesia"}, ""),
    ({}, "?api_key=sk-cartesia&cartesia_version=2025-04-16"),
    ({"Authorization": "Bearer sk-cartesia"}, ""),
])
def test_api_key_by_header_query_or_bearer(keyed_server: ServerThread, headers: dict[str, str], query: str) -> None:
    async def scenario() -> ContextLog:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(keyed_server) + query, additional_headers=headers) as ws:
            await ws.send(generation("k", "Welcome back."))
            await receive_until(ws, logs, {"k"})
        return logs["k"]

    assert asyncio.run(scenario()).final["type"] == "done"


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong"}, {"Authorization": "Basic sk-cartesia"}])
def test_a_missing_or_wrong_key_is_refused_at_the_handshake(keyed_server: ServerThread, headers: dict[str, str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """401 with Cartesia's body; the server logs the refusal at INFO and no ERROR line (a client's mistake)."""
    caplog.set_level(logging.INFO, logger="uvicorn.error")  # the server runs at warning level

    async def scenario() -> None:
        async with connect(ws_url(keyed_server), additional_headers=headers):
            pass

    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(scenario())
    response = refused.value.response
    assert response.status_code == 401
    body = json.loads(response.body)
    assert body["type"] == "error" and body["status_code"] == 401 and "API key" in body["error"]
    # One more request on the server's event loop: the refused handshake's task has returned by its answer.
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200
    assert any(r.name == "uvicorn.error" and " 401" in r.getMessage() for r in caplog.records)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def test_with_no_buffer_delay_every_transcript_is_its_own_chunk(server: ServerThread) -> None:
    """Pipecat's sentence mode: whole sentences without spaces between, max_buffer_delay_ms 0."""
    async def scenario() -> ContextLog:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            for k, sentence in enumerate(("Hello there.", "How are you?")):
                await ws.send(generation("s", sentence, more=True, add_timestamps=True, max_buffer_delay_ms=0))
                if k == 0:  # the first is spoken before the second is written
                    await receive_until_kind(ws, logs, "s", "flush_done")
            await ws.send(generation("s", "", more=False, max_buffer_delay_ms=0))
            await receive_until(ws, logs, {"s"})
        return logs["s"]

    log = asyncio.run(scenario())
    assert [m["flush_id"] for _, m in log.messages if m["type"] == "flush_done"] == [1, 2]
    stamps = [m["word_timestamps"]["words"] for _, m in log.messages if m["type"] == "timestamps"]
    assert stamps == [["Hello", "there"], ["How", "are", "you"]]
    assert [m.get("flush_id") for _, m in log.messages if m["type"] == "timestamps"] == [None, 1]
    assert log.kinds[-1] == "done"


def test_a_bare_voice_id_is_a_voice(server: ServerThread) -> None:
    """The `cartesia` SDK 4 types `voice` as an id string or an object; both name the same voice."""
    async def bare_voice() -> ContextLog:
        logs: dict[str, ContextLog] = {}
        message = {**json.loads(generation("bare", "Hello there.")), "voice": "leo"}
        async with connect(ws_url(server)) as ws:
            await ws.send(json.dumps(message))
            await receive_until(ws, logs, {"bare"})
        return logs["bare"]

    bare = asyncio.run(bare_voice())
    as_object = asyncio.run(one_context(server, "Hello there.", voice="leo"))
    tara = asyncio.run(one_context(server, "Hello there.", voice="tara"))
    assert bare.final["type"] == "done"
    assert_same_audio(bytes(bare.audio), bytes(as_object.audio))
    assert bytes(bare.audio) != bytes(tara.audio)


async def receive_until_kind(ws: object, logs: dict[str, ContextLog], context_id: str, kind: str) -> None:
    while kind not in (logs[context_id].kinds if context_id in logs else []):
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))  # type: ignore[attr-defined]
        log = logs.setdefault(message["context_id"], ContextLog())
        log.messages.append((0.0, message))
        if message["type"] == "chunk":
            log.audio += base64.b64decode(message["data"])


def test_text_after_the_end_stops_the_context_with_an_error(server: ServerThread) -> None:
    async def scenario() -> ContextLog:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("e", "Short and done.", more=False))
            await ws.send(generation("e", "", more=False))  # a repeated end: nothing to do
            await ws.send(generation("e", "One more thing.", more=False))
            await receive_until(ws, logs, {"e"})
        return logs["e"]

    log = asyncio.run(scenario())
    assert log.final["type"] == "error" and log.final["status_code"] == 400
    assert "ended" in log.final["error"]


def test_an_oversized_transcript_costs_only_its_own_context(server: ServerThread) -> None:
    """A 100,000-character transcript (over the old 65,536-byte frame limit) for one of two live contexts: an
    error for that context; the other finishes its audio whole, the same audio as alone."""
    kept = "Sure, I can help with that."

    async def scenario(with_neighbour: bool) -> dict[str, ContextLog]:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("kept", kept + " ", more=True))
            if with_neighbour:
                await ws.send(generation("hit", "Something else entirely, said at length. ", more=True))
                await receive_until_kind(ws, logs, "kept", "chunk")  # both are live
                await ws.send(generation("hit", "word " * 20_000, more=True))
            await ws.send(generation("kept", "", more=False))
            await receive_until(ws, logs, {"kept", "hit"} if with_neighbour else {"kept"})
        return logs

    logs = asyncio.run(scenario(with_neighbour=True))
    assert logs["hit"].final["type"] == "error" and logs["hit"].final["status_code"] == 400, logs["hit"].final
    assert logs["kept"].final["type"] == "done"
    assert_same_audio(bytes(logs["kept"].audio), bytes(asyncio.run(scenario(with_neighbour=False))["kept"].audio))


def test_contexts_per_socket_are_bounded(server: ServerThread) -> None:
    async def scenario() -> dict:
        async with connect(ws_url(server)) as ws:
            for k in range(MAX_CONTEXTS_PER_CONNECTION):  # open, waiting for text
                await ws.send(generation(f"c{k}", "", more=True))
            await ws.send(generation("one-too-many", "Hello.", more=False))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    error = asyncio.run(scenario())
    assert error["type"] == "error" and error["context_id"] == "one-too-many" and error["status_code"] == 400
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["gateway"]["active_streams"]["cartesia"] == 0 and snapshot["gateway"]["open_connections"] == 0


def test_client_cli_speaks_over_the_cartesia_protocol(server: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    code = api_client.main(["--url", server.base_url, "--text", "Hello there.", "--voice", "tara",
                            "--output", str(out), "--protocol", "cartesia"])
    assert code == 0 and out.stat().st_size > 44


@pytest.mark.slow
def test_a_client_that_stops_reading_is_cut_off(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> None:
    """Its socket buffers fill, the server's sends wait, and after server.stalled_client_timeout_s its contexts
    are cancelled and the connection is reset; the server keeps serving."""
    srv = greedy_server(tiny_orpheus, tiny_snac, **{"sampling.max_tokens": 350, "server.stalled_client_timeout_s": 1.5,
                                                    "server.socket_send_buffer_bytes": 16384})
    try:
        async def stop_reading() -> None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            sock.connect(("127.0.0.1", srv.http_port))
            sock.setblocking(False)
            ws = await connect(ws_url(srv), sock=sock, max_queue=1, max_size=None)
            await ws.send(generation("quiet", REPLY))
            for _ in range(600):  # bounded: until the server resets the connection
                if srv.server.gateway.limiter.open == 0:
                    break
                await asyncio.sleep(0.1)
            ws.transport.abort()

        before = stats(srv)["gateway"]["requests"]["cartesia"].get("client_stalled", 0)
        asyncio.run(stop_reading())
        snapshot = settled_stats(lambda: stats(srv))
        assert snapshot["gateway"]["requests"]["cartesia"].get("client_stalled", 0) - before == 1
        assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["open_connections"] == 0
        assert asyncio.run(one_context(srv, "Still serving.")).final["type"] == "done"
    finally:
        srv.stop()


def test_a_bad_message_for_an_open_context_ends_it_as_its_error_says(server: ServerThread) -> None:
    async def scenario() -> tuple[ContextLog, ContextLog]:
        logs: dict[str, ContextLog] = {}
        async with connect(ws_url(server)) as ws:
            await ws.send(generation("broken", "A reply that goes on", more=True))
            await ws.send(generation("fine", "Another reply.", more=False))
            await ws.send(json.dumps({"context_id": "broken", "transcript": ["not", "text"], "continue": True}))
            await receive_until(ws, logs, {"broken", "fine"})
            await ws.send(generation("broken", " and on.", more=False))  # dropped: the context is over
            await ws.send(generation("last", "Last one.", more=False))
            await receive_until(ws, logs, {"last"})
        return logs["broken"], logs["fine"]

    broken, fine = asyncio.run(scenario())
    assert broken.final["type"] == "error" and broken.final["status_code"] == 400 and broken.kinds[-1] == "error"
    assert fine.final["type"] == "done"
