"""What the agent WebSockets that carry many contexts on one socket share (Cartesia's, ElevenLabs').

One socket is one reader task feeding a bounded inbox (a client that sends
faster than it is served waits on its own socket: nothing queues without
bound) and one task per open context, each streaming its own audio. Sends go
through one lock; a client that takes nothing for
`server.stalled_client_timeout_s` is cut off (`ClientStalledError`), its
contexts are cancelled and its connection is reset. When the socket ends,
for whatever reason, every context task and the reader are cancelled and
awaited before the connection's lease goes back to the gateway: a client that
vanishes leaves nothing running behind it.

A subclass says how a refused connection is told (`_refuse_connection`), how
messages are served (`_serve`, which returns the close code to send, or None
when the client left), and keeps its open contexts in `_contexts` (any value
with a `task`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fastapi import WebSocket, WebSocketDisconnect

from ..request.errors import ClientStalledError
from .errors import TooManyConnectionsError
from .gateway import Gateway

if TYPE_CHECKING:
    from starlette.types import Message

log = logging.getLogger(__name__)

INBOX_MESSAGES = 64  # client messages read ahead of the one being handled
CLOSE_TRY_AGAIN_LATER = 1013


@dataclass(frozen=True, slots=True)
class Incoming:
    message: Message
    received_at: float  # perf_counter when the reader took it off the socket


class HasTask(Protocol):
    task: asyncio.Task[None] | None


class ContextSocket:
    """One socket's reader, inbox, send lock and teardown; see the module docstring."""

    protocol: ClassVar[str]  # the gateway's name for the protocol (connection counts, stats)

    def __init__(self, websocket: WebSocket, gateway: Gateway) -> None:
        self.ws = websocket
        self.gateway = gateway
        self._contexts: dict[Any, HasTask] = {}
        self._send_lock = asyncio.Lock()
        self._send_timeout_s = gateway.config.server.stalled_client_timeout_s
        self._inbox: asyncio.Queue[Incoming] = asyncio.Queue(maxsize=INBOX_MESSAGES)
        self._gone = asyncio.Event()  # the client left, or stopped reading: the connection ends
        self._stalled = False

    # ---- for subclasses

    async def _refuse_connection(self, exc: TooManyConnectionsError) -> None:
        """Tell an accepted socket that it is over the connection limit (it is closed after this)."""
        raise NotImplementedError

    async def _serve(self) -> int | None:
        """Handle messages until the client leaves (None) or the socket is to close (its close code)."""
        raise NotImplementedError

    async def _serve_context(self, ctx: Any, received_at: float) -> None:
        """Stream one context to its end; a request error becomes the protocol's error message."""
        raise NotImplementedError

    def _internal_error(self, ctx: Any) -> dict[str, Any]:
        """The message that tells the client a context failed inside the server."""
        raise NotImplementedError

    def _forget(self, ctx: Any) -> None:
        """The context is over: it leaves `_contexts` (if it is still the one under its id)."""
        if self._contexts.get(ctx.context_id) is ctx:
            del self._contexts[ctx.context_id]

    # ---- one context

    async def _speak(self, ctx: Any, received_at: float) -> None:
        """A context's task: serve it to its end; whatever fails in the server becomes an error message for
        this context only, and the socket goes on."""
        try:
            await self._serve_context(ctx, received_at)
        except ClientStalledError:
            self._cut_off()
        except (WebSocketDisconnect, OSError):
            self._gone.set()
        except Exception:
            log.exception("%s context %s failed", self.protocol, ctx.context_id)
            await self._send_quietly(self._internal_error(ctx))
        finally:
            self._forget(ctx)

    async def _send_quietly(self, body: dict[str, Any]) -> None:
        """Send a last message for a context whose client may be gone already."""
        try:
            await self._send(body)
        except (ClientStalledError, WebSocketDisconnect, OSError):
            self._gone.set()

    # ---- sending

    async def _send(self, body: dict[str, Any]) -> None:
        """Send one message; a client that takes nothing for server.stalled_client_timeout_s is cut off."""
        if self._stalled:
            raise ClientStalledError("the client stopped reading")
        text = json.dumps(body, separators=(",", ":"))
        try:
            await asyncio.wait_for(self._send_locked(text), self._send_timeout_s)
        except asyncio.TimeoutError:
            self._cut_off()
            raise ClientStalledError("the client stopped reading") from None
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # A context stopped (a barge-in) in the very instant its send completed: before Python 3.12,
            # wait_for then returns the send's result and the cancel is lost (gh-86296), and the context went
            # on, its generation too, until its text timed out (stream_input.idle_timeout_s).
            raise asyncio.CancelledError

    async def _send_locked(self, text: str) -> None:
        async with self._send_lock:
            await self.ws.send_text(text)

    def _cut_off(self) -> None:
        if not self._stalled:
            log.info("%s WebSocket: the client took nothing for %.1f s; cutting it off", self.protocol,
                     self._send_timeout_s)
        self._stalled = True
        self._gone.set()

    # ---- the connection's life

    async def run(self) -> None:
        try:
            lease = self.gateway.acquire_connection(self.protocol)
        except TooManyConnectionsError as exc:
            await self.ws.accept()
            await self._refuse_connection(exc)
            await self.ws.close(CLOSE_TRY_AGAIN_LATER)
            return
        reader: asyncio.Task[None] | None = None
        try:
            await self.ws.accept()
            reader = asyncio.create_task(self._read(), name=f"{self.protocol}-reader")
            code = await self._serve()
            if code is not None:
                await self.ws.close(code)
        except (WebSocketDisconnect, OSError, ClientStalledError) as exc:
            log.debug("%s WebSocket ended: %r", self.protocol, exc)
        finally:
            tasks = [c.task for c in self._contexts.values() if c.task is not None]
            running = [t for t in (*tasks, reader) if t is not None]
            for task in running:
                if not task.done():
                    task.cancel()
            if running:
                await asyncio.wait(running)
            self._contexts.clear()
            lease.release()
            if self._stalled:
                self.gateway.reset_connection(self.ws.scope.get("client"))

    async def _read(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                await self._inbox.put(Incoming(message, time.perf_counter()))
        finally:
            self._gone.set()
