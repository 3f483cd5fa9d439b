"""Where one request's response stands, and the draining of one session's outputs into audio chunks.

The output side of `TTSService.synthesize`, as vLLM's OutputProcessor and RequestState: `RequestState`
holds what one request has submitted and sent so far (its text source, the sessions it has in flight,
the audio out, its metrics); `drain_session` turns one text chunk's session outputs into the request's
AudioChunks, in order, and starts the next chunk the moment this one has finished generating, while its
audio still plays (ARCHITECTURE §5b).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from .. import token_format
from ..core.client import EngineCoreClient, Outcome, SessionDone, SessionOutput
from ..request.errors import (
    EngineFailureError,
    EngineUnavailableError,
    InvalidRequestError,
    ServiceUnavailableError,
    SynthesisError,
    SynthesisTimeoutError,
)
from ..request.text import speech_chunks
from ..request.text_stream import TextStream
from ..request.types import AudioChunk, ChunkTimings, SynthesisMetrics, SynthesisRequest, TextChunk, TextSource
from .word_timings import AudioEnvelope, estimate_word_timings


@dataclass(slots=True)
class RequestState:
    """One request's response so far: text chunks submitted, the sessions still live, the audio out."""

    request: SynthesisRequest
    text: TextSource
    received: float  # monotonic time the request arrived
    metrics: SynthesisMetrics
    live: list[str] = field(default_factory=list)  # session ids submitted and not yet fully drained
    submitted: int = 0  # text chunks submitted
    chunk_index: int = 0  # the text chunk being drained
    index: int = 0  # AudioChunk index
    samples: int = 0  # samples out so far
    first_audio_at: float | None = None
    reported: bool = False  # the request's outcome has been told to the observers
    # The text chunk after the current one and its session id, taken as soon as the current one has generated.
    following: TextChunk | None = None
    following_id: str | None = None

    @classmethod
    def open(cls, req: SynthesisRequest, received: float) -> RequestState:
        """The state of a validated request: its incremental text, or its whole text cut into chunks."""
        if req.text_input is not None:
            text: TextSource = req.text_input
        else:
            chunks = speech_chunks(req.text)
            if not chunks:
                raise InvalidRequestError("input has no text to speak after normalisation", param="input")
            text = TextStream.complete(chunks)
        return cls(request=req, text=text, received=received, metrics=SynthesisMetrics(request_id=req.request_id))

    @property
    def timings_wanted(self) -> bool:
        return self.request.timestamps or self.request.text_input is not None

    def audio_chunk(self, pcm: bytes) -> AudioChunk:
        """The next AudioChunk of the response; the first one sets the time to first byte."""
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            self.metrics.ttfb_s = self.first_audio_at - self.received
        chunk = AudioChunk(pcm=pcm, index=self.index, start_sample=self.samples)
        self.index += 1
        self.samples += chunk.num_samples
        return chunk

    def generated(self, done: SessionDone) -> None:
        """A text chunk's generation finished: count its tokens and frames."""
        self.metrics.tokens += done.tokens
        self.metrics.frames += done.frames
        if self.chunk_index == 0:
            self.metrics.queue_s = done.queue_s
        if done.outcome is Outcome.LENGTH:
            self.metrics.finish_reason = "length"

    def failed(self, done: SessionDone) -> SynthesisError:
        """A session failed: the error the request raises."""
        self.metrics.finish_reason = "error" if done.error is not None else done.outcome.value
        if done.outcome is Outcome.TIMEOUT:
            return SynthesisTimeoutError("the request timed out (waiting for a slot or generating)")
        if done.outcome is Outcome.CANCELLED:
            return ServiceUnavailableError("the request was cancelled by the server (shutting down)")
        if done.outcome is Outcome.UNAVAILABLE:  # the engine-core process died under the stream
            return EngineUnavailableError(done.error or "the engine core is unavailable")
        return EngineFailureError(done.error or "generation failed")

    def chunk_timings(self, chunk: TextChunk, start_sample: int, envelope: AudioEnvelope | None) -> ChunkTimings:
        words = estimate_word_timings(chunk.text, start_sample, envelope) if envelope else ()
        return ChunkTimings(index=self.chunk_index, text=chunk.text, start_sample=start_sample,
                            end_sample=self.samples, words=words, flush_id=chunk.flush_id)

    def finish(self) -> SynthesisMetrics:
        """The response is complete: its final metrics."""
        self.metrics.samples = self.samples
        self.metrics.audio_seconds = self.samples / token_format.SAMPLE_RATE
        self.metrics.wall_s = time.monotonic() - self.received
        self.reported = True
        return self.metrics


async def drain_session(state: RequestState, client: EngineCoreClient, session_id: str, *,
                        envelope: AudioEnvelope | None, start_following: Callable[[], Awaitable[None]],
                        on_first_audio: Callable[[], None]) -> AsyncIterator[AudioChunk]:
    """One session's audio as the request's AudioChunks, until its generation has finished and its last
    audio is out. Each chunk handed on counts as delivered (flow control, ARCHITECTURE §5a). Once it has
    generated, `start_following` takes and submits the next text chunk: at once if there is one, else as
    soon as new text arrives while this audio still drains."""
    outputs = client.outputs(session_id)
    generated = audio_out = False
    while not (generated and audio_out):
        if generated and state.following is None and not state.text.exhausted:
            item = await _first_of(outputs, state.text)
            if item is None:
                await start_following()
                continue
        else:
            item = await outputs.get()
        if isinstance(item, bytes):
            first = state.first_audio_at is None
            chunk = state.audio_chunk(item)
            if first:
                on_first_audio()
            if envelope is not None:
                envelope.add(item)
            client.note_delivered(session_id, chunk.num_samples)
            yield chunk
            continue
        # a SessionDone: generation finished, the codec's last audio is out, or the stream failed
        if item.error is not None or item.outcome.failed:
            raise state.failed(item)
        if item.outcome is Outcome.AUDIO:
            audio_out = True
            continue
        generated = True
        state.generated(item)
        if state.following is None:
            await start_following()


async def next_chunk(text: TextSource) -> TextChunk | None:
    """The next chunk to generate, waiting for text if need be; None once the text is exhausted."""
    while (chunk := text.take()) is None:
        if text.exhausted:
            return None
        await text.wait()
    return chunk


async def _first_of(outputs: asyncio.Queue[SessionOutput], text: TextSource) -> SessionOutput | None:
    """The session's next output, or None if the text changed first (new text, a flush, the end, a deadline)."""
    get = asyncio.ensure_future(outputs.get())
    changed = asyncio.ensure_future(text.wait())
    try:
        await asyncio.wait({get, changed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        changed.cancel()
        if not get.done():
            get.cancel()  # Queue.get takes its item only when it resumes: a cancelled get loses nothing
    return get.result() if get.done() and not get.cancelled() else None

