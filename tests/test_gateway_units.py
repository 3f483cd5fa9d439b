"""Gateway pieces that need no server: error mapping, wire models, proto conversion, API keys, limits."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from pydantic import ValidationError

from orpheus_serve.api.errors import (
    RequestLimitError,
    TooManyConnectionsError,
    UnauthorizedError,
    error_body,
    grpc_status,
    http_headers,
    mapping_for,
)
from orpheus_serve.api.gateway import ConnectionLimiter, OutputOptions, SpeechStream, voice_list
from orpheus_serve.api.grpc_server import metrics_to_proto, request_from_proto
from orpheus_serve.api.schemas import SpeechRequestBody, StreamRequestMessage, first_validation_error
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.request.errors import (
    EngineFailureError,
    InvalidRequestError,
    QueueFullError,
    ServiceUnavailableError,
    SynthesisTimeoutError,
)
from orpheus_serve.request.types import AudioChunk, SynthesisMetrics, SynthesisRequest
from orpheus_serve.token_format import OPENAI_VOICE_ALIASES, VOICES


@pytest.mark.parametrize("exc,status,grpc_code", [
    (InvalidRequestError("bad", param="input"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (UnauthorizedError("no"), 401, grpc.StatusCode.UNAUTHENTICATED),
    (RequestLimitError("enough"), 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QueueFullError("full", retry_after_s=2.4), 503, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManyConnectionsError("busy"), 503, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ServiceUnavailableError("warming"), 503, grpc.StatusCode.UNAVAILABLE),
    (SynthesisTimeoutError("slow"), 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineFailureError("boom"), 500, grpc.StatusCode.INTERNAL),
])
def test_every_service_error_maps_to_a_status_and_a_grpc_code(exc, status, grpc_code) -> None:
    assert mapping_for(exc).http_status == status
    assert grpc_status(exc)[0] == grpc_code
    body = error_body(exc)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == exc.code
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_retryable_errors_carry_retry_after() -> None:
    assert http_headers(QueueFullError("full", retry_after_s=2.4)) == {"Retry-After": "2"}
    assert http_headers(QueueFullError("full", retry_after_s=0.1)) == {"Retry-After": "1"}
    assert "Retry-After" in http_headers(ServiceUnavailableError("warming"))
    assert http_headers(InvalidRequestError("bad")) == {}


def test_error_body_names_the_parameter() -> None:
    assert error_body(InvalidRequestError("too long", param="input"))["error"]["param"] == "input"


def _rest_error(body: dict) -> InvalidRequestError:
    with pytest.raises(ValidationError) as info:
        SpeechRequestBody.model_validate(body)
    return first_validation_error(list(info.value.errors()), skip=())


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "response_format": "ogg"}, "response_format"),
    ({"input": "hi", "speed": 0.1}, "speed"),
    ({"input": "hi", "speed": "fast"}, "speed"),
    ({"input": "hi", "speed": float("nan")}, "speed"),
    ({"input": 42}, "input"),
    ({"input": "hi", "voice": 3}, "voice"),
    ({"input": "hi", "seed": 1.5}, "seed"),
    ({"input": "hi", "seed": True}, "seed"),
    ({"input": "hi", "stream_format": "chunks"}, "stream_format"),
    ({"input": "hi", "bogus": 1}, "bogus"),
    ({"input": "hi", "model": ""}, "model"),
])
def test_speech_body_shape_errors_name_the_parameter(body: dict, param: str) -> None:
    assert _rest_error(body).param == param


def test_speech_body_converts_to_service_types() -> None:
    body = SpeechRequestBody.model_validate({"model": "tts-1", "input": "Hello.", "voice": "nova",
                                             "response_format": "opus", "speed": 1.25, "temperature": 0,
                                             "seed": 7, "max_tokens": 70})
    request = body.synthesis_request()
    assert (request.text, request.voice, request.temperature, request.seed, request.max_tokens) == \
        ("Hello.", "nova", 0, 7, 70)
    output = body.output_options()
    assert (output.format, output.sample_rate, output.speed) == ("opus", 24000, 1.25)
    # `text` is an alias of `input`; the default voice is the service's.
    alias = SpeechRequestBody.model_validate({"text": "Hi."}).synthesis_request()
    assert alias.text == "Hi." and alias.voice == "tara"
    assert SpeechRequestBody.model_validate({"input": "x"}).response_format == "mp3"  # OpenAI's default


def test_speech_text_needs_exactly_one_text() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SpeechRequestBody.model_validate({"model": "tts-1"}).synthesis_request()
    assert info.value.param == "input"
    with pytest.raises(InvalidRequestError):
        SpeechRequestBody.model_validate({"input": "a", "text": "b"}).synthesis_request()
    assert SpeechRequestBody.model_validate({"input": "a", "text": "a"}).synthesis_request().text == "a"


def test_stream_message_defaults_to_pcm_and_takes_a_sample_rate() -> None:
    message = StreamRequestMessage.model_validate({"text": "Hi", "sample_rate": 16000, "request_id": "abc"})
    assert message.output_options().format == "pcm"
    assert message.output_options().sample_rate == 16000
    with pytest.raises(ValidationError):
        StreamRequestMessage.model_validate({"text": "Hi", "sample_rate": 1000})


def test_proto_request_converts_with_defaults_and_optional_sampling() -> None:
    request, output = request_from_proto(pb.SynthesizeRequest(
        text="Hello", voice="leo", format=pb.AUDIO_FORMAT_FLAC, sample_rate=16000, speed=1.5,
        sampling=pb.SamplingOptions(temperature=0.0, seed=3)))
    assert (request.text, request.voice, request.temperature, request.seed, request.top_p) == ("Hello", "leo", 0.0, 3,
                                                                                                None)
    assert (output.format, output.sample_rate, output.speed) == ("flac", 16000, 1.5)
    request, output = request_from_proto(pb.SynthesizeRequest(text="Hi"))
    assert request.voice == "tara" and request.temperature is None
    assert (output.format, output.sample_rate, output.speed) == ("pcm", 24000, 1.0)


def test_proto_unknown_fields_and_enum_values_are_invalid() -> None:
    raw = pb.SynthesizeRequest(text="hi").SerializeToString() + b"\x98\x06\x01"  # field 99, varint 1
    with pytest.raises(InvalidRequestError, match="99"):
        request_from_proto(pb.SynthesizeRequest.FromString(raw))
    nested = pb.SamplingOptions(top_p=0.5).SerializeToString() + b"\x98\x06\x01"
    raw = pb.SynthesizeRequest(text="hi").SerializeToString() + b"\x32" + bytes([len(nested)]) + nested
    with pytest.raises(InvalidRequestError) as info:
        request_from_proto(pb.SynthesizeRequest.FromString(raw))
    assert info.value.param == "sampling"
    raw = pb.SynthesizeRequest(text="hi").SerializeToString() + b"\x18\x63"  # format = 99
    with pytest.raises(InvalidRequestError) as info:
        request_from_proto(pb.SynthesizeRequest.FromString(raw))
    assert info.value.param in ("format", "SynthesizeRequest")


def test_metrics_to_proto_round_trip() -> None:
    metrics = SynthesisMetrics(request_id="r1", ttfb_s=0.05, wall_s=1.0, audio_seconds=2.0, samples=48000,
                               tokens=560, frames=80, text_chunks=1)
    message = metrics_to_proto(metrics.as_dict())
    assert (message.request_id, message.samples, message.frames, message.rtf) == ("r1", 48000, 80, 0.5)
    assert message.ttfb_ms == pytest.approx(50.0)


def test_connection_limiter_counts_and_releases_once() -> None:
    limiter = ConnectionLimiter(2)
    a, b = limiter.acquire(), limiter.acquire()
    with pytest.raises(TooManyConnectionsError):
        limiter.acquire()
    a.release()
    a.release()  # idempotent: must not free a slot someone else holds
    assert limiter.open == 1
    c = limiter.acquire()
    assert limiter.open == 2
    b.release()
    c.release()
    assert limiter.open == 0


def test_voice_list_covers_every_voice_and_alias() -> None:
    voices = voice_list()
    assert [v["id"] for v in voices] == list(VOICES)
    assert sorted(a for v in voices for a in v["aliases"]) == sorted(OPENAI_VOICE_ALIASES)


def test_closing_a_stream_stops_its_pump_when_a_hand_over_completes_as_it_is_cancelled() -> None:
    """A client that leaves just as its pump hands over an item: before Python 3.12, asyncio.wait_for
    swallows a cancellation that arrives as the awaited put completes (gh-86296). The pump must stop at
    close all the same, not feed a queue nobody reads until the stall timeout (the session kept for
    nothing all that time, the client counted as stalled instead of gone)."""

    async def scenario() -> tuple[float, list[str], bool]:
        generator_closed = asyncio.Event()

        class Service:
            async def synthesize(self, request: SynthesisRequest):
                try:
                    for i in range(1000):
                        yield AudioChunk(pcm=b"\0\0" * 2048, index=i, start_sample=2048 * i)
                finally:
                    generator_closed.set()

        statuses: list[str] = []
        gateway = SimpleNamespace(
            service=Service(), config=SimpleNamespace(server=SimpleNamespace(stalled_client_timeout_s=5.0)),
            stream_opened=lambda protocol: None, stream_closed=lambda protocol, status: statuses.append(status),
            metrics=SimpleNamespace(first_byte=lambda *args: None))
        stream = SpeechStream(gateway, SynthesisRequest(text="hi"), OutputOptions(), "rest", received_at=0.0,
                              lease=None)
        assert await stream.start()
        while not stream._queue.full():  # the pump fills the queue, then waits to hand over the next item
            await asyncio.sleep(0)
        stream._queue.get_nowait()  # the consumer takes one: the waiting put completes ...
        await asyncio.sleep(0)
        started = time.perf_counter()
        await stream.close()  # ... and the pump is cancelled in that same instant
        return time.perf_counter() - started, statuses, generator_closed.is_set()

    took, statuses, generator_closed = asyncio.run(scenario())
    assert statuses == ["cancelled"]
    assert generator_closed
    assert took < 1.0, took


def test_a_close_cancelled_while_it_waits_still_returns_the_slot_and_counts_the_outcome() -> None:
    """A client's cancel can land while its handler is already closing the stream (the request had just
    finished): the connection slot and the open-stream count must be returned all the same."""

    async def scenario() -> tuple[list[str], int]:
        class Service:
            async def synthesize(self, request: SynthesisRequest):
                try:
                    for i in range(1000):
                        yield AudioChunk(pcm=b"\0\0" * 2048, index=i, start_sample=2048 * i)
                finally:
                    await asyncio.sleep(0.2)  # the session's cleanup takes a moment

        statuses: list[str] = []
        gateway = SimpleNamespace(
            service=Service(), config=SimpleNamespace(server=SimpleNamespace(stalled_client_timeout_s=5.0)),
            stream_opened=lambda protocol: None, stream_closed=lambda protocol, status: statuses.append(status),
            metrics=SimpleNamespace(first_byte=lambda *args: None))
        limiter = ConnectionLimiter(1)
        stream = SpeechStream(gateway, SynthesisRequest(text="hi"), OutputOptions(), "grpc", received_at=0.0,
                              lease=limiter.acquire())
        assert await stream.start()
        closing = asyncio.create_task(stream.close())
        await asyncio.sleep(0.05)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        return statuses, limiter.open

    statuses, still_open = asyncio.run(scenario())
    assert statuses == ["cancelled"]
    assert still_open == 0
