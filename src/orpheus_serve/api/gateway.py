"""What every protocol handler shares: the one admission path, API keys, and one audio stream in flight.

`Gateway` is built once per server and handed to the HTTP app, the WebSocket
route and the gRPC servicer, so the connection limit, the counters and the
metrics registry cover all three protocols.

The admission path, the same for every protocol (`Gateway.admit`):

    build()            the adapter's wire conversion: wire message -> SynthesisRequest + OutputOptions
    check_output()     the output options (format, rate, speed) checked
    lease              one of server.max_connections (WebSocket: held by the connection instead)
    readiness          warming up, shutting down or a dead engine: ServiceUnavailableError
    open_stream()      synthesis started and its first item awaited, so refusals surface before any
                       byte is sent: the request validated (once, by the service: validation.py),
                       the queue full, a timeout while queued
    stream.audio()     the adapter frames these bytes for its wire
    stream.close()     the session cancelled if still running, the lease freed, the outcome counted

Every refusal on the way is counted under its error code before it is raised,
and every stream that opened is counted when it closes, so an adapter records
nothing itself; it only converts its wire types and maps `SynthesisError`s to
its own convention (errors.py). Errors raised before an adapter runs (an API
key checked by middleware, a body FastAPI cannot parse) are counted with
`Gateway.refused`. A new protocol is one more adapter module calling `admit`,
plus its route or service registration in server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..audio.encoding import CONTENT_TYPES, AudioOptionError, AudioStreamEncoder, check_output_options
from ..config import Config
from ..metrics.prometheus import ServingMetrics
from ..metrics.stats import merge_api_processes
from ..request.errors import ClientStalledError, InvalidRequestError, ServiceUnavailableError, SynthesisError
from ..request.types import PROTOCOLS, AudioChunk, ChunkTimings, ProtocolName, SynthesisMetrics, SynthesisRequest
from ..token_format import OPENAI_VOICE_ALIASES, SAMPLE_RATE, VOICES
from .errors import TooManyConnectionsError, UnauthorizedError

if TYPE_CHECKING:
    from ..metrics.stats import ServiceSnapshot
    from ..service.service import TTSService

log = logging.getLogger(__name__)



class SpeechService(Protocol):
    """The part of `TTSService` the gateway uses."""

    model_info: Any
    ready: bool
    accepting: bool
    engine_alive: bool

    def saturation(self) -> str | None: ...
    def synthesize(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk | ChunkTimings | SynthesisMetrics]: ...
    def stats(self) -> dict: ...
    def snapshot(self) -> ServiceSnapshot: ...
    def add_observer(self, observer: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How the client wants its audio: encoding, output sample rate, playback speed."""

    format: str = "pcm"
    sample_rate: int = SAMPLE_RATE
    speed: float = 1.0

    @property
    def passthrough(self) -> bool:
        """Raw PCM (or WAV) at the model's rate and speed: the chunk's bytes as they are."""
        return self.format in ("pcm", "wav") and self.sample_rate == SAMPLE_RATE and self.speed == 1.0


class ConnectionLease:
    """One slot of server.max_connections; `release()` is idempotent."""

    def __init__(self, limiter: ConnectionLimiter) -> None:
        self._limiter = limiter
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._release()


class ConnectionLimiter:
    """Counts HTTP streams, WebSockets and gRPC calls against one global limit (event-loop only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open = 0

    @property
    def open(self) -> int:
        return self._open

    def acquire(self) -> ConnectionLease:
        if self._open >= self.limit:
            raise TooManyConnectionsError(
                f"the server has {self.limit} streams open (server.max_connections); retry shortly")
        self._open += 1
        return ConnectionLease(self)

    def _release(self) -> None:
        self._open -= 1


def voice_list() -> list[dict[str, Any]]:
    """Every Orpheus voice with the OpenAI names accepted for it."""
    return [{"id": v, "name": v.capitalize(), "aliases": sorted(a for a, t in OPENAI_VOICE_ALIASES.items() if t == v)}
            for v in VOICES]


_UNAVAILABLE = {
    "warming_up": "the server is warming up; retry shortly",
    "shutting_down": "the server is shutting down; retry on another instance",
    "engine_failed": "the synthesis engine has failed and is not serving; retry on another instance",
}


class Gateway:
    """Shared by all protocol handlers of one server."""

    def __init__(self, service: SpeechService | TTSService, config: Config) -> None:
        self.service = service
        self.config = config
        self.limiter = ConnectionLimiter(config.server.max_connections)
        self._api_keys = [k.encode() for k in config.server.api_keys]
        self._active: Counter[str] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()
        self._outcomes: Counter[tuple[str, str]] = Counter()
        self.started_at = time.time()
        self.shutting_down = False  # set by the server when shutdown begins; the service says the rest
        self.metrics = ServingMetrics(service.snapshot, self.figures)
        service.add_observer(self.metrics)
        # Compressed encoding, resampling and tempo cost milliseconds per chunk; PyAV releases the GIL while
        # it works, so they run here instead of on the event loop that serves every stream.
        self.encode_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                              thread_name_prefix="audio-encode")
        # Set by the server that owns the HTTP listener: resets the connection of an ASGI scope's
        # `client` (host, port); True if it found one. None: stalled clients only get a graceful close.
        self.connection_resetter: Callable[[Any], bool] | None = None
        # Set by a server with more than one API process (server.api_processes): this process's index and
        # every API process's own counters, which /v1/stats sums (stats.merge_api_processes).
        self.api_processes: Callable[[], tuple[int, dict[int, dict[str, Any]]]] | None = None

    def close(self) -> None:
        """Release the encoding threads (after the listeners are closed)."""
        self.encode_pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------ admission

    @property
    def auth_required(self) -> bool:
        return bool(self._api_keys)

    def check_api_key(self, authorization: str | None) -> None:
        """Raise UnauthorizedError unless `authorization` is `Bearer <a configured key>` (or keys are off)."""
        if not self._api_keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthorizedError("missing API key: send the header 'Authorization: Bearer <key>'")
        candidate = token.strip().encode()
        # Compare against every key so timing does not reveal which one nearly matched.
        matched = False
        for key in self._api_keys:
            matched |= hmac.compare_digest(candidate, key)
        if not matched:
            raise UnauthorizedError("incorrect API key provided")

    @staticmethod
    def check_output(output: OutputOptions) -> None:
        """The gateway's half of a request (how its audio is encoded); InvalidRequestError if it cannot be.
        The service validates the other half, once, when synthesis starts."""
        try:
            check_output_options(output.format, sample_rate=output.sample_rate, speed=output.speed)
        except AudioOptionError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None

    def readiness(self) -> Literal["ready", "warming_up", "shutting_down", "engine_failed", "saturated"]:
        """What /ready says. `engine_failed`: the engine fails every step, nothing can be served.
        `saturated`: serving, but the pipeline is behind or at capacity with nowhere to queue (ARCHITECTURE §5a);
        it clears by itself."""
        if self.shutting_down:
            return "shutting_down"
        if not self.service.engine_alive:
            return "engine_failed"
        if not (self.service.ready and self.service.accepting):
            return "warming_up"
        return "saturated" if self.service.saturation() is not None else "ready"

    def acquire_connection(self, protocol: ProtocolName) -> ConnectionLease:
        """One of server.max_connections, for a connection that carries many requests (a WebSocket)."""
        try:
            return self.limiter.acquire()
        except TooManyConnectionsError as exc:
            self.refused(protocol, exc)
            raise

    async def admit(self, protocol: ProtocolName, build: Callable[[], tuple[SynthesisRequest, OutputOptions]], *,
                    received_at: float, hold_connection: bool = True,
                    disconnected: Callable[[], Awaitable[object]] | None = None) -> SpeechStream | None:
        """The admission path of every protocol (see the module docstring): a started stream, or None if
        `disconnected()` returned first (the client left while queued; nothing is owed to it).

        Raises SynthesisError, already counted, for anything refused. `build` is the adapter's wire
        conversion and raises InvalidRequestError for a message it cannot convert. `hold_connection`:
        the stream holds one of server.max_connections (False where the connection already holds one)."""
        lease: ConnectionLease | None = None
        try:
            request, output = build()
            self.check_output(output)
            if hold_connection:
                lease = self.limiter.acquire()
        except SynthesisError as exc:
            self.refused(protocol, exc)
            raise
        return await self.open_stream(request, output, protocol, received_at=received_at, lease=lease,
                                      disconnected=disconnected)

    def reset_connection(self, client: Any) -> bool:
        """Drop the HTTP/WebSocket connection of a client that stopped reading, buffers and all.

        A graceful close waits until the bytes already written reach the client, which never happens
        when it reads nothing: the socket, its kernel buffers and the transport's write buffer would
        stay until the client itself goes away, and the client would never learn it was cut off."""
        resetter = self.connection_resetter
        return resetter(client) if resetter is not None and client is not None else False

    async def open_stream(self, request: SynthesisRequest, output: OutputOptions, protocol: ProtocolName, *,
                          received_at: float, lease: ConnectionLease | None = None,
                          disconnected: Callable[[], Awaitable[object]] | None = None) -> SpeechStream | None:
        """Start synthesis and wait for its first item, so admission errors surface before any byte is sent.

        Raises the service's SynthesisError (queue full, unavailable, ...).
        Returns None when `disconnected()` returns first: the session is then
        already cancelled and nothing is owed to the client.
        """
        try:
            stream = SpeechStream(self, request, output, protocol, received_at=received_at, lease=lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        try:
            state = self.readiness()
            if state not in ("ready", "saturated"):  # a saturated server still queues or refuses by itself
                raise ServiceUnavailableError(_UNAVAILABLE[state])
            if not await stream.start(disconnected):
                await stream.close()
                return None
        except BaseException as exc:
            await stream.close(exc)
            raise
        return stream

    # -------------------------------------------------------------- figures

    def stream_opened(self, protocol: str) -> None:
        self._active[protocol] += 1
        self._idle.clear()

    def stream_closed(self, protocol: str, status: str) -> None:
        self._active[protocol] -= 1
        self._record(protocol, status)
        if not any(self._active.values()):
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open (their last bytes written); False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def refused(self, protocol: str, error: SynthesisError) -> None:
        """Count a request refused before a stream opened (streams count themselves when they close)."""
        self._record(protocol, error.code)

    def abandoned(self, protocol: str) -> None:
        """Count a request a connection accepted but never started (it closed first): cancelled."""
        self._record(protocol, "cancelled")

    def _record(self, protocol: str, status: str) -> None:
        self._outcomes[(protocol, status)] += 1
        self.metrics.request_done(protocol, status)

    def figures(self) -> dict[str, Any]:
        by_protocol: dict[str, dict[str, int]] = {p: {} for p in PROTOCOLS}
        for (protocol, status), count in sorted(self._outcomes.items()):
            by_protocol.setdefault(protocol, {})[status] = count
        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            "open_connections": self.limiter.open,
            "max_connections": self.limiter.limit,
            "active_streams": {p: self._active[p] for p in PROTOCOLS},
            "requests": by_protocol,
        }

    def stats(self) -> dict[str, Any]:
        """The service's snapshot plus the gateway's figures and the process's CPU time (GET /v1/stats)."""
        snapshot = {**self.service.stats(), "gateway": self.figures()}
        if self.api_processes is not None:  # server.api_processes > 1: every API process's counters, summed
            own_index, figures = self.api_processes()
            merge_api_processes(snapshot, own_index, figures)
        # CPU seconds of the whole server process (all threads): benchmarks difference two snapshots.
        snapshot.setdefault("process", {"pid": os.getpid(), "cpu_s": round(time.process_time(), 3),
                                        "threads": threading.active_count()})
        return snapshot


_DONE = object()
# Items a stream's pump may hold ahead of its client: the service's generator advances (and counts
# audio as delivered) only as fast as the client's socket takes the bytes.
STREAM_QUEUE_ITEMS = 2


class SpeechStream:
    """One synthesis in flight, encoded for its client.

    A pump task consumes the service's generator and hands items over through
    a small bounded queue, so the generator lives in a single task from start
    to finish whichever task serves the client, cancelling the pump is all it
    takes to cancel the session (the generator is closed with it), and the
    service sees the client's pace (flow control). If the client takes nothing
    for `server.stalled_client_timeout_s`, the pump cancels the session and
    sets `stalled`; the protocol handler then drops the connection.
    """

    def __init__(self, gateway: Gateway, request: SynthesisRequest, output: OutputOptions,
                 protocol: ProtocolName, *, received_at: float, lease: ConnectionLease | None) -> None:
        self.gateway = gateway
        self.request = request
        self.output = output
        self.protocol = protocol
        self.received_at = received_at
        self.encoder: AudioStreamEncoder | None = None
        self.metrics: SynthesisMetrics | None = None
        self.first_byte_s: float | None = None
        self._lease = lease
        self._queue: asyncio.Queue[AudioChunk | ChunkTimings | SynthesisMetrics | BaseException | object] = asyncio.Queue(
            maxsize=STREAM_QUEUE_ITEMS)
        self.stalled = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._head: AudioChunk | ChunkTimings | SynthesisMetrics | BaseException | object | None = None
        self._status: str | None = None
        self._closed = False
        gateway.stream_opened(protocol)

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.output.format]

    async def cancel_when_stalled(self, cancel: Callable[[], object]) -> None:
        """Call `cancel` once the client is reported stalled (ARCHITECTURE §5a). Every adapter runs this
        beside the task that writes the stream, with that task's (or its scope's) cancel."""
        await self.stalled.wait()
        cancel()

    async def _in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run an encoder call off the loop unless it is a plain copy. Calls of one stream never overlap."""
        if self.output.passthrough:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.gateway.encode_pool, fn, *args)

    def _new_encoder(self) -> AudioStreamEncoder:
        return AudioStreamEncoder(self.output.format, sample_rate=self.output.sample_rate, speed=self.output.speed)

    async def _run_pump(self) -> None:
        items = self.gateway.service.synthesize(self.request)
        try:
            async for item in items:
                if not await self._hand_over(item):
                    return
        except Exception as exc:  # handed to the consumer, which raises it in its own task
            await self._hand_over(exc)
        else:
            await self._hand_over(_DONE)
        finally:
            await items.aclose()  # cancels the session if it is still running

    async def _hand_over(self, item: object) -> bool:
        """Queue an item for the consumer; False (and `stalled` set) if the client took nothing for too long."""
        timeout = self.gateway.config.server.stalled_client_timeout_s
        try:
            await asyncio.wait_for(self._queue.put(item), timeout)
        except asyncio.TimeoutError:
            self._status = ClientStalledError.code
            log.info("request %s (%s): the client took no audio for %.1f s; cutting it off",
                     self.request.request_id, self.protocol, timeout)
            while not self._queue.empty():  # nothing queued is owed any more: the consumer finds the error next
                self._queue.get_nowait()
            self._queue.put_nowait(ClientStalledError(
                f"the client took no audio for {timeout:g} s (server.stalled_client_timeout_s)"))
            self.stalled.set()
            return False
        # close() may have cancelled the pump in the very instant the put completed: before Python 3.12,
        # wait_for then returns the put's result and the cancellation is lost (gh-86296). Without this
        # check the pump would go on into a queue nobody reads, keeping the session for the stall timeout.
        return not self._closed

    async def start(self, disconnected: Callable[[], Awaitable[object]] | None = None) -> bool:
        """Wait for the first item; raise its error if it is one. False if the client left first."""
        self._pump = asyncio.create_task(self._run_pump(), name=f"speech-{self.request.request_id}")
        # Opening a container encoder takes milliseconds: done while the first audio is being generated.
        self.encoder = await self._in_pool(self._new_encoder)
        first = asyncio.ensure_future(self._queue.get())
        waiters: set[asyncio.Future[Any]] = {first}
        watcher = None if disconnected is None else asyncio.ensure_future(disconnected())
        if watcher is not None:
            waiters.add(watcher)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.cancel()
        if not first.done() or first.cancelled():
            self._status = "cancelled"
            return False
        head = first.result()
        if isinstance(head, BaseException):
            self._status = head.code if isinstance(head, SynthesisError) else "internal_error"
            raise head
        self._head = head
        return True

    async def audio(self) -> AsyncIterator[bytes]:
        """Encoded bytes as they become ready (never empty); sets `metrics` when the stream is complete.

        Raises SynthesisError when synthesis fails mid-stream.
        """
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, bytes):
                    yield event

    async def events(self) -> AsyncIterator[bytes | ChunkTimings]:
        """`audio()`'s bytes with each text chunk's ChunkTimings in order, after that chunk's audio
        (incremental-text requests and requests with timestamps; see request.types.ChunkTimings)."""
        item = self._head
        self._head = None
        encoder = self.encoder
        assert encoder is not None, "audio() before start()"
        while True:
            if item is None:
                item = await self._queue.get()
            if item is _DONE:
                raise RuntimeError(f"synthesis of {self.request.request_id} ended without final metrics")
            if isinstance(item, BaseException):
                self._status = item.code if isinstance(item, SynthesisError) else "internal_error"
                raise item
            if isinstance(item, ChunkTimings):
                yield item
                item = None
                continue
            if isinstance(item, SynthesisMetrics):
                self.metrics = item
                tail = await self._in_pool(encoder.flush)
                self._status = "ok"
                if tail:
                    yield self._mark(tail)
                return
            assert isinstance(item, AudioChunk)
            data = await self._in_pool(encoder.encode, item.pcm)
            if data:
                yield self._mark(data)
            item = None

    def _mark(self, data: bytes) -> bytes:
        if self.first_byte_s is None:
            self.first_byte_s = time.perf_counter() - self.received_at
            self.gateway.metrics.first_byte(self.protocol, self.first_byte_s)
        return data

    def metrics_dict(self) -> dict[str, Any]:
        """The service's metrics plus what the gateway saw, for final messages to the client."""
        out: dict[str, Any] = self.metrics.as_dict() if self.metrics is not None else {"request_id":
                                                                                         self.request.request_id}
        out["gateway_ttfb_ms"] = None if self.first_byte_s is None else round(self.first_byte_s * 1000, 2)
        out["format"] = self.output.format
        out["sample_rate"] = self.output.sample_rate
        out["speed"] = self.output.speed
        out["bytes"] = self.encoder.bytes_out if self.encoder is not None else 0
        return out

    async def close(self, error: BaseException | None = None) -> None:
        """Cancel the session if it is still running, free the connection slot, count the outcome. Idempotent."""
        if self._closed:
            return
        self._closed = True
        pump = self._pump
        try:
            if pump is not None and not pump.done():
                pump.cancel()
                # Wait for the generator's cleanup (the service cancels the session there).
                await asyncio.wait({pump})
        finally:
            # Even if this task is cancelled again while waiting: the slot, the count and the outcome
            # must not leak (the pump was cancelled above and finishes on its own).
            self._release(error)

    def _release(self, error: BaseException | None) -> None:
        if self._lease is not None:
            self._lease.release()
        if error is not None and not isinstance(error, asyncio.CancelledError):
            status = error.code if isinstance(error, SynthesisError) else "internal_error"
        else:
            # "ok", the error audio() raised, or, if it never finished, the client went away.
            status = self._status or "cancelled"
        self.gateway.stream_closed(self.protocol, status)
        if status not in ("ok", "cancelled"):
            log.info("request %s (%s) ended: %s", self.request.request_id, self.protocol, status)
