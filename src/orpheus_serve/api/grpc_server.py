"""The gRPC gateway: `orpheus.v1.Synthesizer` on grpc.aio, plus the standard health service.

Handlers only convert: protobuf in -> `SynthesisRequest` + `OutputOptions`,
encoded audio -> `AudioChunk` messages, `SynthesisMetrics` -> the final
message, `SynthesisError` -> a status code (errors.py). A cancelled call
cancels the handler task, which closes the stream and so the session.

A request that does not decode (a string field that is not UTF-8, a corrupt
wire format) is INVALID_ARGUMENT like any other bad input: the methods are
registered with deserializers that hand the handler an `UndecodableRequest`
instead of raising, which grpc would answer INTERNAL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..audio import default_sample_rate
from ..proto import AUDIO_FORMAT_NAMES
from ..proto import orpheus_pb2 as pb
from ..proto import orpheus_pb2_grpc as pb_grpc
from ..synthesis import InvalidRequestError, SynthesisError, SynthesisRequest
from ..validation import check_request_id
from .errors import UnauthorizedError, grpc_status
from .gateway import Gateway, OutputOptions, voice_list

log = logging.getLogger(__name__)

SERVICE_NAME = "orpheus.v1.Synthesizer"
_METHOD_PREFIX = f"/{SERVICE_NAME}/"



class UndecodableRequest:
    """Stands for a request message that could not be parsed (see the module docstring)."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return parse(data)
        except DecodeError as exc:
            return UndecodableRequest(str(exc))

    return deserialize


def add_synthesizer(servicer: pb_grpc.SynthesizerServicer, server: grpc.aio.Server) -> None:
    """`pb_grpc.add_SynthesizerServicer_to_server`, with lenient request deserializers."""
    handlers = {
        "Synthesize": grpc.unary_stream_rpc_method_handler(
            servicer.Synthesize, request_deserializer=_lenient(pb.SynthesizeRequest.FromString),
            response_serializer=pb.SynthesizeResponse.SerializeToString),
        "ListVoices": grpc.unary_unary_rpc_method_handler(
            servicer.ListVoices, request_deserializer=_lenient(pb.ListVoicesRequest.FromString),
            response_serializer=pb.ListVoicesResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _check_decoded(request: Message | UndecodableRequest) -> None:
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(f"the request message does not decode: {request.error}", param=None)


def _reject_unknown_fields(message: Message, path: str) -> None:
    """A field this server does not know is an error, not silently dropped (a newer client asked for more)."""
    numbers = sorted({field.field_number for field in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise InvalidRequestError(f"{path} has fields this server does not know: {numbers}", param=path)


def request_from_proto(request: pb.SynthesizeRequest | UndecodableRequest) -> tuple[SynthesisRequest, OutputOptions]:
    """Protobuf -> service types. Shape errors here; content errors in TTSService.validate."""
    _check_decoded(request)
    assert isinstance(request, pb.SynthesizeRequest)
    _reject_unknown_fields(request, "SynthesizeRequest")
    if request.request_id:
        check_request_id(request.request_id)
    sampling: dict[str, Any] = {}
    if request.HasField("sampling"):
        _reject_unknown_fields(request.sampling, "sampling")
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "seed"):
            if request.sampling.HasField(name):
                sampling[name] = getattr(request.sampling, name)
    fmt = AUDIO_FORMAT_NAMES.get(request.format)
    if fmt is None:
        raise InvalidRequestError(f"unknown AudioFormat value {request.format}", param="format")
    fields: dict[str, Any] = {"text": request.text, **sampling}
    if request.voice:
        fields["voice"] = request.voice
    output = OutputOptions(format=fmt, sample_rate=request.sample_rate or default_sample_rate(fmt),
                           speed=request.speed or 1.0)
    return SynthesisRequest(**fields), output


def metrics_to_proto(metrics: dict[str, Any]) -> pb.SynthesisMetrics:
    return pb.SynthesisMetrics(
        request_id=metrics["request_id"],
        ttfb_ms=metrics["ttfb_ms"] or 0.0,
        queue_ms=metrics["queue_ms"],
        wall_ms=metrics["wall_ms"],
        audio_seconds=metrics["audio_seconds"],
        rtf=metrics["rtf"] or 0.0,
        samples=metrics["samples"],
        tokens=metrics["tokens"],
        frames=metrics["frames"],
        text_chunks=metrics["text_chunks"],
        finish_reason=metrics["finish_reason"],
    )


async def _abort(context: grpc.aio.ServicerContext, exc: SynthesisError) -> NoReturn:
    code, message = grpc_status(exc)
    metadata: tuple[tuple[str, str], ...] = (("error-code", exc.code),)
    param = getattr(exc, "param", None)
    if param:
        metadata += (("error-param", param),)
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        metadata += (("retry-after-s", f"{retry:g}"),)
    context.set_trailing_metadata(metadata)
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # abort always raises


class SynthesizerService(pb_grpc.SynthesizerServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Synthesize(self, request: pb.SynthesizeRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[pb.SynthesizeResponse]:
        try:
            stream = await self.gateway.admit("grpc", lambda: request_from_proto(request),
                                              received_at=time.perf_counter())
        except SynthesisError as exc:
            await _abort(context, exc)
        assert stream is not None  # no disconnect watcher: a cancelled call cancels this task instead
        output = stream.output
        await context.send_initial_metadata((("x-request-id", stream.request.request_id),))
        try:
            index = 0
            async for data in stream.audio():
                yield pb.SynthesizeResponse(audio=pb.AudioChunk(audio=data, sample_rate=output.sample_rate,
                                                                index=index))
                index += 1
        except SynthesisError as exc:
            await _abort(context, exc)
        finally:
            # Also on cancellation: the call's task is cancelled and the session with it.
            await stream.close()
        metrics = stream.metrics_dict()
        if request.request_id:
            metrics["request_id"] = request.request_id
        yield pb.SynthesizeResponse(metrics=metrics_to_proto(metrics))

    async def ListVoices(self, request: pb.ListVoicesRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListVoicesResponse:
        try:
            _check_decoded(request)
        except InvalidRequestError as exc:
            await _abort(context, exc)
        return pb.ListVoicesResponse(voices=[pb.Voice(**v) for v in voice_list()])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` metadata on orpheus.v1 methods; the health service stays open."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self.gateway.check_api_key(metadata.get("authorization"))
        except UnauthorizedError as exc:
            if handler_call_details.method.endswith("/Synthesize"):
                self.gateway.refused("grpc", exc)
            return _denying_handler(handler, exc)
        return handler


def _denying_handler(handler: grpc.RpcMethodHandler, exc: UnauthorizedError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without running it."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _abort(context, exc)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _abort(context, exc)
        yield  # makes this an async generator, like the handler it stands in for

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class GrpcGateway:
    """The grpc.aio server: Synthesizer + health, bound to `host:port` (port 0 picks a free one)."""

    def __init__(self, gateway: Gateway, host: str, port: int) -> None:
        self.gateway = gateway
        max_message = gateway.config.server.max_body_bytes
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(gateway)],
            options=[("grpc.max_receive_message_length", max_message), ("grpc.so_reuseport", 0)],
        )
        add_synthesizer(SynthesizerService(gateway), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"gRPC could not bind {address}")

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
