"""Cartesia's HTTP endpoints (`POST /tts/bytes`, `POST /tts/sse`) and the WebSocket's flush ids, driven by the
clients that call them, unchanged from PyPI: the `cartesia` SDK, LiveKit's Cartesia `synthesize()` and
Pipecat's `CartesiaHttpTTSService`, each pointed at the server by base URL alone.

Greedy decoding on the tiny models makes a text's speech reproducible, so each client's audio is checked
against the native API's (`POST /v1/audio/speech`) for the same text and voice.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import pytest
from cartesia import AsyncCartesia, AuthenticationError, BadRequestError, Cartesia
from livekit.plugins import cartesia as lk_cartesia
from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame, TTSStoppedFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.services.cartesia.tts import CartesiaHttpTTSService
from pipecat.workers.runner import WorkerRunner

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.audio.encoding import decode_audio, g711_decode
from orpheus_serve.request.errors import EngineFailureError
from orpheus_serve.request.types import AudioChunk, ChunkTimings, SynthesisMetrics, SynthesisRequest
from orpheus_serve.service.build import build_service
from orpheus_serve.service.word_timings import words_of
from tests.cartesia_support import REPLY, assert_same_audio
from tests.gateway_support import settled_stats, stats, tiny_config
from tests.test_cartesia_clients import Recorder

API_KEY = "sk-cartesia"
TEXT = "The weather today is sunny, with a light breeze."
VOICE = "leo"
RAW_24K = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}
ERROR_FIELDS = {"error_code", "title", "message", "request_id"}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    config = tiny_config(tiny_orpheus, tiny_snac, **{"sampling.temperature": 0.0, "scheduler.admission": "slots",
                                                     "server.api_keys": [API_KEY]})
    srv = ServerThread(config, build_service(config)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def long_server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    """Chunks of up to 50 frames (4 s): a reply is still generating when its first audio is out. A request
    whose transcript starts with "Fail" meets an engine failure after its first audio chunk (injected into
    the real service: Orpheus on CPU does not fail by itself)."""
    config = tiny_config(tiny_orpheus, tiny_snac, **{"sampling.temperature": 0.0, "sampling.max_tokens": 350,
                                                     "server.api_keys": [API_KEY]})
    service = build_service(config)
    synthesize = service.synthesize

    async def failing_after_first_chunk(req: SynthesisRequest
                                        ) -> AsyncIterator[AudioChunk | ChunkTimings | SynthesisMetrics]:
        async with contextlib.aclosing(synthesize(req)) as items:
            async for item in items:
                yield item
                if isinstance(item, AudioChunk) and req.text.startswith("Fail"):
                    raise EngineFailureError("injected engine failure after the first chunk")

    service.synthesize = failing_after_first_chunk  # type: ignore[method-assign]
    srv = ServerThread(config, service).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def native(server: ServerThread) -> dict[str, bytes]:
    """The native API's answers for TEXT in VOICE, by response_format (fetched once)."""
    out: dict[str, bytes] = {}
    for fmt in ("pcm", "mp3", "mulaw"):
        response = httpx.post(f"{server.base_url}/v1/audio/speech", headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"input": TEXT, "voice": VOICE, "response_format": fmt}, timeout=120)
        assert response.status_code == 200, response.text
        out[fmt] = response.content
    return out


def sdk(server: ServerThread) -> Cartesia:
    return Cartesia(api_key=API_KEY, base_url=server.base_url, websocket_base_url=f"ws://127.0.0.1:{server.http_port}",
                    max_retries=0)


def generate(server: ServerThread, output_format: dict[str, Any], text: str = TEXT, **extra: Any) -> bytes:
    with sdk(server) as client:
        return client.tts.generate(model_id="sonic-3", transcript=text, voice={"mode": "id", "id": VOICE},
                                   output_format=output_format, language="en", **extra).read()


def f32_as_pcm16(data: bytes) -> bytes:
    """`pcm_f32le` audio back as the 16-bit samples it widens (exactly: each is a 16-bit value / 32768)."""
    scaled = np.frombuffer(data, "<f4") * 32768.0
    assert np.array_equal(scaled, np.round(scaled)) and np.abs(scaled).max() <= 32768
    return scaled.astype("<i2").tobytes()


def assert_same_g711(a: bytes, b: bytes, fmt: str) -> None:
    """Two G.711 streams of the same greedy speech: a sample the codec moved by a unit may land in the next
    quantisation step, which is about 1/16 of the magnitude (at least 16 in 16-bit units near zero)."""
    x, y = g711_decode(a, fmt).astype(np.int32), g711_decode(b, fmt).astype(np.int32)
    assert len(x) == len(y) > 0
    assert np.all(np.abs(x - y) <= 16 + np.abs(x) // 8)


def wav_parts(data: bytes) -> tuple[int, int, int, bytes]:
    """(format tag, sample rate, bits per sample, data) of a streamed 44-byte-header WAV."""
    riff, _, wave, fmt, _, tag, channels, rate, _, _, bits, data_id, size = struct.unpack_from(
        "<4sI4s4sIHHIIHH4sI", data)
    assert (riff, wave, fmt, data_id, channels, size) == (b"RIFF", b"WAVE", b"fmt ", b"data", 1, 0xFFFFFFFF)
    return tag, rate, bits, data[44:]


# ------------------------------------------------------------------ the cartesia SDK: bytes


def test_sdk_bytes_raw_and_wav_match_the_native_api(server: ServerThread, native: dict[str, bytes]) -> None:
    raw = generate(server, RAW_24K)
    assert_same_audio(raw, native["pcm"])
    assert_same_audio(f32_as_pcm16(generate(server, {**RAW_24K, "encoding": "pcm_f32le"})), native["pcm"])
    tag, rate, bits, body = wav_parts(generate(server, {**RAW_24K, "container": "wav"}))
    assert (tag, rate, bits) == (1, 24000, 16)
    assert_same_audio(body, native["pcm"])
    tag, rate, bits, body = wav_parts(generate(server, {**RAW_24K, "container": "wav", "encoding": "pcm_f32le"}))
    assert (tag, rate, bits) == (3, 24000, 32)  # WAVE_FORMAT_IEEE_FLOAT
    assert_same_audio(f32_as_pcm16(body), native["pcm"])


def test_sdk_bytes_telephony_and_other_rates(server: ServerThread, native: dict[str, bytes]) -> None:
    mulaw = generate(server, {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000})
    assert_same_g711(mulaw, native["mulaw"], "mulaw")  # the native API's `mulaw` (8 kHz)
    tag, rate, bits, body = wav_parts(generate(server, {"container": "wav", "encoding": "pcm_mulaw",
                                                        "sample_rate": 8000}))
    assert (tag, rate, bits) == (7, 8000, 8)  # WAVE_FORMAT_MULAW
    assert_same_g711(body, mulaw, "mulaw")
    alaw = generate(server, {"container": "raw", "encoding": "pcm_alaw", "sample_rate": 8000})
    tag, rate, bits, body = wav_parts(generate(server, {"container": "wav", "encoding": "pcm_alaw",
                                                        "sample_rate": 8000}))
    assert (tag, rate, bits) == (6, 8000, 8)  # WAVE_FORMAT_ALAW
    assert_same_g711(body, alaw, "alaw")
    # Both companded from the same 8 kHz samples: decoded, they agree within G.711's quantisation.
    mu, a = g711_decode(mulaw, "mulaw").astype(np.int32), g711_decode(alaw, "alaw").astype(np.int32)
    assert len(mu) == len(a) == len(native["pcm"]) // 2 // 3
    assert np.all(np.abs(mu - a) <= 8 + np.abs(mu) // 8)
    seconds = len(native["pcm"]) / 2 / 24000
    for rate in (16000, 22050, 44100, 48000):
        pcm = generate(server, {**RAW_24K, "sample_rate": rate})
        assert abs(len(pcm) / 2 - seconds * rate) <= rate * 0.01, (rate, len(pcm))


def test_sdk_bytes_mp3_matches_the_native_mp3(server: ServerThread, native: dict[str, bytes]) -> None:
    mp3 = generate(server, {"container": "mp3", "sample_rate": 24000, "bit_rate": 128000})
    assert mp3[:3] == b"ID3" or mp3[0] == 0xFF
    ours, rate = decode_audio(mp3, "mp3")
    theirs, native_rate = decode_audio(native["mp3"], "mp3")
    assert rate == native_rate == 24000
    assert len(ours) == len(theirs)
    assert np.abs(ours.astype(np.int32) - theirs.astype(np.int32)).max() <= 64


def test_sdk_bytes_honours_speed_and_takes_a_bare_voice_id(server: ServerThread) -> None:
    normal = generate(server, RAW_24K)
    with sdk(server) as client:
        bare = client.tts.generate(model_id="sonic-3", transcript=TEXT, voice=VOICE, output_format=RAW_24K,
                                   speed="normal", save=False, locale="en-US").read()
    assert_same_audio(bare, normal)
    fast = generate(server, RAW_24K, generation_config={"speed": 1.5, "volume": 1.0, "emotion": "calm"})
    assert abs(len(fast) / len(normal) - 1 / 1.5) < 0.05


# ------------------------------------------------------------------ the cartesia SDK: SSE


def test_sdk_sse_streams_chunks_timestamps_and_done(server: ServerThread, native: dict[str, bytes]) -> None:
    async def scenario() -> list[Any]:
        async with AsyncCartesia(api_key=API_KEY, base_url=server.base_url, max_retries=0) as client:
            stream = await client.tts.generate_sse(model_id="sonic-3", transcript=TEXT, voice={"id": VOICE},
                                                   output_format=RAW_24K, add_timestamps=True, context_id="sse-1")
            return [event async for event in stream]

    events = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and kinds.count("done") == 1 and "chunk" in kinds and "timestamps" in kinds
    assert all(e.context_id == "sse-1" for e in events)
    chunks = [e for e in events if e.type == "chunk"]
    assert all(e.status_code == 206 and e.done is False and e.step_time >= 0 for e in chunks)
    assert_same_audio(b"".join(e.audio for e in chunks), native["pcm"])
    words = [w for e in events if e.type == "timestamps" for w in e.word_timestamps.words]
    assert words == words_of(TEXT)
    ends = [t for e in events if e.type == "timestamps" for t in e.word_timestamps.end]
    assert ends == sorted(ends) and ends[-1] <= len(native["pcm"]) / 2 / 24000 + 1e-3


def test_sse_wire_format_and_no_timestamps_unless_asked(server: ServerThread, native: dict[str, bytes]) -> None:
    body = {"model_id": "sonic-3", "transcript": TEXT, "voice": VOICE,
            "output_format": {**RAW_24K, "encoding": "pcm_f32le"}}
    with httpx.stream("POST", f"{server.base_url}/tts/sse", json=body, timeout=120,
                      headers={"X-API-Key": API_KEY, "Cartesia-Version": "2025-04-16"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    blocks = [b for b in text.split("\n\n") if b]
    events = []
    for block in blocks:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    assert {e["type"] for e in events} == {"chunk", "done"}
    assert events[-1] == {"type": "done", "done": True, "status_code": 206, "context_id": None}
    audio = np.frombuffer(b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "chunk"), "<f4")
    assert_same_audio(f32_as_pcm16(audio.tobytes()), native["pcm"])


# ------------------------------------------------------------------ the cartesia SDK: WebSocket flush ids


def test_sdk_websocket_numbers_audio_by_flush(server: ServerThread) -> None:
    with sdk(server) as client, client.tts.websocket_connect() as connection:
        ctx = connection.context(model_id="sonic-3", voice={"mode": "id", "id": VOICE}, output_format=RAW_24K)
        ctx.push("Stay hungry, ")
        ctx.push("", flush=True)
        ctx.push("stay foolish.")
        ctx.no_more_inputs()  # the SDK sends the voice as a bare id here
        events = list(ctx.receive())
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and events[-1].status_code == 206, [(e.type, getattr(e, "message", "")) for e in events]
    flush = kinds.index("flush_done")
    assert events[flush].flush_id == 1
    before = [e for e in events[:flush] if e.type == "chunk"]
    after = [e for e in events[flush:] if e.type == "chunk"]
    assert before and after
    assert all(e.flush_id is None for e in before) and all(e.flush_id == 1 for e in after)
    assert all(e.step_time >= 0 for e in before + after)


# ------------------------------------------------------------------ LiveKit and Pipecat over HTTP


def test_livekit_synthesize_matches_the_native_api(server: ServerThread, native: dict[str, bytes]) -> None:
    async def scenario() -> bytes:
        async with aiohttp.ClientSession() as session:
            tts = lk_cartesia.TTS(base_url=server.base_url, api_key=API_KEY, http_session=session, voice=VOICE,
                                  sample_rate=24000)
            try:
                audio = bytearray()
                async with tts.synthesize(TEXT) as stream:
                    async for event in stream:
                        audio += bytes(event.frame.data.cast("b"))
                return bytes(audio)
            finally:
                await tts.aclose()

    audio = asyncio.run(scenario())
    # LiveKit's emitter cuts the stream into frames and pads the last one with silence.
    assert_same_audio(audio[:len(native["pcm"])], native["pcm"])
    assert not any(audio[len(native["pcm"]):])


def test_pipecat_http_service_matches_the_native_api(server: ServerThread, native: dict[str, bytes]) -> None:
    async def scenario() -> Recorder:
        tts = CartesiaHttpTTSService(api_key=API_KEY, base_url=server.base_url, sample_rate=24000,
                                     settings=CartesiaHttpTTSService.Settings(voice=VOICE))
        recorder = Recorder()
        worker = PipelineWorker(Pipeline([tts, recorder]), params=PipelineParams(audio_out_sample_rate=24000),
                                cancel_on_idle_timeout=False)
        started = asyncio.Event()

        @worker.event_handler("on_pipeline_started")
        async def on_started(worker: PipelineWorker, frame: Any) -> None:
            started.set()

        async def drive() -> None:
            from pipecat.frames.frames import EndFrame

            await asyncio.wait_for(started.wait(), 30)
            try:
                await worker.queue_frame(TTSSpeakFrame(TEXT))
                await recorder.wait_for(TTSStoppedFrame)
            finally:
                await worker.queue_frame(EndFrame())

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        await asyncio.gather(runner.run(), drive())
        return recorder

    recorder = asyncio.run(scenario())
    assert any(isinstance(f, TTSAudioRawFrame) for _, f in recorder.frames)
    assert_same_audio(recorder.audio(), native["pcm"])


# ------------------------------------------------------------------ auth and hostile input


def test_the_sdk_sees_cartesia_errors(server: ServerThread) -> None:
    with (Cartesia(api_key="wrong", base_url=server.base_url, max_retries=0) as client,
          pytest.raises(AuthenticationError) as wrong_key):
        client.tts.generate(model_id="sonic-3", transcript=TEXT, voice=VOICE, output_format=RAW_24K)
    assert wrong_key.value.status_code == 401 and set(wrong_key.value.body) == ERROR_FIELDS
    with sdk(server) as client, pytest.raises(BadRequestError) as bad:
        client.tts.generate(model_id="sonic-3", transcript=TEXT, voice="nobody", output_format=RAW_24K)
    assert bad.value.body["error_code"] == "invalid_request", bad.value.body
    assert "nobody" in bad.value.body["message"]


HOSTILE: list[tuple[str, str, dict[str, str], bytes | None, int, str]] = [
    # (what, path, extra headers, body, status, a word the message must hold)
    ("not JSON", "/tts/bytes", {}, b"{\"transcript\": ", 400, "JSON"),
    ("not UTF-8", "/tts/bytes", {}, b"\xff\xfe{}", 400, "UTF-8"),
    ("not an object", "/tts/sse", {}, b"[1, 2]", 400, "object"),
    ("deep nesting", "/tts/bytes", {}, b"[" * 60_000, 400, "deeply"),
    ("too large", "/tts/sse", {}, b" " * 70_000, 413, "max_body_bytes"),
    ("no body", "/tts/bytes", {}, b"", 400, "JSON"),
    ("no key", "/tts/bytes", {"X-API-Key": ""}, None, 401, "API key"),
    ("wrong key", "/tts/sse", {"X-API-Key": "sk-wrong"}, None, 401, "API key"),
    ("bad version", "/tts/bytes", {"Cartesia-Version": "latest"}, None, 400, "Cartesia-Version"),
]
HOSTILE_FIELDS: list[tuple[str, str, dict[str, Any], str]] = [
    # (what, path, fields over a good request, a word the message must hold)
    ("unknown field", "/tts/bytes", {"temperature": 0.5}, "temperature"),
    ("timestamps on bytes", "/tts/bytes", {"add_timestamps": True}, "add_timestamps"),
    ("unknown container", "/tts/bytes", {"output_format": {"container": "ogg", "sample_rate": 24000}}, "container"),
    ("unknown encoding", "/tts/bytes", {"output_format": {**RAW_24K, "encoding": "pcm_s24le"}}, "encoding"),
    ("unsupported rate", "/tts/bytes", {"output_format": {**RAW_24K, "sample_rate": 11025}}, "sample_rate"),
    ("rate as a string", "/tts/bytes", {"output_format": {**RAW_24K, "sample_rate": "24000"}}, "sample_rate"),
    ("mp3 without a rate", "/tts/bytes", {"output_format": {"container": "mp3", "bit_rate": 64000}}, "sample_rate"),
    ("extra format field", "/tts/bytes", {"output_format": {**RAW_24K, "channels": 2}}, "channels"),
    ("wav over SSE", "/tts/sse", {"output_format": {**RAW_24K, "container": "wav"}}, "container"),
    ("no transcript", "/tts/sse", {"transcript": None}, "transcript"),
    ("empty transcript", "/tts/bytes", {"transcript": ""}, "text"),
    ("embedding voice", "/tts/bytes", {"voice": {"mode": "embedding", "embedding": [0.1] * 4}}, "embedding"),
    ("speed out of range", "/tts/bytes", {"generation_config": {"speed": 3.0}}, "speed"),
    ("transcript not a string", "/tts/sse", {"transcript": 42}, "transcript"),
]


def test_hostile_requests_get_cartesia_errors_and_the_server_goes_on(server: ServerThread) -> None:
    good = {"model_id": "sonic-3", "transcript": TEXT, "voice": VOICE, "output_format": RAW_24K}
    problems = []
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        cases = [(what, path, headers, body, status, word) for what, path, headers, body, status, word in HOSTILE]
        for what, path, fields, word in HOSTILE_FIELDS:
            request = {k: v for k, v in {**good, **fields}.items() if v is not None}
            cases.append((what, path, {}, json.dumps(request).encode(), 400, word))
        for what, path, headers, body, status, word in cases:
            headers = {"X-API-Key": API_KEY, "Content-Type": "application/json", **headers}
            response = client.post(path, content=json.dumps(good).encode() if body is None else body,
                                   headers={k: v for k, v in headers.items() if v})
            error = response.json() if response.headers.get("content-type") == "application/json" else {}
            if (response.status_code != status or set(error) != ERROR_FIELDS or word not in error["message"]
                    or not error["title"] or not error["error_code"]):
                problems.append(f"{what}: {response.status_code} {response.text[:300]}")
        assert not problems, "\n".join(problems)
        # The server is fine: a good request right after gets its whole audio, and nothing is left open.
        after = client.post("/tts/bytes", json=good, headers={"Authorization": f"Bearer {API_KEY}"})
        assert after.status_code == 200 and len(after.content) > 0
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["cartesia"] == 0
    refused = snapshot["gateway"]["requests"]["cartesia"]
    assert refused.get("invalid_request", 0) >= len(HOSTILE_FIELDS) and refused.get("invalid_api_key", 0) >= 2


def test_a_client_that_leaves_mid_stream_cancels_its_session(long_server: ServerThread) -> None:
    """The audio streams as it is produced: the client has its first bytes while the reply is still being
    generated, and leaving then cancels the session (counted as cancelled, not ok)."""
    server = long_server
    before = stats(server)["gateway"]["requests"]["cartesia"].get("cancelled", 0)
    body = {"model_id": "sonic-3", "transcript": REPLY, "voice": VOICE, "output_format": RAW_24K}
    with httpx.stream("POST", f"{server.base_url}/tts/bytes", json=body, headers={"X-API-Key": API_KEY},
                      timeout=120) as response:
        assert response.status_code == 200
        first = next(response.iter_raw())
        assert first
    snapshot = settled_stats(lambda: stats(server), outcomes=None)
    assert snapshot["gateway"]["requests"]["cartesia"].get("cancelled", 0) == before + 1
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["cartesia"] == 0


def test_a_failure_mid_stream_is_an_sse_error_event_and_cuts_bytes_short(long_server: ServerThread) -> None:
    server = long_server
    body = {"model_id": "sonic-3", "transcript": "Fail " + REPLY, "voice": VOICE, "output_format": RAW_24K,
            "context_id": "doomed"}
    with httpx.stream("POST", f"{server.base_url}/tts/sse", json=body, headers={"X-API-Key": API_KEY},
                      timeout=120) as response:
        assert response.status_code == 200  # the first audio was out before the failure
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "error" and "chunk" in [e["type"] for e in events]
    error = events[-1]
    assert set(error) == {"type", "done", "status_code", "error_code", "title", "message", "request_id",
                          "context_id"}
    assert (error["done"], error["status_code"], error["error_code"], error["context_id"]) == (
        True, 500, "engine_error", "doomed")
    assert "injected" in error["message"]
    # /tts/bytes has sent its status already: the body ends without its terminating chunk, which the
    # client sees as an incomplete response (not as a short, complete one).
    bytes_body = {k: v for k, v in body.items() if k != "context_id"}
    with (pytest.raises(httpx.RemoteProtocolError),
          httpx.stream("POST", f"{server.base_url}/tts/bytes", json=bytes_body, headers={"X-API-Key": API_KEY},
                       timeout=120) as response):
        assert response.status_code == 200
        response.read()
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["gateway"]["requests"]["cartesia"].get("engine_error", 0) == 2
    assert snapshot["kv_cache"]["used_slots"] == 0
    # The server goes on: the next request is whole.
    ok = httpx.post(f"{server.base_url}/tts/bytes", json={**bytes_body, "transcript": TEXT},
                    headers={"X-API-Key": API_KEY}, timeout=120)
    assert ok.status_code == 200 and ok.content
