"""The ElevenLabs clients voice-agent stacks ship, unchanged, against the real server on loopback: the
`elevenlabs` SDK (REST, with timestamps, the stream-input WebSocket), LiveKit's `livekit-plugins-elevenlabs`
and Pipecat's `ElevenLabsTTSService` / `ElevenLabsHttpTTSService`, each pointed here by its base URL alone.

Greedy decoding on the tiny models makes a text's speech reproducible, so each client's audio is compared
sample by sample with the native API's for the same request: `POST /v1/audio/speech` for a whole text, a
replay of the same text chunks (tests/cartesia_support.replay) for text streamed into a context.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import pytest
from elevenlabs import VoiceSettings
from elevenlabs.client import ElevenLabs
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import elevenlabs as lk_elevenlabs
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService, ElevenLabsTTSService
from pipecat.workers.runner import WorkerRunner

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.audio.encoding import decode_audio
from orpheus_serve.client.protocols import synthesize
from orpheus_serve.service.build import build_service
from orpheus_serve.service.word_timings import words_of
from tests.agent_support import AGENT_INTERRUPTED, AGENT_NEXT, agent_barge_in, run_with_session
from tests.cartesia_support import (
    INTERRUPTED,
    REPLY,
    assert_same_audio,
    await_stop,
    before_cancel,
    cancelled_streams,
    context_sessions,
    replay,
)
from tests.elevenlabs_support import TlsRelay, self_signed_certificate
from tests.gateway_support import settled_stats, stats, tiny_config

API_KEY = "sk-agent"
SENTENCE = "Your table for two is booked at seven tonight."
# Full stability is greedy decoding (temperature 0), so audio from clients that always send voice settings
# stays comparable; the server's own default is greedy too.
STABLE = VoiceSettings(stability=1.0, similarity_boost=0.75)


def greedy_server(tiny_orpheus: Path, tiny_snac: Path, **overrides: object) -> ServerThread:
    config = tiny_config(tiny_orpheus, tiny_snac, **{"sampling.temperature": 0.0, "scheduler.admission": "slots",
                                                     "server.api_keys": [API_KEY], **overrides})
    return ServerThread(config, build_service(config, record_tokens=True)).start()


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    srv = greedy_server(tiny_orpheus, tiny_snac)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def long_server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    """Chunks of up to 50 frames (4 s): an answer is still generating when its first audio plays."""
    srv = greedy_server(tiny_orpheus, tiny_snac, **{"sampling.max_tokens": 350})
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


def test_own_client_speaks_elevenlabs(server: ServerThread) -> None:
    """client.py / the benchmark's `--protocol elevenlabs` (also one of the `mixed` protocols)."""
    result = asyncio.run(synthesize("elevenlabs", SENTENCE, url=server.base_url, api_key=API_KEY, voice="tara"))
    assert result.status == "ok", result.error
    refused = asyncio.run(synthesize("elevenlabs", SENTENCE, url=server.base_url, api_key=API_KEY, voice="nobody"))
    assert (refused.status, refused.code) == ("error", "voice_not_found")


def test_sdk_voices(server: ServerThread) -> None:
    client = sdk(server)
    voices = client.voices.get_all().voices
    assert {v.voice_id for v in voices} >= {"tara", "leo"}
    assert client.voices.get("leo").name == "Leo"
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["elevenlabs"] == 0


# ------------------------------------------------------------------ WebSockets: shared checks


def response_chunks(server: ServerThread, reply: str) -> list[str]:
    """The text chunks the server cut the latest response to `reply` into, in order."""
    chunks = [e["text"] for e in context_sessions(server, reply.split(",")[0])]
    assert words_of(" ".join(chunks)) == words_of(reply)
    return chunks


def idle(server: ServerThread) -> None:
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["elevenlabs"] == 0


async def fake_llm(reply: str, gap_s: float = 0.05) -> AsyncIterator[str]:
    """An LLM writing `reply` token by token (a word and its space)."""
    for k, word in enumerate(reply.split(" ")):
        if k:
            await asyncio.sleep(gap_s)
        yield word + " "


# ------------------------------------------------------------------ the SDK's stream-input WebSocket


def test_sdk_stream_input_websocket(server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`convert_realtime` always connects with wss://: through the TLS relay, trusted by SSL_CERT_FILE."""
    cert, key = self_signed_certificate(tmp_path)
    relay = TlsRelay(server.http_port, cert, key).start()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    try:
        client = ElevenLabs(base_url=f"https://127.0.0.1:{relay.port}", api_key=API_KEY)
        audio = b"".join(client.text_to_speech.convert_realtime(
            voice_id="tara", text=(word + " " for word in REPLY.split(" ")), model_id="eleven_flash_v2_5", output_format="pcm_24000",
            voice_settings=STABLE))
    finally:
        relay.stop()
    assert_same_audio(audio, asyncio.run(replay(server, response_chunks(server, REPLY))))
    idle(server)


# ------------------------------------------------------------------ LiveKit Agents


def livekit_tts(server: ServerThread, session: aiohttp.ClientSession) -> lk_elevenlabs.TTS:
    return lk_elevenlabs.TTS(base_url=f"{server.base_url}/v1", api_key=API_KEY, http_session=session,
                             voice_id="tara", encoding="pcm_24000",
                             voice_settings=lk_elevenlabs.VoiceSettings(stability=1.0, similarity_boost=0.75))


def test_livekit_stream_word_by_word_and_synthesize(server: ServerThread) -> None:
    async def scenario() -> tuple[bytes, list[tuple[str, float, float]], float, float, bytes]:
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(server, session)
            try:
                stream = tts.stream()
                ended_at = 0.0

                async def feed() -> None:
                    nonlocal ended_at
                    async for word in fake_llm(REPLY):
                        stream.push_text(word)
                    stream.end_input()
                    ended_at = time.perf_counter()

                feeder = asyncio.create_task(feed())
                audio = bytearray()
                timed: list[tuple[str, float, float]] = []
                first_at = 0.0
                async for event in stream:
                    first_at = first_at or time.perf_counter()
                    audio += bytes(event.frame.data.cast("b"))
                    for piece in event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or ():
                        timed.append((str(piece), piece.start_time, piece.end_time))
                await feeder
                await stream.aclose()
                whole = bytearray()
                async for event in tts.synthesize(SENTENCE):
                    whole += bytes(event.frame.data.cast("b"))
                return bytes(audio), timed, ended_at, first_at, bytes(whole)
            finally:
                await tts.aclose()

    audio, timed, ended_at, first_at, whole = asyncio.run(scenario())
    assert first_at < ended_at, "no audio before the LLM finished writing"
    assert_same_audio(audio, asyncio.run(replay(server, response_chunks(server, REPLY))))
    assert [w for text, _, _ in timed for w in words_of(text)] == words_of(REPLY)
    # LiveKit's emitter ends the audio with a short stretch of silence (padding to its frame size).
    native = native_pcm(server, SENTENCE)
    assert_same_audio(whole[:len(native)], native)
    assert len(whole) - len(native) <= 2 * 480 and not any(whole[len(native):])  # at most 20 ms
    idle(server)


def test_livekit_agent_session_barge_in_stops_the_turn_at_once(long_server: ServerThread) -> None:
    """LiveKit's AgentSession on the ElevenLabs plugin: the plugin flushes each sentence and answers
    `interrupt()` with one close_context while the LLM is still writing. That close is a barge-in: the turn's
    generation stops, the stream is counted cancelled, and the next turn is served."""
    server = long_server
    result = run_with_session(lambda http: agent_barge_in(server, livekit_tts(server, http), "elevenlabs",
                                                          AGENT_INTERRUPTED, AGENT_NEXT))
    print(f"LiveKit AgentSession (ElevenLabs) barge-in, from the interruption: {result.stop}")
    result.stop.check()
    assert result.cancelled == 1
    assert result.next_turn and all(e["finish_reason"] in ("stop", "length")
                                    for e in context_sessions(server, AGENT_NEXT[:10]))
    idle(server)


# ------------------------------------------------------------------ Pipecat


class Recorder(FrameProcessor):
    """The end of the pipeline: every frame that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []
        self.changed = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.frames.append((time.perf_counter(), frame))
        self.changed.set()
        await self.push_frame(frame, direction)

    async def wait_for(self, kind: type, count: int = 1, timeout_s: float = 120.0) -> None:
        async def until() -> None:
            while sum(isinstance(f, kind) for _, f in self.frames) < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(until(), timeout_s)

    def audio(self) -> bytes:
        return b"".join(f.audio for _, f in self.frames if isinstance(f, TTSAudioRawFrame))


async def run_pipecat(tts: Any, script: Any) -> Recorder:
    """A pipeline `tts -> Recorder`; `script(worker, recorder)` drives it, then it ends."""
    recorder = Recorder()
    worker = PipelineWorker(Pipeline([tts, recorder]), params=PipelineParams(audio_out_sample_rate=24000),
                            cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker: PipelineWorker, frame: Frame) -> None:
        started.set()

    async def drive() -> None:
        await asyncio.wait_for(started.wait(), 30)
        try:
            await script(worker, recorder)
        finally:
            await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return recorder


async def pipecat_reply(worker: PipelineWorker, reply: str, gap_s: float = 0.05) -> None:
    await worker.queue_frame(LLMFullResponseStartFrame())
    async for token in fake_llm(reply, gap_s):
        await worker.queue_frame(LLMTextFrame(token))
    await worker.queue_frame(LLMFullResponseEndFrame())


def pipecat_ws(server: ServerThread) -> ElevenLabsTTSService:
    return ElevenLabsTTSService(api_key=API_KEY, url=f"ws://127.0.0.1:{server.http_port}", sample_rate=24000,
                                settings=ElevenLabsTTSService.Settings(voice="tara", stability=1.0))


@pytest.mark.slow  # the longest of these (about 45 s on two shared cores): an answer, a barge-in, another answer
def test_pipecat_websocket_reply_then_barge_in(long_server: ServerThread) -> None:
    """A whole answer (audio and word timestamps), then one interrupted mid-answer: the context is closed
    without a flush, the server stops its generation, and the next answer on the socket is untouched."""
    server = long_server
    measured: dict[str, Any] = {}

    async def script(worker: PipelineWorker, recorder: Recorder) -> None:
        await pipecat_reply(worker, REPLY, 0.0)
        await recorder.wait_for(TTSStoppedFrame)
        measured["reply"] = recorder.audio()
        measured["chunks"] = response_chunks(server, REPLY)
        await pipecat_reply(worker, INTERRUPTED, 0.0)
        await recorder.wait_for(TTSAudioRawFrame, count=sum(isinstance(f, TTSAudioRawFrame)
                                                            for _, f in recorder.frames) + 1)
        at_cancel = before_cancel(server, INTERRUPTED[:20], "elevenlabs")
        await worker.queue_frame(InterruptionFrame())  # the user starts talking
        measured["stop"] = await await_stop(server, INTERRUPTED[:20], at_cancel, protocol="elevenlabs")
        measured["cancelled"] = cancelled_streams(server, "elevenlabs") - at_cancel.cancelled
        measured["after"] = len(recorder.frames)
        await pipecat_reply(worker, SENTENCE, 0.0)
        await recorder.wait_for(TTSStoppedFrame, count=2)

    recorder = asyncio.run(run_pipecat(pipecat_ws(server), script))
    assert_same_audio(measured["reply"], asyncio.run(replay(server, measured["chunks"])))
    texts = [f for _, f in recorder.frames if isinstance(f, TTSTextFrame)]
    assert words_of(" ".join(f.text for f in texts))[:len(words_of(REPLY))] == words_of(REPLY)
    stop = measured["stop"]
    print(f"Pipecat barge-in, from the interruption: {stop}")
    stop.check()
    assert measured["cancelled"] == 1
    # After the close (the server answers it with isFinal) only the next answer's audio arrives, whole.
    later = b"".join(f.audio for _, f in recorder.frames[measured["after"]:] if isinstance(f, TTSAudioRawFrame))
    assert_same_audio(later, asyncio.run(replay(server, response_chunks(server, SENTENCE))))
    idle(server)


def test_pipecat_http_service(server: ServerThread) -> None:
    async def scenario() -> Recorder:
        async with aiohttp.ClientSession() as session:
            tts = ElevenLabsHttpTTSService(api_key=API_KEY, aiohttp_session=session, base_url=server.base_url,
                                           sample_rate=24000,
                                           settings=ElevenLabsHttpTTSService.Settings(voice="tara"))

            async def script(worker: PipelineWorker, recorder: Recorder) -> None:
                await pipecat_reply(worker, SENTENCE, 0.0)
                await recorder.wait_for(TTSStoppedFrame)

            return await run_pipecat(tts, script)

    recorder = asyncio.run(scenario())
    assert_same_audio(recorder.audio(), native_pcm(server, SENTENCE))
    texts = [f for _, f in recorder.frames if isinstance(f, TTSTextFrame)]
    assert [w for f in texts for w in words_of(f.text)] == words_of(SENTENCE)
    idle(server)

