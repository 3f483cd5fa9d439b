"""HTTP response pieces every REST adapter shares (http.py's OpenAI-compatible routes, cartesia_http.py's
/tts/bytes and /tts/sse, elevenlabs.py's): the streamed speech response that closes its stream however it ends,
the request's arrival time, the client-disconnect probe and why a JSON body could not be parsed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..request.errors import InvalidRequestError
from .gateway import SpeechStream

# Where the API-key middleware (the outermost layer) stamps the time a request arrived.
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


async def client_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue
