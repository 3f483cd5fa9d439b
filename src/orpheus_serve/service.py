"""TTSService: the one async facade every gateway uses.

    synthesize(request)                              (asyncio, the gateway's task)
      ├─ validate (validation.py), split text into sentence chunks (text.py)
      ├─ per chunk: prompt ids -> SessionRequest -> EngineCoreClient.submit
      │     (engine_client.py: the engine core and codec behind one seam)
      └─ yields AudioChunk (16-bit PCM) from the session's outputs in order, then one SynthesisMetrics

Long text plays as one continuous stream: chunk k+1 is submitted the moment
chunk k finishes generating (its audio is still being decoded and played),
and its audio is held until chunk k's last sample is out, so the order is
exact and the client's buffer bridges the next chunk's first-audio time.

Leaving the iterator early (client gone, `aclose`) cancels the live session:
the scheduler frees its slot at the next step and the codec drops its state.
The asyncio loop never runs model code.

Flow control (DESIGN §5a) closes the loop from the client back to the engine:
every chunk the consumer takes from `synthesize` is reported as delivered
(the gateway consumes only as fast as the client's socket takes bytes), and
the scheduler holds back sessions that run too far ahead of their client.

The service also measures how late its own event loop runs (`_watch_loop_lag`)
and tells the engine core: a gateway too busy to hand audio out in time closes
admission however fast the engine is (DESIGN §5a's "admit what can stay
real-time" includes the gateway).

The service counts nothing itself: observers (the request tally behind
`/v1/stats`, the Prometheus metrics) hear of every request's progress and
outcome. Wiring lives in service_builder.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from . import protocol
from .config import Config
from .engine_client import EngineCoreClient, SessionDone, SessionOutput
from .scheduler import AdmissionError, SchedulerFullError, SessionRequest
from .stats import RequestOutcome, RequestTally, ServiceSnapshot, saturation, service_stats
from .step import SEED_MAX
from .synthesis import (
    AudioChunk,
    ChunkTimings,
    EngineFailureError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelInfo,
    QueueFullError,
    ServiceUnavailableError,
    SynthesisMetrics,
    SynthesisRequest,
    SynthesisTimeoutError,
)
from .text import TEXT_CHUNK_CHARS, speech_chunks
from .text_stream import TextChunk, TextStream
from .validation import Limits, resolve_sampling, validate_request
from .word_timings import AudioEnvelope, estimate_word_timings

if TYPE_CHECKING:
    from .service_builder import TokenLog

log = logging.getLogger(__name__)

LOOP_LAG_TICK_S = 0.05  # how often the event loop's lag is measured and reported
LOOP_LAG_SMOOTHING = 0.5  # weight of the newest tick: one late tick (a GC pause) does not close admission


class ServiceObserver(Protocol):
    """Hears of every counted request: started, then invalid, rejected, or queued -> first audio ->
    finished (completed, failed or cancelled); ended in every case but invalid."""

    def on_request_started(self, request_id: str) -> None: ...
    def on_request_invalid(self, reason: str) -> None: ...
    def on_request_queued(self, request_id: str) -> None: ...
    def on_first_audio(self, request_id: str, ttfb_s: float, queue_s: float) -> None: ...
    def on_request_rejected(self, reason: str) -> None: ...
    def on_request_finished(self, metrics: SynthesisMetrics, outcome: RequestOutcome) -> None: ...
    def on_request_ended(self, request_id: str) -> None: ...


class TTSService:
    def __init__(self, config: Config, *, client: EngineCoreClient, tokenizer: Any, model_info: ModelInfo,
                 max_seq_len: int, token_log: TokenLog | None = None) -> None:
        self.config = config
        self.model_info = model_info
        self._client = client
        self._tokenizer = tokenizer
        self._limits = Limits.from_config(config, max_seq_len=max_seq_len, chunk_chars=TEXT_CHUNK_CHARS)
        self.token_log = token_log
        self.tally = RequestTally()
        self._observers: list[ServiceObserver] = [self.tally]
        self._idle = asyncio.Event()
        self._started_at = time.monotonic()
        self.ready = False
        self.accepting = False
        self._lag_watch: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: Config, *, record_tokens: bool = False) -> TTSService:
        """Build tokenizer, engine and codec from config (service_builder.build_service)."""
        from .service_builder import build_service

        return build_service(config, record_tokens=record_tokens)

    # --------------------------------------------------------------- lifecycle

    async def start(self, *, warmup: bool = True) -> None:
        self._idle.set()
        self._client.start(asyncio.get_running_loop())
        self._lag_watch = asyncio.create_task(self._watch_loop_lag(), name="loop-lag")
        self.accepting = True
        if warmup:
            warm = SynthesisRequest(text="Hello.", voice=protocol.DEFAULT_VOICE, max_tokens=28, temperature=0.0,
                                    request_id="warmup")
            async for _ in self._synthesize(warm, count=False):
                pass
        self.ready = True

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop admitting; let in-flight streams finish within grace_s; then cancel the rest."""
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        self.accepting = False
        self.ready = False
        if self.tally.active:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for session_id in self._client.open_sessions():
            self._client.cancel(session_id)
        if self._lag_watch is not None:
            self._lag_watch.cancel()
            self._lag_watch = None
        self._client.shutdown()

    async def _watch_loop_lag(self) -> None:
        """Every LOOP_LAG_TICK_S: how much later than asked this loop woke up, smoothed, to the engine core."""
        loop = asyncio.get_running_loop()
        smoothed = 0.0
        while True:
            due = loop.time() + LOOP_LAG_TICK_S
            await asyncio.sleep(LOOP_LAG_TICK_S)
            lag = max(0.0, loop.time() - due)
            smoothed = (1 - LOOP_LAG_SMOOTHING) * smoothed + LOOP_LAG_SMOOTHING * lag
            self._client.note_loop_lag(smoothed)

    def add_observer(self, observer: ServiceObserver) -> None:
        self._observers.append(observer)

    @property
    def client(self) -> EngineCoreClient:
        return self._client

    @property
    def engine_alive(self) -> bool:
        """False once the engine core has declared the engine dead (every retry of a step failed)."""
        return self._client.engine_alive

    # --------------------------------------------------------------- requests

    def validate(self, req: SynthesisRequest) -> SynthesisRequest:
        """`req` checked against what this server's engine can take (validation.py): text normalised,
        voice resolved, max_tokens clamped to the context. InvalidRequestError naming the parameter."""
        return validate_request(req, self._limits, prompt_len=lambda voice, text: len(self.prompt_ids(voice, text)))

    def prompt_ids(self, voice: str, text: str) -> tuple[int, ...]:
        return tuple(protocol.build_prompt_ids(self._tokenizer, voice, text))

    async def synthesize(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk | ChunkTimings | SynthesisMetrics]:
        """AudioChunk items (and, with timestamps or incremental text, a ChunkTimings after each text chunk's
        audio), then one SynthesisMetrics. Closing early cancels."""
        if not self.accepting:
            raise ServiceUnavailableError("the server is not accepting requests (starting up or shutting down)")
        if not self.engine_alive:
            raise ServiceUnavailableError("the engine has failed; this server needs a restart")
        try:
            req = self.validate(req)
        except InvalidRequestError as exc:
            self._notify("on_request_invalid", str(exc))
            raise
        # aclosing: leaving this generator early must close the inner one now (it cancels the session),
        # not whenever the garbage collector finalises it.
        async with contextlib.aclosing(self._synthesize(req, count=True)) as items:
            async for item in items:
                yield item

    async def _synthesize(self, req: SynthesisRequest, *, count: bool
                          ) -> AsyncIterator[AudioChunk | ChunkTimings | SynthesisMetrics]:
        received = time.monotonic()
        if req.text_input is not None:
            text = req.text_input
        else:
            chunks = speech_chunks(req.text)
            if not chunks:
                raise InvalidRequestError("input has no text to speak after normalisation", param="input")
            text = TextStream.complete(chunks)
        timings_wanted = req.timestamps or req.text_input is not None
        metrics = SynthesisMetrics(request_id=req.request_id)
        if count:
            self._notify("on_request_started", req.request_id)
            self._idle.clear()
        live: list[str] = []  # session ids submitted and not yet fully drained
        reported = False  # the request's outcome has been told to the observers
        run = _Run(received)

        async def start(chunk: TextChunk | None) -> str | None:
            """Submit `chunk` if it has something to say (a flush marker has not); its session id."""
            if chunk is None or not chunk.text:
                return None
            session = await self._submit_chunk(req, chunk, run)
            live.append(session)
            return session

        try:
            current = await self._next_chunk(text)
            if count:
                self._notify("on_request_queued", req.request_id)
            session_id = await start(current)
            k = 0
            while current is not None:
                start_sample = run.samples
                envelope = AudioEnvelope() if req.timestamps else None
                following: TextChunk | None = None  # the next chunk, taken as soon as this one has generated
                following_id: str | None = None
                if session_id is not None:
                    outputs = self._client.outputs(session_id)
                    generated = audio_out = False
                    while not (generated and audio_out):
                        if generated and following is None and not text.exhausted:
                            # Generated, nothing to follow yet: the next text may arrive while this audio drains.
                            item = await _first_of(outputs, text)
                            if item is None:
                                following = text.take()
                                following_id = await start(following)
                                continue
                        else:
                            item = await outputs.get()
                        if isinstance(item, bytes):
                            if run.first_audio_at is None:
                                run.first_audio_at = time.monotonic()
                                metrics.ttfb_s = run.first_audio_at - received
                                if count:
                                    self._notify("on_first_audio", req.request_id, metrics.ttfb_s, metrics.queue_s)
                            chunk = AudioChunk(pcm=item, index=run.index, start_sample=run.samples,
                                               resumes_playback=run.resumes_playback)
                            run.resumes_playback = False
                            run.index += 1
                            run.samples += chunk.num_samples
                            if envelope is not None:
                                envelope.add(item)
                            # Handed to the consumer: delivered, as far as flow control is concerned.
                            self._client.note_delivered(session_id, chunk.num_samples)
                            yield chunk
                            continue
                        # a SessionDone: generation finished, the codec's last audio is out, or the stream failed
                        if item.error is not None or item.reason in ("error", "timeout", "cancelled", "unavailable"):
                            metrics.finish_reason = "error" if item.error is not None else item.reason
                            self._raise_for(item)
                        if item.reason == "audio":
                            audio_out = True
                            continue
                        generated = True
                        metrics.tokens += item.tokens
                        metrics.frames += item.frames
                        if k == 0:
                            metrics.queue_s = item.queue_s
                        if item.reason == "length":
                            metrics.finish_reason = "length"
                        if following is None:
                            # Generation of this chunk is done; admit the next now, while this audio still plays.
                            following = text.take()
                            following_id = await start(following)
                    live.remove(session_id)
                    self._client.release(session_id)
                    metrics.text_chunks += 1
                if timings_wanted:
                    words = estimate_word_timings(current.text, start_sample, envelope) if envelope else ()
                    yield ChunkTimings(index=k, text=current.text, start_sample=start_sample,
                                       end_sample=run.samples, words=words, flush_id=current.flush_id)
                k += 1
                current, session_id = following, following_id
                if current is None:
                    current = await self._next_chunk(text)
                    session_id = await start(current)
            metrics.samples = run.samples
            metrics.audio_seconds = run.samples / protocol.SAMPLE_RATE
            metrics.wall_s = time.monotonic() - received
            reported = True
            if count:
                self._notify("on_request_finished", metrics, "completed")
            yield metrics
        except QueueFullError as exc:
            reported = True
            if count:
                self._notify("on_request_rejected", str(exc))
            raise
        except (EngineFailureError, SynthesisTimeoutError):
            reported = True
            if count:
                metrics.wall_s = time.monotonic() - received
                self._notify("on_request_finished", metrics, "failed")
            raise
        finally:
            for session_id in live:
                self._client.cancel(session_id)
                self._client.release(session_id)
            if count:
                # Left early (the client went, the server shut down), a session running or not: an incremental
                # text may be between chunks, waiting for its next words.
                if not reported and metrics.finish_reason not in ("error", "timeout"):
                    self._notify("on_request_finished", metrics, "cancelled")
                self._notify("on_request_ended", req.request_id)
                if self.tally.active == 0:
                    self._idle.set()

    @staticmethod
    async def _next_chunk(text: TextStream) -> TextChunk | None:
        """The next chunk to generate, waiting for text if need be; None once the text is exhausted."""
        while (chunk := text.take()) is None:
            if text.exhausted:
                return None
            await text.wait()
        return chunk

    async def _submit_chunk(self, req: SynthesisRequest, chunk: TextChunk, run: _Run) -> str:
        k = run.submitted
        run.submitted += 1
        session_id = f"{req.request_id}-{k}"
        now = time.monotonic()
        # Audio the client still has to play when this chunk starts: its deadline (DESIGN §5). A client whose
        # audio ran out while the text was still coming is waiting now, like one waiting for its first audio.
        audio_before = run.samples / protocol.SAMPLE_RATE
        played_from = run.first_audio_at if run.first_audio_at is not None else now
        if req.text_input is not None and played_from + audio_before <= now:
            played_from, audio_before = now, 0.0
            run.resumes_playback = k > 0
        sampling = resolve_sampling(self.config.sampling, req, chunk.text)
        if sampling.seed is not None and k:
            sampling = replace(sampling, seed=(sampling.seed + k) % (SEED_MAX + 1))  # seeds wrap in 0..2^64-1
        session = SessionRequest(request_id=session_id, prompt_ids=self.prompt_ids(req.voice, chunk.text),
                                 sampling=sampling, arrival_s=now if k else run.received,
                                 playback_start_s=played_from if k else None, audio_before_s=audio_before if k else 0.0)
        if self.token_log is not None:
            self.token_log.record(session_id, chunk.text, session.prompt_ids)
        try:
            await self._client.submit(session)
        except AdmissionError as exc:  # the scheduler's refusal, in the service's terms
            if isinstance(exc, SchedulerFullError):
                raise QueueFullError(str(exc), retry_after_s=exc.retry_after_s) from None
            raise InvalidRequestError(str(exc), param=getattr(exc, "param", None)) from None
        return session_id

    @staticmethod
    def _raise_for(done: SessionDone) -> None:
        if done.reason == "timeout":
            raise SynthesisTimeoutError("the request timed out (waiting for a slot or generating)")
        if done.reason == "cancelled":
            raise ServiceUnavailableError("the request was cancelled by the server (shutting down)")
        if done.reason == "unavailable":  # the engine-core process died under the stream
            raise EngineUnavailableError(done.error or "the engine core is unavailable")
        raise EngineFailureError(done.error or "generation failed")

    def _notify(self, method: str, *args: Any) -> None:
        for observer in self._observers:
            getattr(observer, method)(*args)

    # ------------------------------------------------------------------ stats

    def snapshot(self) -> ServiceSnapshot:
        core = self._client.stats()
        return ServiceSnapshot(core=core, saturation=saturation(core, self.config))

    def saturation(self) -> str | None:
        """Why the pipeline is behind (for /ready), or None (stats.saturation)."""
        return saturation(self._client.stats(), self.config)

    def stats(self) -> dict[str, Any]:
        return service_stats(self.snapshot(), self.tally, backend=self.model_info.backend,
                             uptime_s=time.monotonic() - self._started_at, cpu_s=time.process_time())



@dataclass(slots=True)
class _Run:
    """Where one request's response stands: chunks submitted, audio out so far."""

    received: float
    submitted: int = 0
    index: int = 0  # AudioChunk index
    samples: int = 0  # samples out so far
    first_audio_at: float | None = None
    resumes_playback: bool = False  # the client's audio ran out while its text was awaited (AudioChunk)


async def _first_of(outputs: asyncio.Queue[SessionOutput], text: TextStream) -> SessionOutput | None:
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
