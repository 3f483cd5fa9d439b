"""Hostile and broken input on the ElevenLabs-compatible API: every refusal is a 4xx in ElevenLabs' shape
(`{"detail": {"status", "message"}}`) or, on an open WebSocket, an error message; nothing takes the server or
another stream down. A real server on loopback with the tiny models, driven with plain httpx and websockets."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.service.word_timings import words_of
from tests.cartesia_support import assert_same_audio
from tests.gateway_support import settled_stats, start_server, stats, tiny_config

API_KEY = "sk-eleven"
KEY = {"xi-api-key": API_KEY}
TEXT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    srv = start_server(tiny_config(tiny_orpheus, tiny_snac, **{"server.api_keys": [API_KEY]}))
    yield srv
    srv.stop()


def tts(server: ServerThread, path: str = "/v1/text-to-speech/tara/stream", **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", KEY)
    return httpx.post(f"{server.base_url}{path}", timeout=60, **kwargs)


def check_detail(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert set(detail) == {"status", "message"} and detail["status"] == code and detail["message"], detail
    return detail["message"]


def test_rest_refusals_are_elevenlabs_shaped(server: ServerThread) -> None:
    check_detail(tts(server, content=b"{not json"), 400, "invalid_request")
    check_detail(tts(server, content=b"\xff\xfe"), 400, "invalid_request")
    check_detail(tts(server, content=b"[" * 30_000 + b"]" * 30_000), 400, "invalid_request")
    check_detail(tts(server, content=b" " * 100_000), 413, "request_too_large")
    check_detail(tts(server, json=["a list"]), 400, "invalid_request")
    assert "text" in check_detail(tts(server, json={"model_id": "eleven_flash_v2_5"}), 400, "invalid_request")
    check_detail(tts(server, json={"text": 42}), 400, "invalid_request")
    assert "output_format" in check_detail(
        tts(server, json={"text": TEXT}, params={"output_format": "mp3_44100_999"}), 400, "invalid_request")
    check_detail(tts(server, json={"text": TEXT}, params={"output_format": "wav"}), 400, "invalid_request")
    assert "stability" in check_detail(
        tts(server, json={"text": TEXT, "voice_settings": {"stability": 7}}), 400, "invalid_request")
    check_detail(tts(server, json={"text": TEXT, "voice_settings": {"speed": 0}}), 400, "invalid_request")
    check_detail(tts(server, json={"text": TEXT, "seed": -1}), 400, "invalid_request")
    check_detail(tts(server, json={"text": ""}), 400, "invalid_request")
    check_detail(tts(server, json={"text": "x" * 50_000}), 400, "invalid_request")
    check_detail(tts(server, "/v1/text-to-speech/nobody/stream", json={"text": TEXT}), 404, "voice_not_found")
    check_detail(tts(server, "/v1/text-to-speech/nobody/with-timestamps", json={"text": TEXT}), 404,
                 "voice_not_found")
    check_detail(httpx.get(f"{server.base_url}/v1/voices/nobody", headers=KEY), 404, "voice_not_found")
    # Routes ElevenLabs has and this server does not, and a wrong method, in ElevenLabs' shape too.
    check_detail(tts(server, "/v1/text-to-speech/tara/unknown", json={"text": TEXT}), 404, "not_found")
    check_detail(httpx.get(f"{server.base_url}/v1/text-to-speech/tara/stream", headers=KEY), 405,
                 "method_not_allowed")
    # The API key: missing or wrong, in ElevenLabs' shape, before the body is read.
    check_detail(tts(server, json={"text": TEXT}, headers={}), 401, "invalid_api_key")
    check_detail(tts(server, json={"text": TEXT}, headers={"xi-api-key": "wrong"}), 401, "invalid_api_key")
    check_detail(httpx.get(f"{server.base_url}/v1/voices"), 401, "invalid_api_key")
    # Unknown fields are accepted and ignored, as are the settings Orpheus has no use for.
    fine = tts(server, json={"text": TEXT, "model_id": "eleven_v3", "language_code": "en", "previous_text": "Hi.",
                             "apply_text_normalization": "auto", "voice_settings": {
                                 "stability": 0.5, "similarity_boost": 0.9, "style": 0.1, "use_speaker_boost": True,
                                 "speed": 1.1}, "whatever": {"nested": [1, 2]}},
               params={"output_format": "pcm_22050", "optimize_streaming_latency": "4", "enable_logging": "false"})
    assert fine.status_code == 200 and fine.headers["content-type"] == "audio/pcm" and fine.content
    snapshot = settled_stats(lambda: stats(server))
    refused = snapshot["gateway"]["requests"]["elevenlabs"]
    assert refused.get("invalid_request", 0) >= 13 and refused.get("voice_not_found", 0) >= 2, refused
    assert refused.get("invalid_api_key", 0) >= 3 and refused.get("ok", 0) >= 1, refused


def ws_url(server: ServerThread, path: str, **query: str) -> str:
    query = {"output_format": "pcm_24000", **query}
    return (f"ws://127.0.0.1:{server.http_port}/v1/text-to-speech/{path}?"
            + "&".join(f"{k}={v}" for k, v in query.items()))


async def receive_all(ws: Any) -> list[dict[str, Any]]:
    """Every message until the server closes the socket (with whatever code)."""
    replies = []
    while True:
        try:
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
        except ConnectionClosed:
            return replies


def test_websocket_handshake_refusals(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    """Refused with the HTTP status and ElevenLabs' body; a client's mistake is no server error, so the
    server logs no ERROR line for it (uvicorn's sansio protocol did, for every denial response)."""
    caplog.set_level(logging.INFO, logger="uvicorn.error")  # the server runs at warning level

    async def status_of(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        try:
            async with connect(url, additional_headers=headers):
                return 101, {}
        except InvalidStatus as exc:
            return exc.response.status_code, json.loads(exc.response.body)

    async def scenario() -> None:
        code, body = await status_of(ws_url(server, "nobody/stream-input"), KEY)
        assert (code, body["detail"]["status"]) == (404, "voice_not_found")
        code, body = await status_of(ws_url(server, "tara/multi-stream-input", output_format="flac_1"), KEY)
        assert (code, body["detail"]["status"]) == (400, "invalid_request")
        code, body = await status_of(ws_url(server, "tara/stream-input"), {})
        assert (code, body["detail"]["status"]) == (401, "invalid_api_key")
        # The key as a query parameter, as browsers must send it.
        code, _ = await status_of(ws_url(server, "tara/stream-input", xi_api_key=API_KEY), {})
        assert code == 101
        code, body = await status_of(ws_url(server, "nobody/multi-stream-input"), KEY)
        assert (code, body["detail"]["status"]) == (404, "voice_not_found")
        code, body = await status_of(ws_url(server, "tara/stream-input", output_format="mp3_1_2"), KEY)
        assert (code, body["detail"]["status"]) == (400, "invalid_request")
        # The native socket's refusal goes the same way.
        code, body = await status_of(f"ws://127.0.0.1:{server.http_port}/v1/audio/stream", {})
        assert (code, body["error"]["code"]) == (401, "invalid_api_key")

    asyncio.run(scenario())
    # One more request on the server's event loop: the refused handshakes' tasks have returned by its answer.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    refusals = [r for r in caplog.records if r.name == "uvicorn.error" and " 40" in r.getMessage()]
    assert len(refusals) >= 6, [r.getMessage() for r in caplog.records]  # the log was captured
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


@pytest.mark.core_in_process
def test_stream_input_bad_message_closes_that_socket_only(server: ServerThread) -> None:
    """stream-input answers an unusable message with an error and closes (policy violation), as ElevenLabs
    does; a multi-stream socket and its other contexts go on; the server serves the next request."""
    async def scenario() -> None:
        async with connect(ws_url(server, "tara/stream-input"), additional_headers=KEY) as ws:
            await ws.send('{"text": ')
            replies = await receive_all(ws)
            assert replies[-1]["error"] == "invalid_request" and replies[-1]["code"] == 400
            assert ws.close_code == 1008
        async with connect(ws_url(server, "tara/stream-input"), additional_headers=KEY) as ws:
            await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": "high"}}))
            replies = await receive_all(ws)
            assert "stability" in replies[-1]["message"]

        async with connect(ws_url(server, "tara/multi-stream-input"), additional_headers=KEY) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "good"}))
            await ws.send(json.dumps({"text": TEXT + " ", "context_id": "good"}))
            await ws.send(b"\x00binary")
            await ws.send("[1, 2]")
            await ws.send(json.dumps({"text": 5, "context_id": "bad"}))
            await ws.send(json.dumps({"text": "x" * 10_000, "context_id": "huge"}))
            await ws.send(json.dumps({"context_id": "good", "flush": True}))
            await ws.send(json.dumps({"context_id": "good", "close_context": True}))
            await ws.send(json.dumps({"close_socket": True}))
            replies = await receive_all(ws)
            errors = [r for r in replies if "error" in r]
            assert [r["contextId"] for r in errors] == [None, None, "bad", "huge"], errors
            good = [r for r in replies if r.get("contextId") == "good"]
            assert good[-1]["isFinal"] is True
            assert sum(len(base64.b64decode(r["audio"])) for r in good if r.get("audio")) > 0
            assert ws.close_code == 1000

        ok = httpx.post(f"{server.base_url}/v1/text-to-speech/tara/stream", headers=KEY, json={"text": TEXT},
                        params={"output_format": "pcm_16000"}, timeout=60)
        assert ok.status_code == 200 and ok.content

    asyncio.run(scenario())
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["elevenlabs"] == 0
    assert snapshot["gateway"]["open_connections"] == 0


def test_close_context_is_the_end_only_right_after_a_flush_without_text(server: ServerThread) -> None:
    """As LiveKit sends them: a sentence with its own flush, then close_context, is a barge-in (stopped, counted
    cancelled, nothing after its isFinal); `{"text": "", "flush": true}` then close_context ends the answer
    (all of it spoken, counted ok)."""
    def counts() -> dict[str, int]:
        return settled_stats(lambda: stats(server))["gateway"]["requests"]["elevenlabs"]

    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server, "tara/multi-stream-input"), additional_headers=KEY) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "cut"}))
            await ws.send(json.dumps({"text": TEXT + " ", "context_id": "cut", "flush": True}))
            replies = [json.loads(await asyncio.wait_for(ws.recv(), 60))]
            while not replies[-1].get("audio"):
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            await ws.send(json.dumps({"context_id": "cut", "close_context": True}))
            await ws.send(json.dumps({"text": " ", "context_id": "whole"}))
            await ws.send(json.dumps({"text": TEXT + " ", "context_id": "whole", "flush": True}))
            await ws.send(json.dumps({"text": "", "context_id": "whole", "flush": True}))
            await ws.send(json.dumps({"context_id": "whole", "close_context": True}))
            await ws.send(json.dumps({"close_socket": True}))
            return replies + await receive_all(ws)

    before = counts()
    replies = asyncio.run(scenario())
    after = counts()
    cut = [r for r in replies if r.get("contextId") == "cut"]
    assert cut[-1] == {"isFinal": True, "contextId": "cut"} and sum(r == cut[-1] for r in cut) == 1, [{k: v for k, v in r.items() if k != "audio"} for r in cut]
    whole = [r for r in replies if r.get("contextId") == "whole"]
    assert whole[-1] == {"isFinal": True, "contextId": "whole"}
    assert sum(len(base64.b64decode(r["audio"])) for r in whole if r.get("audio")) > 0
    assert after.get("cancelled", 0) - before.get("cancelled", 0) == 1
    assert after.get("ok", 0) - before.get("ok", 0) == 1


def test_an_oversized_message_costs_only_its_own_context(server: ServerThread) -> None:
    """A 100,000-character message (over the socket's old 65,536-byte frame limit, and far over the character
    limit) for one of two live contexts: an error for that context, and the other finishes its audio whole,
    the same audio as alone. The socket stays open and closes normally."""
    greedy = {"stability": 1.0, "similarity_boost": 0.75}
    huge = "word " * 20_000
    assert len(huge) == 100_000

    async def speak(with_neighbour: bool) -> tuple[bytes, list[dict[str, Any]], int | None]:
        async with connect(ws_url(server, "tara/multi-stream-input"), additional_headers=KEY) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "kept", "voice_settings": greedy}))
            await ws.send(json.dumps({"text": TEXT + " ", "context_id": "kept", "flush": True}))
            replies: list[dict[str, Any]] = []
            if with_neighbour:
                await ws.send(json.dumps({"text": " ", "context_id": "hit", "voice_settings": greedy}))
                await ws.send(json.dumps({"text": "Something else entirely, said at length. ", "context_id": "hit"}))
                while not any(r.get("audio") and r["contextId"] == "kept" for r in replies):  # both are live
                    replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
                await ws.send(json.dumps({"text": huge, "context_id": "hit"}))
            await ws.send(json.dumps({"context_id": "kept", "flush": True}))
            await ws.send(json.dumps({"context_id": "kept", "close_context": True}))
            await ws.send(json.dumps({"close_socket": True}))
            replies += await receive_all(ws)
            audio = b"".join(base64.b64decode(r["audio"]) for r in replies
                             if r.get("audio") and r["contextId"] == "kept")
            return audio, replies, ws.close_code

    audio, replies, close_code = asyncio.run(speak(with_neighbour=True))
    assert close_code == 1000
    errors = [r for r in replies if "error" in r]
    assert [(r["contextId"], r["error"], r["code"]) for r in errors] == [("hit", "invalid_request", 400)], errors
    assert "max_buffered_chars" in errors[0]["message"]
    assert [r for r in replies if r.get("contextId") == "kept"][-1] == {"isFinal": True, "contextId": "kept"}
    alone, _, _ = asyncio.run(speak(with_neighbour=False))
    assert_same_audio(audio, alone)
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["elevenlabs"] == 0


@pytest.mark.core_in_process
def test_stream_input_alignment_spans_the_audio(server: ServerThread) -> None:
    """The stream-input protocol as the SDK speaks it: audio, then each chunk's alignment in ms from that
    chunk's first sample; the spans add up to the audio's length and the characters spell the text."""
    text = "Sure, I can help with that. The weather today is sunny, with a light breeze."

    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server, "tara/stream-input"), additional_headers=KEY) as ws:
            await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 1.0, "similarity_boost": 0.8},
                                      "generation_config": {"chunk_length_schedule": [50]},
                                      "try_trigger_generation": True}))
            for word in text.split(" "):
                await ws.send(json.dumps({"text": word + " ", "try_trigger_generation": True}))
            await ws.send(json.dumps({"text": ""}))
            replies = await receive_all(ws)
            assert ws.close_code == 1000
            return replies

    replies = asyncio.run(scenario())
    assert replies[-1] == {"isFinal": True}
    audio_ms = sum(len(base64.b64decode(r["audio"])) for r in replies if r.get("audio")) / 2 / 24
    alignments = [r["alignment"] for r in replies if r.get("alignment")]
    assert alignments and all(r["normalizedAlignment"] == r["alignment"] for r in replies if r.get("alignment"))
    assert words_of("".join(c for a in alignments for c in a["chars"])) == words_of(text)
    spans = [a["charStartTimesMs"][-1] + a["charDurationsMs"][-1] for a in alignments]
    assert sum(spans) == pytest.approx(audio_ms, abs=2 * len(spans))
    for a in alignments:
        assert a["charStartTimesMs"] == sorted(a["charStartTimesMs"]) and min(a["charDurationsMs"]) >= 0

    async def ended_at_once() -> int | None:
        async with connect(ws_url(server, "tara/stream-input"), additional_headers=KEY) as ws:
            await ws.send(json.dumps({"text": ""}))
            assert await receive_all(ws) == []
            return ws.close_code

    assert asyncio.run(ended_at_once()) == 1000
