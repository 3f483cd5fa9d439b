"""What the HTTP routes of every protocol share to stream a SpeechStream: the response that closes the
stream however it ends, the probe that sees the client leave while queued, and the scope key under which
ApiKeyMiddleware stamps a request's arrival (http.py: OpenAI's speech endpoint; cartesia_http.py:
Cartesia's /tts/bytes and /tts/sse)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .gateway import SpeechStream

RECEIVED_AT_KEY = "orpheus.received_at"


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
            # Starlette's task group wraps the body's own error (a SynthesisError mid-stream) in a group:
            # the outcome is counted under that error's code.
            error = exc
            # (an exception group has `exceptions`; Python 3.10 has no BaseExceptionGroup builtin to test for)
            while len(inner := getattr(error, "exceptions", ())) == 1 and isinstance(inner[0], BaseException):
                error = inner[0]
            raise
        finally:
            # A client disconnect cancels the response task; the session must still be cancelled.
            with anyio.CancelScope(shield=True):
                await self.stream.close(error)
            if self.stream.stalled.is_set():
                self.stream.gateway.reset_connection(scope.get("client"))


async def client_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue
