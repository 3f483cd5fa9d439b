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

from ..audio.encoding import default_sample_rate
from ..proto import AUDIO_FORMAT_NAMES
from ..proto import orpheus_pb2 as pb
from ..proto import orpheus_pb2_grpc as pb_grpc
from ..request.errors import InvalidRequestError, SynthesisError
from ..request.types import ProtocolName, SynthesisRequest
from ..request.validation import check_request_id
from .errors import UnauthorizedError, grpc_status
from .gateway import Gateway, OutputOptions, voice_list

log = logging.getLogger(__name__)

SERVICE_NAME = "orpheus.v1.Synthesizer"
# Every method on the port needs the API key except the health service's.
_OPEN_PREFIX = f"/{health.SERVICE_NAME}/"



class UndecodableRequest:
    """Stands for a request message that could not be parsed (see the module docstring)."""

    def __init__(self, error: str) -> None:
        self.error = error


def lenient(parse: Callable[[bytes], Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    """A request deserializer that hands the handler an `UndecodableRequest` instead of raising."""

    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return parse(data)
        except DecodeError as exc:
            return UndecodableRequest(str(exc))

    return deserialize


def synthesizer_handlers(servicer: pb_grpc.SynthesizerServicer) -> dict[str, grpc.RpcMethodHandler]:
    """`pb_grpc.add_SynthesizerServicer_to_server`'s handlers, with lenient request deserializers."""
    return {
        "Synthesize": grpc.unary_stream_rpc_method_handler(
            servicer.Synthesize, request_deserializer=lenient(pb.SynthesizeRequest.FromString),
            response_serializer=pb.SynthesizeResponse.SerializeToString),
        "ListVoices": grpc.unary_unary_rpc_method_handler(
            servicer.ListVoices, request_deserializer=lenient(pb.ListVoicesRequest.FromString),
            response_serializer=pb.ListVoicesResponse.SerializeToString),
    }


def check_decoded(request: Message | UndecodableRequest) -> None:
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(f"the request message does not decode: {request.error}", param=None)


def reject_unknown_fields(message: Message, path: str) -> None:
    """A field this server does not know is an error, not silently dropped (a newer client asked for more)."""
    numbers = sorted({field.field_number for field in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise InvalidRequestError(f"{path} has fields this server does not know: {numbers}", param=path)


def request_from_proto(request: pb.SynthesizeRequest | UndecodableRequest) -> tuple[SynthesisRequest, OutputOptions]:
    """Protobuf -> service types. Shape errors here; content errors in TTSService.validate."""
    check_decoded(request)
    assert isinstance(request, pb.SynthesizeRequest)
    reject_unknown_fields(request, "SynthesizeRequest")
    if request.request_id:
        check_request_id(request.request_id)
    sampling: dict[str, Any] = {}
    if request.HasField("sampling"):
        reject_unknown_fields(request.sampling, "sampling")
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


async def abort_call(context: grpc.aio.ServicerContext, exc: SynthesisError) -> NoReturn:
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
            await abort_call(context, exc)
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
            await abort_call(context, exc)
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
            check_decoded(request)
        except InvalidRequestError as exc:
            await abort_call(context, exc)
        return pb.ListVoicesResponse(voices=[pb.Voice(**v) for v in voice_list()])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` metadata on every method but the health service's.

    A refused call of a method in `counted` (method path -> protocol: the ones that synthesise) is
    counted under its protocol, as the gateway counts every refusal."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.counted: dict[str, ProtocolName] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self.gateway.check_api_key(metadata.get("authorization"))
        except UnauthorizedError as exc:
            protocol = self.counted.get(method)
            if protocol is not None:
                self.gateway.refused(protocol, exc)
            return _denying_handler(handler, exc)
        return handler


def _denying_handler(handler: grpc.RpcMethodHandler, exc: UnauthorizedError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without running it."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_call(context, exc)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort_call(context, exc)
        yield  # makes this an async generator, like the handler it stands in for

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(deny_stream if handler.response_streaming else deny, **kwargs)


class GrpcGateway:
    """The grpc.aio server: Synthesizer + health, bound to `host:port` (port 0 picks a free one).
    More services join with `add_service` before `start()` (server.py adds Riva's)."""

    def __init__(self, gateway: Gateway, host: str, port: int) -> None:
        self.gateway = gateway
        max_message = gateway.config.server.max_body_bytes
        self._auth = ApiKeyInterceptor(gateway)
        # Several API processes (server.api_processes) share the port; otherwise a second server on the same
        # port is an error, not a silent split of the traffic.
        reuse_port = int(gateway.config.server.api_processes > 1)
        self.server = grpc.aio.server(
            interceptors=[self._auth],
            options=[("grpc.max_receive_message_length", max_message), ("grpc.so_reuseport", reuse_port)],
        )
        self.service_names: list[str] = []
        self.add_service(SERVICE_NAME, synthesizer_handlers(SynthesizerService(gateway)),
                         counted={"Synthesize": "grpc"})
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"gRPC could not bind {address}")

    def add_service(self, name: str, handlers: dict[str, grpc.RpcMethodHandler], *,
                    counted: dict[str, ProtocolName]) -> None:
        """Serve `handlers` as service `name` (API key required; in the health service under its name).
        `counted`: method name -> protocol, the methods whose refusals count as requests of that protocol."""
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        self.server.add_registered_method_handlers(name, handlers)
        self._auth.counted.update({f"/{name}/{method}": protocol for method, protocol in counted.items()})
        self.service_names.append(name)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
