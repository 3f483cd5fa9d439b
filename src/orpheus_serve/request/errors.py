"""The errors the service raises; each gateway maps them to its own convention (ARCHITECTURE §9)."""

from __future__ import annotations


class SynthesisError(Exception):
    """Base of the errors a gateway maps to its own convention."""

    code = "internal_error"


class InvalidRequestError(SynthesisError):
    """Bad input: HTTP 400 / gRPC INVALID_ARGUMENT / a WebSocket error message."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(SynthesisError):
    """Every slot is taken and the admission queue is full: 503 / RESOURCE_EXHAUSTED."""

    code = "server_busy"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(SynthesisError):
    """Not ready yet, or shutting down: 503 / UNAVAILABLE."""

    code = "unavailable"


class SynthesisTimeoutError(SynthesisError):
    """Waited too long for a slot, or the session ran past its timeout: 504 / DEADLINE_EXCEEDED."""

    code = "timeout"


class EngineFailureError(SynthesisError):
    """The engine or codec failed this request (others are unaffected): 500 / INTERNAL."""

    code = "engine_error"


class EngineUnavailableError(EngineFailureError, ServiceUnavailableError):
    """The engine core went away under a running stream (its process died): 503 / UNAVAILABLE, counted as a
    failed request. The server restarts the core (server.restart_core); a retry may succeed."""

    code = "engine_unavailable"


class ClientStalledError(SynthesisError):
    """The client took no audio for server.stalled_client_timeout_s: its session is cancelled and the
    connection closed (408 / DEADLINE_EXCEEDED, if the client reads on at all)."""

    code = "client_stalled"
