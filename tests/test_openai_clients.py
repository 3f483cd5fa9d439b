"""OpenAI compatibility as voice-agent frameworks use it: their own client packages from PyPI against a real
server on loopback (sim engine and codec, no pacing), and the fields those clients send over plain HTTP.

- LiveKit's `livekit-plugins-openai` TTS with `instructions` (its SSE path for gpt-4o-mini-tts and its raw
  path for tts-1), outside a room.
- Pipecat's `OpenAITTSService` with `marin` and `cedar`, OpenAI voices in its validated list, through
  Pipecat's own test pipeline (`pipecat.tests.utils.run_test`).
- `instructions` is accepted and ignored (`X-Orpheus-Ignored`), `stream` true or false gives the same bytes,
  `language` is `en` or absent, and the default profile takes OpenAI's 4,096 characters.
- `/openapi.json` names these fields, the Content-Types, and the bearer key only when the server has keys
  (tests/test_fuzz.py checks the whole document against the server with schemathesis).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path

import httpx
import pytest
from livekit.plugins import openai as livekit_openai
from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.tests.utils import run_test

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.request.text import normalize_text, speech_chunks
from orpheus_serve.token_format import OPENAI_VOICE_ALIASES, SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.gateway_support import check_openai_error, sim_config, start_server

API_KEY = "agent-key"
FRAMES = 4  # audio frames per text chunk (engine.sim.end_after_frames)
OPENAI_MAX_INPUT = 4096
SENTENCE = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path):
    # The default profile's limits (nothing overridden): what a new user's server accepts.
    srv = start_server(sim_config(tiny_orpheus, **{"engine.sim.realtime": False, "codec.sim.realtime": False,
                                                   "engine.sim.end_after_frames": FRAMES,
                                                   "server.api_keys": [API_KEY]}))
    yield srv
    srv.stop()


@pytest.fixture
def http(server: ServerThread):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as client:
        yield client


def ignored_instructions(caplog: pytest.LogCaptureFixture) -> int:
    return sum("ignoring instructions" in record.getMessage() for record in caplog.records)


# ------------------------------------------------------------------ LiveKit

@pytest.mark.parametrize(("model", "response_format"), [("gpt-4o-mini-tts", "pcm"), ("gpt-4o-mini-tts", "mp3"),
                                                        ("tts-1", "pcm")])
def test_livekit_openai_tts_with_instructions_returns_audio(server: ServerThread, caplog: pytest.LogCaptureFixture,
                                                            model: str, response_format: str) -> None:
    """gpt-4o-mini-tts asks for `stream_format: sse`, tts-1 for raw audio; both send `instructions`."""

    async def synthesize() -> list:
        tts = livekit_openai.TTS(base_url=f"{server.base_url}/v1", api_key=API_KEY, model=model, voice="marin",
                                 instructions="Speak warmly, like a concierge.", response_format=response_format)
        try:
            async with tts.synthesize("Your table for two is booked for seven.") as stream:
                return [event.frame async for event in stream]
        finally:
            await tts.aclose()

    with caplog.at_level(logging.DEBUG, logger="orpheus_serve.api.http"):
        frames = asyncio.run(synthesize())
    samples = sum(frame.samples_per_channel for frame in frames)
    assert frames and {frame.sample_rate for frame in frames} == {SAMPLE_RATE}, frames
    # At least the utterance's frames (the plugin may pad its last frame; mp3 adds encoder padding).
    assert samples >= FRAMES * SAMPLES_PER_FRAME, samples
    assert any(any(frame.data) for frame in frames), "all silence"
    assert ignored_instructions(caplog) == 1  # the server got `instructions` and said it ignored them


# ------------------------------------------------------------------ Pipecat

@pytest.mark.parametrize("voice", ["marin", "cedar"])
def test_pipecat_openai_tts_with_new_openai_voices_returns_audio(server: ServerThread, voice: str) -> None:
    tts = OpenAITTSService(api_key=API_KEY, base_url=f"{server.base_url}/v1",
                           settings=OpenAITTSService.Settings(voice=voice, instructions="Calm and friendly."))
    down, up = asyncio.run(run_test(tts, frames_to_send=[TTSSpeakFrame("Your table for two is booked for seven.")]))
    errors = [frame.error for frame in [*down, *up] if isinstance(frame, ErrorFrame)]
    assert not errors, errors
    audio = b"".join(frame.audio for frame in down if isinstance(frame, TTSAudioRawFrame))
    assert len(audio) == FRAMES * SAMPLES_PER_FRAME * 2, len(audio)  # 16-bit PCM, the whole utterance
    assert any(audio), "all silence"


# ------------------------------------------------------------------ the fields, over plain HTTP

def speech(http: httpx.Client, **body: object) -> httpx.Response:
    return http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hello there.", "response_format": "pcm",
                                               "seed": 7, **body})


def audio_of(response: httpx.Response) -> bytes:
    """The audio bytes of a response: the body, or the `speech.audio.delta` events' audio (their timings differ)."""
    if response.headers["content-type"] != "text/event-stream; charset=utf-8":
        return response.content
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines() if line]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")


def test_instructions_are_accepted_and_named_as_ignored(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="orpheus_serve.api.http"):
        told = speech(http, instructions="Whisper, with a French accent.")
        plain = speech(http)
        empty = speech(http, instructions="")
    assert told.status_code == 200 and told.headers["X-Orpheus-Ignored"] == "instructions", told.headers
    assert told.content == plain.content and len(told.content) == FRAMES * SAMPLES_PER_FRAME * 2
    assert "X-Orpheus-Ignored" not in plain.headers and "X-Orpheus-Ignored" not in empty.headers
    assert ignored_instructions(caplog) == 1
    check_openai_error(speech(http, instructions=5), 400, "invalid_request")


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_stream_true_or_false_gives_the_same_bytes(http: httpx.Client, stream_format: str) -> None:
    responses = [speech(http, stream=flag, stream_format=stream_format) for flag in (True, False, None)]
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text[:200] for r in responses]
    first, *others = [audio_of(r) for r in responses]
    assert len(first) == FRAMES * SAMPLES_PER_FRAME * 2 and all(other == first for other in others)
    error = check_openai_error(speech(http, stream="yes"), 400, "invalid_request")
    assert error["param"] == "stream", error


def test_language_is_english_or_absent(http: httpx.Client) -> None:
    assert speech(http, language="en").status_code == 200
    assert speech(http, language=None).status_code == 200
    for value in ("fr", "EN", "", 5):
        error = check_openai_error(speech(http, language=value), 400, "invalid_request")
        assert error["param"] == "language" and error["type"] == "invalid_request_error", error
    assert "English" in check_openai_error(speech(http, language="de"), 400)["message"]


def test_marin_and_cedar_are_listed_and_speak(http: httpx.Client) -> None:
    voices = {v["id"]: v["aliases"] for v in http.get("/v1/audio/voices").json()["voices"]}
    for alias in ("marin", "cedar"):
        assert alias in voices[OPENAI_VOICE_ALIASES[alias]], voices
        # The alias and its voice are the same prompt: the same seed gives the same audio.
        assert speech(http, voice=alias).content == speech(http, voice=OPENAI_VOICE_ALIASES[alias]).content


def test_default_profile_takes_openais_4096_characters(http: httpx.Client) -> None:
    text = (SENTENCE * (OPENAI_MAX_INPUT // len(SENTENCE) + 1))[:OPENAI_MAX_INPUT - 2] + "o!"
    assert len(text) == len(normalize_text(text)) == OPENAI_MAX_INPUT
    response = speech(http, input=text)
    assert response.status_code == 200, response.text[:300]
    # Every sentence chunk spoke, one after another, FRAMES frames each.
    chunks = speech_chunks(text)
    assert len(chunks) >= OPENAI_MAX_INPUT // 200, len(chunks)
    assert len(response.content) == len(chunks) * FRAMES * SAMPLES_PER_FRAME * 2, len(response.content)
    too_long = check_openai_error(speech(http, input=text + "!"), 400, "invalid_request")
    assert too_long["param"] == "input" and str(OPENAI_MAX_INPUT) in too_long["message"], too_long


# ------------------------------------------------------------------ the document

def test_openapi_document_describes_the_fields_and_this_servers_auth(http: httpx.Client, tiny_orpheus: Path) -> None:
    document = http.get("/openapi.json").json()
    speech_op = document["paths"]["/v1/audio/speech"]["post"]
    body = document["components"]["schemas"]["SpeechRequestBody"]["properties"]
    assert {"instructions", "stream", "language"} <= set(body), sorted(body)
    assert set(speech_op["responses"]) == {"200", "400", "401", "413", "500", "503", "504"}
    assert {"audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/pcm", "audio/basic",
            "audio/x-alaw-basic", "text/event-stream"} == set(speech_op["responses"]["200"]["content"])
    assert "X-Orpheus-Ignored" in speech_op["responses"]["200"]["headers"]
    assert speech_op["security"] == [{"bearer": []}] and "bearer" in document["components"]["securitySchemes"]
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    # Without API keys the same server never answers 401, and its document says so.
    keyless = start_server(sim_config(tiny_orpheus))
    try:
        open_document = httpx.get(f"{keyless.base_url}/openapi.json").json()
    finally:
        keyless.stop()
    open_speech = open_document["paths"]["/v1/audio/speech"]["post"]
    assert "401" not in open_speech["responses"] and "security" not in open_speech
    assert "securitySchemes" not in open_document.get("components", {})
