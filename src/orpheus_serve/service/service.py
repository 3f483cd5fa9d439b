"""TTSService: the one async facade every gateway uses.

    synthesize(request)                              (asyncio, the gateway's task)
      ├─ validate (validation.py), split text into sentence chunks (text.py)
      ├─ per chunk: prompt ids -> SessionRequest -> EngineCoreClient.submit
      │     (core/client.py: the engine core and codec behind one seam)
      └─ yields AudioChunk (16-bit PCM) from the session's outputs in order, then one SynthesisMetrics

Long text plays as one continuous stream: chunk k+1 is submitted the moment
chunk k finishes generating (its audio is still being decoded and played),
and its audio is held until chunk k's last sample is out, so the order is
exact and the client's buffer bridges the next chunk's first-audio time.

Leaving the iterator early (client gone, `aclose`) cancels the live session:
the scheduler frees its slot at the next step and the codec drops its state.
The asyncio loop never runs model code.

Flow control (ARCHITECTURE §5a) closes the loop from the client back to the engine:
every chunk the consumer takes from `synthesize` is reported as delivered
(the gateway consumes only as fast as the client's socket takes bytes), and
the scheduler holds back sessions that run too far ahead of their client.

The service also measures how late its own event loop runs (`_watch_loop_lag`)
and tells the engine core: a gateway too busy to hand audio out in time closes
admission however fast the engine is (ARCHITECTURE §5a's "admit what can stay
real-time" includes the gateway).

The service counts nothing itself: observers (the request tally behind
`/v1/stats`, the Prometheus metrics) hear of every request's progress and
outcome. Wiring lives in service/build.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from .. import token_format
from ..config import Config
from ..core.client import EngineCoreClient
from ..metrics.stats import RequestOutcome, RequestTally, ServiceSnapshot, saturation, service_stats
from ..request.errors import (
    EngineFailureError,
    InvalidRequestError,
    QueueFullError,
    ServiceUnavailableError,
    SynthesisTimeoutError,
)
from ..request.text import TEXT_CHUNK_CHARS
from ..request.types import (
    AudioChunk,
    ChunkTimings,
    ModelInfo,
    SynthesisMetrics,
    SynthesisRequest,
    TextChunk,
)
from ..request.validation import Limits, resolve_sampling, validate_request
from ..scheduler import AdmissionError, SchedulerFullError, SessionRequest
from ..scheduler.step import SEED_MAX
from .request_state import RequestState, drain_session, next_chunk
from .voices import VoiceCatalog
from .word_timings import AudioEnvelope

if TYPE_CHECKING:
    from .token_log import TokenLog

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
        self.voices = VoiceCatalog(config.voices.adapters_dir)  # built-in + custom (LoRA) voices
        self.token_log = token_log
        self.tally = RequestTally()
        self._observers: list[ServiceObserver] = [self.tally]
        self._idle = asyncio.Event()
        self._started_at = time.monotonic()
        self.ready = False
        self.accepting = False
        self._lag_watch: asyncio.Task[None] | None = None

    # --------------------------------------------------------------- lifecycle

    async def start(self, *, warmup: bool = True) -> None:
        self._idle.set()
        self._client.start(asyncio.get_running_loop())
        self._lag_watch = asyncio.create_task(self._watch_loop_lag(), name="loop-lag")
        self.accepting = True
        if warmup:
            warm = SynthesisRequest(text="Hello.", voice=token_format.DEFAULT_VOICE, max_tokens=28, temperature=0.0,
                                    request_id=f"warmup-{os.getpid()}")  # one per API process
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
        req = validate_request(req, self._limits, prompt_len=lambda voice, text: len(self.prompt_ids(voice, text)),
                               resolve_voice=self.voices.resolve)
        defaults = self.voices.get(req.voice).sampling  # a custom voice's voice.json; the request's own values win
        unset = {k: v for k, v in defaults.items() if getattr(req, k) is None}
        if "top_k" in unset:
            unset["top_k"] = int(unset["top_k"])
        return replace(req, **unset) if unset else req

    async def adapters(self, op: str, name: str | None = None) -> list[dict[str, Any]]:
        """Custom-voice adapters in the engine: "list", "load" or "unload" one (api/admin.py)."""
        return await self._client.adapters(op, name)

    def prompt_ids(self, voice: str, text: str) -> tuple[int, ...]:
        return tuple(token_format.build_prompt_ids(self._tokenizer, self.voices.get(voice).prompt_name, text))

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
        state = RequestState.open(req, time.monotonic())
        if count:
            self._notify("on_request_started", req.request_id)
            self._idle.clear()
        try:
            async with contextlib.aclosing(self._responses(state, count=count)) as responses:
                async for item in responses:
                    yield item
            metrics = state.finish()
            if count:
                self._notify("on_request_finished", metrics, "completed")
            yield metrics
        except QueueFullError as exc:
            state.reported = True
            if count:
                self._notify("on_request_rejected", str(exc))
            raise
        except (EngineFailureError, SynthesisTimeoutError):
            state.reported = True
            if count:
                state.metrics.wall_s = time.monotonic() - state.received
                self._notify("on_request_finished", state.metrics, "failed")
            raise
        finally:
            for session_id in state.live:
                self._client.cancel(session_id)
                self._client.release(session_id)
            if count:
                # Left early (the client went, the server shut down), a session running or not: an incremental
                # text may be between chunks, waiting for its next words.
                if not state.reported and state.metrics.finish_reason not in ("error", "timeout"):
                    self._notify("on_request_finished", state.metrics, "cancelled")
                self._notify("on_request_ended", req.request_id)
                if self.tally.active == 0:
                    self._idle.set()

    async def _responses(self, state: RequestState, *, count: bool) -> AsyncIterator[AudioChunk | ChunkTimings]:
        """Every text chunk's audio in order (and its timings when wanted); each chunk's session is submitted
        while the one before it still plays."""
        req = state.request

        async def start(chunk: TextChunk | None) -> str | None:
            """Submit `chunk` if it has something to say (a flush marker has not); its session id."""
            if chunk is None or not chunk.text:
                return None
            session = await self._submit_chunk(state, chunk)
            state.live.append(session)
            return session

        async def start_following() -> None:
            state.following = state.text.take()
            state.following_id = await start(state.following)

        def on_first_audio() -> None:
            if count:
                self._notify("on_first_audio", req.request_id, state.metrics.ttfb_s, state.metrics.queue_s)

        current = await next_chunk(state.text)
        if count:
            self._notify("on_request_queued", req.request_id)
        session_id = await start(current)
        while current is not None:
            start_sample = state.samples
            envelope = AudioEnvelope() if req.timestamps else None
            state.following = state.following_id = None
            if session_id is not None:
                drain = drain_session(state, self._client, session_id, envelope=envelope,
                                      start_following=start_following, on_first_audio=on_first_audio)
                async with contextlib.aclosing(drain) as chunks:
                    async for chunk in chunks:
                        yield chunk
                state.live.remove(session_id)
                self._client.release(session_id)
                state.metrics.text_chunks += 1
            if state.timings_wanted:
                yield state.chunk_timings(current, start_sample, envelope)
            state.chunk_index += 1
            current, session_id = state.following, state.following_id
            if current is None:
                current = await next_chunk(state.text)
                session_id = await start(current)

    async def _submit_chunk(self, state: RequestState, chunk: TextChunk) -> str:
        req = state.request
        k = state.submitted
        state.submitted += 1
        session_id = f"{req.request_id}-{k}"
        now = time.monotonic()
        # Audio the client still has to play when this chunk starts: its deadline (ARCHITECTURE §5). A client whose
        # audio ran out while the text was still coming is waiting now, like one waiting for its first audio.
        audio_before = state.samples / token_format.SAMPLE_RATE
        played_from = state.first_audio_at if state.first_audio_at is not None else now
        if req.text_input is not None and played_from + audio_before <= now:
            played_from, audio_before = now, 0.0
            state.resumes_playback = k > 0
        sampling = resolve_sampling(self.config.sampling, req, chunk.text)
        if sampling.seed is not None and k:
            sampling = replace(sampling, seed=(sampling.seed + k) % (SEED_MAX + 1))  # seeds wrap in 0..2^64-1
        session = SessionRequest(request_id=session_id, prompt_ids=self.prompt_ids(req.voice, chunk.text),
                                 sampling=sampling, arrival_s=now if k else state.received,
                                 playback_start_s=played_from if k else None, audio_before_s=audio_before if k else 0.0,
                                 adapter=self.voices.get(req.voice).adapter)
        if self.token_log is not None:
            self.token_log.record(session_id, chunk.text, session.prompt_ids)
        try:
            await self._client.submit(session)
        except AdmissionError as exc:  # the scheduler's refusal, in the service's terms
            if isinstance(exc, SchedulerFullError):
                raise QueueFullError(str(exc), retry_after_s=exc.retry_after_s) from None
            raise InvalidRequestError(str(exc), param=getattr(exc, "param", None)) from None
        return session_id

    def _notify(self, method: str, *args: Any) -> None:
        for observer in self._observers:
            getattr(observer, method)(*args)

    # ------------------------------------------------------------------ stats

    def snapshot(self) -> ServiceSnapshot:
        core = self._client.stats()
        return ServiceSnapshot(core=core, saturation=saturation(core, self.config))

    def saturation(self) -> str | None:
        """Why the pipeline is behind (for /ready and each new stream), or None (stats.saturation). From the
        client's recent stats: a core that is slow to answer must not hold the event loop."""
        return saturation(self._client.recent_stats(), self.config)

    def stats(self) -> dict[str, Any]:
        return service_stats(self.snapshot(), self.tally, backend=self.model_info.backend,
                             uptime_s=time.monotonic() - self._started_at, cpu_s=time.process_time())
