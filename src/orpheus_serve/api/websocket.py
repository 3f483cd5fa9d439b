"""`WebSocket /v1/audio/stream`: many requests over one socket, audio as binary messages.

Client -> server, JSON text messages:
    {"text": "...", "voice": "tara", "response_format": "pcm", "sample_rate": 24000, "speed": 1.0,
     "temperature": ..., "seed": ..., "request_id": "..."}   a request (queued if one is running)
    {"cancel": true}                                           stop the running request

Server -> client:
    binary messages                          the running request's audio, in order
    {"done": true, "request_id", "metrics"}  it finished
    {"cancelled": true, "request_id"}        it was cancelled
    {"error": {...}, "request_id"}           OpenAI-shaped error; the socket stays usable

Contexts: text that arrives in pieces (a voice agent's LLM reply), one continuous audio stream:
    {"context_id": "r1", "text": "Sure, ", "voice": "tara", ...options, "timestamps": true}
                                                               opens context r1 (a request; text optional)
    {"context_id": "r1", "text": "I can help."}                more text (concatenated as sent)
    {"context_id": "r1", "flush": true}                        speak what has arrived now
    {"context_id": "r1", "end": true}                          no more text (may carry text too)
    {"context_id": "r1", "cancel": true}                       stop r1, running or queued; others untouched
  Server -> client, besides its audio and "done"/"cancelled"/"error" (each with "context_id"):
    {"flushed": true, "context_id", "flush_id"}                a flush's audio is all sent (flush_id counts
                                                               the context's flushes from 1)
    {"timestamps": {...}, "context_id"}                        with "timestamps": after each text chunk's
                                                               audio, its exact bounds and estimated word times
  A context is cut into generation chunks at sentence and clause boundaries as its text arrives
  (text_stream.py), so its first audio comes before its text is complete. Options are set by the first
  message; later ones carry only text, flush and end. A context with no text for stream_input.idle_timeout_s
  ends by itself. Plain requests may ask for "timestamps" too.

Requests and contexts run one at a time in arrival order (a context queued behind another takes text
meanwhile). A message that cannot be used
(binary data, broken JSON, JSON nested too deeply, an integer of more digits
than Python converts, a JSON value that is not an object, an invalid request)
gets an error message, and the socket stays open for the next request; so
does a request that fails for a reason of the server's own. The one exception
is a text message that is not valid UTF-8: RFC 6455 requires closing the
connection (1007), and `WebSocketProtocol` sends the error message just
before it does. Disconnecting cancels the running request and drops queued
ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

from ..request.errors import InvalidRequestError, SynthesisError
from ..request.text_stream import TextStream
from ..request.types import ChunkTimings, SynthesisRequest
from ..request.validation import is_request_id
from ..token_format import SAMPLE_RATE
from .context_socket import CLOSE_TRY_AGAIN_LATER, INBOX_MESSAGES
from .errors import RequestLimitError, TooManyConnectionsError, error_body
from .gateway import Gateway
from .json_frames import json_object_frame
from .schemas import ContextOpenMessage, ContextTextMessage, StreamRequestMessage, first_validation_error

if TYPE_CHECKING:
    from starlette.types import Message

log = logging.getLogger(__name__)

STREAM_PATH = "/v1/audio/stream"
CLOSE_POLICY_VIOLATION = 1008
CLOSE_INVALID_PAYLOAD = 1007
CLOSED_CONTEXTS_REMEMBERED = 64


def _error_text(exc: SynthesisError, request_id: str | None = None) -> str:
    return json.dumps({**error_body(exc), "request_id": request_id}, separators=(",", ":"))


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol (server.py passes it to uvicorn), with two changes.

    A text message that is not valid UTF-8 never reaches the app: the protocol must fail the
    connection with 1007 (RFC 6455 §8.1), which uvicorn does without a word. Here the client
    first gets this API's JSON error message, so it learns what was wrong; then the same close.

    A handshake refused with an HTTP response (the ASGI websocket denial response: a wrong key,
    an unknown voice, a bad output format) is a finished handshake. uvicorn 0.54's sansio protocol
    writes the response but leaves `handshake_complete` unset, so each refusal logged
    `ERROR ... ASGI callable returned without completing handshake.` (its wsproto protocol sets it;
    upstream: Kludex/uvicorn PR #3138). A client's mistake is logged at INFO, as uvicorn logs the
    status line, and never as a server error."""

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = b"".join(self.frames)
            try:
                data.decode()
            except UnicodeDecodeError as exc:
                self.frames = []
                if self.conn.state is not State.OPEN:  # the client's close came with it: nothing more to say
                    return
                error = InvalidRequestError(f"the text message is not valid UTF-8 (byte 0x{data[exc.start]:02x} at "
                                            f"offset {exc.start}); the connection is closed, as RFC 6455 requires")
                self.conn.send_text(_error_text(error).encode())
                self.conn.send_close(CLOSE_INVALID_PAYLOAD, "text message is not valid UTF-8")
                self.handle_parser_exception()  # writes both frames; tells the app the client is gone
                return
        super().send_receive_event_to_app()


@dataclass(frozen=True, slots=True)
class _Incoming:
    message: Message | None  # None: the client disconnected
    received_at: float


@dataclass(frozen=True, slots=True)
class _Job:
    request: StreamRequestMessage
    received_at: float
    text_input: TextStream | None = None  # a context's incremental text
    context_id: str | None = None


class StreamConnection:
    """One WebSocket: a reader task feeding an inbox, and at most one request streaming at a time."""

    def __init__(self, websocket: WebSocket, gateway: Gateway) -> None:
        self.ws = websocket
        self.gateway = gateway
        self.max_requests = gateway.config.server.max_ws_requests_per_connection
        self.max_contexts = gateway.config.server.max_ws_contexts_per_connection
        self._send_lock = asyncio.Lock()
        # Bounded: past it the reader stops reading, and the client's own socket pushes back.
        self._inbox: asyncio.Queue[_Incoming] = asyncio.Queue(maxsize=INBOX_MESSAGES)
        self._queued: deque[_Job] = deque()
        self._current: asyncio.Task[None] | None = None
        self._current_id: str | None = None
        self._current_context: str | None = None
        self._contexts: dict[str, TextStream] = {}  # open contexts, running or queued, by context_id
        # Ids of contexts that ended lately: text still in flight for one (an LLM reply cut off by a barge-in)
        # is refused instead of opening a new context that would speak it.
        self._closed_contexts: deque[str] = deque(maxlen=CLOSED_CONTEXTS_REMEMBERED)
        self._accepted = 0
        self._stalled = False  # a request found the client reading nothing: the connection is reset

    async def _send_json(self, body: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(body, separators=(",", ":")))

    async def _send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(data)

    async def _send_error(self, exc: SynthesisError, request_id: str | None = None, context_id: str | None = None
                          ) -> None:
        text = _error_text(exc, request_id)
        if context_id is not None:
            text = json.dumps({**json.loads(text), "context_id": context_id}, separators=(",", ":"))
        async with self._send_lock:
            await self.ws.send_text(text)

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                await self._inbox.put(_Incoming(None, time.perf_counter()))
                return
            await self._inbox.put(_Incoming(message, time.perf_counter()))

    async def run(self) -> None:
        try:
            lease = self.gateway.acquire_connection("ws")
        except TooManyConnectionsError as exc:
            await self.ws.accept()
            await self._send_error(exc)
            await self.ws.close(CLOSE_TRY_AGAIN_LATER)
            return
        reader: asyncio.Task[None] | None = None
        try:
            await self.ws.accept()
            reader = asyncio.create_task(self._read(), name="ws-reader")
            await self._serve()
        except WebSocketDisconnect as exc:
            # The client went away while we were writing to it: the normal end of a connection.
            log.debug("WebSocket closed by the client (code %s)", exc.code)
        finally:
            for task in (self._current, reader):
                if task is not None and not task.done():
                    task.cancel()
            pending = {t for t in (self._current, reader) if t is not None}
            if pending:
                await asyncio.wait(pending)
            for _ in self._queued:  # accepted but never started: cancelled by the disconnect, counted as such
                self.gateway.abandoned("ws")
            self._queued.clear()
            lease.release()
            if self._stalled:
                self.gateway.reset_connection(self.ws.scope.get("client"))

    async def _serve(self) -> None:
        next_message = asyncio.create_task(self._inbox.get())
        try:
            while True:
                waiters: set[asyncio.Task[Any]] = {next_message}
                if self._current is not None:
                    waiters.add(self._current)
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if self._current is not None and self._current in done and not self._finish_current():
                    return
                if next_message in done:
                    incoming = next_message.result()
                    if incoming.message is None:
                        return
                    next_message = asyncio.create_task(self._inbox.get())
                    if not await self._handle(incoming):
                        return
                if self._current is None and self._queued:
                    self._start(self._queued.popleft())
        finally:
            next_message.cancel()

    def _finish_current(self) -> bool:
        """Reap the finished request task; False if the socket is gone."""
        task, self._current, self._current_id = self._current, None, None
        if self._current_context is not None:
            self._close_context(self._current_context)
            self._current_context = None
        assert task is not None
        if task.cancelled():
            return True
        exc = task.exception()
        if exc is None:
            return True
        if isinstance(exc, WebSocketDisconnect | OSError):
            return False
        raise exc

    def _start(self, job: _Job) -> None:
        # The service's request id is always the server's own; a client's id is only echoed back.
        synthesis_request = replace(job.request.synthesis_request(), text_input=job.text_input,
                                    timestamps=job.request.timestamps)
        self._current_id = job.request.request_id or synthesis_request.request_id
        self._current_context = job.context_id
        self._current = asyncio.create_task(self._stream(job, synthesis_request, self._current_id),
                                            name=f"ws-{synthesis_request.request_id}")

    async def _handle(self, incoming: _Incoming) -> bool:
        """Act on one client message; False when the connection must close."""
        message = incoming.message
        assert message is not None
        try:
            body = json_object_frame(message)
        except InvalidRequestError as exc:
            await self._send_error(exc)
            return True
        if "context_id" in body:
            return await self._handle_context(body, incoming)
        if "cancel" in body:
            await self._cancel(body)
            return True
        request_id = body["request_id"] if is_request_id(body.get("request_id")) else None  # echoed only if valid
        try:
            request = StreamRequestMessage.model_validate(body)
            request.speech_text()
        except ValidationError as exc:
            error = first_validation_error(list(exc.errors()), skip=())
            self.gateway.refused("ws", error)
            await self._send_error(error, request_id)
            return True
        except InvalidRequestError as exc:
            self.gateway.refused("ws", exc)
            await self._send_error(exc, request_id)
            return True
        if not await self._count_request(request_id):
            return False
        self._queued.append(_Job(request, incoming.received_at))
        return True

    async def _count_request(self, request_id: str | None, context_id: str | None = None) -> bool:
        """One more request on this connection; False (and the socket closed) past the limit."""
        if self._accepted >= self.max_requests:
            error = RequestLimitError(f"this connection has served its {self.max_requests} requests "
                                      "(server.max_ws_requests_per_connection); open a new one")
            self.gateway.refused("ws", error)
            await self._send_error(error, request_id, context_id)
            await self.ws.close(CLOSE_POLICY_VIOLATION)
            return False
        self._accepted += 1
        return True

    async def _handle_context(self, body: dict[str, Any], incoming: _Incoming) -> bool:
        """A context message: open, more text, flush, end or cancel. False when the connection must close."""
        context_id = body["context_id"] if is_request_id(body.get("context_id")) else None
        if context_id is None:
            await self._send_error(InvalidRequestError(
                "context_id must be 1 to 128 printable ASCII characters", param="context_id"))
            return True
        if "cancel" in body:
            await self._cancel_context(body, context_id)
            return True
        text = self._contexts.get(context_id)
        if text is None and context_id in self._closed_contexts:
            await self._send_error(InvalidRequestError(
                f"context {context_id!r} has ended (finished or cancelled); open a new context with a new id",
                param="context_id"), None, context_id)
            return True
        try:
            if text is not None:
                message = ContextTextMessage.model_validate(body)
                piece = message.piece()
            else:
                opening = ContextOpenMessage.model_validate(body)
                message, piece = opening, opening.piece()
                opening.speech_text()
        except ValidationError as exc:
            error = first_validation_error(list(exc.errors()), skip=())
            if text is None:
                self.gateway.refused("ws", error)
            elif error.param not in ContextTextMessage.model_fields:
                error = InvalidRequestError(f"{error} (a context's options are set by its first message)",
                                            param=error.param)
            request_id = body["request_id"] if text is None and is_request_id(body.get("request_id")) else None
            await self._send_error(error, request_id, context_id)
            return True
        except InvalidRequestError as exc:
            await self._send_error(exc, None, context_id)
            return True
        if text is None:
            if len(self._contexts) >= self.max_contexts:
                error = InvalidRequestError(
                    f"this connection has {self.max_contexts} contexts open "
                    "(server.max_ws_contexts_per_connection); end or cancel one first", param="context_id")
                self.gateway.refused("ws", error)
                await self._send_error(error, None, context_id)
                return True
            if not await self._count_request(message.request_id, context_id):
                return False
            text = TextStream(self.gateway.config.stream_input)
            self._contexts[context_id] = text
            self._queued.append(_Job(message, incoming.received_at, text, context_id))
        try:
            if piece:
                text.push(piece)
            if message.flush:
                text.flush()
            if message.end:
                text.end()
        except InvalidRequestError as exc:
            await self._send_error(exc, None, context_id)
        return True

    def _close_context(self, context_id: str) -> None:
        if self._contexts.pop(context_id, None) is not None:
            self._closed_contexts.append(context_id)

    async def _cancel_context(self, body: dict[str, Any], context_id: str) -> None:
        if body.get("cancel") is not True or set(body) != {"context_id", "cancel"}:
            await self._send_error(InvalidRequestError(
                'a context cancel message is exactly {"context_id": ..., "cancel": true}', param="cancel"),
                None, context_id)
            return
        if self._current is not None and self._current_context == context_id:
            task, request_id = self._current, self._current_id
            task.cancel()
            await asyncio.wait({task})
            self._finish_current()
            await self._send_json({"cancelled": True, "request_id": request_id, "context_id": context_id})
            return
        for job in self._queued:
            if job.context_id == context_id:
                self._queued.remove(job)
                self._close_context(context_id)
                self.gateway.abandoned("ws")
                await self._send_json({"cancelled": True, "request_id": job.request.request_id,
                                       "context_id": context_id})
                return
        await self._send_json({"cancelled": False, "request_id": None, "context_id": context_id,
                               "message": "no such context is open"})

    async def _cancel(self, body: dict[str, Any]) -> None:
        if body.get("cancel") is not True or len(body) > 1:
            await self._send_error(InvalidRequestError('a cancel message is exactly {"cancel": true}',
                                                       param="cancel"))
            return
        if self._current is None:
            await self._send_json({"cancelled": False, "request_id": None, "message": "no request is running"})
            return
        task, request_id, context_id = self._current, self._current_id, self._current_context
        task.cancel()
        await asyncio.wait({task})
        self._finish_current()
        await self._send_json({"cancelled": True, "request_id": request_id,
                               **({"context_id": context_id} if context_id is not None else {})})

    async def _stream(self, job: _Job, synthesis_request: SynthesisRequest, request_id: str) -> None:
        """Serve one request to the end; its errors, the server's own included, become error messages."""
        try:
            await self._serve_request(job, synthesis_request, request_id)
        except (WebSocketDisconnect, OSError):
            raise  # the client is gone: nobody to tell
        except Exception:
            log.exception("WebSocket request %s failed", request_id)
            await self._send_error(SynthesisError("internal server error"), request_id, job.context_id)

    async def _serve_request(self, job: _Job, synthesis_request: SynthesisRequest, request_id: str) -> None:
        context = {"context_id": job.context_id} if job.context_id is not None else {}
        try:
            stream = await self.gateway.admit("ws", lambda: (synthesis_request, job.request.output_options()),
                                              received_at=job.received_at, hold_connection=False)
        except SynthesisError as exc:
            await self._send_error(exc, request_id, job.context_id)
            return
        assert stream is not None
        streaming = asyncio.current_task()
        assert streaming is not None
        watcher = asyncio.create_task(stream.cancel_when_stalled(streaming.cancel))
        speed = stream.output.speed
        try:
            async for event in stream.events():
                if isinstance(event, bytes):
                    await self._send_bytes(event)
                    continue
                if job.request.timestamps and event.text:
                    await self._send_json({"timestamps": timings_body(event, speed), "request_id": request_id,
                                           **context})
                if event.flush_id is not None:
                    await self._send_json({"flushed": True, "flush_id": event.flush_id, "request_id": request_id,
                                           **context})
        except SynthesisError as exc:
            await self._send_error(exc, request_id, job.context_id)
            return
        except asyncio.CancelledError:
            if not stream.stalled.is_set():
                raise
            # Cancelled by the watcher: the client reads nothing (its socket is full), so no message can
            # reach it; the connection is dropped.
            self._stalled = True
            raise ConnectionAbortedError(f"request {request_id}: the client stopped reading") from None
        finally:
            watcher.cancel()
            await stream.close()
        await self._send_json({"done": True, "request_id": request_id, **context, "metrics": stream.metrics_dict()})


def timings_body(timings: ChunkTimings, speed: float = 1.0) -> dict[str, Any]:
    """A text chunk's bounds (exact) and word times (estimated), in seconds of the audio as played."""
    scale = 1.0 / (SAMPLE_RATE * speed)
    return {
        "chunk": {"index": timings.index, "text": timings.text, "start_s": round(timings.start_sample * scale, 4),
                  "end_s": round(timings.end_sample * scale, 4)},
        "words": [{"word": w.word, "start_s": round(w.start_s / speed, 4), "end_s": round(w.end_s / speed, 4)}
                  for w in timings.words],
        "estimated": timings.estimated,
    }


def add_stream_route(app: FastAPI, gateway: Gateway) -> None:
    @app.websocket(STREAM_PATH)
    async def audio_stream(websocket: WebSocket) -> None:
        await StreamConnection(websocket, gateway).run()
