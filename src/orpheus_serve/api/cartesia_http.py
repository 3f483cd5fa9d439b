"""`POST /tts/bytes` and `POST /tts/sse`: Cartesia's HTTP text-to-speech endpoints.

The `cartesia` SDK's `tts.generate` / `tts.generate_sse`, LiveKit's Cartesia
`synthesize()` and Pipecat's `CartesiaHttpTTSService` call these. Both are
adapters onto `Gateway.admit` with a whole transcript (one request, no
contexts; ARCHITECTURE §7), and stream as the audio is produced.

Request body (JSON), as Cartesia's API reference and SDK types define it:
    {"model_id", "transcript", "voice": "<id>" | {"mode": "id", "id"},
     "output_format": {"container": "raw" | "wav", "encoding", "sample_rate"}
                    | {"container": "mp3", "sample_rate", "bit_rate"},
     "generation_config": {"speed", "volume", "emotion"}, "language", "locale", ...}
    /tts/sse also takes "context_id", "add_timestamps", "add_phoneme_timestamps", "use_normalized_timestamps";
    its output_format is raw only.

Supported: the transcript, the voice (an Orpheus voice or OpenAI alias; a Cartesia voice UUID is spoken with
the default voice, as on the WebSocket), every encoding (`pcm_s16le`, `pcm_f32le`, `pcm_mulaw`, `pcm_alaw`) at
8000, 16000, 22050, 24000, 44100 or 48000 Hz in `raw` and `wav` (a WAV header of the encoding's own format tag:
PCM, IEEE float, G.711 mu-law or A-law, its sizes the streaming sentinel 0xFFFFFFFF), `mp3` at those rates,
`generation_config.speed` (0.6-1.5, pitch-preserving), and word timestamps on SSE (estimated inside each text
chunk: Orpheus has no aligner). Accepted and ignored, because Orpheus has no use for them: `model_id`,
`language`, `locale`, `normalization`, `pronunciation_dict_id`, `save`, `speed` (Cartesia's experimental
slow/normal/fast), `duration`, `generation_config.volume` and `.emotion`, mp3's `bit_rate` (the audio module
codes mp3 at its own rate), `add_phoneme_timestamps` (no phoneme events are sent), `use_normalized_timestamps`.
Refused with 400: any other field, a field of the wrong type, a container, encoding or rate outside those
lists, an embedding voice (Cartesia's API refuses it too), an empty transcript.

Errors are Cartesia's HTTP error object `{"error_code", "title", "message", "request_id"}` with the status
(400 invalid, 401 key, 503 + Retry-After busy or not ready, 504 timeout, 500 engine); a failure after the
SSE stream has begun is an `error` event (`type`, `done`, `status_code`, `title`, `message`, `error_code`,
`request_id`, `context_id`). Auth (when server.api_keys is set): `X-API-Key`, `Authorization: Bearer` or
`?api_key=`, as on the WebSocket. `Cartesia-Version`, when sent, must be a date (YYYY-MM-DD); any date is
served with this server's one behaviour.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..audio.encoding import WAV_HEADER_BYTES, WAV_UNKNOWN_SIZE
from ..audio.pcm import pcm16_to_float
from ..request.errors import InvalidRequestError, SynthesisError
from ..request.types import SynthesisRequest
from ..token_format import UnknownVoiceError
from .cartesia import (
    ENCODINGS,
    ContextId,
    StepClock,
    Voice,
    _validation_message,
    chunk_message,
    done_message,
    http_error_body,
    offered_api_key,
    resolve_cartesia_voice,
    timestamps_message,
)
from .errors import UnauthorizedError, http_headers, mapping_for
from .gateway import Gateway, OutputOptions, SpeechStream
from .json_frames import json_object
from .responses import RECEIVED_AT_KEY, SpeechResponse, client_disconnected

log = logging.getLogger(__name__)

BYTES_PATH = "/tts/bytes"
SSE_PATH = "/tts/sse"
PROTOCOL = "cartesia"
_API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}$")

Encoding = Literal["pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw"]
SampleRate = Literal[8000, 16000, 22050, 24000, 44100, 48000]


# ---------------------------------------------------------------- wire types


class _Strict(BaseModel):
    """A field this server does not know is refused (each one it accepts is listed, used or not)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class RawFormat(_Strict):
    container: Literal["raw"]
    encoding: Encoding
    sample_rate: SampleRate


class WavFormat(_Strict):
    container: Literal["wav"]
    encoding: Encoding
    sample_rate: SampleRate


class Mp3Format(_Strict):
    container: Literal["mp3"]
    sample_rate: SampleRate
    bit_rate: Literal[32000, 64000, 96000, 128000, 192000] | None = None  # accepted, ignored


class HttpGenerationConfig(BaseModel):
    """Cartesia's sonic-3 controls; later API versions may add fields, which are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    speed: float | None = Field(None, ge=0.6, le=1.5)
    volume: float | None = Field(None, ge=0.5, le=2.0)  # accepted, ignored
    emotion: str | None = None  # accepted, ignored


class BytesRequest(_Strict):
    """The body of POST /tts/bytes."""

    model_id: str | None = None
    transcript: str
    voice: Voice | str
    output_format: Annotated[RawFormat | WavFormat | Mp3Format, Field(discriminator="container")]
    generation_config: HttpGenerationConfig | None = None
    # Accepted and ignored: Orpheus has one model, speaks the text as written, and saves nothing.
    language: str | None = None
    locale: str | None = None
    normalization: str | None = None
    pronunciation_dict_id: str | None = None
    save: bool | None = None
    speed: str | float | None = None
    duration: float | None = None

    def synthesis_request(self, *, timestamps: bool = False,
                          resolve: Callable[[str | None], str] | None = None) -> SynthesisRequest:
        """`resolve`: the server's voice catalog (service/voices.py: built-in and custom voices)."""
        if isinstance(self.voice, Voice) and self.voice.mode == "embedding":
            raise InvalidRequestError("voice embeddings are not accepted; give a voice id", param="voice")
        try:
            voice = (resolve_cartesia_voice(self.voice, resolve) if resolve is not None
                     else resolve_cartesia_voice(self.voice))
        except UnknownVoiceError as exc:
            raise InvalidRequestError(str(exc), param="voice") from None
        return SynthesisRequest(text=self.transcript, voice=voice, timestamps=timestamps,
                                request_id=uuid.uuid4().hex)

    def output_options(self) -> OutputOptions:
        fmt = self.output_format
        speed = self.generation_config.speed if self.generation_config is not None else None
        codec = "mp3" if isinstance(fmt, Mp3Format) else ENCODINGS[fmt.encoding]
        return OutputOptions(format=codec, sample_rate=fmt.sample_rate, speed=1.0 if speed is None else speed)


class SseRequest(BytesRequest):
    """The body of POST /tts/sse: raw audio in events, optionally with word timestamps."""

    output_format: RawFormat  # type: ignore[assignment]
    context_id: ContextId | None = None
    add_timestamps: bool | None = None
    add_phoneme_timestamps: bool | None = None  # accepted; Orpheus has no phoneme times to send
    use_normalized_timestamps: bool | None = None  # accepted; the words are the transcript's own


# ---------------------------------------------------------------- audio framing

# WAVE format tags and bits per sample of each Cartesia encoding.
_WAV_FORMATS: dict[str, tuple[int, int]] = {"pcm_s16le": (1, 16), "pcm_f32le": (3, 32), "pcm_alaw": (6, 8),
                                            "pcm_mulaw": (7, 8)}


def wav_header(encoding: str, sample_rate: int) -> bytes:
    """A 44-byte mono RIFF/WAVE header for `encoding`, its sizes the streaming sentinel (the length is not
    known when it leaves). Readers take the data to run to the end of the response."""
    tag, bits = _WAV_FORMATS[encoding]
    block_align = bits // 8
    header = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", WAV_UNKNOWN_SIZE, b"WAVE", b"fmt ", 16, tag, 1, sample_rate,
                         sample_rate * block_align, block_align, bits, b"data", WAV_UNKNOWN_SIZE)
    assert len(header) == WAV_HEADER_BYTES
    return header


async def _body_bytes(stream: SpeechStream, output_format: RawFormat | WavFormat | Mp3Format
                      ) -> AsyncIterator[bytes]:
    """The response body: the encoded audio as it is produced, after a WAV header for the wav container."""
    float32 = not isinstance(output_format, Mp3Format) and output_format.encoding == "pcm_f32le"
    if isinstance(output_format, WavFormat):
        yield wav_header(output_format.encoding, output_format.sample_rate)
    async for data in stream.audio():
        yield pcm16_to_float(data).tobytes() if float32 else data


def _event(body: dict[str, Any]) -> bytes:
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def _sse_events(stream: SpeechStream, body: SseRequest, admitting: float) -> AsyncIterator[bytes]:
    """Cartesia's `chunk`, `timestamps` and `done` events; a failure mid-stream is an `error` event."""
    context_id = body.context_id
    float32 = body.output_format.encoding == "pcm_f32le"
    clock = StepClock(admitting)
    try:
        async for event in stream.events():
            if isinstance(event, bytes):
                step_ms = clock.step_ms()
                data = pcm16_to_float(event).tobytes() if float32 else event
                yield _event(chunk_message(data, context_id, step_ms))
            elif body.add_timestamps and event.words:
                yield _event(timestamps_message(event, context_id, stream.output.speed))
            clock.restart()
    except SynthesisError as exc:
        log.warning("request %s failed mid-stream: %s", stream.request.request_id, exc)
        status = mapping_for(exc).http_status
        yield _event({"type": "error", "done": True, "status_code": status, **_error_fields(exc, status,
                                                                                              stream.request.request_id),
                      "context_id": context_id})
        return
    yield _event(done_message(context_id))


# ---------------------------------------------------------------- errors


def _error_fields(exc: SynthesisError, status: int, request_id: str | None = None) -> dict[str, Any]:
    return http_error_body(exc.code, status, str(exc) or exc.__class__.__name__, request_id)


def cartesia_error_response(exc: SynthesisError, request_id: str | None = None) -> JSONResponse:
    """Cartesia's HTTP error object (API version 2026-03-01 and later) with the error's status."""
    status = mapping_for(exc).http_status
    headers = http_headers(exc)
    if isinstance(exc, UnauthorizedError):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(_error_fields(exc, status, request_id), status_code=status, headers=headers)


def _parse(raw: bytes, model: type[BytesRequest]) -> BytesRequest:
    body = json_object(raw, "request body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        text, param = _validation_message(exc)
        if exc.errors()[0]["type"] == "extra_forbidden":
            text = f"unknown field {param!r}"
        raise InvalidRequestError(text, param=param) from None


# ---------------------------------------------------------------- routes


def add_cartesia_http_routes(app: FastAPI, gateway: Gateway) -> None:
    """Register POST /tts/bytes and POST /tts/sse on the server's app."""

    def check_access(request: Request) -> None:
        """The key (as the Cartesia clients send it) and the API version header; counted when refused."""
        version = request.headers.get("cartesia-version")
        try:
            if gateway.auth_required:
                key = offered_api_key(request)
                if key is None:
                    raise UnauthorizedError("missing API key: send the header 'X-API-Key: <key>'")
                gateway.check_api_key(f"Bearer {key}")
            if version is not None and not _API_VERSION.match(version.strip()):
                raise InvalidRequestError(f"Cartesia-Version {version[:40]!r} is not an API version (YYYY-MM-DD)",
                                          param="Cartesia-Version")
        except SynthesisError as exc:
            gateway.refused(PROTOCOL, exc)
            raise

    async def admit(request: Request, model: type[BytesRequest], timestamps: bool
                    ) -> tuple[BytesRequest, SpeechStream | None, float]:
        check_access(request)
        raw = await request.body()
        parsed: list[BytesRequest] = []

        def build() -> tuple[SynthesisRequest, OutputOptions]:
            body = _parse(raw, model)
            parsed.append(body)
            wants_timestamps = timestamps and bool(getattr(body, "add_timestamps", False))
            request = body.synthesis_request(timestamps=wants_timestamps, resolve=gateway.service.voices.resolve)
            return request, body.output_options()

        admitting = time.perf_counter()
        stream = await gateway.admit(PROTOCOL, build,
                                     received_at=request.scope.get(RECEIVED_AT_KEY, admitting),
                                     disconnected=lambda: client_disconnected(request))
        return parsed[0], stream, admitting

    @app.post(BYTES_PATH, include_in_schema=False)
    async def cartesia_bytes(request: Request) -> Response:
        try:
            body, stream, _ = await admit(request, BytesRequest, timestamps=False)
        except SynthesisError as exc:
            return cartesia_error_response(exc)
        if stream is None:  # the client left while queued; nobody reads this
            return Response(status_code=499)
        fmt = body.output_format
        if isinstance(fmt, WavFormat):
            media = "audio/wav"
        elif isinstance(fmt, Mp3Format):
            media = "audio/mpeg"
        else:
            media = "application/octet-stream"
        headers = {"X-Request-Id": stream.request.request_id, "Cache-Control": "no-cache"}
        return SpeechResponse(stream, _body_bytes(stream, fmt), media_type=media, headers=headers)

    @app.post(SSE_PATH, include_in_schema=False)
    async def cartesia_sse(request: Request) -> Response:
        try:
            body, stream, admitting = await admit(request, SseRequest, timestamps=True)
        except SynthesisError as exc:
            return cartesia_error_response(exc)
        if stream is None:
            return Response(status_code=499)
        assert isinstance(body, SseRequest)
        headers = {"X-Request-Id": stream.request.request_id, "Cache-Control": "no-cache"}
        return SpeechResponse(stream, _sse_events(stream, body, admitting), media_type="text/event-stream",
                              headers=headers)
