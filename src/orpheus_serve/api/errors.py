"""One table from service errors to each interface's convention.

Every failure a client can see is a `SynthesisError` (the service's own, plus
the two the gateway raises itself: a bad API key and the connection limit).
HTTP turns it into an OpenAI-shaped body `{"error": {"message", "type",
"param", "code"}}` with a status; gRPC into a status code; the WebSocket sends
the same body as HTTP as a JSON text message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from ..request.errors import (
    ClientStalledError,
    EngineFailureError,
    InvalidRequestError,
    QueueFullError,
    ServiceUnavailableError,
    SynthesisError,
    SynthesisTimeoutError,
)


class UnauthorizedError(SynthesisError):
    """Missing or wrong API key: 401 / UNAUTHENTICATED. Checked before anything reaches the service."""

    code = "invalid_api_key"


class TooManyConnectionsError(SynthesisError):
    """server.max_connections streams are open: 503 / RESOURCE_EXHAUSTED, retry shortly."""

    code = "too_many_connections"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestLimitError(SynthesisError):
    """A WebSocket connection used up server.max_ws_requests_per_connection: 429."""

    code = "too_many_requests"


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    http_status: int
    openai_type: str
    grpc_code: grpc.StatusCode


# Most specific first: the first isinstance match wins.
_MAPPINGS: tuple[tuple[type[SynthesisError], ErrorMapping], ...] = (
    (InvalidRequestError, ErrorMapping(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (UnauthorizedError, ErrorMapping(401, "invalid_request_error", grpc.StatusCode.UNAUTHENTICATED)),
    (RequestLimitError, ErrorMapping(429, "invalid_request_error", grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (QueueFullError, ErrorMapping(503, "server_error", grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (TooManyConnectionsError, ErrorMapping(503, "server_error", grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (ServiceUnavailableError, ErrorMapping(503, "server_error", grpc.StatusCode.UNAVAILABLE)),
    (SynthesisTimeoutError, ErrorMapping(504, "server_error", grpc.StatusCode.DEADLINE_EXCEEDED)),
    (ClientStalledError, ErrorMapping(408, "invalid_request_error", grpc.StatusCode.DEADLINE_EXCEEDED)),
    (EngineFailureError, ErrorMapping(500, "server_error", grpc.StatusCode.INTERNAL)),
)
_FALLBACK = ErrorMapping(500, "server_error", grpc.StatusCode.INTERNAL)


def mapping_for(exc: SynthesisError) -> ErrorMapping:
    for cls, mapping in _MAPPINGS:
        if isinstance(exc, cls):
            return mapping
    return _FALLBACK


def retry_after_s(exc: SynthesisError) -> float | None:
    """Seconds a client should wait before retrying, for errors that are worth retrying."""
    if isinstance(exc, QueueFullError | TooManyConnectionsError):
        return exc.retry_after_s
    if isinstance(exc, ServiceUnavailableError):
        return 1.0
    return None


def openai_error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
                      code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_body(exc: SynthesisError) -> dict[str, Any]:
    """The OpenAI-shaped body for a service error (HTTP responses and WebSocket messages)."""
    return openai_error_body(str(exc) or exc.__class__.__name__, type=mapping_for(exc).openai_type,
                             param=getattr(exc, "param", None), code=exc.code)


def http_headers(exc: SynthesisError) -> dict[str, str]:
    retry = retry_after_s(exc)
    # Retry-After takes whole seconds; never advertise 0 (an immediate retry storm).
    return {} if retry is None else {"Retry-After": str(max(1, round(retry)))}


def grpc_status(exc: SynthesisError) -> tuple[grpc.StatusCode, str]:
    """Status code and details; the parameter at fault travels in trailing metadata (`error-param`)."""
    return mapping_for(exc).grpc_code, str(exc) or exc.__class__.__name__
