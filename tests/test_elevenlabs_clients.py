"""The ElevenLabs clients voice-agent stacks ship, unchanged, against the real server on loopback: the
`elevenlabs` SDK (REST, with timestamps, the stream-input WebSocket), LiveKit's `livekit-plugins-elevenlabs`
and Pipecat's `ElevenLabsTTSService` / `ElevenLabsHttpTTSService`, each pointed here by its base URL alone.

Greedy decoding on the tiny models makes a text's speech reproducible, so each client's audio is compared
sample by sample with the native API's for the same request: `POST /v1/audio/speech` for a whole text, a
replay of the same text chunks (tests/cartesia_support.replay) for text streamed into a context.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from elevenlabs import VoiceSettings
from elevenlabs.client import ElevenLabs

from orpheus_serve.api.server import ServerThread
from orpheus_serve.audio import decode_audio
from orpheus_serve.service import TTSService
from orpheus_serve.word_timings import words_of
from tests.cartesia_support import assert_same_audio
from tests.gateway_support import settled_stats, stats, tiny_config

API_KEY = "sk-agent"
SENTENCE = "Your table for two is booked at seven tonight."
# Full stability is greedy decoding (temperature 0), so audio from clients that always send voice settings
# stays comparable; the server's own default is greedy too.
STABLE = VoiceSettings(stability=1.0, similarity_boost=0.75)


def greedy_server(tiny_orpheus: Path, tiny_snac: Path, **overrides: object) -> ServerThread:
    config = tiny_config(tiny_orpheus, tiny_snac, **{"sampling.temperature": 0.0, "scheduler.admission": "slots",
                                                     "server.api_keys": [API_KEY], **overrides})
    return ServerThread(config, TTSService.from_config(config, record_tokens=True)).start()


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    srv = greedy_server(tiny_orpheus, tiny_snac)
    yield srv
    srv.stop()


def native_pcm(server: ServerThread, text: str, **body: object) -> bytes:
    """The native API's audio for `text`: 24 kHz 16-bit PCM."""
    response = httpx.post(f"{server.base_url}/v1/audio/speech", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"input": text, "voice": "tara", "response_format": "pcm", **body})
    assert response.status_code == 200, response.text
    return response.content


def sdk(server: ServerThread) -> ElevenLabs:
    return ElevenLabs(base_url=server.base_url, api_key=API_KEY, timeout=120)


def check_alignment(alignment: object, text: str, audio_s: float) -> None:
    """Characters that spell the text's words, with times in order inside the audio."""
    chars = alignment.characters
    starts = alignment.character_start_times_seconds
    ends = alignment.character_end_times_seconds
    assert len(chars) == len(starts) == len(ends) > 0
    assert words_of("".join(chars)) == words_of(text)
    for start, end in zip(starts, ends, strict=True):
        assert 0.0 <= start <= end <= audio_s + 1e-3
    for (_, end), (start, _) in itertools.pairwise(zip(starts, ends, strict=True)):
        assert end <= start + 1e-3
    assert ends[-1] == pytest.approx(audio_s, abs=2e-3)


# ------------------------------------------------------------------ the SDK over REST


def test_sdk_stream_is_the_native_audio(server: ServerThread) -> None:
    audio = b"".join(sdk(server).text_to_speech.stream(voice_id="tara", text=SENTENCE, model_id="eleven_flash_v2_5",
                                                       output_format="pcm_24000", voice_settings=STABLE))
    assert_same_audio(audio, native_pcm(server, SENTENCE))


def test_sdk_convert_mp3_and_resampled_pcm(server: ServerThread) -> None:
    client = sdk(server)
    mp3 = b"".join(client.text_to_speech.convert(voice_id="tara", text=SENTENCE, output_format="mp3_44100_128"))
    samples, rate = decode_audio(mp3, "mp3")
    assert rate == 44100
    native_s = len(native_pcm(server, SENTENCE)) / 2 / 24000
    assert abs(samples.size / rate - native_s) < 0.1  # the encoder's padding at most
    pcm16k = b"".join(client.text_to_speech.convert(voice_id="leo", text=SENTENCE, output_format="pcm_16000"))
    assert len(pcm16k) / 2 / 16000 == pytest.approx(len(native_pcm(server, SENTENCE, voice="leo")) / 2 / 24000,
                                                    abs=0.01)
    ulaw = b"".join(client.text_to_speech.convert(voice_id="tara", text=SENTENCE, output_format="ulaw_8000"))
    assert len(ulaw) / 8000 == pytest.approx(native_s, abs=0.01)


def test_sdk_with_timestamps(server: ServerThread) -> None:
    client = sdk(server)
    native = native_pcm(server, SENTENCE)
    audio_s = len(native) / 2 / 24000
    whole = client.text_to_speech.convert_with_timestamps(voice_id="tara", text=SENTENCE, output_format="pcm_24000")
    assert_same_audio(base64.b64decode(whole.audio_base_64), native)
    check_alignment(whole.alignment, SENTENCE, audio_s)
    check_alignment(whole.normalized_alignment, SENTENCE, audio_s)

    audio = bytearray()
    chars: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    for piece in client.text_to_speech.stream_with_timestamps(voice_id="tara", text=SENTENCE,
                                                              output_format="pcm_24000"):
        audio += base64.b64decode(piece.audio_base_64)
        if piece.alignment is not None:
            chars += piece.alignment.characters
            starts += piece.alignment.character_start_times_seconds
            ends += piece.alignment.character_end_times_seconds
    assert_same_audio(bytes(audio), native)
    assert chars == whole.alignment.characters
    assert np.allclose(starts, whole.alignment.character_start_times_seconds, atol=0.02)


def test_sdk_voices(server: ServerThread) -> None:
    client = sdk(server)
    voices = client.voices.get_all().voices
    assert {v.voice_id for v in voices} >= {"tara", "leo"}
    assert client.voices.get("leo").name == "Leo"
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["elevenlabs"] == 0
