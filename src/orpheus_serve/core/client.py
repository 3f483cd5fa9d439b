"""The engine-core client: the one seam between the service's asyncio side and the engine core.

As vLLM keeps `EngineCoreClient` between its API server and `EngineCore`, the
service talks to the engine core only through `EngineCoreClient`:

    await submit(SessionRequest)  queue a session (the scheduler's AdmissionError if refused)
    outputs(session_id)           its outputs, in order, on the event loop: PCM bytes, then SessionDone
    note_delivered(id, samples)   the consumer took audio (flow control's delivery feedback)
    note_loop_lag(seconds)        how late this process's event loop runs (admission closes past a bound)
    cancel(session_id)            stop it; its slot is freed at the next step
    release(session_id)           forget its outputs (after its end, or once cancelled)
    stats()                       typed figures: EngineCoreStats

What crosses the seam is plain data (the request dataclass, PCM bytes, a
`SessionDone` record, a stats dataclass), so the engine core can run in this
process or in another one behind the same protocol:

    CoreRuntime   the scheduler, the engine core thread and the codec worker thread, wired
                  together; outputs leave through one `post(session_id, item)` callback
    InprocClient  CoreRuntime as threads of this process (server.engine_process: false)
    MPClient      CoreRuntime in an engine-core process of its own, over ZeroMQ with msgpack
                  messages (mp_client.py, core/process.py, core/wire.py; server.engine_process: true)

In-process:

    engine core thread: schedule -> engine.step -> update
       FramesReady ──────────────▶ codec worker thread (batched SNAC decode)
       Session{Finished,Failed} ─┐                  │ CodecResult -> PCM16 bytes
                                 ▼                  ▼
            loop.call_soon_threadsafe(  per-session asyncio.Queue  )

Items from both threads reach the loop in batches: one wake-up per batch of
codec results instead of one per result. The mailboxes stay bounded because
the scheduler holds back sessions whose client has not taken their audio
(`max_server_buffer_s` plus one push). In the engine-core process the same
posts go to an output thread that sends one message per batch instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from .. import token_format
from ..audio.pcm import float_to_pcm16
from ..codec.base import CodecResult, StreamingDecoder
from ..codec.worker import CodecWorker
from ..config import Config
from ..engines.base import MemoryReport, TokenEngine
from ..engines.lora import AdapterError, adapter_call
from ..scheduler import (
    FlowStats,
    FramesReady,
    InvalidSessionError,
    Scheduler,
    SchedulerEvent,
    SchedulerStats,
    SessionFailed,
    SessionFinished,
    SessionRequest,
)
from .engine_core import EngineCore
from .host_time import CoreHostSampler

log = logging.getLogger(__name__)


class Outcome(str, Enum):
    """How one part of a session's output ended (SessionDone.outcome). The values travel on the wire."""

    AUDIO = "audio"  # the codec's last audio is out
    STOP = "stop"  # generation finished: end of speech
    LENGTH = "length"  # generation finished: max_tokens
    ERROR = "error"  # the engine or codec failed the session
    TIMEOUT = "timeout"  # it waited or ran past its timeout
    CANCELLED = "cancelled"  # the scheduler cancelled it (server shutting down)
    UNAVAILABLE = "unavailable"  # the engine-core process died under it

    @property
    def failed(self) -> bool:
        return self in _FAILED


_FAILED = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.CANCELLED, Outcome.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class SessionDone:
    """The end of one part of a session's output (see Outcome); a failed one has `error` saying why where
    there is a message."""

    outcome: Outcome
    tokens: int = 0
    frames: int = 0
    queue_s: float = 0.0
    error: str | None = None


SessionOutput = bytes | SessionDone


@dataclass(frozen=True, slots=True)
class EngineCoreStats:
    scheduler: SchedulerStats
    flow: FlowStats
    codec: dict[str, Any]
    codec_backlog_frames: int
    codec_oldest_pending_s: float
    memory: MemoryReport
    engine_alive: bool
    engine_failure: str | None
    steps: int
    step_errors: int
    busy_s: float
    engine_elapsed_s: float  # the engine's own account of its steps (the sim engine: modelled time)
    loop_s: float  # engine-core loop periods that ran a step (busy_s plus scheduling and dispatch)
    # CPU seconds of the engine-core process (all its threads) when it runs apart; 0.0 in-process, where
    # the server's own process time already counts it.
    core_cpu_s: float = 0.0
    core_pid: int | None = None  # the engine-core process, when it runs apart
    core_restarts: int = 0  # times it was started again after it died
    # Where the engine-core process's host time goes (core/host_time.py: the `core_host` record); None where
    # it was not asked for (the loop's own quick checks: recent_stats in-process).
    core_host: dict[str, Any] | None = None


class EngineCoreClient(Protocol):
    @property
    def engine_alive(self) -> bool: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def shutdown(self) -> None: ...
    async def submit(self, request: SessionRequest) -> None: ...
    def outputs(self, session_id: str) -> asyncio.Queue[SessionOutput]: ...
    def note_delivered(self, session_id: str, samples: int) -> None: ...
    def note_loop_lag(self, seconds: float) -> None: ...
    def cancel(self, session_id: str) -> None: ...
    def release(self, session_id: str) -> None: ...
    def open_sessions(self) -> list[str]: ...
    def stats(self) -> EngineCoreStats: ...
    async def adapters(self, op: str, name: str | None = None) -> list[dict[str, Any]]: ...
    def recent_stats(self) -> EngineCoreStats: ...  # never waits on the core: the loop's hot paths


def audible_lookahead(decoder: StreamingDecoder) -> int:
    """Frames that must follow the first frame before the decoder returns any audio.

    A windowed decoder emits whole frames: its lookahead. The stateful decoder
    returns every sample that is final, so audio starts once the frames pushed
    cover its lookahead in samples (4757 for snac_24khz: after 3 frames, 21
    tokens, not 4). The scheduler's first flush waits for this many frames."""
    samples = getattr(decoder, "lookahead_samples", None)
    if samples is None:
        return decoder.lookahead_frames
    return samples // token_format.SAMPLES_PER_FRAME


class CoreRuntime:
    """The scheduler, the engine core thread and the codec worker thread, wired together.

    Outputs leave through `post(session_id, item)`, called on the engine core
    thread (SessionDone of generation) and on the codec thread (PCM, the codec's
    SessionDone). Both clients run exactly this: `InprocClient` posts to the
    asyncio loop of this process, the engine-core process (core/process.py)
    posts to the ZeroMQ sockets of its API processes."""

    def __init__(self, config: Config, engine: TokenEngine, decoder: StreamingDecoder,
                 post: Callable[[str, SessionOutput], None], *, codec_device: str = "cpu",
                 on_frames: Callable[[FramesReady], None] | None = None,
                 on_event: Callable[[SchedulerEvent], None] | None = None) -> None:
        self.engine = engine
        self._post = post
        lookahead = audible_lookahead(decoder)
        self.scheduler = Scheduler(
            config.scheduler, engine.num_slots, lookahead_frames=lookahead, max_seq_len=engine.max_seq_len,
            lookahead_samples=getattr(decoder, "lookahead_samples", lookahead * token_format.SAMPLES_PER_FRAME),
            delivery_feedback=True, max_frames_per_pass=config.codec.max_frames_per_pass,
            max_pass_s=config.codec.max_pass_ms / 1000,
            # The torch engine's adapter pool (TensorRT-LLM's GPU LoRA cache) holds this many voices at once.
            max_adapters=config.voices.max_loras if config.voices.adapters_dir is not None else None,
        )
        self._codec = CodecWorker(
            decoder, self._on_codec_result, max_batch=config.codec.max_batch,
            max_frames_per_pass=config.codec.max_frames_per_pass,
            max_frames_per_session=config.codec.max_frames_per_session,
            max_pass_s=config.codec.max_pass_ms / 1000,
            min_pass_frames=config.codec.min_pass_frames, max_pass_wait_s=config.codec.max_pass_wait_ms / 1000,
            held_audio_s=self.scheduler.client_held_s, on_pass=self._on_codec_pass, device=codec_device,
        )
        self._tap = on_event  # optional tap (token logs for tooling), on the engine core thread
        step_profiler = None
        if config.engine.profile_dir is not None:  # diagnostics on request (engines/profiling.py)
            from ..engines.profiling import ArmedStepProfiler

            try:
                step_profiler = ArmedStepProfiler(config.engine.profile_dir, getattr(engine, "device", "cpu"))
            except OSError:  # a diagnostic: the server serves without it
                log.exception("engine.profile_dir %s cannot be used; the engine core runs without its step "
                              "profiler", config.engine.profile_dir)
        self._core = EngineCore(self.scheduler, engine, self._codec, self._on_scheduler_event, on_frames=on_frames,
                                overlap=config.engine.overlap, step_profiler=step_profiler)
        self._host = CoreHostSampler()

    @property
    def engine_alive(self) -> bool:
        return self._core.engine_alive

    @property
    def engine_failure(self) -> str | None:
        return self._core.engine_failure

    def start(self) -> None:
        self._codec.start()
        self._core.start()

    def shutdown(self) -> None:
        self._core.stop()
        self._codec.stop(5.0)
        self.engine.close()

    def submit(self, request: SessionRequest) -> None:
        if request.adapter is not None:
            self.prefetch_adapter(request.adapter)
        self._core.submit(request)

    def prefetch_adapter(self, name: str) -> None:
        """A custom voice's adapter read and checked before its session is admitted (engines/lora.py), on the
        submitting thread; a bad one refuses the session with the reason (InvalidSessionError, param voice)."""
        manager = getattr(self.engine, "lora", None)
        if manager is None:  # TensorRT-LLM loads adapters itself; the sim engine has none
            return
        try:
            manager.prefetch(name)
        except AdapterError as exc:
            raise InvalidSessionError(str(exc), param="voice") from None

    def note_delivered(self, session_id: str, samples: int) -> None:
        self.scheduler.note_delivered(session_id, samples)

    def note_gateway_lag(self, api_index: int, seconds: float) -> None:
        self.scheduler.note_gateway_lag(api_index, seconds)
        self._core.wake()  # queued sessions may be admitted again

    def wake(self) -> None:
        self._core.wake()

    def cancel(self, session_id: str) -> None:
        self._core.cancel(session_id, "cancelled")

    def adapters(self, op: str, name: str | None = None) -> list[dict[str, Any]]:
        """Custom-voice adapters: "list", "load" or "unload" one (engines/lora.adapter_call); AdapterError
        with the reason. Any thread: the engine writes its adapter pool only between steps."""
        return adapter_call(getattr(self.engine, "lora", None), op, name)

    def stats(self, *, core_cpu_s: float = 0.0, host: bool = True) -> EngineCoreStats:
        """The figures; `host`: with the `core_host` record (a few /proc reads and percentiles, made at most
        every host_time.SUMMARY_MAX_AGE_S)."""
        backlog_frames, oldest_s = self._codec.backlog()
        return EngineCoreStats(
            scheduler=self._core.scheduler_stats(), flow=self.scheduler.flow_stats(), codec=self._codec.stats(),
            codec_backlog_frames=backlog_frames, codec_oldest_pending_s=oldest_s,
            memory=self.engine.memory_report(), engine_alive=self._core.engine_alive,
            engine_failure=self._core.engine_failure, steps=self._core.steps, step_errors=self._core.step_errors,
            busy_s=self._core.busy_s, engine_elapsed_s=self._core.engine_elapsed_s, loop_s=self._core.loop_s,
            core_cpu_s=core_cpu_s,
            core_host=self._host.sample(self._core.host_clock, self._codec.pass_clock) if host else None,
        )

    # ------------------------------------------- from the engine core and codec threads

    def _on_scheduler_event(self, event: SchedulerEvent) -> None:
        if self._tap is not None:
            self._tap(event)
        if isinstance(event, SessionFailed):
            done = SessionDone(Outcome.ERROR, error=event.error)
        elif isinstance(event, SessionFinished):
            if event.reason == "error":
                return  # SessionFailed already carried the error
            done = SessionDone(Outcome(event.reason), tokens=event.tokens, frames=event.frames, queue_s=event.queue_s)
        else:
            return
        self._post(event.request_id, done)

    def _on_codec_pass(self, frames: int, seconds: float) -> None:
        """After each pass: measure it, and let held-back sessions go on."""
        self.scheduler.record_codec_pass(frames, seconds)
        self._core.wake()

    def _on_codec_result(self, result: CodecResult) -> None:
        """Converts to PCM here, on the codec thread."""
        key = str(result.key)
        self.scheduler.note_decoded(key, result.frames, int(result.pcm.size),
                                    final=result.final or result.error is not None)
        if result.error:
            self._post(key, SessionDone(Outcome.ERROR, error=f"codec error: {result.error}"))
            return
        if result.pcm.size:
            self._post(key, float_to_pcm16(result.pcm))
        if result.final:
            self._post(key, SessionDone(Outcome.AUDIO))


class InprocClient:
    """The engine core and codec worker as threads of this process (see the module docstring)."""

    def __init__(self, config: Config, engine: TokenEngine, decoder: StreamingDecoder, *, codec_device: str = "cpu",
                 on_frames: Callable[[FramesReady], None] | None = None,
                 on_event: Callable[[SchedulerEvent], None] | None = None) -> None:
        self._runtime = CoreRuntime(config, engine, decoder, self._post, codec_device=codec_device,
                                    on_frames=on_frames, on_event=on_event)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: list[tuple[str, SessionOutput]] = []
        self._inbox_lock = threading.Lock()
        self._drain_scheduled = False
        self._mailboxes: dict[str, asyncio.Queue[SessionOutput]] = {}

    # ------------------------------------------------------------ the protocol

    @property
    def engine_alive(self) -> bool:
        return self._runtime.engine_alive

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._runtime.start()

    def shutdown(self) -> None:
        self._runtime.shutdown()

    async def submit(self, request: SessionRequest) -> None:
        fresh = request.request_id not in self._mailboxes  # else the scheduler refuses it: the id is in use
        if fresh:
            self._mailboxes[request.request_id] = asyncio.Queue()
        try:
            if request.adapter is not None:  # the adapter's files are read off the event loop
                await asyncio.to_thread(self._runtime.prefetch_adapter, request.adapter)
            self._runtime.submit(request)
        except BaseException:
            if fresh:
                del self._mailboxes[request.request_id]
            raise

    def outputs(self, session_id: str) -> asyncio.Queue[SessionOutput]:
        return self._mailboxes[session_id]

    def note_delivered(self, session_id: str, samples: int) -> None:
        self._runtime.note_delivered(session_id, samples)
        self._runtime.wake()

    def note_loop_lag(self, seconds: float) -> None:
        self._runtime.note_gateway_lag(0, seconds)

    def cancel(self, session_id: str) -> None:
        self._runtime.cancel(session_id)

    def release(self, session_id: str) -> None:
        self._mailboxes.pop(session_id, None)

    def open_sessions(self) -> list[str]:
        return list(self._mailboxes)

    def stats(self) -> EngineCoreStats:
        return self._runtime.stats()

    async def adapters(self, op: str, name: str | None = None) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._runtime.adapters, op, name)  # a load reads the adapter's files
    def recent_stats(self) -> EngineCoreStats:
        return self._runtime.stats(host=False)  # in this process: current, and no wait

    # ------------------------------------------- from the engine core and codec threads

    def _post(self, key: str, item: SessionOutput) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._inbox_lock:
            self._inbox.append((key, item))
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        loop.call_soon_threadsafe(self._drain_inbox)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
            self._drain_scheduled = False
        for key, item in items:
            mailbox = self._mailboxes.get(key)
            if mailbox is not None:  # None: the client left; its session is being cancelled
                mailbox.put_nowait(item)
