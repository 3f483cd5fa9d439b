"""TTSService: the one async facade every gateway uses.

    synthesize(request)                              (asyncio, the gateway's task)
      ├─ validate, split text into sentence chunks (text.py)
      ├─ per chunk: prompt ids -> SessionRequest -> EngineCore.submit
      │     engine core thread: schedule -> engine.step -> update
      │        FramesReady ───────────────▶ codec worker thread (batched SNAC decode)
      │        Session{Finished,Failed} ─┐                  │ CodecResult
      │                                  ▼                  ▼
      │          loop.call_soon_threadsafe(  per-session asyncio.Queue  )
      └─ yields AudioChunk (16-bit PCM) in order, then one SynthesisMetrics

Long text plays as one continuous stream: chunk k+1 is submitted the moment
chunk k finishes generating (its audio is still being decoded and played),
and its audio is held until chunk k's last sample is out, so the order is
exact and the client's buffer bridges the next chunk's first-audio time.

Leaving the iterator early (client gone, `aclose`) cancels the live session:
the scheduler frees its slot at the next step and the codec drops its state.
The asyncio loop never runs model code.

Flow control (DESIGN §5a) closes the loop from the client back to the engine:
the codec reports each session's decoded frames to the scheduler, and every
chunk the consumer takes from `synthesize` is reported as delivered (the
gateway consumes only as fast as the client's socket takes bytes). The
scheduler holds back sessions that run too far ahead of either, so the
per-session mailboxes below stay bounded by `max_server_buffer_s` plus one push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from . import protocol
from .codec.base import CodecResult, StreamingDecoder
from .config import Config
from .engine_core import EngineCore
from .engines.base import TokenEngine
from .scheduler import (
    AdmissionError,
    FramesReady,
    Scheduler,
    SchedulerEvent,
    SchedulerFullError,
    SessionFailed,
    SessionFinished,
    SessionRequest,
)
from .step import SEED_MAX, SamplingParams
from .synthesis import (
    AudioChunk,
    EngineFailureError,
    InvalidRequestError,
    QueueFullError,
    ServiceUnavailableError,
    SynthesisMetrics,
    SynthesisRequest,
    SynthesisTimeoutError,
)
from .text import normalize_text, split_text
from .validation import Limits, validate_request

log = logging.getLogger(__name__)

TEXT_CHUNK_CHARS = 200  # sentence chunks the model handles well; long text is split into these


class ServiceObserver(Protocol):
    def on_request_queued(self, request_id: str) -> None: ...
    def on_first_audio(self, request_id: str, ttfb_s: float, queue_s: float) -> None: ...
    def on_request_finished(self, metrics: SynthesisMetrics) -> None: ...
    def on_request_rejected(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    backend: str
    model_path: str
    codec_path: str
    tiny: bool
    warning: str | None = None


@dataclass(slots=True)
class _Done:
    """End of one session's stream, from the scheduler (reason) or the codec (error)."""

    reason: str
    tokens: int = 0
    frames: int = 0
    queue_s: float = 0.0
    error: str | None = None


class _SessionChannel:
    """Per-session mailbox on the asyncio loop: PCM from the codec, _Done from scheduler and codec."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | _Done] = asyncio.Queue()


def audible_lookahead(decoder: StreamingDecoder) -> int:
    """Frames that must follow the first frame before the decoder returns any audio.

    A windowed decoder emits whole frames: its lookahead. The stateful decoder
    returns every sample that is final, so audio starts once the frames pushed
    cover its lookahead in samples (4757 for snac_24khz: after 3 frames, 21
    tokens, not 4). The scheduler's first flush waits for this many frames."""
    samples = getattr(decoder, "lookahead_samples", None)
    if samples is None:
        return decoder.lookahead_frames
    return samples // protocol.SAMPLES_PER_FRAME


def pcm16(samples: np.ndarray) -> bytes:
    """float32 [-1, 1] -> 16-bit little-endian PCM."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class TTSService:
    def __init__(
        self,
        config: Config,
        *,
        engine: TokenEngine,
        decoder: StreamingDecoder,
        tokenizer: Any,
        model_info: ModelInfo,
        codec_device: str = "cpu",
        record_tokens: bool = False,
    ) -> None:
        from .codec.worker import CodecWorker

        self.config = config
        self.model_info = model_info
        self._engine = engine
        self._decoder = decoder
        self._tokenizer = tokenizer
        lookahead = audible_lookahead(decoder)
        self._scheduler = Scheduler(
            config.scheduler, engine.num_slots, lookahead_frames=lookahead, max_seq_len=engine.max_seq_len,
            lookahead_samples=getattr(decoder, "lookahead_samples", lookahead * protocol.SAMPLES_PER_FRAME),
            delivery_feedback=True, max_frames_per_pass=config.codec.max_frames_per_pass,
            max_pass_s=config.codec.max_pass_ms / 1000,
        )
        self._codec = CodecWorker(
            decoder, self._on_codec_result, max_batch=config.codec.max_batch,
            max_frames_per_pass=config.codec.max_frames_per_pass,
            max_frames_per_session=config.codec.max_frames_per_session,
            max_pass_s=config.codec.max_pass_ms / 1000,
            held_audio_s=self._scheduler.client_held_s, on_pass=self._on_codec_pass, device=codec_device,
        )
        self._limits = Limits.from_config(config, max_seq_len=engine.max_seq_len, chunk_chars=TEXT_CHUNK_CHARS)
        # session id -> (prompt ids, frames so far, finish reason); only for tooling (--tokens-out)
        self.token_log: dict[str, dict[str, Any]] | None = {} if record_tokens else None
        self._core = EngineCore(self._scheduler, engine, self._codec, self._on_scheduler_event,
                                on_frames=self._record_frames if record_tokens else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Items from the engine and codec threads, handed to the loop in batches: one wake-up
        # per batch of codec results instead of one per result.
        self._inbox: list[tuple[Hashable, bytes | _Done]] = []
        self._inbox_lock = threading.Lock()
        self._drain_scheduled = False
        self._channels: dict[Hashable, _SessionChannel] = {}
        self._observers: list[ServiceObserver] = []
        self._active_requests = 0
        self._idle = asyncio.Event()
        self._started_at = time.monotonic()
        self.ready = False
        self.accepting = False
        self.counters = {
            "requests_total": 0,
            "requests_completed": 0,
            "requests_failed": 0,
            "requests_cancelled": 0,
            "requests_rejected": 0,
            "requests_invalid": 0,
            "audio_seconds_total": 0.0,
            "tokens_total": 0,
        }

    # ------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, config: Config, *, record_tokens: bool = False) -> TTSService:
        """Build tokenizer, engine and codec from config, falling back to the tiny models if needed."""
        from .codec import build_decoder, load_snac
        from .codec.sim import SimDecoder
        from .config import apply_engine_mode, resolve_device, resolve_dtype
        from .engines.factory import check_backend, create_engine
        from .models import resolve_model_paths

        config = apply_engine_mode(config)
        check_backend(config)
        paths = resolve_model_paths(config)
        if paths.warning:
            log.warning("!" * 72)
            log.warning(paths.warning)
            log.warning("!" * 72)
        engine_cfg = config.engine.model_copy(update={"model_path": str(paths.model_path)})
        config = config.model_copy(update={"engine": engine_cfg})
        tokenizer = load_tokenizer(paths.tokenizer_path)
        engine = create_engine(config)
        codec_device = resolve_device(config.codec.device)
        if config.codec.decoder == "sim":
            sim = config.codec.sim
            decoder: StreamingDecoder = SimDecoder(base_ms=sim.base_ms, per_frame_ms=sim.per_frame_ms,
                                                   realtime=sim.realtime)
        else:
            snac = load_snac(
                str(paths.codec_path),
                device=codec_device,
                dtype=resolve_dtype(config.codec.dtype, codec_device, cuda_default="fp16"),
                noise=config.codec.noise,
                seed=config.codec.seed,
                compile=config.codec.compile,
            )
            decoder = build_decoder(config.codec, snac)
        info = ModelInfo(
            id="orpheus-tiny" if paths.tiny else Path(paths.model_path).name,
            backend=config.engine.backend,
            model_path=str(paths.model_path),
            codec_path=str(paths.codec_path),
            tiny=paths.tiny,
            warning=paths.warning,
        )
        return cls(config, engine=engine, decoder=decoder, tokenizer=tokenizer, model_info=info,
                   codec_device=codec_device, record_tokens=record_tokens)

    # --------------------------------------------------------------- lifecycle

    async def start(self, *, warmup: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._codec.start()
        self._core.start()
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
        if self._active_requests:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for key in list(self._channels):
            self._core.cancel(str(key), "cancelled")
        self._core.stop()
        self._codec.stop(5.0)
        self._engine.close()

    def add_observer(self, observer: ServiceObserver) -> None:
        self._observers.append(observer)

    # -------------------------------------------------------------- validation

    @property
    def engine_alive(self) -> bool:
        """False once the engine core has declared the engine dead (every retry of a step failed)."""
        return self._core.engine_alive

    def validate(self, req: SynthesisRequest) -> SynthesisRequest:
        """`req` checked against what this server's engine can take (validation.py): text normalised,
        voice resolved, max_tokens clamped to the context. InvalidRequestError naming the parameter."""
        return validate_request(req, self._limits, prompt_len=lambda voice, text: len(self.prompt_ids(voice, text)))

    def _sampling_for(self, req: SynthesisRequest, text: str) -> SamplingParams:
        s = self.config.sampling
        max_tokens = s.max_tokens_for(text) if req.max_tokens is None else req.max_tokens
        max_tokens = max(7, max_tokens - max_tokens % 7)
        return SamplingParams(
            temperature=s.temperature if req.temperature is None else float(req.temperature),
            top_p=s.top_p if req.top_p is None else float(req.top_p),
            top_k=s.top_k if req.top_k is None else int(req.top_k),
            repetition_penalty=s.repetition_penalty if req.repetition_penalty is None else float(req.repetition_penalty),
            max_tokens=max_tokens,
            seed=req.seed,
            constrained=s.constrained if req.constrained is None else bool(req.constrained),
        )

    def prompt_ids(self, voice: str, text: str) -> tuple[int, ...]:
        return tuple(protocol.build_prompt_ids(self._tokenizer, voice, text))

    # --------------------------------------------------------------- streaming

    async def synthesize(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk | SynthesisMetrics]:
        """AudioChunk items, then one SynthesisMetrics. Closing early cancels."""
        if not self.accepting:
            raise ServiceUnavailableError("the server is not accepting requests (starting up or shutting down)")
        if not self.engine_alive:
            raise ServiceUnavailableError("the engine has failed; this server needs a restart")
        try:
            req = self.validate(req)
        except InvalidRequestError:
            self.counters["requests_invalid"] += 1
            raise
        # aclosing: leaving this generator early must close the inner one now (it cancels the session),
        # not whenever the garbage collector finalises it.
        async with contextlib.aclosing(self._synthesize(req, count=True)) as items:
            async for item in items:
                yield item

    def text_chunks(self, text: str) -> list[str]:
        return split_text(normalize_text(text), max_chars=TEXT_CHUNK_CHARS)

    async def _synthesize(self, req: SynthesisRequest, *, count: bool) -> AsyncIterator[AudioChunk | SynthesisMetrics]:
        received = time.monotonic()
        chunks = self.text_chunks(req.text)
        if not chunks:
            raise InvalidRequestError("input has no text to speak after normalisation", param="input")
        metrics = SynthesisMetrics(request_id=req.request_id, text_chunks=len(chunks))
        if count:
            self.counters["requests_total"] += 1
            self._active_requests += 1
            self._idle.clear()
        live: list[str] = []  # session ids submitted and not yet fully drained
        index = 0
        sample_offset = 0
        first_audio_at: float | None = None
        try:
            next_session = self._submit_chunk(req, chunks, 0, received, None, 0.0)
            live.append(next_session)
            if count:
                self._notify("on_request_queued", req.request_id)
            for k in range(len(chunks)):
                session_id = next_session
                channel = self._channels[session_id]
                submitted_next = False
                generated = audio_out = False
                while not (generated and audio_out):
                    item = await channel.queue.get()
                    if isinstance(item, bytes):
                        if first_audio_at is None:
                            first_audio_at = time.monotonic()
                            metrics.ttfb_s = first_audio_at - received
                            if count:
                                self._notify("on_first_audio", req.request_id, metrics.ttfb_s, metrics.queue_s)
                        chunk = AudioChunk(pcm=item, index=index, start_sample=sample_offset)
                        index += 1
                        sample_offset += chunk.num_samples
                        # Handed to the consumer: delivered, as far as flow control is concerned.
                        self._scheduler.note_delivered(session_id, chunk.num_samples)
                        self._core.wake()
                        yield chunk
                        continue
                    # a _Done: generation finished, the codec's last audio is out, or the stream failed
                    if item.error is not None or item.reason in ("error", "timeout", "cancelled"):
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
                    if not submitted_next and k + 1 < len(chunks):
                        # Generation of chunk k is done; admit chunk k+1 now, while k's audio still plays.
                        played_from = first_audio_at if first_audio_at is not None else time.monotonic()
                        audio_before = sample_offset / protocol.SAMPLE_RATE
                        next_session = self._submit_chunk(req, chunks, k + 1, time.monotonic(), played_from,
                                                          audio_before)
                        live.append(next_session)
                        submitted_next = True
                live.remove(session_id)
                self._channels.pop(session_id, None)
            metrics.samples = sample_offset
            metrics.audio_seconds = sample_offset / protocol.SAMPLE_RATE
            metrics.wall_s = time.monotonic() - received
            if count:
                self.counters["requests_completed"] += 1
                self.counters["audio_seconds_total"] += metrics.audio_seconds
                self.counters["tokens_total"] += metrics.tokens
                self._notify("on_request_finished", metrics)
            yield metrics
        except QueueFullError as exc:
            if count:
                self.counters["requests_rejected"] += 1
                self._notify("on_request_rejected", str(exc))
            raise
        except (EngineFailureError, SynthesisTimeoutError):
            if count:
                self.counters["requests_failed"] += 1
                metrics.wall_s = time.monotonic() - received
                self._notify("on_request_finished", metrics)
            raise
        finally:
            cancelled = bool(live)
            for session_id in live:
                self._core.cancel(session_id, "cancelled")
                self._channels.pop(session_id, None)
            if count:
                if cancelled and metrics.finish_reason not in ("error", "timeout"):
                    self.counters["requests_cancelled"] += 1
                self._active_requests -= 1
                if self._active_requests == 0:
                    self._idle.set()

    def _submit_chunk(
        self,
        req: SynthesisRequest,
        chunks: list[str],
        k: int,
        arrival_s: float,
        playback_start_s: float | None,
        audio_before_s: float,
    ) -> str:
        session_id = f"{req.request_id}-{k}"
        sampling = self._sampling_for(req, chunks[k])
        if sampling.seed is not None and k:
            sampling = replace(sampling, seed=(sampling.seed + k) % (SEED_MAX + 1))  # seeds wrap in 0..2^64-1
        session = SessionRequest(
            request_id=session_id,
            prompt_ids=self.prompt_ids(req.voice, chunks[k]),
            sampling=sampling,
            arrival_s=arrival_s,
            playback_start_s=playback_start_s,
            audio_before_s=audio_before_s,
        )
        self._channels[session_id] = _SessionChannel()
        if self.token_log is not None:
            self.token_log[session_id] = {"text": chunks[k], "prompt_ids": list(session.prompt_ids), "frames": [],
                                          "finish_reason": None}
        try:
            self._core.submit(session)
        except AdmissionError as exc:
            self._channels.pop(session_id, None)
            if isinstance(exc, SchedulerFullError):
                raise QueueFullError(str(exc), retry_after_s=exc.retry_after_s) from None
            raise InvalidRequestError(str(exc), param=getattr(exc, "param", None)) from None
        return session_id

    @staticmethod
    def _raise_for(done: _Done) -> None:
        if done.reason == "timeout":
            raise SynthesisTimeoutError("the request timed out (waiting for a slot or generating)")
        if done.reason == "cancelled":
            raise ServiceUnavailableError("the request was cancelled by the server (shutting down)")
        raise EngineFailureError(done.error or "generation failed")

    # --------------------------------------------- callbacks from other threads

    def _record_frames(self, event: FramesReady) -> None:
        """Engine core thread: keep every session's frames for the token log."""
        entry = self.token_log.get(event.request_id) if self.token_log is not None else None
        if entry is not None:
            entry["frames"].extend(event.frames.tolist())

    def _on_scheduler_event(self, event: SchedulerEvent) -> None:
        """Engine core thread -> asyncio loop."""
        if self.token_log is not None and isinstance(event, SessionFinished) and event.request_id in self.token_log:
            self.token_log[event.request_id]["finish_reason"] = event.reason
        if isinstance(event, SessionFailed):
            done = _Done(reason="error", error=event.error)
        elif isinstance(event, SessionFinished):
            if event.reason == "error":
                return  # SessionFailed already carried the error
            done = _Done(reason=event.reason, tokens=event.tokens, frames=event.frames, queue_s=event.queue_s)
        else:
            return
        self._post(event.request_id, done)

    def _on_codec_pass(self, frames: int, seconds: float) -> None:
        """Codec worker thread, after each pass: measure it, and let held-back sessions go on."""
        self._scheduler.record_codec_pass(frames, seconds)
        self._core.wake()

    def _on_codec_result(self, result: CodecResult) -> None:
        """Codec worker thread -> asyncio loop. Converts to PCM here, off the loop."""
        self._scheduler.note_decoded(str(result.key), result.frames, int(result.pcm.size),
                                     final=result.final or result.error is not None)
        if result.error:
            self._post(result.key, _Done(reason="error", error=f"codec error: {result.error}"))
            return
        if result.pcm.size:
            self._post(result.key, pcm16(result.pcm))
        if result.final:
            self._post(result.key, _Done(reason="audio"))

    def _post(self, key: Hashable, item: bytes | _Done) -> None:
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
            channel = self._channels.get(key)
            if channel is not None:  # None: the client left; its session is being cancelled
                channel.queue.put_nowait(item)

    def _notify(self, method: str, *args: Any) -> None:
        for observer in self._observers:
            getattr(observer, method)(*args)

    # ------------------------------------------------------------------ stats

    def flow_stats(self) -> dict[str, Any]:
        """Flow control: capacity against demand, backpressure, codec backlog, and whether we are behind."""
        flow = self._scheduler.flow_stats().as_dict()
        backlog_frames, oldest_s = self._codec.backlog()
        flow["codec_backlog_frames"] = backlog_frames
        flow["codec_oldest_pending_s"] = round(oldest_s, 4)
        flow["saturated"] = self.saturation() is not None
        flow["saturation"] = self.saturation()
        return flow

    def saturation(self) -> str | None:
        """Why the pipeline is behind (for /ready), or None: the codec's oldest undecoded frame is older
        than server.ready_max_backlog_s, or admission is closed and no request could wait for it."""
        _, oldest_s = self._codec.backlog()
        if oldest_s > self.config.server.ready_max_backlog_s:
            return f"codec backlog: oldest undecoded frame is {oldest_s:.1f} s old"
        flow = self._scheduler.flow_stats()
        if not flow.admission_open:
            if self.config.scheduler.admission == "reject":
                return f"at capacity: {flow.demand_streams} of {flow.capacity_streams} real-time streams"
            waiting = self._scheduler.stats().pending_sessions
            if waiting >= self.config.scheduler.max_queue:
                return f"at capacity with a full queue: {waiting} requests waiting"
        return None

    def stats(self) -> dict[str, Any]:
        s = self._core.scheduler_stats()
        uptime = max(time.monotonic() - self._started_at, 1e-9)
        mem = self._engine.memory_report()
        codec_stats = self._codec.stats() if hasattr(self._codec, "stats") else {}
        return {
            "scheduler": {
                "total_sessions": s.total_sessions,
                "active_sessions": s.active_sessions,
                "pending_sessions": s.pending_sessions,
                "max_concurrent": s.max_concurrent,
                "policy": s.policy,
                "finished": s.finished,
                "cancelled": s.cancelled,
                "failed": s.failed,
                "timed_out": s.timed_out,
                "rejected": s.rejected,
                "mean_batch_size": round(s.mean_batch_size, 3),
                "total_steps": s.total_steps,
            },
            "kv_cache": {
                "used_slots": s.used_slots,
                "free_slots": s.free_slots,
                "usage": round(s.used_slots / max(s.max_concurrent, 1), 4),
                "bytes_per_slot": mem.kv_bytes_per_slot,
                "total_bytes": mem.kv_cache_bytes,
                "max_seq_len": mem.max_seq_len,
            },
            "total_tokens": s.total_tokens,
            "total_batches": s.total_batches,
            "engine": {
                "backend": self.model_info.backend,
                "alive": self._core.engine_alive,
                "failure": self._core.engine_failure,
                "device": mem.device,
                "steps": self._core.steps,
                "step_errors": self._core.step_errors,
                "busy_s": round(self._core.busy_s, 3),
            },
            "codec": codec_stats,
            "flow": self.flow_stats(),
            "requests": {
                "active": self._active_requests,
                **{k: v for k, v in self.counters.items() if k.startswith("requests_")},
            },
            "process": {"cpu_s": round(time.process_time(), 3)},  # all threads; for CPU cost per audio second
            "throughput": {
                "uptime_s": round(uptime, 3),
                "audio_seconds_total": round(self.counters["audio_seconds_total"], 3),
                "tokens_total": self.counters["tokens_total"],
                "tokens_per_s": round(s.total_tokens / uptime, 2),
                "audio_seconds_per_s": round(self.counters["audio_seconds_total"] / uptime, 4),
            },
        }


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from a Hugging Face folder (tokenizer.json)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return Tokenizer.from_file(str(file))
