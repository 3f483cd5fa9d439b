"""NVIDIA Riva's TTS API, `nvidia.riva.tts.RivaSpeechSynthesis`, on the gRPC port beside `orpheus.v1.Synthesizer`.

Voice agents that speak gRPC call this service: nvidia-riva-client's
`SpeechSynthesisService`, livekit-plugins-nvidia's `TTS`, Pipecat's
`NvidiaTTSService`. They work against this server with only a changed address.
The messages are the ones nvidia-riva-client 2.27.0 ships
(`riva.client.proto.riva_tts_pb2`, generated from Riva's MIT-licensed
protos): server and clients share one definition, and one process can hold
both (a second copy of the same protobuf package would clash in the
descriptor pool).

- `Synthesize`: the whole utterance in one response.
- `SynthesizeOnline` (stream -> stream): the first message sets voice,
  language, encoding and rate; its text and that of every later message are
  one context (text_stream.TextStream): synthesis starts as soon as the first
  clause is complete, and the audio of all the text comes back in order, as
  it is generated. One message is the classic call. Later messages carry the
  same settings as the first (or none).
- `GetRivaSynthesisConfig`: one model config per voice, with the
  `language_code`, `voice_name` and `subvoices` parameters that
  livekit-plugins-nvidia's `list_voices()` and Riva's own tools turn into voice
  names (`voice_name` + "." + each subvoice before its ":").

Handlers only convert: protobuf in -> `SynthesisRequest` + `OutputOptions`
and one `Gateway.admit` per call; encoded audio -> `SynthesizeSpeechResponse`;
`SynthesisError` -> a status code (errors.py), as grpc_server.py does for
orpheus.v1. A cancelled call cancels its handler task, which closes the
stream and so the session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from riva.client.proto import riva_audio_pb2 as riva_audio
from riva.client.proto import riva_tts_pb2 as rtts

from ..audio.encoding import default_sample_rate, supported_sample_rates
from ..request.errors import InvalidRequestError, SynthesisError
from ..request.text_stream import TextStream
from ..request.types import ChunkTimings, SynthesisRequest
from ..token_format import SAMPLE_RATE, VOICES
from .gateway import Gateway, OutputOptions, SpeechStream
from .grpc_server import (
    GrpcGateway,
    UndecodableRequest,
    abort_call,
    check_decoded,
    lenient,
    reject_unknown_fields,
)

SERVICE_NAME = "nvidia.riva.tts.RivaSpeechSynthesis"

LANGUAGE_CODE = "en-US"
RIVA_VOICE_PREFIX = "English-US"
# Riva-style subvoices (`English-US.Female-1`) -> Orpheus voices. Each voice also answers to its own name
# (`English-US.Tara`, or plain `tara`).
RIVA_SUBVOICES: dict[str, str] = {
    "Female-1": "tara",
    "Female-2": "leah",
    "Female-3": "jess",
    "Female-4": "mia",
    "Female-5": "zoe",
    "Male-1": "leo",
    "Male-2": "dan",
    "Male-3": "zac",
}
_BY_SUBVOICE: dict[str, str] = {**{k.lower(): v for k, v in RIVA_SUBVOICES.items()}, **{v: v for v in VOICES}}

# Riva's encodings -> this server's format names. ENCODING_UNSPECIFIED is LINEAR_PCM, as in Riva.
ENCODINGS: dict[int, str] = {
    riva_audio.ENCODING_UNSPECIFIED: "pcm",
    riva_audio.LINEAR_PCM: "pcm",  # raw 16-bit little-endian samples, no header (Riva's convention)
    riva_audio.FLAC: "flac",
    riva_audio.MULAW: "mulaw",
    riva_audio.OGGOPUS: "opus",
    riva_audio.ALAW: "alaw",
}

# custom_configuration keys: the Orpheus extras a Riva client can set (values are strings on the wire).
_CUSTOM: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float,
                            "seed": int, "max_tokens": int, "speed": float}


def riva_voice_names(voice: str) -> list[str]:
    """The Riva-style names of one Orpheus voice: `English-US.Female-1`, `English-US.Tara`."""
    return [f"{RIVA_VOICE_PREFIX}.{sub}" for sub, v in RIVA_SUBVOICES.items() if v == voice] + \
        [f"{RIVA_VOICE_PREFIX}.{voice.capitalize()}"]


def resolve_voice(name: str) -> str | None:
    """A Riva `voice_name` -> the voice handed to the service (None: its default).

    `English-US.<subvoice>` (or `English-US-<subvoice>`, Riva's older spelling) maps through
    RIVA_SUBVOICES or the voice's own name; `English-US` alone is the first voice, as Riva picks a
    model's first subvoice. Anything else goes to the service as it is: an Orpheus voice or an OpenAI
    alias, which the service checks."""
    name = name.strip()
    if not name:
        return None
    if not name.lower().startswith(RIVA_VOICE_PREFIX.lower()):
        return name
    rest = name[len(RIVA_VOICE_PREFIX):]
    if not rest:
        return VOICES[0]
    voice = _BY_SUBVOICE.get(rest[1:].lower()) if rest[0] in ".-" else None
    if voice is None:
        known = ", ".join(n for v in VOICES for n in riva_voice_names(v))
        raise InvalidRequestError(f"voice_name {name!r} is not served here; the voices are: {known} "
                                  f"(or the Orpheus names {', '.join(VOICES)})", param="voice_name")
    return voice


def _output(request: rtts.SynthesizeSpeechRequest) -> OutputOptions:
    fmt = ENCODINGS.get(request.encoding)
    if fmt is None:
        served = ", ".join(riva_audio.AudioEncoding.Name(e) for e in ENCODINGS if e)
        raise InvalidRequestError(f"encoding {request.encoding} is not served; use one of {served}",
                                  param="encoding")
    rate = request.sample_rate_hz or default_sample_rate(fmt)
    rates = supported_sample_rates(fmt)
    if rates is not None and rate not in rates and rate < max(rates):
        # Opus codes at 8/12/16/24/48 kHz only (and an Ogg Opus stream decodes at 48 kHz whatever it was
        # coded at): another rate, such as riva.client's default 22050, is coded at the next one up.
        rate = min(r for r in rates if r > rate)
    speed = 1.0
    if "speed" in request.custom_configuration:
        speed = _custom_value(request, "speed")
    return OutputOptions(format=fmt, sample_rate=rate, speed=speed)


def _custom_value(request: rtts.SynthesizeSpeechRequest, key: str) -> Any:
    raw = request.custom_configuration[key]
    try:
        return _CUSTOM[key](raw.strip())
    except ValueError:
        raise InvalidRequestError(f"custom_configuration {key}={raw!r} is not a valid {_CUSTOM[key].__name__}",
                                  param=f"custom_configuration.{key}") from None


def _check_message(request: rtts.SynthesizeSpeechRequest | UndecodableRequest) -> rtts.SynthesizeSpeechRequest:
    """Shape checks: the message decodes and asks for nothing this server cannot do."""
    check_decoded(request)
    assert isinstance(request, rtts.SynthesizeSpeechRequest)
    reject_unknown_fields(request, "SynthesizeSpeechRequest")
    language = request.language_code.strip()
    if language and language.lower() != LANGUAGE_CODE.lower():
        raise InvalidRequestError(f"language_code {request.language_code!r} is not available on this server; "
                                  f"the only language served is {LANGUAGE_CODE}", param="language_code")
    if request.HasField("zero_shot_data"):
        raise InvalidRequestError("zero-shot voice cloning (zero_shot_data) is not supported: Orpheus speaks "
                                  "with its built-in voices", param="zero_shot_data")
    if request.custom_dictionary:
        raise InvalidRequestError("custom_dictionary (phoneme overrides) is not supported: Orpheus reads "
                                  "graphemes only", param="custom_dictionary")
    unknown = sorted(set(request.custom_configuration) - set(_CUSTOM))
    if unknown:
        raise InvalidRequestError(f"custom_configuration keys {unknown} are not known; the known keys are "
                                  f"{', '.join(_CUSTOM)}", param="custom_configuration")
    return request


def request_from_riva(request: rtts.SynthesizeSpeechRequest | UndecodableRequest, *,
                      text: str | None = None, text_input: TextStream | None = None,
                      timestamps: bool = False) -> tuple[SynthesisRequest, OutputOptions]:
    """Riva message -> service types. Shape errors here; content errors (text, voice, sampling bounds) in
    TTSService.validate. `text_input`: the context the message's text goes into instead of `text`."""
    request = _check_message(request)
    fields: dict[str, Any] = {key: _custom_value(request, key) for key in request.custom_configuration
                              if key != "speed"}
    voice = resolve_voice(request.voice_name)
    if voice is not None:
        fields["voice"] = voice
    synthesis = SynthesisRequest(text=request.text if text is None else text, text_input=text_input,
                                 timestamps=timestamps or request.enable_word_time_offsets, **fields)
    return synthesis, _output(request)


def _settings_key(request: rtts.SynthesizeSpeechRequest) -> bytes:
    """Everything in a message but its text and id: what later messages of a stream must repeat or leave out."""
    settings = rtts.SynthesizeSpeechRequest()
    settings.CopyFrom(request)
    settings.ClearField("text")
    settings.ClearField("id")
    return settings.SerializeToString(deterministic=True)


def _piece(text: str) -> str:
    """One message's text as a piece of the context: messages are whole segments (words complete), so one
    ends with a space unless it has its own, and a boundary at its end counts at once."""
    return text if not text or text[-1].isspace() else text + " "


def _word_timings(timings: ChunkTimings, speed: float) -> list[rtts.WordTiming]:
    """The chunk's estimated word times in Riva's unit, whole milliseconds of the output audio."""
    scale = 1000.0 / speed
    return [rtts.WordTiming(word=w.word, start_time=round(w.start_s * scale), end_time=round(w.end_s * scale))
            for w in timings.words]


def model_configs() -> list[rtts.RivaSynthesisConfigResponse.Config]:
    """One model config per voice (see the module docstring)."""
    configs = []
    for index, voice in enumerate(VOICES):
        subvoices = ",".join(f"{name.split('.', 1)[1]}:{index}" for name in riva_voice_names(voice))
        configs.append(rtts.RivaSynthesisConfigResponse.Config(model_name=f"orpheus-{voice}", parameters={
            "language_code": LANGUAGE_CODE,
            "voice_name": RIVA_VOICE_PREFIX,
            "subvoices": subvoices,
            "orpheus_voice": voice,
            "sample_rate": str(SAMPLE_RATE),
            "encodings": ",".join(riva_audio.AudioEncoding.Name(e) for e in ENCODINGS if e),
        }))
    return configs


class RivaSpeechSynthesisService:
    """The servicer; `register` adds it to the gRPC gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def register(self, grpc_gateway: GrpcGateway) -> None:
        handlers = {
            "Synthesize": grpc.unary_unary_rpc_method_handler(
                self.Synthesize, request_deserializer=lenient(rtts.SynthesizeSpeechRequest.FromString),
                response_serializer=rtts.SynthesizeSpeechResponse.SerializeToString),
            "SynthesizeOnline": grpc.stream_stream_rpc_method_handler(
                self.SynthesizeOnline, request_deserializer=lenient(rtts.SynthesizeSpeechRequest.FromString),
                response_serializer=rtts.SynthesizeSpeechResponse.SerializeToString),
            "GetRivaSynthesisConfig": grpc.unary_unary_rpc_method_handler(
                self.GetRivaSynthesisConfig,
                request_deserializer=lenient(rtts.RivaSynthesisConfigRequest.FromString),
                response_serializer=rtts.RivaSynthesisConfigResponse.SerializeToString),
        }
        grpc_gateway.add_service(SERVICE_NAME, handlers,
                                 counted={"Synthesize": "riva", "SynthesizeOnline": "riva"})

    async def _admit(self, build: Callable[[], tuple[SynthesisRequest, OutputOptions]],
                     context: grpc.aio.ServicerContext, **kwargs: Any) -> SpeechStream | None:
        try:
            stream = await self.gateway.admit("riva", build, received_at=time.perf_counter(), **kwargs)
        except SynthesisError as exc:
            await abort_call(context, exc)
        if stream is not None:
            await context.send_initial_metadata((("x-request-id", stream.request.request_id),))
        return stream

    async def Synthesize(self, request: rtts.SynthesizeSpeechRequest | UndecodableRequest,
                         context: grpc.aio.ServicerContext) -> rtts.SynthesizeSpeechResponse:
        # Timestamps on: the chunks' texts make meta.processed_text (and their words meta.words, if asked).
        stream = await self._admit(lambda: request_from_riva(request, timestamps=True), context)
        assert stream is not None and isinstance(request, rtts.SynthesizeSpeechRequest)
        audio: list[bytes] = []
        chunks: list[ChunkTimings] = []
        try:
            async for event in stream.events():
                if isinstance(event, bytes):
                    audio.append(event)
                else:
                    chunks.append(event)
        except SynthesisError as exc:
            await abort_call(context, exc)
        finally:
            await stream.close()  # also on cancellation: the session with it
        meta = rtts.SynthesizeSpeechResponseMetadata(text=request.text,
                                                     processed_text=" ".join(c.text for c in chunks if c.text))
        if request.enable_word_time_offsets:
            meta.words.extend(w for c in chunks for w in _word_timings(c, stream.output.speed))
        response = rtts.SynthesizeSpeechResponse(audio=b"".join(audio), meta=meta)
        if request.HasField("id"):
            response.id.CopyFrom(request.id)
        return response

    async def SynthesizeOnline(self, requests: AsyncIterator[rtts.SynthesizeSpeechRequest | UndecodableRequest],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[rtts.SynthesizeSpeechResponse]:
        try:
            first = await anext(requests, None)
            if first is None:
                raise InvalidRequestError("SynthesizeOnline needs at least one SynthesizeSpeechRequest", param=None)
            first = _check_message(first)
            if not first.text.strip():
                raise InvalidRequestError("text is empty: the first message must carry text to speak", param="text")
        except SynthesisError as exc:
            self.gateway.refused("riva", exc)
            await abort_call(context, exc)
        text = TextStream(self.gateway.config.stream_input)
        failure: asyncio.Future[SynthesisError] = asyncio.get_running_loop().create_future()

        def build() -> tuple[SynthesisRequest, OutputOptions]:
            built = request_from_riva(first, text="", text_input=text)
            text.push(_piece(first.text))
            return built

        async def failed() -> SynthesisError:
            return await asyncio.shield(failure)

        # The reader runs from admit's first await on, after build() has pushed the first text: later text
        # and the end of the input reach the context while admission waits for the first audio.
        reader = asyncio.create_task(self._read_more(requests, first, text, failure), name="riva-text-input")
        stream: SpeechStream | None = None
        events = None
        step: asyncio.Future[Any] | None = None
        try:
            stream = await self._admit(build, context, disconnected=failed)
            if stream is None:  # a later message was refused while the first audio was on its way
                await abort_call(context, failure.result())
            speed = stream.output.speed
            events = stream.events()
            meta_sent = False
            while True:
                step = asyncio.ensure_future(anext(events))
                await asyncio.wait({step, failure}, return_when=asyncio.FIRST_COMPLETED)
                if failure.done():  # a later message was refused: the call ends with its error
                    step.cancel()
                    await abort_call(context, failure.result())
                try:
                    event = step.result()
                except StopAsyncIteration:
                    break
                response = rtts.SynthesizeSpeechResponse()
                if first.HasField("id"):
                    response.id.CopyFrom(first.id)
                if isinstance(event, bytes):
                    response.audio = event
                    if not meta_sent:
                        response.meta.text = first.text
                        meta_sent = True
                elif first.enable_word_time_offsets and event.text:
                    # Only when asked: clients play every response's audio, and this one has none.
                    response.meta.processed_text = event.text
                    response.meta.words.extend(_word_timings(event, speed))
                else:
                    continue
                yield response
        except SynthesisError as exc:
            await abort_call(context, exc)
        finally:
            reader.cancel()
            if step is not None:
                step.cancel()  # it runs the events generator: let it stop before the generator is closed
                await asyncio.wait({step})
                if not step.cancelled():
                    step.exception()  # an error it ended with has been answered (or superseded) above
            if events is not None:
                await events.aclose()
            if stream is not None:
                await stream.close()

    @staticmethod
    async def _read_more(requests: AsyncIterator[Message | UndecodableRequest], first: rtts.SynthesizeSpeechRequest,
                         text: TextStream, failure: asyncio.Future[SynthesisError]) -> None:
        """Later messages' text into the context, then its end; a refused message fails the call."""
        settings = _settings_key(first)
        empty = _settings_key(rtts.SynthesizeSpeechRequest())
        try:
            async for message in requests:
                message = _check_message(message)
                if _settings_key(message) not in (settings, empty):
                    raise InvalidRequestError("a SynthesizeOnline stream keeps the voice, language, encoding, rate "
                                              "and options of its first message; later messages must repeat them "
                                              "or leave them out", param="voice_name")
                text.push(_piece(message.text))
            text.end()
        except SynthesisError as exc:
            failure.set_result(exc)

    async def GetRivaSynthesisConfig(self, request: rtts.RivaSynthesisConfigRequest | UndecodableRequest,
                                     context: grpc.aio.ServicerContext) -> rtts.RivaSynthesisConfigResponse:
        try:
            check_decoded(request)
            assert isinstance(request, rtts.RivaSynthesisConfigRequest)
            configs = model_configs()
            if request.model_name:
                configs = [c for c in configs if c.model_name == request.model_name]
                if not configs:
                    names = ", ".join(c.model_name for c in model_configs())
                    raise InvalidRequestError(f"model {request.model_name!r} is not served; the models are: {names}",
                                              param="model_name")
        except SynthesisError as exc:
            await abort_call(context, exc)
        return rtts.RivaSynthesisConfigResponse(model_config=configs)
