"""`WebSocket /tts/websocket`: Cartesia's TTS WebSocket protocol (API version 2025-04-16), for voice agents.

The agent frameworks (LiveKit Agents' Cartesia plugin, Pipecat's
`CartesiaTTSService`, the `cartesia` SDK) speak this protocol; pointing their
base URL here is all they need. Each context on a socket is one incremental-
text request (ARCHITECTURE §5b): its `TextStream` takes the transcripts as they come
and its audio streams back as the text is cut into chunks. Many contexts run
on one socket at once.

Client -> server, JSON text messages:
    {"context_id", "transcript", "continue", "model_id", "voice": {"mode": "id", "id"},
     "output_format": {"container": "raw", "encoding", "sample_rate"}, "add_timestamps",
     "max_buffer_delay_ms", "flush", "generation_config": {"speed"}, "language", ...}
        the first message of a context opens it (voice, format and timestamps are fixed from then on);
        every message appends its transcript as it is (the client sends its own spaces);
        `flush: true` cuts what is buffered into a chunk now (answered by `flush_done` once it is spoken);
        `max_buffer_delay_ms: 0` (on the first message) flushes every transcript as it comes;
        `continue: false` (or absent) ends the context's text: it finishes after its audio.
    {"context_id", "cancel": true}
        stop that context now; nothing more is sent for it. Other contexts go on.

Server -> client:
    {"type": "chunk", "data": <base64 audio>, "done": false, "status_code": 206, "step_time", "context_id",
     "flush_id"?}  step_time: milliseconds the server spent producing the chunk (see `StepClock`)
    {"type": "timestamps", "word_timestamps": {"words", "start", "end"}, "done": false, "status_code": 206,
     "context_id", "flush_id"?}  seconds from the context's first sample, once each text chunk's audio is final
     (estimated inside a chunk: Orpheus has no aligner; the chunk bounds are exact)
    {"type": "flush_done", "flush_done": true, "flush_id", "done": false, "status_code": 206, "context_id"}
    {"type": "done", "done": true, "status_code": 206, "context_id"}
    {"type": "error", "error", "message", "title", "error_code", "status_code": 4xx/5xx, "done": true,
     "context_id"}  the context (if any) is over; the socket stays open
    `flush_id` N (from 1) is on the chunks and timestamps that follow the N-th `flush_done`, i.e. the audio
    of the text sent after the N-th flush; before the first flush they carry none, as Cartesia's do.

Auth (when server.api_keys is set): `X-API-Key: <key>`, `?api_key=<key>` or `Authorization: Bearer <key>`,
checked before the handshake completes (a wrong key gets HTTP 401). Fields this server has no use for
(`model_id`, `language`, `pronunciation_dict_id`, ...) are accepted and ignored; a known field of the
wrong type is an error. Voices: an Orpheus voice or OpenAI alias as `id` (or as a bare string, as the
`cartesia` SDK 4 may send it); a Cartesia voice id (a UUID)
or an embedding is spoken with the default voice. Audio: raw `pcm_s16le`, `pcm_f32le`, `pcm_mulaw` or
`pcm_alaw` (G.711, for telephony), at 8000, 16000, 22050, 24000, 44100 or 48000 Hz.
Disconnecting cancels every context of the socket.
"""

from __future__ import annotations

import asyncio
import base64
import http
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from starlette.requests import HTTPConnection

from ..audio.pcm import pcm16_to_float
from ..config import StreamInputConfig
from ..request.errors import ClientStalledError, InvalidRequestError, SynthesisError
from ..request.text_stream import TextStream
from ..request.types import ChunkTimings, SynthesisRequest
from ..token_format import DEFAULT_VOICE, SAMPLE_RATE, UnknownVoiceError, resolve_voice
from .context_socket import ContextSocket, Incoming
from .errors import TooManyConnectionsError, UnauthorizedError, mapping_for
from .gateway import Gateway, OutputOptions
from .json_frames import json_object_frame

log = logging.getLogger(__name__)

CARTESIA_PATH = "/tts/websocket"
# Cartesia's paths (the WebSocket and the HTTP endpoints, cartesia_http.py): their errors take Cartesia's shape.
CARTESIA_PREFIX = "/tts/"
API_VERSION = "2025-04-16"
# Cartesia encoding -> the audio module's format. The float encoding is the 16-bit stream widened here.
ENCODINGS: dict[str, str] = {"pcm_s16le": "pcm", "pcm_f32le": "pcm", "pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}
# Contexts one socket may have open at once (each holds a text buffer and, while it speaks, a stream).
MAX_CONTEXTS_PER_CONNECTION = 32
# Cancelled context ids remembered per socket, so text that was in flight when the cancel was sent does
# not open the context again.
CANCELLED_MEMORY = 256
_UUID = re.compile(r"^[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$", re.IGNORECASE)


# ---------------------------------------------------------------- wire types


class _Lenient(BaseModel):
    """Fields this server reads are type-checked; anything else a client sends is ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class OutputFormat(_Lenient):
    container: Literal["raw"] = "raw"
    encoding: Literal["pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw"] = "pcm_s16le"
    sample_rate: Literal[8000, 16000, 22050, 24000, 44100, 48000] = SAMPLE_RATE


class Voice(_Lenient):
    mode: Literal["id", "embedding"] = "id"
    id: str | None = None


class GenerationConfig(_Lenient):
    speed: float | None = Field(None, ge=0.6, le=1.5)


ContextId = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class GenerationRequest(_Lenient):
    """One Cartesia generation request (only the fields this server uses or checks)."""

    context_id: ContextId
    transcript: str = ""
    continue_: bool = Field(False, alias="continue")
    flush: bool | None = None
    model_id: str | None = None
    voice: Voice | str = Voice()
    output_format: OutputFormat = OutputFormat()
    add_timestamps: bool | None = None
    max_buffer_delay_ms: int | None = Field(None, ge=0, le=5000)
    generation_config: GenerationConfig | None = None
    language: str | None = None


class CancelRequest(_Lenient):
    context_id: ContextId
    cancel: Literal[True]


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or None
    if error["type"] == "missing":
        return f"missing field {where!r}", where
    return f"{where}: {error['msg']}" if where else error["msg"], where


def resolve_cartesia_voice(voice: Voice | str, resolve: Callable[[str | None], str] = resolve_voice) -> str:
    """The Orpheus voice for a Cartesia voice specifier (see the module docstring): an object, or a bare id;
    `resolve`: the server's voice catalog (service/voices.py: built-in and custom voices)."""
    if isinstance(voice, str):
        voice = Voice(mode="id", id=voice)
    if voice.mode == "embedding":
        log.info("voice embeddings are not supported; speaking with the default voice %r", DEFAULT_VOICE)
        return DEFAULT_VOICE
    try:
        return resolve(voice.id)
    except UnknownVoiceError:
        if voice.id is not None and _UUID.match(voice.id.strip()):
            log.info("Cartesia voice id %s is not a voice of this server; speaking with the default voice %r",
                     voice.id, DEFAULT_VOICE)
            return DEFAULT_VOICE
        raise


@dataclass(frozen=True, slots=True)
class ContextSpec:
    """What a context's first message fixes: the request for the service and how its audio is framed."""

    request: SynthesisRequest
    output: OutputOptions
    float32: bool
    timestamps: bool
    # `max_buffer_delay_ms: 0` leaves buffering to the client: every transcript is cut as it comes (a flush,
    # answered by flush_done), as Cartesia does. Pipecat sends whole sentences this way, without spaces between.
    flush_each: bool = False

    @classmethod
    def from_message(cls, message: GenerationRequest, text: TextStream,
                     resolve: Callable[[str | None], str] = resolve_voice) -> ContextSpec:
        fmt = ENCODINGS[message.output_format.encoding]
        try:
            voice = resolve_cartesia_voice(message.voice, resolve)
        except UnknownVoiceError as exc:
            raise InvalidRequestError(str(exc), param="voice.id") from None
        speed = message.generation_config.speed if message.generation_config else None
        timestamps = bool(message.add_timestamps)
        request = SynthesisRequest(text="", voice=voice, text_input=text, timestamps=timestamps,
                                   request_id=uuid.uuid4().hex)
        output = OutputOptions(format=fmt, sample_rate=message.output_format.sample_rate,
                               speed=1.0 if speed is None else speed)
        return cls(request, output, message.output_format.encoding == "pcm_f32le", timestamps,
                   flush_each=message.max_buffer_delay_ms == 0)


# ---------------------------------------------------------------- messages out


def http_error_body(code: str | None, status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    """Cartesia's HTTP error object (API version 2026-03-01 and later); its title is the status's phrase."""
    return {"error_code": code, "title": http.HTTPStatus(status).phrase, "message": message,
            "request_id": request_id or str(uuid.uuid4())}


def _reply(kind: str, context_id: str | None, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "context_id": context_id, **fields}


def error_message(exc: SynthesisError, context_id: str | None) -> dict[str, Any]:
    message = str(exc) or exc.__class__.__name__
    status = mapping_for(exc).http_status
    return _reply("error", context_id, done=True, status_code=status, error=message, message=message,
                  title=exc.__class__.__name__.removesuffix("Error") or "Error", error_code=exc.code)


def timestamps_message(timings: ChunkTimings, context_id: str | None, speed: float, *,
                       flush_id: int | None = None) -> dict[str, Any]:
    # Word times are at the model's pace; audio played faster or slower moves them with it.
    words = timings.words
    return _reply("timestamps", context_id, done=False, status_code=206, word_timestamps={
        "words": [w.word for w in words],
        "start": [round(w.start_s / speed, 4) for w in words],
        "end": [round(w.end_s / speed, 4) for w in words],
    }, **_flush_field(flush_id))


def chunk_message(data: bytes, context_id: str | None, step_time_ms: float, *,
                  flush_id: int | None = None) -> dict[str, Any]:
    return _reply("chunk", context_id, data=base64.b64encode(data).decode("ascii"), done=False, status_code=206,
                  step_time=step_time_ms, **_flush_field(flush_id))


def done_message(context_id: str | None) -> dict[str, Any]:
    # 206 as Cartesia sends it: the status of the stream of messages, not of one HTTP response.
    return _reply("done", context_id, done=True, status_code=206)


def _flush_field(flush_id: int | None) -> dict[str, int]:
    return {} if flush_id is None else {"flush_id": flush_id}


class StepClock:
    """Cartesia's `step_time`: the milliseconds the server spent producing a chunk.

    Counted from the moment the connection was ready for the chunk (its previous message sent; for the first,
    the moment admission began) to the moment the chunk is ready; the time spent handing messages to the
    client is not counted, so a slow reader does not inflate it. Inside a context that waits for more text
    from its client, the wait is counted: the server cannot tell it from generating."""

    def __init__(self, start: float) -> None:
        self._since = start

    def step_ms(self) -> float:
        return round((time.perf_counter() - self._since) * 1000, 3)

    def restart(self) -> None:
        self._since = time.perf_counter()


# ---------------------------------------------------------------- the connection


@dataclass(slots=True)
class _Context:
    context_id: str
    text: TextStream
    spec: ContextSpec
    task: asyncio.Task[None] | None = None


class CartesiaConnection(ContextSocket):
    """One socket: a reader task feeding a bounded inbox, and one task per open context (api/context_socket.py)."""

    protocol = "cartesia"

    def __init__(self, websocket: WebSocket, gateway: Gateway) -> None:
        super().__init__(websocket, gateway)
        self._contexts: dict[str, _Context] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    async def _refuse_connection(self, exc: TooManyConnectionsError) -> None:
        await self.ws.send_text(json.dumps(error_message(exc, None)))

    async def _serve(self) -> int | None:
        gone = asyncio.create_task(self._gone.wait())
        try:
            while True:
                next_message = asyncio.create_task(self._inbox.get())
                await asyncio.wait({next_message, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not next_message.done():
                    # The client left or stopped reading: its contexts are cancelled, what it sent is moot.
                    next_message.cancel()
                    return None
                await self._handle(next_message.result())
        except ClientStalledError:
            return None
        finally:
            gone.cancel()

    # ---- client messages

    async def _handle(self, incoming: Incoming) -> None:
        try:
            body = json_object_frame(incoming.message)
        except InvalidRequestError as exc:
            await self._error(exc)
            return
        raw_id = body.get("context_id")
        context_id = raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= 256 else None
        try:
            if "cancel" in body:
                await self._cancel(CancelRequest.model_validate(body).context_id)
                return
            request = GenerationRequest.model_validate(body)
        except ValidationError as exc:
            text, param = _validation_message(exc)
            error = InvalidRequestError(text, param=param)
            self.gateway.refused("cartesia", error)
            if context_id in self._contexts:  # the error ends the context it names (`done: true`): stop it
                await self._cancel(context_id)
            await self._error(error, context_id)
            return
        await self._generate(request, incoming.received_at)

    async def _cancel(self, context_id: str) -> None:
        self._remember_cancelled(context_id)
        ctx = self._contexts.pop(context_id, None)
        if ctx is None:  # finished already, or never opened: nothing to stop (the clients cancel freely)
            return
        if ctx.task is not None and not ctx.task.done():
            ctx.task.cancel()
            await asyncio.wait({ctx.task})

    def _remember_cancelled(self, context_id: str) -> None:
        self._cancelled[context_id] = None
        self._cancelled.move_to_end(context_id)
        while len(self._cancelled) > CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)

    async def _generate(self, request: GenerationRequest, received_at: float) -> None:
        context_id = request.context_id
        if context_id in self._cancelled:
            log.debug("Cartesia context %s: text after its cancel, dropped", context_id)
            return
        ctx = self._contexts.get(context_id)
        if ctx is None:
            if len(self._contexts) >= MAX_CONTEXTS_PER_CONNECTION:
                error = InvalidRequestError(f"this connection has {MAX_CONTEXTS_PER_CONNECTION} contexts open; "
                                            "finish or cancel one first", param="context_id")
                self.gateway.refused("cartesia", error)
                await self._error(error, context_id)
                return
            text = TextStream(self._stream_settings(request))
            try:
                spec = ContextSpec.from_message(request, text, self.gateway.service.voices.resolve)
            except InvalidRequestError as error:
                self.gateway.refused("cartesia", error)
                await self._error(error, context_id)
                return
            ctx = _Context(context_id, text, spec)
        elif ctx.text.ended and not request.transcript.strip():
            return  # a repeated end (or flush) of text already complete: nothing to do
        try:
            ctx.text.push(request.transcript)
            if request.flush or (ctx.spec.flush_each and request.transcript.strip()):
                ctx.text.flush()
            if not request.continue_:
                ctx.text.end()
        except InvalidRequestError as error:
            if ctx.task is None:
                self.gateway.refused("cartesia", error)
            else:  # the context cannot go on: it stops here, and says so
                await self._cancel(context_id)
            await self._error(error, context_id)
            return
        if ctx.task is None:
            self._contexts[context_id] = ctx
            ctx.task = asyncio.create_task(self._speak(ctx, received_at), name=f"cartesia-{context_id}")

    def _stream_settings(self, request: GenerationRequest) -> StreamInputConfig:
        settings = self.gateway.config.stream_input
        if request.max_buffer_delay_ms is None:
            return settings
        return settings.model_copy(update={"max_buffer_delay_ms": float(request.max_buffer_delay_ms)})

    async def _error(self, exc: SynthesisError, context_id: str | None = None) -> None:
        await self._send(error_message(exc, context_id))

    # ---- one context

    def _internal_error(self, ctx: _Context) -> dict[str, Any]:
        return error_message(SynthesisError("internal server error"), ctx.context_id)

    async def _serve_context(self, ctx: _Context, received_at: float) -> None:
        spec = ctx.spec
        admitting = time.perf_counter()
        try:
            stream = await self.gateway.admit("cartesia", lambda: (spec.request, spec.output),
                                              received_at=received_at, hold_connection=False)
        except SynthesisError as exc:
            await self._send(error_message(exc, ctx.context_id))
            return
        assert stream is not None  # admit returns None only with a `disconnected` probe
        speaking = asyncio.current_task()
        assert speaking is not None
        watcher = asyncio.create_task(stream.cancel_when_stalled(speaking.cancel))
        clock = StepClock(admitting)
        flushed: int | None = None  # the last flush_done sent: what follows it carries its id
        stalled: ClientStalledError | None = None
        try:
            async for event in stream.events():
                if isinstance(event, bytes):
                    step_ms = clock.step_ms()
                    data = pcm16_to_float(event).tobytes() if spec.float32 else event
                    await self._send(chunk_message(data, ctx.context_id, step_ms, flush_id=flushed))
                    clock.restart()
                    continue
                if spec.timestamps and event.words:
                    await self._send(timestamps_message(event, ctx.context_id, spec.output.speed, flush_id=flushed))
                if event.flush_id is not None:
                    await self._send(_reply("flush_done", ctx.context_id, done=False, flush_done=True,
                                            flush_id=event.flush_id, status_code=206))
                    flushed = event.flush_id
                clock.restart()
        except ClientStalledError as exc:  # a send timed out: counted as the stream's outcome
            stalled = exc
            raise
        except SynthesisError as exc:
            await self._send(error_message(exc, ctx.context_id))
            return
        except asyncio.CancelledError:
            if not stream.stalled.is_set():
                raise
            stalled = ClientStalledError("the client stopped reading")
            raise stalled from None
        finally:
            watcher.cancel()
            await stream.close(stalled)
        await self._send(done_message(ctx.context_id))


# ---------------------------------------------------------------- auth and route


def offered_api_key(connection: HTTPConnection) -> str | None:
    """The key as a Cartesia client sends it: `X-API-Key`, `?api_key=`, or `Authorization: Bearer`."""
    key = connection.headers.get("x-api-key") or connection.query_params.get("api_key")
    if key:
        return key
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def add_cartesia_route(app: FastAPI, gateway: Gateway) -> None:
    @app.websocket(CARTESIA_PATH)
    async def cartesia_websocket(websocket: WebSocket) -> None:
        if gateway.auth_required:
            key = offered_api_key(websocket)
            try:
                gateway.check_api_key(None if key is None else f"Bearer {key}")
            except UnauthorizedError as exc:
                gateway.refused("cartesia", exc)
                if key is None:
                    exc = UnauthorizedError("missing API key: send the header 'X-API-Key: <key>' "
                                            "(or the query parameter api_key)")
                body = error_message(exc, None)
                if "websocket.http.response" in websocket.scope.get("extensions", {}):
                    await websocket.send_denial_response(JSONResponse(body, status_code=401))
                else:
                    await websocket.close(1008, body["error"][:120])
                return
        await CartesiaConnection(websocket, gateway).run()

