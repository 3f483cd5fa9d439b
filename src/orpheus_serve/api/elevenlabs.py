"""ElevenLabs-compatible API: text-to-speech over REST and WebSockets, and the voice list.

The clients voice-agent stacks ship (the `elevenlabs` SDK, LiveKit's
`livekit-plugins-elevenlabs`, Pipecat's `ElevenLabsTTSService` and
`ElevenLabsHttpTTSService`) need only their base URL pointed here. Every
route is an adapter onto the one admission path (`Gateway.admit`); the
WebSockets map ElevenLabs' contexts onto incremental-text requests
(`TextStream`, ARCHITECTURE §5b), as the Cartesia adapter does.

REST (`output_format` in the query, JSON body `{"text", "model_id", "voice_settings", "seed", ...}`):
    POST /v1/text-to-speech/{voice_id}                        the audio (streamed as it is made)
    POST /v1/text-to-speech/{voice_id}/stream                 the same
    POST /v1/text-to-speech/{voice_id}/with-timestamps        {"audio_base64", "alignment", "normalized_alignment"}
    POST /v1/text-to-speech/{voice_id}/stream/with-timestamps the same, one JSON object per line as audio is
                                                              made; alignment times are seconds from the
                                                              response's first sample
    GET  /v1/voices, /v1/voices/{voice_id}                    the Orpheus voices in ElevenLabs' shape

WebSocket /v1/text-to-speech/{voice_id}/stream-input (one context per socket):
    {"text": " ", "voice_settings": {...}, "generation_config": {...}}  the first message (settings fixed)
    {"text": "Hello ", "try_trigger_generation": true, "flush": false}   text pieces, concatenated as sent
    {"text": ""}                                                         end of text: the rest is spoken, then
                                                                         {"isFinal": true} and the socket closes
    server: {"audio": <base64>, "isFinal": false, "alignment": null, "normalizedAlignment": null}
            {"audio": null, "isFinal": false, "alignment": {...}, "normalizedAlignment": {...}}
                once a text chunk's audio is out: `chars`, `charStartTimesMs`, `charDurationsMs`, in ms from that
                chunk's first sample (the previous alignment's span ends there: clients add them up)

WebSocket /v1/text-to-speech/{voice_id}/multi-stream-input (many contexts per socket), each message with
`context_id` (absent: the socket's default context); replies carry `contextId`:
    the first message of a context opens it (`voice_settings` fixed from then on); `{"text": ""}` keeps it alive;
    `{"flush": true}` speaks what is buffered now;
    `{"close_context": true}` ends it: right after a flush that brought no text (`{"flush": true}` or
        `{"text": "", "flush": true}`: the end of an answer, as LiveKit and Pipecat send it) the flushed audio
        finishes and `isFinal` follows; any other close (text or a sentence's own flush last, never flushed, or
        a context closed already) is a barge-in: generation stops now and nothing more is sent but
        `{"isFinal": true, "contextId"}`;
    `{"close_socket": true}` ends every context's text; the socket closes once all are spoken.

Voices: an Orpheus voice (or OpenAI alias) or a custom voice (service/voices.py) as `voice_id`; any other id
is 404 `voice_not_found`; GET /v1/voices lists the custom voices too (category "cloned").
`voice_settings.speed` is the playback speed; `stability` maps to the sampling temperature
(`STABILITY_TEMPERATURE_SPAN * (1 - stability)`: 0.5 is Orpheus' usual 0.6, 1.0 is greedy); the other settings,
`model_id`, `language_code` and the latency/normalisation options are accepted and ignored. Alignment is
estimated inside each text chunk (word_timings.py; the chunk bounds are exact) and carries the normalised text
as spoken. Errors: `{"detail": {"status", "message"}}` with an HTTP status (REST, and WebSocket handshakes);
on an open WebSocket `{"error", "message", "code", "contextId"}`. API key: `xi-api-key` (header), checked by
the HTTP app's middleware like every /v1/ route; WebSockets may send `?xi_api_key=` instead.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..audio.encoding import CONTENT_TYPES, MAX_SPEED, MIN_SPEED
from ..request.errors import ClientStalledError, InvalidRequestError, SynthesisError
from ..request.text_stream import TextStream
from ..request.types import ChunkTimings, SynthesisRequest
from ..service.voices import Voice, VoiceCatalog
from ..service.word_timings import words_of
from ..token_format import OPENAI_VOICE_ALIASES, SAMPLE_RATE, VOICES, UnknownVoiceError, resolve_voice
from .context_socket import ContextSocket, Incoming
from .errors import TooManyConnectionsError, elevenlabs_error_body, http_headers, mapping_for
from .gateway import Gateway, OutputOptions, SpeechStream
from .json_frames import json_object_frame
from .responses import RECEIVED_AT_KEY, SpeechResponse, body_parse_error, client_disconnected

log = logging.getLogger(__name__)

TTS_PATH = "/v1/text-to-speech/{voice_id}"
VOICES_PATH = "/v1/voices"
PROTOCOL = "elevenlabs"
# stability 0..1 -> temperature SPAN..0: ElevenLabs' default 0.5 is Orpheus' usual 0.6, full stability is greedy.
STABILITY_TEMPERATURE_SPAN = 1.2
DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"
MAX_CONTEXTS_PER_CONNECTION = 32
# Finished context ids remembered per socket, so text in flight after a close_context does not reopen one.
FINISHED_MEMORY = 256
CLOSE_POLICY_VIOLATION = 1008
SENTENCE_END = ".!?"
CLOSE_INTERNAL_ERROR = 1011


# ---------------------------------------------------------------- output formats


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """An ElevenLabs `output_format` as the audio module's format and rate. The mp3 and opus bit rates are
    accepted and not honoured: the audio module encodes at its own (64 kb/s mp3, 48 kb/s opus)."""

    name: str
    format: str
    sample_rate: int

    @property
    def media_type(self) -> str:
        return CONTENT_TYPES[self.format]


OUTPUT_FORMATS: dict[str, OutputFormat] = {
    name: OutputFormat(name, fmt, rate) for name, fmt, rate in (
        *((f"pcm_{rate}", "pcm", rate) for rate in (8000, 16000, 22050, 24000, 32000, 44100, 48000)),
        ("ulaw_8000", "mulaw", 8000),
        ("alaw_8000", "alaw", 8000),
        *((f"mp3_{rate}_{kbps}", "mp3", rate) for rate, kbps in (
            (22050, 32), (24000, 48), (44100, 32), (44100, 64), (44100, 96), (44100, 128), (44100, 192))),
        ("mp3_44100", "mp3", 44100),
        *((f"opus_48000_{kbps}", "opus", 48000) for kbps in (32, 64, 96, 128, 192)),
    )
}


def output_format(name: str | None) -> OutputFormat:
    """The format for an `output_format` query value (ElevenLabs' default when absent)."""
    spec = OUTPUT_FORMATS.get(DEFAULT_OUTPUT_FORMAT if name is None else name)
    if spec is None:
        raise InvalidRequestError(f"output_format {name!r} is not supported; supported: "
                                  f"{', '.join(OUTPUT_FORMATS)}", param="output_format")
    return spec


# ---------------------------------------------------------------- wire types


class _Lenient(BaseModel):
    """Fields this server reads are type-checked; anything else a client sends is ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class VoiceSettings(_Lenient):
    stability: float | None = Field(None, ge=0.0, le=1.0)
    speed: float | None = Field(None, ge=MIN_SPEED, le=MAX_SPEED)
    # Accepted and ignored: Orpheus has no counterpart.
    similarity_boost: float | None = None
    style: float | None = None
    use_speaker_boost: bool | None = None


class SpeechBody(_Lenient):
    """The JSON body of the REST routes (only the fields this server uses or checks)."""

    text: str
    model_id: str | None = None
    voice_settings: VoiceSettings | None = None
    seed: int | None = Field(None, ge=0, le=4_294_967_295)
    language_code: str | None = None


class SocketMessage(_Lenient):
    """One client message on either WebSocket."""

    text: str | None = None
    context_id: str | None = Field(None, min_length=1, max_length=256)
    voice_settings: VoiceSettings | None = None
    flush: bool | None = None
    try_trigger_generation: bool | None = None
    close_context: bool | None = None
    close_socket: bool | None = None


def _validation_error(exc: ValidationError) -> InvalidRequestError:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or None
    message = f"missing field {where!r}" if error["type"] == "missing" else \
        (f"{where}: {error['msg']}" if where else error["msg"])
    return InvalidRequestError(message, param=where)


class VoiceNotFoundError(InvalidRequestError):
    """A voice_id that is no voice of this server: 404, as ElevenLabs answers it."""

    code = "voice_not_found"

    def __init__(self, voice_id: str, voices: Sequence[str] = VOICES) -> None:
        super().__init__(f"A voice with the voice_id {voice_id!r} was not found; this server's voices are "
                         f"{', '.join(voices)} (GET /v1/voices)", param="voice_id")


def orpheus_voice(voice_id: str, catalog: VoiceCatalog | None = None) -> str:
    """The voice a voice_id names: built-in or, with the server's `catalog` (service/voices.py), custom."""
    try:
        return catalog.resolve(voice_id) if catalog is not None else resolve_voice(voice_id)
    except UnknownVoiceError:
        raise VoiceNotFoundError(voice_id, catalog.names() if catalog is not None else VOICES) from None


@dataclass(frozen=True, slots=True)
class Settings:
    """What `voice_settings` means here."""

    temperature: float | None = None
    speed: float = 1.0

    @classmethod
    def from_wire(cls, settings: VoiceSettings | None) -> Settings:
        if settings is None:
            return cls()
        temperature = None if settings.stability is None else \
            round(STABILITY_TEMPERATURE_SPAN * (1.0 - settings.stability), 6)
        return cls(temperature, 1.0 if settings.speed is None else settings.speed)


def status_of(exc: SynthesisError) -> int:
    return 404 if isinstance(exc, VoiceNotFoundError) else mapping_for(exc).http_status


def error_response(exc: SynthesisError) -> JSONResponse:
    return JSONResponse(elevenlabs_error_body(exc), status_code=status_of(exc), headers=http_headers(exc))


# ---------------------------------------------------------------- alignment


def chunk_alignment(timings: ChunkTimings, *, origin_sample: int, speed: float
                    ) -> tuple[list[str], list[float], list[float]]:
    """Characters of a text chunk with start and end times (seconds from `origin_sample`).

    A word's characters share its estimated span evenly; punctuation and tags that are no word take no time;
    the space after each token covers the pause to the next word, the last one the chunk's remaining audio,
    so the chunk's characters span its audio exactly (clients that add spans up stay on the audio's clock)."""
    tokens = timings.text.split()
    words = iter(timings.words)
    spans: list[tuple[float, float] | None] = [
        (w.start_s, w.end_s) if words_of(token) and (w := next(words, None)) is not None else None
        for token in tokens]
    origin = origin_sample / SAMPLE_RATE
    chunk_end = timings.end_sample / SAMPLE_RATE
    chars: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    cursor = timings.start_sample / SAMPLE_RATE
    for k, token in enumerate(tokens):
        span = spans[k]
        low, high = (cursor, cursor) if span is None else (max(cursor, span[0]), max(cursor, span[1]))
        step = (high - low) / len(token)
        for j, char in enumerate(token):
            chars.append(char)
            starts.append(low + j * step)
            ends.append(low + (j + 1) * step)
        following = next((s[0] for s in spans[k + 1:] if s is not None), chunk_end)
        chars.append(" ")
        starts.append(high)
        ends.append(max(high, following))
        cursor = ends[-1]
    return (chars, [round((s - origin) / speed, 4) for s in starts], [round((e - origin) / speed, 4) for e in ends])


def rest_alignment(timings: list[ChunkTimings], speed: float) -> dict[str, list[Any]] | None:
    """`alignment` of the REST routes: characters with seconds from the response's first sample."""
    chars: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    for chunk in timings:
        c, s, e = chunk_alignment(chunk, origin_sample=0, speed=speed)
        chars += c
        starts += s
        ends += e
    if not chars:
        return None
    return {"characters": chars, "character_start_times_seconds": starts, "character_end_times_seconds": ends}


def socket_alignment(chunk: ChunkTimings, speed: float) -> dict[str, list[Any]] | None:
    """`alignment` of the WebSockets: milliseconds from the chunk's first sample."""
    chars, starts, ends = chunk_alignment(chunk, origin_sample=chunk.start_sample, speed=speed)
    if not chars:
        return None
    starts_ms = [round(s * 1000) for s in starts]
    return {"chars": chars, "charStartTimesMs": starts_ms,
            "charDurationsMs": [max(0, round(e * 1000) - s) for s, e in zip(starts_ms, ends, strict=True)]}


# ---------------------------------------------------------------- REST


def _parse_body(raw: bytes) -> SpeechBody:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc.msg}") from None
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        parse_error = body_parse_error(exc)
        raise parse_error if parse_error is not None else InvalidRequestError(str(exc)) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return SpeechBody.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


@dataclass(slots=True)
class _RestRequest:
    voice_id: str
    raw: bytes
    output_format: str | None
    timestamps: bool
    catalog: VoiceCatalog | None = None
    fmt: OutputFormat | None = None

    def build(self) -> tuple[SynthesisRequest, OutputOptions]:
        body = _parse_body(self.raw)
        self.fmt = output_format(self.output_format)
        voice = orpheus_voice(self.voice_id, self.catalog)
        settings = Settings.from_wire(body.voice_settings)
        request = SynthesisRequest(text=body.text, voice=voice, temperature=settings.temperature, seed=body.seed,
                                   timestamps=self.timestamps)
        return request, OutputOptions(self.fmt.format, self.fmt.sample_rate, settings.speed)


def _line(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


async def _timestamp_lines(stream: SpeechStream) -> AsyncIterator[bytes]:
    """One JSON object per line: each audio piece, carrying the alignment of the chunks finished since the
    previous line (a last line with no audio carries what the audio's end left)."""
    pending: list[ChunkTimings] = []
    speed = stream.output.speed
    async for event in stream.events():
        if isinstance(event, ChunkTimings):
            if event.text:
                pending.append(event)
            continue
        alignment = rest_alignment(pending, speed)
        pending.clear()
        yield _line({"audio_base64": base64.b64encode(event).decode("ascii"), "alignment": alignment,
                     "normalized_alignment": alignment})
    if pending:
        alignment = rest_alignment(pending, speed)
        yield _line({"audio_base64": "", "alignment": alignment, "normalized_alignment": alignment})


async def _whole_with_timestamps(stream: SpeechStream) -> dict[str, Any]:
    audio = bytearray()
    timings: list[ChunkTimings] = []
    async for event in stream.events():
        if isinstance(event, ChunkTimings):
            if event.text:
                timings.append(event)
        else:
            audio += event
    alignment = rest_alignment(timings, stream.output.speed)
    return {"audio_base64": base64.b64encode(bytes(audio)).decode("ascii"), "alignment": alignment,
            "normalized_alignment": alignment}


def _add_rest_routes(app: FastAPI, gateway: Gateway) -> None:
    # Left out of /openapi.json, which describes this server's own API; docs/API.md describes these routes.
    async def speak(request: Request, voice_id: str, kind: Literal["audio", "lines", "json"]) -> Response:
        received_at = request.scope.get(RECEIVED_AT_KEY, time.perf_counter())
        wire = _RestRequest(voice_id, await request.body(), request.query_params.get("output_format"),
                            timestamps=kind != "audio", catalog=gateway.service.voices)
        try:
            stream = await gateway.admit(PROTOCOL, wire.build, received_at=received_at,
                                         disconnected=lambda: client_disconnected(request))
        except SynthesisError as exc:
            return error_response(exc)
        if stream is None:  # the client left while queued; nobody reads this
            return Response(status_code=499)
        headers = {"request-id": stream.request.request_id, "X-Request-Id": stream.request.request_id,
                   "Cache-Control": "no-cache"}
        if kind == "json":
            error: BaseException | None = None
            try:
                return JSONResponse(await _whole_with_timestamps(stream), headers=headers)
            except SynthesisError as exc:
                error = exc
                return error_response(exc)
            except BaseException as exc:
                error = exc
                raise
            finally:
                await stream.close(error)
        if kind == "lines":
            return SpeechResponse(stream, _timestamp_lines(stream), media_type="application/json", headers=headers)
        assert wire.fmt is not None
        return SpeechResponse(stream, stream.audio(), media_type=wire.fmt.media_type, headers=headers)

    @app.post(TTS_PATH, include_in_schema=False, summary="ElevenLabs: text to speech")
    async def convert(request: Request, voice_id: str) -> Response:
        return await speak(request, voice_id, "audio")

    @app.post(TTS_PATH + "/stream", include_in_schema=False, summary="ElevenLabs: text to speech, streamed")
    async def stream(request: Request, voice_id: str) -> Response:
        return await speak(request, voice_id, "audio")

    @app.post(TTS_PATH + "/with-timestamps", include_in_schema=False, summary="ElevenLabs: with character timings")
    async def with_timestamps(request: Request, voice_id: str) -> Response:
        return await speak(request, voice_id, "json")

    @app.post(TTS_PATH + "/stream/with-timestamps", include_in_schema=False,
              summary="ElevenLabs: streamed, with character timings (one JSON object per line)")
    async def stream_with_timestamps(request: Request, voice_id: str) -> Response:
        return await speak(request, voice_id, "lines")

    @app.get(VOICES_PATH, include_in_schema=False, summary="ElevenLabs: the voices")
    async def voices() -> dict[str, Any]:
        cards = [voice_card(v) for v in gateway.service.voices.voices()]
        return {"voices": cards, "has_more": False, "total_count": len(cards)}

    @app.get(VOICES_PATH + "/{voice_id}", include_in_schema=False, summary="ElevenLabs: one voice")
    async def voice(voice_id: str) -> Response:
        catalog = gateway.service.voices
        try:
            return JSONResponse(voice_card(catalog.get(orpheus_voice(voice_id, catalog))))
        except VoiceNotFoundError as exc:
            return error_response(exc)


def voice_card(voice: Voice | str) -> dict[str, Any]:
    """A voice in ElevenLabs' shape: a built-in one is "premade", a custom voice (LoRA adapter) "cloned"."""
    if isinstance(voice, str):
        voice = Voice(name=voice, prompt_name=voice)
    name = voice.name
    if voice.adapter is not None:
        return {"voice_id": name, "name": name, "category": "cloned", "labels": {"model": "orpheus", "custom": "true"},
                "description": voice.description or f"custom voice {name!r}", "preview_url": None,
                "available_for_tiers": [], "settings": None, "samples": None, "high_quality_base_model_ids": []}
    aliases = sorted(a for a, v in OPENAI_VOICE_ALIASES.items() if v == name)
    return {"voice_id": name, "name": name.capitalize(), "category": "premade",
            "labels": {"model": "orpheus", **({"aliases": ",".join(aliases)} if aliases else {})},
            "description": f"Orpheus voice {name!r}", "preview_url": None, "available_for_tiers": [],
            "settings": None, "samples": None, "high_quality_base_model_ids": []}


# ---------------------------------------------------------------- WebSockets


@dataclass(slots=True)
class _Context:
    context_id: str | None
    text: TextStream
    request: SynthesisRequest
    output: OutputOptions
    task: asyncio.Task[None] | None = None
    # The context's last message was a flush that brought no text of its own: the client's "that is all"
    # (LiveKit's `{"text": "", "flush": true}`, Pipecat's `{"flush": true}`). Only a close_context right after
    # one is the end of an answer; any other is a barge-in (docs/API.md, "When a close is a barge-in").
    text_complete: bool = False
    sentence_ended: bool = False  # the last piece ended with a sentence mark and no space


@dataclass(frozen=True, slots=True)
class _SocketSpec:
    """What the handshake fixes: the voice (from the path), the output format (query), the protocol."""

    voice: str
    fmt: OutputFormat
    multi: bool  # multi-stream-input (contexts by id) or stream-input (one context)


class ElevenLabsSocket(ContextSocket):
    """One stream-input or multi-stream-input socket: a reader feeding a bounded inbox, one task per context
    (api/context_socket.py)."""

    protocol = PROTOCOL

    def __init__(self, websocket: WebSocket, gateway: Gateway, spec: _SocketSpec) -> None:
        super().__init__(websocket, gateway)
        self.spec = spec
        self._contexts: dict[str | None, _Context] = {}  # open contexts (stream-input: the one, under None)
        self._closing = False  # close_socket (multi) or end of text (single): close once every context is done
        self._finished: OrderedDict[str | None, None] = OrderedDict()

    def _reply(self, context_id: str | None, **fields: Any) -> dict[str, Any]:
        return {**fields, "contextId": context_id} if self.spec.multi else fields

    async def _error(self, exc: SynthesisError, context_id: str | None = None) -> None:
        message = str(exc) or exc.__class__.__name__
        await self._send(self._reply(context_id, error=exc.code, message=message, code=status_of(exc)))

    async def _refuse_connection(self, exc: TooManyConnectionsError) -> None:
        await self._error(exc)

    async def _serve(self) -> int | None:
        """Handle messages until the client leaves (None) or the socket is to close (its close code)."""
        gone = asyncio.create_task(self._gone.wait())
        try:
            while True:
                if self._closing and not any(c.task is not None and not c.task.done()
                                             for c in self._contexts.values()):
                    return 1000
                next_message = asyncio.create_task(self._inbox.get())
                waiters: set[asyncio.Future[Any]] = {next_message, gone}
                if self._closing:
                    waiters |= {c.task for c in self._contexts.values() if c.task is not None}
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if not next_message.done():
                    next_message.cancel()
                    if gone.done():
                        return None
                    continue  # a context finished while the socket closes
                code = await self._handle(next_message.result())
                if code is not None:
                    return code
        finally:
            gone.cancel()

    # ---- client messages

    async def _handle(self, incoming: Incoming) -> int | None:
        received_at = incoming.received_at
        try:
            body = json_object_frame(incoming.message)
        except InvalidRequestError as exc:
            return await self._refuse(exc)
        try:
            wire = SocketMessage.model_validate(body)
        except ValidationError as exc:
            context_id = body.get("context_id") if isinstance(body.get("context_id"), str) else None
            return await self._refuse(_validation_error(exc), context_id)
        context_id = wire.context_id if self.spec.multi else None
        if self.spec.multi and wire.close_socket:
            self._closing = True
            for ctx in list(self._contexts.values()):
                await self._close_context(ctx, graceful=True)
            return None
        ctx = self._contexts.get(context_id)
        if self.spec.multi and wire.close_context:
            if ctx is not None:
                # Right after a flush without text, the end of an answer; otherwise (text or a sentence's flush
                # last, or the context closed already) a barge-in.
                await self._close_context(ctx, graceful=ctx.text_complete and not ctx.text.ended)
            elif context_id not in self._finished:
                await self._send(self._reply(context_id, isFinal=True))
            return None
        if not self.spec.multi and wire.text == "" and not wire.flush:
            # stream-input: the empty text ends the input (and the socket, once the audio is out).
            self._closing = True
            if ctx is not None:
                ctx.text.end()
            return None
        if ctx is None:
            opens = (wire.text is not None and wire.text != "") or bool(wire.flush)
            if self._closing or not opens or context_id in self._finished:
                return None  # a keep-alive (empty text), or text for a context that is over: nothing to do
            if len(self._contexts) >= MAX_CONTEXTS_PER_CONNECTION:
                return await self._refuse(InvalidRequestError(
                    f"this connection has {MAX_CONTEXTS_PER_CONNECTION} contexts open; close one first",
                    param="context_id"), context_id)
            ctx = self._open(context_id, wire)
        try:
            piece = wire.text or ""
            if piece:  # spaces too: a token that is only a space separates the words around it
                if ctx.sentence_ended and piece[0].isupper():
                    # Pipecat sends whole sentences with no space between them ("...that.The weather"): a
                    # capital right after a sentence end starts a new sentence.
                    piece = " " + piece
                ctx.text.push(piece)
                ctx.sentence_ended = piece[-1] in SENTENCE_END
            if wire.flush:
                ctx.text.flush()
                ctx.text_complete = not piece.strip()
            elif piece.strip():
                ctx.text_complete = False
        except InvalidRequestError as exc:
            if ctx.task is None:
                self._contexts.pop(context_id, None)
                return await self._refuse(exc, context_id)
            await self._stop(ctx)  # a running context cannot go on: its stream is counted as it closes
            return await self._refuse(exc, context_id, count=False)
        if ctx.task is None:
            ctx.task = asyncio.create_task(self._speak(ctx, received_at), name=f"elevenlabs-{context_id}")
        return None

    async def _refuse(self, exc: InvalidRequestError, context_id: str | None = None, *, count: bool = True
                      ) -> int | None:
        """A message that cannot be used: an error message; stream-input then closes (as ElevenLabs does)."""
        if count:
            self.gateway.refused(PROTOCOL, exc)
        await self._error(exc, context_id)
        return None if self.spec.multi else CLOSE_POLICY_VIOLATION

    def _open(self, context_id: str | None, wire: SocketMessage) -> _Context:
        settings = Settings.from_wire(wire.voice_settings)
        text = TextStream(self.gateway.config.stream_input)
        request = SynthesisRequest(text="", voice=self.spec.voice, temperature=settings.temperature,
                                   text_input=text, timestamps=True, request_id=uuid.uuid4().hex)
        output = OutputOptions(self.spec.fmt.format, self.spec.fmt.sample_rate, settings.speed)
        ctx = _Context(context_id, text, request, output)
        self._contexts[context_id] = ctx
        return ctx

    async def _close_context(self, ctx: _Context, *, graceful: bool) -> None:
        if graceful:
            ctx.text.end()  # its task speaks what is left, then sends isFinal
            return
        await self._stop(ctx)
        await self._send(self._reply(ctx.context_id, isFinal=True))

    def _forget(self, ctx: _Context) -> None:
        """The context is over: its id is remembered, so text that was in flight does not open it again."""
        super()._forget(ctx)
        self._finished[ctx.context_id] = None
        self._finished.move_to_end(ctx.context_id)
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    async def _stop(self, ctx: _Context) -> None:
        """Barge-in: the context's generation stops now; nothing more is sent for it."""
        self._forget(ctx)
        if ctx.task is not None and not ctx.task.done():
            ctx.task.cancel()
            await asyncio.wait({ctx.task})

    # ---- one context

    def _internal_error(self, ctx: _Context) -> dict[str, Any]:
        return self._reply(ctx.context_id, error="internal_error", message="internal server error", code=500)

    async def _serve_context(self, ctx: _Context, received_at: float) -> None:
        try:
            stream = await self.gateway.admit(PROTOCOL, lambda: (ctx.request, ctx.output), received_at=received_at,
                                              hold_connection=False)
        except SynthesisError as exc:
            await self._error(exc, ctx.context_id)
            if not self.spec.multi:
                self._closing = True
            return
        assert stream is not None  # None only with a `disconnected` probe
        speaking = asyncio.current_task()
        assert speaking is not None
        watcher = asyncio.create_task(stream.cancel_when_stalled(speaking.cancel))
        stalled: ClientStalledError | None = None
        try:
            async for event in stream.events():
                if isinstance(event, bytes):
                    await self._send(self._reply(ctx.context_id, audio=base64.b64encode(event).decode("ascii"),
                                                 isFinal=False, alignment=None, normalizedAlignment=None))
                elif event.text and (alignment := socket_alignment(event, ctx.output.speed)) is not None:
                    await self._send(self._reply(ctx.context_id, audio=None, isFinal=False, alignment=alignment,
                                                 normalizedAlignment=alignment))
        except ClientStalledError as exc:
            stalled = exc
            raise
        except SynthesisError as exc:
            await self._error(exc, ctx.context_id)
            if not self.spec.multi:
                self._closing = True
            return
        except asyncio.CancelledError:
            if not stream.stalled.is_set():
                raise
            stalled = ClientStalledError("the client stopped reading")
            raise stalled from None
        finally:
            watcher.cancel()
            await stream.close(stalled)
        await self._send(self._reply(ctx.context_id, isFinal=True))


def _add_socket_routes(app: FastAPI, gateway: Gateway) -> None:
    async def serve(websocket: WebSocket, voice_id: str, *, multi: bool) -> None:
        try:
            voice = orpheus_voice(voice_id, gateway.service.voices)
            fmt = output_format(websocket.query_params.get("output_format"))
            gateway.check_output(OutputOptions(fmt.format, fmt.sample_rate))
        except InvalidRequestError as exc:
            gateway.refused(PROTOCOL, exc)
            await _deny(websocket, exc)
            return
        await ElevenLabsSocket(websocket, gateway, _SocketSpec(voice, fmt, multi)).run()

    @app.websocket(TTS_PATH + "/stream-input")
    async def stream_input(websocket: WebSocket, voice_id: str) -> None:
        await serve(websocket, voice_id, multi=False)

    @app.websocket(TTS_PATH + "/multi-stream-input")
    async def multi_stream_input(websocket: WebSocket, voice_id: str) -> None:
        await serve(websocket, voice_id, multi=True)


async def _deny(websocket: WebSocket, exc: SynthesisError) -> None:
    """Refuse the handshake with the ElevenLabs error body and its HTTP status (or close 1008 without one)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error_response(exc))
    else:
        await websocket.close(CLOSE_POLICY_VIOLATION, (str(exc) or exc.code)[:120])


def add_elevenlabs_routes(app: FastAPI, gateway: Gateway) -> None:
    """The ElevenLabs-compatible routes (see the module docstring) on the server's HTTP app."""
    _add_rest_routes(app, gateway)
    _add_socket_routes(app, gateway)

