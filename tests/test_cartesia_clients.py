"""The voice-agent frameworks' own Cartesia clients against the real server on loopback: LiveKit Agents'
`livekit-plugins-cartesia` TTS and Pipecat's `CartesiaTTSService`, changed only in their base URL.

A fake LLM (an async generator) writes each reply word by word with 50 ms gaps. Greedy decoding on the
tiny models makes the speech of a text chunk reproducible, so a response can be checked sample by sample
against a replay of the same chunks (tests/cartesia_support.replay).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import cartesia as lk_cartesia
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
from pipecat.services.cartesia.tts import CartesiaTTSService
from pipecat.services.tts_service import TextAggregationMode
from pipecat.workers.runner import WorkerRunner

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.service.build import build_service
from orpheus_serve.service.word_timings import words_of
from tests.agent_support import AGENT_INTERRUPTED, AGENT_NEXT, agent_barge_in, run_with_session
from tests.cartesia_support import (
    INTERRUPTED,
    REPLY,
    Stop,
    assert_same_audio,
    await_stop,
    before_cancel,
    cancelled_streams,
    context_sessions,
    replay,
)
from tests.gateway_support import settled_stats, stats, tiny_config

KEPT = "The weather today is sunny, with a light breeze."
API_KEY = "sk-agent"


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


async def fake_llm(reply: str, gap_s: float = 0.05) -> AsyncIterator[str]:
    """An LLM writing `reply` token by token (a word and its space)."""
    for k, word in enumerate(reply.split(" ")):
        if k:
            await asyncio.sleep(gap_s)
        yield word + " "


def check_word_times(words: list[tuple[str, float, float]], reply: str, audio_s: float) -> None:
    assert [w for text, _, _ in words for w in words_of(text)] == words_of(reply)
    for (_, start, end), (_, next_start, _) in itertools.pairwise(words):
        assert start <= end <= next_start + 1e-6
    assert words[0][1] >= 0 and words[-1][2] <= audio_s + 1e-3


def response_chunks(server: ServerThread, reply: str) -> list[str]:
    """The text chunks the server cut the latest response to `reply` into, in order."""
    chunks = [e["text"] for e in context_sessions(server, reply.split(",")[0])]
    assert words_of(" ".join(chunks)) == words_of(reply)
    return chunks


# ------------------------------------------------------------------ LiveKit Agents


def livekit_tts(server: ServerThread, session: aiohttp.ClientSession) -> lk_cartesia.TTS:
    return lk_cartesia.TTS(base_url=server.base_url, api_key=API_KEY, http_session=session, voice="tara",
                           sample_rate=24000)


async def livekit_say(tts: lk_cartesia.TTS, words: AsyncIterator[str], *, first_audio: asyncio.Event | None = None
                      ) -> tuple[bytes, list[tuple[str, float, float]], float, float]:
    """Stream `words` into a LiveKit SynthesizeStream; (audio, timed words, input-end time, first-audio time)."""
    stream = tts.stream()
    ended_at = 0.0

    async def feed() -> None:
        nonlocal ended_at
        async for word in words:
            stream.push_text(word)
        stream.end_input()
        ended_at = time.perf_counter()

    feeder = asyncio.create_task(feed())
    audio = bytearray()
    timed: list[tuple[str, float, float]] = []
    first_at = 0.0
    try:
        async for event in stream:
            if not first_at:
                first_at = time.perf_counter()
                if first_audio is not None:
                    first_audio.set()
            audio += bytes(event.frame.data.cast("b"))
            for piece in event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or ():
                timed.append((str(piece), piece.start_time, piece.end_time))
        await feeder
    finally:
        feeder.cancel()
        await stream.aclose()
    return bytes(audio), timed, ended_at, first_at


def test_livekit_streams_an_llm_reply_as_it_is_written(server: ServerThread) -> None:
    async def scenario() -> tuple[bytes, list[tuple[str, float, float]], float, float]:
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(server, session)
            try:
                return await livekit_say(tts, fake_llm(REPLY))
            finally:
                await tts.aclose()

    started = time.perf_counter()
    audio, timed, ended_at, first_at = asyncio.run(scenario())
    print(f"LiveKit: first audio {first_at - started:.3f} s after the stream opened, the reply was written by "
          f"{ended_at - started:.3f} s")
    assert first_at < ended_at, "no audio before the LLM finished writing"
    # In order and complete: the same samples as the server's chunks of this reply played back to back.
    assert_same_audio(audio, asyncio.run(replay(server, response_chunks(server, REPLY))))
    check_word_times(timed, REPLY, len(audio) / 2 / 24000)


def test_livekit_barge_in_stops_one_answer_and_the_next_is_untouched(long_server: ServerThread) -> None:
    """LiveKit's plugin answers a barge-in by closing the interrupted stream; its connection pool drops that
    stream's socket when the agent next synthesizes (1.8.9 defers the close to the pool's next `get`). The
    server cancels the context as the socket goes: generation stops, and the next answer is whole."""
    server = long_server

    async def scenario() -> tuple[bytes, bytes, Stop, int]:
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(server, session)
            try:
                alone, _, _, _ = await livekit_say(tts, fake_llm(KEPT, 0.0))
                playing = asyncio.Event()
                interrupted = asyncio.create_task(livekit_say(tts, fake_llm(INTERRUPTED, 0.0), first_audio=playing))
                await asyncio.wait_for(playing.wait(), 60)
                interrupted.cancel()  # the user starts talking: the agent closes the answer's stream
                await asyncio.wait({interrupted})
                at_next = before_cancel(server, INTERRUPTED[:20])
                kept = asyncio.create_task(livekit_say(tts, fake_llm(KEPT, 0.0)))  # the agent's next answer
                stop = await await_stop(server, INTERRUPTED[:20], at_next)
                cancelled = cancelled_streams(server) - at_next.cancelled
                kept_audio, _, _, _ = await asyncio.wait_for(kept, 120)
                return alone, kept_audio, stop, cancelled
            finally:
                await tts.aclose()

    alone, kept, stop, cancelled = asyncio.run(scenario())
    print(f"LiveKit barge-in, from the next answer's start (when the plugin drops the socket): {stop}")
    stop.check()
    assert cancelled == 1
    # The socket that carried the interrupted answer is gone: nothing of it can reach the client after.
    assert_same_audio(kept, alone)
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["cartesia"] == 0


def test_livekit_agent_session_barge_in_stops_the_turn(long_server: ServerThread) -> None:
    """LiveKit's AgentSession on the Cartesia plugin: `interrupt()` closes the turn's stream, and the plugin's
    connection pool drops that socket when the agent next synthesizes (LiveKit 1.8.9 sends no cancel). The
    server cancels the context as the socket goes: generation stops, counted cancelled; the next turn is
    served."""
    server = long_server
    result = run_with_session(lambda http: agent_barge_in(server, livekit_tts(server, http), "cartesia",
                                                          AGENT_INTERRUPTED, AGENT_NEXT, closes_at_next_turn=True))
    # Counted from the next turn's start: the plugin tells the server only once the next turn's LLM has
    # written and the pool is asked for a socket.
    print(f"LiveKit AgentSession (Cartesia) barge-in, from the next turn's start: {result.stop}")
    result.stop.check()
    assert result.cancelled == 1
    assert result.next_turn and all(e["finish_reason"] in ("stop", "length")
                                    for e in context_sessions(server, AGENT_NEXT[:10]))
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["cartesia"] == 0


# ------------------------------------------------------------------ Pipecat


class Recorder(FrameProcessor):
    """The end of the pipeline: every frame that reaches it, with its arrival time."""

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

    def audio(self, context_id: str | None = None) -> bytes:
        return b"".join(f.audio for _, f in self.frames if isinstance(f, TTSAudioRawFrame)
                        and (context_id is None or f.context_id == context_id))


async def run_pipecat(server: ServerThread, script: Any, mode: TextAggregationMode = TextAggregationMode.SENTENCE
                      ) -> Recorder:
    """A pipeline `CartesiaTTSService -> Recorder`; `script(worker, recorder)` drives it, then it ends."""
    tts = CartesiaTTSService(api_key=API_KEY, url=f"ws://127.0.0.1:{server.http_port}/tts/websocket",
                             settings=CartesiaTTSService.Settings(voice="tara"), text_aggregation_mode=mode)
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


async def pipecat_reply(worker: PipelineWorker, reply: str, gap_s: float = 0.05) -> float:
    """The LLM's reply as Pipecat's LLM services emit it; the time its last token was out."""
    await worker.queue_frame(LLMFullResponseStartFrame())
    async for token in fake_llm(reply, gap_s):
        await worker.queue_frame(LLMTextFrame(token))
    await worker.queue_frame(LLMFullResponseEndFrame())
    return time.perf_counter()


@pytest.mark.parametrize("mode", [TextAggregationMode.SENTENCE, TextAggregationMode.TOKEN])
def test_pipecat_streams_an_llm_reply_as_it_is_written(server: ServerThread, mode: TextAggregationMode) -> None:
    """Sentence mode (the default) sends each sentence as it completes, with max_buffer_delay_ms 0; token mode
    sends every LLM token and leaves the cutting to the server."""
    ended_at = started = 0.0

    async def script(worker: PipelineWorker, recorder: Recorder) -> None:
        nonlocal ended_at, started
        started = time.perf_counter()
        ended_at = await pipecat_reply(worker, REPLY)
        await recorder.wait_for(TTSStoppedFrame)

    recorder = asyncio.run(run_pipecat(server, script, mode))
    audio_frames = [(t, f) for t, f in recorder.frames if isinstance(f, TTSAudioRawFrame)]
    assert audio_frames, "no audio"
    print(f"Pipecat ({mode.value}): first audio {audio_frames[0][0] - started:.3f} s after the first token, the reply was written "
          f"by {ended_at - started:.3f} s")
    assert audio_frames[0][0] < ended_at, "no audio before the LLM finished writing"
    audio = recorder.audio()
    assert_same_audio(audio, asyncio.run(replay(server, response_chunks(server, REPLY))))
    # Pipecat turns the word timestamps into TTSTextFrames stamped with their presentation times.
    texts = [f for _, f in recorder.frames if isinstance(f, TTSTextFrame)]
    pts = [f.pts for f in texts]
    assert [w for f in texts for w in words_of(f.text)] == words_of(REPLY)
    assert all(a <= b for a, b in itertools.pairwise(pts))
    assert (pts[-1] - pts[0]) / 1e9 <= len(audio) / 2 / 24000


def test_pipecat_barge_in_cancels_one_context_and_the_next_is_untouched(long_server: ServerThread) -> None:
    server = long_server
    measured: dict[str, Any] = {}

    async def script(worker: PipelineWorker, recorder: Recorder) -> None:
        # A run alone first, then an answer interrupted mid-sentence and the next one, on the same socket.
        await pipecat_reply(worker, KEPT, 0.0)
        await recorder.wait_for(TTSStoppedFrame)
        measured["alone"] = recorder.audio()
        measured["before"] = len(recorder.frames)
        await pipecat_reply(worker, INTERRUPTED, 0.0)
        await recorder.wait_for(TTSAudioRawFrame, count=sum(isinstance(f, TTSAudioRawFrame)
                                                            for _, f in recorder.frames) + 1)
        at_cancel = before_cancel(server, INTERRUPTED[:20])
        await worker.queue_frame(InterruptionFrame())  # the user starts talking
        measured["stop"] = await await_stop(server, INTERRUPTED[:20], at_cancel)
        measured["cancelled"] = cancelled_streams(server) - at_cancel.cancelled
        measured["after"] = len(recorder.frames)
        await pipecat_reply(worker, KEPT, 0.0)
        await recorder.wait_for(TTSStoppedFrame, count=2)

    recorder = asyncio.run(run_pipecat(server, script))
    stop = measured["stop"]
    print(f"Pipecat barge-in, from the interruption: {stop}")
    stop.check()
    assert measured["cancelled"] == 1
    # After the cancel only the next answer's audio arrives, whole.
    later = [f for _, f in recorder.frames[measured["after"]:] if isinstance(f, TTSAudioRawFrame)]
    kept = b"".join(f.audio for f in later)
    assert len({f.context_id for f in later}) == 1
    assert_same_audio(kept, measured["alone"])
    snapshot = settled_stats(lambda: stats(server))
    assert snapshot["kv_cache"]["used_slots"] == 0 and snapshot["gateway"]["active_streams"]["cartesia"] == 0
    assert np.frombuffer(kept, "<i2").size > 0
