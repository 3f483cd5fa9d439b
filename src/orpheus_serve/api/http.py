"""The HTTP gateway: OpenAI-compatible `POST /v1/audio/speech` and the operational endpoints.

`create_app(service, config)` builds the FastAPI app; the WebSocket route
(websocket.py) lives on the same app. Every failure answers in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, including the ones FastAPI
and Starlette would otherwise answer themselves (422 becomes 400, a body that
cannot be parsed — not UTF-8, JSON nested too deeply, an integer too long to
convert — 400 saying which, 404, 405), and the two checks made before any
route runs: the API key (401) and the body size (413). With `server.playground`
on, it also serves the web playground (static/) at `/` and `/playground`.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..audio.encoding import CONTENT_TYPES
from ..config import Config
from ..metrics.prometheus import PROMETHEUS_CONTENT_TYPE
from ..request.errors import InvalidRequestError, SynthesisError
from .cartesia import add_cartesia_route
from .errors import UnauthorizedError, error_body, http_headers, mapping_for, openai_error_body
from .gateway import Gateway, SpeechService, SpeechStream, voice_list
from .schemas import (
    IGNORED_HEADER,
    ErrorBody,
    HealthBody,
    ModelList,
    ReadinessBody,
    SpeechRequestBody,
    StatsBody,
    VoiceList,
    first_validation_error,
)
from .websocket import STREAM_PATH, add_stream_route

log = logging.getLogger(__name__)

SPEECH_PATH = "/v1/audio/speech"
RECEIVED_AT_KEY = "orpheus.received_at"
# Paths behind the API key; health, readiness and metrics stay open for probes and scrapers, the playground's
# static files for browsers (the page then sends the key with its own API calls).
PROTECTED_PREFIX = "/v1/"
WS_KEY_SUBPROTOCOL = "orpheus.bearer."
PLAYGROUND_DIR = Path(__file__).resolve().parent / "static"


def _json_bytes(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def error_response(exc: SynthesisError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=mapping_for(exc).http_status, headers=http_headers(exc))


async def _send_json(send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    payload = _json_bytes(body)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on /v1/ (HTTP and WebSocket) when server.api_keys is set.

    Runs before routing and body parsing, so a request with a wrong key is
    answered 401 without its body being read and never reaches the service.
    Browsers cannot set headers on a WebSocket, so the key may also come as
    the subprotocol `orpheus.bearer.<base64url key>` (see `_subprotocol_key`).
    """

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RECEIVED_AT_KEY] = time.perf_counter()
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if scope["type"] == "websocket":
            scope, send, offered = _subprotocol_key(scope, send)
            if offered is not None and not authorization:
                authorization = f"Bearer {offered}"
        if not self.gateway.auth_required:
            await self.app(scope, receive, send)
            return
        try:
            self.gateway.check_api_key(authorization)
        except UnauthorizedError as exc:
            if scope["path"] in (SPEECH_PATH, STREAM_PATH):
                self.gateway.refused("rest" if scope["type"] == "http" else "ws", exc)
            if scope["type"] == "http":
                await _send_json(send, 401, error_body(exc), {"WWW-Authenticate": "Bearer"})
            else:
                await _deny_websocket(scope, receive, send, 401, error_body(exc))
            return
        await self.app(scope, receive, send)


def _subprotocol_key(scope: Scope, send: Send) -> tuple[Scope, Send, str | None]:
    """Take an API key offered as the WebSocket subprotocol `orpheus.bearer.<base64url key>`.

    The key is removed from the scope, so it travels no further inward. A
    browser fails the handshake unless the server selects one of the
    subprotocols it offered, so the accept selects the first other one offered
    (the page offers `orpheus.v1`), or the key's own entry when it was alone.
    Base64url (unpadded) because a subprotocol must be an HTTP token and keys
    may hold `/`, `+` or `=`; one that does not decode is a wrong key.
    """
    offered: list[str] = list(scope.get("subprotocols") or ())
    entry = next((p for p in offered if p.startswith(WS_KEY_SUBPROTOCOL)), None)
    if entry is None:
        return scope, send, None
    encoded = entry.removeprefix(WS_KEY_SUBPROTOCOL)
    try:
        key = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except ValueError:  # binascii.Error and UnicodeDecodeError are both ValueErrors
        key = encoded
    others = [p for p in offered if not p.startswith(WS_KEY_SUBPROTOCOL)]
    selected = others[0] if others else entry

    async def send_selecting(message: Message) -> None:
        if message["type"] == "websocket.accept" and not message.get("subprotocol"):
            message = {**message, "subprotocol": selected}
        await send(message)

    return {**scope, "subprotocols": others}, send_selecting, key


async def _deny_websocket(scope: Scope, receive: Receive, send: Send, status: int, body: Any) -> None:
    """Refuse a WebSocket handshake with an HTTP status (ASGI denial response) or, failing that, close 1008."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        payload = _json_bytes(body)
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "websocket.http.response.body", "body": payload})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": body["error"]["message"][:120]})


class BodyLimitMiddleware:
    """413 for request bodies over server.max_body_bytes, by Content-Length or by counting the bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> dict[str, Any]:
        return openai_error_body(f"request body exceeds {self.max_bytes} bytes (server.max_body_bytes)",
                                 code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _send_json(send, 413, self._too_large())
            return
        # Read the body here (bounded), then replay it: chunked uploads are counted too.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await _send_json(send, 413, self._too_large())
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class SpeechResponse(StreamingResponse):
    """Streams a SpeechStream and closes it however the response ends (done, error, client gone).

    A client that stops reading leaves the response waiting for its socket to drain; when the stream
    reports it stalled (server.stalled_client_timeout_s), the response is abandoned mid-body and the
    connection is reset (Gateway.reset_connection): a graceful close would wait for the client to read."""

    def __init__(self, stream: SpeechStream, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.stream.cancel_when_stalled, group.cancel_scope.cancel)
                await super().__call__(scope, receive, send)
                group.cancel_scope.cancel()
        except BaseException as exc:
            error = exc
            raise
        finally:
            # A client disconnect cancels the response task; the session must still be cancelled.
            with anyio.CancelScope(shield=True):
                await self.stream.close(error)
            if self.stream.stalled.is_set():
                self.stream.gateway.reset_connection(scope.get("client"))


_ERROR_DESCRIPTIONS = {
    400: "The request is invalid; `param` names the parameter at fault.",
    401: "Missing or wrong API key (only when the server has `server.api_keys`).",
    413: "The request body exceeds `server.max_body_bytes`.",
    500: "The synthesis engine failed.",
    503: "Not ready (warming up, shutting down, engine failed), the queue is full or too many connections are "
         "open; retry after `Retry-After` seconds.",
    504: "The request timed out (waiting for a slot or generating).",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
_ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer`.", "schema": {"type": "string"}}},
    503: _RETRY_AFTER,
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error statuses, all with the OpenAI error body."""
    return {status: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[status],
                     **({"headers": _ERROR_HEADERS[status]} if status in _ERROR_HEADERS else {})}
            for status in statuses}


def _format_list() -> str:
    return ", ".join(f"`{fmt}` {media}" for fmt, media in CONTENT_TYPES.items())


_SPEECH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The audio, streamed as it is generated, in the Content-Type of its `response_format` "
                         f"({_format_list()}); with `stream_format: sse`, `text/event-stream` carrying "
                         "`speech.audio.delta` and `speech.audio.done` events.",
          "headers": {
              "X-Request-Id": {"description": "The request's id (also in the server's logs and metrics).",
                               "schema": {"type": "string"}},
              IGNORED_HEADER: {"description": "Request fields accepted for compatibility but not honoured "
                                              "(`instructions`), comma-separated.",
                               "schema": {"type": "string"}}},
          "content": {**{media: {"schema": {"type": "string", "format": "binary"}}
                         for media in sorted(set(CONTENT_TYPES.values()))},
                      # One server-sent event each: its data is one JSON event (OpenAI's names).
                      "text/event-stream": {"schema": {
                          "type": "object", "required": ["data"],
                          "properties": {"data": {
                              "type": "string", "contentMediaType": "application/json",
                              "contentSchema": {"type": "object", "required": ["type"], "properties": {
                                  "type": {"enum": ["speech.audio.delta", "speech.audio.done", "error"]}}}}}}}}},
    **_errors(400, 401, 413, 500, 503, 504),
}


# One example per output (the document's examples are also what API tools try first).
_SPEECH_EXAMPLES: dict[str, Any] = {
    **{fmt: {"summary": f"{fmt} ({media})",
             "value": {"model": "orpheus", "input": "Hello there! How can I help you today?", "voice": "tara",
                       "response_format": fmt}}
       for fmt, media in CONTENT_TYPES.items()},
    "sse": {"summary": "server-sent events (`speech.audio.delta`, base64 PCM)",
            "value": {"model": "orpheus", "input": "Hi <laugh> that is funny.", "voice": "leo",
                      "response_format": "pcm", "stream_format": "sse"}},
    "openai-client": {"summary": "what a voice-agent framework's OpenAI client sends",
                      "value": {"model": "tts-1", "input": "Your table is booked for seven.", "voice": "marin",
                                "response_format": "pcm", "instructions": "Speak warmly.", "stream": True,
                                "language": "en", "speed": 1.0}},
}


def body_parse_error(cause: BaseException | None) -> InvalidRequestError | None:
    """Why FastAPI could not parse a JSON body (it answers a bare 400 for anything but a JSON syntax error)."""
    if isinstance(cause, UnicodeDecodeError):
        return InvalidRequestError(f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at "
                                   f"offset {cause.start}); send JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return InvalidRequestError("the request body nests JSON arrays or objects too deeply")
    if isinstance(cause, ValueError):  # e.g. an integer of more digits than Python converts (4300)
        return InvalidRequestError(f"the request body is not acceptable JSON: {cause}")
    return None


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + _json_bytes(event) + b"\n\n"


async def _sse_events(stream: SpeechStream) -> AsyncIterator[bytes]:
    """OpenAI's `speech.audio.delta` / `speech.audio.done` events; a failure mid-stream is an `error` event."""
    try:
        async for data in stream.audio():
            yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except SynthesisError as exc:
        log.warning("request %s failed mid-stream: %s", stream.request.request_id, exc)
        yield _sse({"type": "error", "error": error_body(exc)["error"]})
        return
    metrics = stream.metrics_dict()
    yield _sse({"type": "speech.audio.done",
                "usage": {"output_tokens": metrics.get("tokens", 0), "total_tokens": metrics.get("tokens", 0),
                          "audio_seconds": metrics.get("audio_seconds")},
                "metrics": metrics})


async def _client_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


def create_app(service: SpeechService, config: Config, *, gateway: Gateway | None = None) -> FastAPI:
    """The HTTP + WebSocket app: every route the server serves, composed here and only here, for one API
    process, each of N API processes and a Ray Serve replica alike (ARCHITECTURE §7). Pass `gateway` to
    share limits and metrics with a gRPC server."""
    gateway = gateway if gateway is not None else Gateway(service, config)
    app = FastAPI(title="orpheus-serve", version=__version__,
                  description="Streaming Orpheus text-to-speech, OpenAI-compatible.")
    app.state.gateway = gateway
    add_error_handlers(app, gateway)
    add_service_routes(app, gateway)
    add_speech_route(app, gateway)
    add_stream_route(app, gateway)
    add_cartesia_route(app, gateway)
    app.openapi = lambda: _openapi_document(app, bearer=gateway.auth_required)  # type: ignore[method-assign]
    if config.server.playground:
        add_playground(app)
    # Added last = outermost: the key is checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, gateway=gateway)
    return app


def add_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    """Every error, FastAPI's and Starlette's included, as an OpenAI-style error body."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = first_validation_error(list(exc.errors()))
        if error.param is None and str(error).startswith("missing required parameter"):
            error = type(error)("the request body is missing; send a JSON object", param=None)
        if request.url.path == SPEECH_PATH:
            gateway.refused("rest", error)
        return error_response(error)

    @app.exception_handler(SynthesisError)
    async def _synthesis_error(request: Request, exc: SynthesisError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and (parse_error := body_parse_error(exc.__cause__)) is not None:
            if request.url.path == SPEECH_PATH:
                gateway.refused("rest", parse_error)
            return error_response(parse_error)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed for {request.url.path}"
        return JSONResponse(openai_error_body(message, param=None, code=code), status_code=exc.status_code,
                            headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(openai_error_body("internal server error", type="server_error", code="internal_error"),
                            status_code=500)


def add_service_routes(app: FastAPI, gateway: Gateway) -> None:
    """Health, readiness, the model and voice lists, stats and Prometheus metrics."""

    @app.get("/health", response_model=HealthBody)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", response_model=ReadinessBody,
             responses={503: {"model": ReadinessBody, "headers": _RETRY_AFTER,
                              "description": "Not serving now: warming up, shutting down, engine failed or "
                                             "saturated."}})
    async def ready() -> JSONResponse:
        state = gateway.readiness()
        if state == "ready":
            return JSONResponse({"status": state})
        return JSONResponse({"status": state}, status_code=503, headers={"Retry-After": "1"})

    # response_model_exclude_unset: the handlers' dicts go out as they are, checked against the documented model.
    @app.get("/v1/models", response_model=ModelList, response_model_exclude_unset=True, responses=_errors(401))
    async def models() -> dict[str, Any]:
        info = gateway.service.model_info
        card = {"id": info.id, "object": "model", "created": int(gateway.started_at), "owned_by": "orpheus-serve",
                "backend": info.backend, "model_path": info.model_path, "codec_path": info.codec_path,
                "tiny": info.tiny, "warning": info.warning}
        out: dict[str, Any] = {"object": "list", "data": [card]}
        if info.tiny:
            out["warning"] = info.warning or "serving the tiny random-weight model: the audio is noise"
        return out

    @app.get("/v1/audio/voices", response_model=VoiceList, responses=_errors(401))
    async def voices() -> dict[str, Any]:
        return {"voices": voice_list()}

    @app.get("/v1/stats", response_model=StatsBody, response_model_exclude_unset=True, responses=_errors(401))
    async def stats() -> dict[str, Any]:
        return gateway.stats()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format.",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)


def add_speech_route(app: FastAPI, gateway: Gateway) -> None:
    """POST /v1/audio/speech: OpenAI's speech endpoint, streamed (raw audio or SSE)."""

    @app.post(SPEECH_PATH, response_class=StreamingResponse, responses=_SPEECH_RESPONSES)
    async def create_speech(body: Annotated[SpeechRequestBody, Body(openapi_examples=_SPEECH_EXAMPLES)],
                            request: Request) -> Response:
        stream = await gateway.admit("rest", lambda: (body.synthesis_request(), body.output_options()),
                                     received_at=request.scope.get(RECEIVED_AT_KEY, time.perf_counter()),
                                     disconnected=lambda: _client_disconnected(request))
        if stream is None:
            # The client left while queued; the session is cancelled and nobody reads this.
            return Response(status_code=499)
        headers = {"X-Request-Id": stream.request.request_id, "Cache-Control": "no-cache"}
        if ignored := body.ignored_fields():
            log.debug("request %s: ignoring %s (Orpheus cannot honour them)", stream.request.request_id,
                      ", ".join(ignored))
            headers[IGNORED_HEADER] = ",".join(ignored)
        if body.stream_format == "sse":
            return SpeechResponse(stream, _sse_events(stream), media_type="text/event-stream", headers=headers)
        return SpeechResponse(stream, stream.audio(), media_type=stream.content_type, headers=headers)


def add_playground(app: FastAPI) -> None:
    # The page refers to its files and to the API by relative URLs, so the same file works at / and at
    # /playground, and under a proxy's path prefix.
    @app.get("/", include_in_schema=False)
    @app.get("/playground", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(PLAYGROUND_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/playground/static", StaticFiles(directory=PLAYGROUND_DIR), name="playground")


def _openapi_document(app: FastAPI, *, bearer: bool) -> dict[str, Any]:
    """FastAPI's document, less the 422 it adds to every route with input (this API answers 400), and with
    the bearer key on /v1/ when the server has API keys (and only then: the document describes this server)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, operations in document["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if path.startswith(PROTECTED_PREFIX):
                    if bearer:
                        operation["security"] = [{"bearer": []}]
                    else:
                        operation["responses"].pop("401", None)
        if bearer:
            document.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "One of `server.api_keys`."}}
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = document
    return app.openapi_schema
