"""The API process's sockets to the engine core (see mp_client.py for the whole picture).

    calls   DEALER -> the core's ROUTER: submit and stats, answered at once; a call's answer resolves a
            future (the socket's descriptor is watched by the loop) or is polled for (blocking calls)
    notes   delivered samples, cancels and releases: fire-and-forget, batched into one message per loop
            pass, always sent before the next call (so a cancel reaches the core before a later submit)
    outputs PULL <- the core's PUSH: one msgpack batch of outputs per wake-up

Messages are msgpack (wire.py). The transport knows nothing of the process behind the sockets: whether
the core still runs, and what to do with one that does not answer, are its owner's (`core_running`,
`on_silence`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ..engines.lora import AdapterError
from ..request.errors import ServiceUnavailableError
from ..scheduler import InvalidSessionError, SchedulerFullError
from . import wire
from .frame_log import FrameEntries, FrameEntry
from .wire import CoreAddresses

log = logging.getLogger(__name__)


class CoreTransport:
    def __init__(self, addresses: CoreAddresses, api_index: int, timeout_s: float, *, file_timeout_s: float,
                 core_running: Callable[[], bool], on_silence: Callable[[str], None]) -> None:
        self._addresses = addresses
        self._api = api_index
        self.timeout_s = timeout_s  # server.core_call_timeout_s
        self.file_timeout_s = file_timeout_s  # voices.read_timeout_s: wire.FILE_CALLS
        self._core_running = core_running
        self._on_silence = on_silence  # a call went unanswered for timeout_s: the owner decides (kill it)
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._calls: zmq.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._seq = 0
        self._replies: dict[int, asyncio.Future[list[Any]]] = {}  # calls awaiting the core's answer, by seq
        self.polled_s = time.monotonic()  # when `poll` last had an answer
        self._calls_fd: int | None = None  # the call socket's descriptor, watched by the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        # Notes for the core, sent once per loop pass: delivered samples (summed per session), cancels, releases.
        self._delivered: dict[str, int] = {}
        self._cancels: list[str] = []
        self._releases: list[str] = []
        self._flush_scheduled = False
        self.up = False  # the core process runs and answers

    @property
    def open(self) -> bool:
        """Up, with a call socket: messages can be sent."""
        return self.up and self._calls is not None

    def bind_outputs(self) -> None:
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, wire.SOCKET_HWM)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._addresses.outputs[self._api])

    async def receive_outputs(self) -> list[Any]:
        assert self._pull is not None
        return wire.unpack(await self._pull.recv())

    def open_calls(self) -> None:
        """A fresh call socket (at start, and for a restarted core: nothing queued for the old one reaches it)."""
        if self._calls is not None:
            self._unwatch_calls()
            self._calls.close(0)
            self.fail_replies("the engine core was started again before it answered")
        self._calls = self._ctx.socket(zmq.DEALER)
        self._calls.setsockopt(zmq.SNDHWM, wire.SOCKET_HWM)
        self._calls.setsockopt(zmq.RCVHWM, wire.SOCKET_HWM)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.connect(self._addresses.input)
        self._watch_calls()

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.polled_s = time.monotonic()  # the polls start now
        self._watch_calls()

    def answering(self) -> bool:
        """False once `poll` has had no answer for timeout_s: a silent core is not served from (ARCHITECTURE §9),
        as a call that waited that long would have found. Before the loop runs nothing polls: True."""
        return self._loop is None or time.monotonic() - self.polled_s <= self.timeout_s

    def _watch_calls(self) -> None:
        if self._loop is not None and self._calls is not None and self._calls_fd is None:
            self._calls_fd = self._calls.getsockopt(zmq.FD)
            self._loop.add_reader(self._calls_fd, self._take_replies)

    def _unwatch_calls(self) -> None:
        if self._calls_fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._calls_fd)
        self._calls_fd = None

    def _take_replies(self) -> None:
        """Every answer waiting on the call socket, to its future. (ZeroMQ's descriptor signals edges, not
        levels: this reads until nothing is left, and each call looks again before it waits.)"""
        calls = self._calls
        while calls is not None and not calls.closed and calls.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._resolve(wire.unpack(calls.recv(zmq.NOBLOCK)))

    def _resolve(self, reply: list[Any]) -> None:
        future = self._replies.get(reply[0])
        if future is not None and not future.done():
            future.set_result(reply[1:])
        # else: the late answer to a call that timed out, or that its caller gave up on

    def fail_replies(self, reason: str) -> None:
        for future in self._replies.values():
            if not future.done():
                future.set_exception(ServiceUnavailableError(reason))

    def close(self) -> None:
        self._unwatch_calls()
        for sock in (self._calls, self._pull):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
        self._actx.term()

    # ------------------------------------------------------------ calls

    def send_nowait(self, message: list[Any]) -> bool:
        """An unanswered message (figures, API gone, loop lag); False if the core's input queue is full."""
        assert self._calls is not None
        try:
            self._calls.send(wire.pack(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _send_call(self, kind: int, args: tuple[Any, ...]) -> int:
        """Send one call, after the notes this loop pass produced; its sequence number."""
        assert self._calls is not None
        self.flush_notes()
        self._seq += 1
        try:
            self._calls.send(wire.pack([kind, self._seq, *args]), zmq.NOBLOCK)
        except zmq.Again:
            raise ServiceUnavailableError("the engine core is not taking requests (its input queue is full)") from None
        return self._seq

    def call_from_any_thread(self, kind: int, *args: Any) -> list[Any]:
        """`call` from any thread. From one other than the running event loop's (a test, a tool reading
        stats), it runs on the loop as `acall`: the call socket has one user."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _on_loop(loop):
            future = asyncio.run_coroutine_threadsafe(self.acall(kind, *args), loop)
            return future.result(self.timeout_s + 1.0)  # acall gives up at the timeout itself
        return self.call(kind, *args)

    async def poll(self, kind: int, period_s: float, take: Callable[[list[Any]], object]) -> None:
        """Call `kind` every `period_s` while the core is up and hand each answer to `take`, never blocking the
        loop. A call without an answer is skipped: the core's death or silence is dealt with where it is
        noticed (MPClient's _core_lost, the supervisor's kill_silent); `polled_s` says when one last came."""
        while True:
            await asyncio.sleep(period_s)
            if not self.up:  # down is reported otherwise (MPClient); silence counts from when it is up
                self.polled_s = time.monotonic()
                continue
            with contextlib.suppress(ServiceUnavailableError):
                take(await self.acall(kind))
                self.polled_s = time.monotonic()

    async def adapters(self, op: str, name: str | None) -> list[dict[str, Any]]:
        """The core's custom-voice adapters (engines/lora.adapter_call); AdapterError with the reason."""
        status, detail = await self.acall(wire.CALL_ADAPTERS, op, name)
        if status == wire.FULL:
            raise ServiceUnavailableError(detail)
        if status != wire.OK:
            raise AdapterError(detail)
        return detail

    async def prefetch(self, adapter: str) -> None:
        """Have the core read and check a custom voice's adapter before its session is submitted, on the
        core's file thread: the submit that follows finds it staged and is answered at once.
        InvalidSessionError (param voice) if the adapter is refused, SchedulerFullError if the core's file
        thread has too much queued."""
        status, detail = await self.acall(wire.CALL_PREFETCH, adapter)
        if status == wire.INVALID:
            raise InvalidSessionError(detail, param="voice")
        if status == wire.FULL:
            raise SchedulerFullError(detail, retry_after_s=1.0)

    def token_frames(self, session_ids: list[str]) -> FrameEntries:
        """The frames and finish reasons the core kept for `session_ids` (a core started with record_tokens)."""
        return {sid: FrameEntry(*entry) for sid, *entry in
                self.call_from_any_thread(wire.CALL_TOKEN_LOG, session_ids)[1]}

    async def acall(self, kind: int, *args: Any) -> list[Any]:
        """`call` without blocking the loop: the answer resolves a future (`_take_replies`). wire.FILE_CALLS
        are answered when the core's file thread is done: no answer within `file_timeout_s` fails that call
        only and does not count as the core's silence."""
        assert self._calls is not None and self._loop is not None
        file_call = kind in wire.FILE_CALLS
        timeout = self.file_timeout_s if file_call else self.timeout_s
        seq = self._send_call(kind, args)
        future = self._replies[seq] = self._loop.create_future()
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._take_replies()  # an answer that came before the loop looked at the socket again
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if file_call:
                        raise ServiceUnavailableError(f"the engine core did not finish this within {timeout:g} s")
                    raise self._unanswered(timeout)
                try:
                    # Bounded waits: the process's death is noticed even if no answer ever comes.
                    return await asyncio.wait_for(asyncio.shield(future), min(remaining, 0.1))
                except TimeoutError:
                    if not self._core_running():
                        raise ServiceUnavailableError("the engine-core process has died") from None
        finally:
            del self._replies[seq]
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: a failure nobody waits for any more is not logged as lost

    def _unanswered(self, timeout: float) -> ServiceUnavailableError:
        message = f"the engine core did not answer within {timeout:g} s"
        self._on_silence(message)
        return ServiceUnavailableError(message)

    def call(self, kind: int, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Send one call and wait for its answer (blocking the loop: one round trip to a core that
        answers from its input thread). ServiceUnavailableError if it cannot be sent, the core dies, or
        no answer comes within `timeout_s` (server.core_call_timeout_s)."""
        assert self._calls is not None
        timeout = self.timeout_s if timeout_s is None else timeout_s
        seq = self._send_call(kind, args)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unanswered(timeout)
            if self._calls.poll(int(min(remaining, 0.1) * 1000) + 1):
                reply = wire.unpack(self._calls.recv())
                if reply[0] == seq:
                    if self._replies and self._loop is not None:
                        # This poll may have taken the descriptor's signal for a submit's answer behind it.
                        self._loop.call_soon(self._take_replies)
                    return reply[1:]
                self._resolve(reply)  # a submit's answer, or the late answer to a call that timed out
                continue
            if not self._core_running():
                raise ServiceUnavailableError("the engine-core process has died")

    # ------------------------------------------------------------ notes

    def note_delivered(self, session_id: str, samples: int) -> None:
        self._delivered[session_id] = self._delivered.get(session_id, 0) + samples
        self._schedule_flush()

    def note_cancel(self, session_id: str) -> None:
        self._cancels.append(session_id)
        self._schedule_flush()

    def note_release(self, session_id: str) -> None:
        self._releases.append(session_id)
        self._schedule_flush()

    def drop_notes(self) -> None:
        """The core is gone: what it was to be told concerns sessions that are gone with it."""
        self._delivered, self._cancels, self._releases = {}, [], []

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush_notes)

    def flush_notes(self) -> None:
        self._flush_scheduled = False
        if not (self._delivered or self._cancels or self._releases) or self._calls is None or not self.up:
            return
        message = wire.pack([wire.NOTES, self._api, list(self._delivered.items()), self._cancels, self._releases])
        try:
            self._calls.send(message, zmq.NOBLOCK)
        except zmq.Again:
            # The core's input queue is full: keep the notes (one entry per session at most) for the next pass.
            log.warning("the engine core's input queue is full; delivery notes wait for the next pass")
            return
        self._delivered = {}
        self._cancels = []
        self._releases = []


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
