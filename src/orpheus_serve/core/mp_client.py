"""`MPClient`: the engine-core client for an engine core in a process of its own (vLLM v1's MPClient).

    API process (asyncio loop)                         engine-core process (core/process.py)
    submit / stats  ── DEALER, answered at once ──▶    ROUTER: scheduler.submit, stats snapshot
    delivered, cancel, release ── batched, one message per loop pass ──▶
    output handler task ◀── PULL ─── one msgpack batch of outputs per wake-up ─── PUSH
        └─▶ per-session asyncio.Queue (what `outputs()` returns, as in-process)

Messages are msgpack (core/wire.py): ids, numbers and PCM bytes, nothing pickled.

Admission is answered before `submit()` returns, as in-process: it sends the
request and awaits the core's answer (admitted, or the scheduler's own
refusal: SchedulerFullError with its retry hint, InvalidSessionError, or
ServiceUnavailableError once the engine is dead), at most
`server.core_call_timeout_s`. The loop does not block on it: the answer
resolves a future (the call socket's descriptor is watched by the loop), so a
burst of requests, admitted or refused, does not hold up the audio of the
streams already playing while the core's input thread, which shares its
interpreter with the engine core, gets round to answering (a fraction of a
millisecond each, several under load). `stats()` is a blocking call (rare,
small). Delivery notes, cancels and releases are
fire-and-forget and batched: everything one loop pass produced goes in one
message, before the next submit or stats call (so a cancel always reaches the
core before a later submit).

Lifecycle. `launch()` spawns the core (multiprocessing spawn context), which
builds the engine and decoder and reports ready, or why it failed. The loop
watches the process's sentinel. A core that leaves a call unanswered for
`server.core_call_timeout_s` is stuck (its input thread answers whatever the
engine is doing) and is killed. If the core dies, every open stream ends with
`SessionDone(Outcome.UNAVAILABLE)` (the service raises EngineUnavailableError:
503 / UNAVAILABLE), `engine_alive` turns False (/ready: 503), and the core is
started again (`server.restart_core`), warmed with the first session this
client ran, and `engine_alive` turns True again; without restart, `fatal` is
set and the server exits non-zero. `shutdown()` asks the core to stop after
the service has drained, then joins it (terminate, then kill, if it does not
go).

More API processes (server.api_processes > 1, api/process_group.py): API
process 0 owns the core as above; API process i > 0 uses `MPClient.attach()`:
the same sockets (its own output address, `outputs[i]`) to the same core, no
process of its own. It learns of the core's death and restart from API process
0 (`core_down()` / `core_up()`) and never kills or restarts the core itself.
Every API process sends its own request and gateway counters (`figures_source`)
to the core when they change, at most every `_FIGURES_S`; the core returns all of
them with each stats answer (`api_figures`), so each /v1/stats can sum them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import select
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from ..config import Config
from ..request.errors import ServiceUnavailableError
from ..scheduler import InvalidSessionError, SchedulerFullError, SessionRequest
from . import wire
from .client import EngineCoreStats, Outcome, SessionDone, SessionOutput
from .process import run_engine_core
from .wire import CALL_SHUTDOWN, CoreAddresses, CoreInfo

log = logging.getLogger(__name__)

_JOIN_S = 10.0  # the core's own shutdown (engine close, codec stop) before it is terminated
_WARMUP_S = 120.0  # a restarted core's warm-up session
# A core (or an API process, api/process_group.py) that dies more than this many times within CRASH_LOOP_S is
# not started again (the server stops): something outside it is wrong, and each restart fails streams again.
CRASH_LOOP_RESTARTS = 3
CRASH_LOOP_S = 300.0
_FIGURES_S = 0.25  # how often an API process's counters may go to the core (when they changed)


class CoreStartError(RuntimeError):
    """The engine-core process failed to build its engine (its traceback is in the message)."""


class MPClient:
    """The EngineCoreClient protocol over ZeroMQ to an engine-core process (see the module docstring)."""

    def __init__(self, config: Config, *, api_index: int = 0, addresses: CoreAddresses | None = None) -> None:
        self._config = config
        self._api = api_index
        self._timeout_s = config.server.core_call_timeout_s
        # Owner: this client starts, watches and restarts the core (API process 0); otherwise it was attached
        # to the core of another API process, which tells it when the core dies and comes back.
        self._owner = addresses is None
        self._dir: Path | None = None
        if addresses is None:
            self._dir = Path(tempfile.mkdtemp(prefix="orpheus-core-"))
            addresses = CoreAddresses(
                input=f"ipc://{self._dir}/input",
                outputs=tuple(f"ipc://{self._dir}/output-{i}" for i in range(config.server.api_processes)))
        self._addresses = addresses
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._calls: zmq.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self.info: CoreInfo | None = None
        self._seq = 0
        self._replies: dict[int, asyncio.Future[list[Any]]] = {}  # calls awaiting the core's answer, by seq
        self._calls_fd: int | None = None  # the call socket's descriptor, watched by the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._mailboxes: dict[str, asyncio.Queue[SessionOutput]] = {}
        # Notes for the core, sent once per loop pass: delivered samples (summed per session), cancels, releases.
        self._delivered: dict[str, int] = {}
        self._cancels: list[str] = []
        self._releases: list[str] = []
        self._flush_scheduled = False
        self._alive = False  # the process runs and answers (the transport is up)
        self._serving = False  # and it takes sessions: up, and warmed up after a restart
        self._core_failure: str | None = None  # why the process is gone
        self._engine_failure: str | None = None  # the core declared its engine dead
        self._last_stats: EngineCoreStats | None = None
        self._warmup: SessionRequest | None = None
        self._stopping = False
        self.restarts = 0
        self._deaths: list[float] = []  # monotonic times the core died, within CRASH_LOOP_S
        # Set when the core died and will not be started again: the server exits non-zero.
        self.fatal = asyncio.Event()
        # API process 0 tells the others: ("down", reason) when the core died, ("up", CoreInfo) once restarted.
        self.core_listeners: list[Callable[[str, Any], None]] = []
        # This API process's own counters (server.api_processes > 1), and every API process's, as of the
        # core's last stats answer: api index -> figures.
        self.figures_source: Callable[[], dict[str, Any]] | None = None
        self.api_figures: dict[int, dict[str, Any]] = {}
        self._figures_sent: dict[str, Any] | None = None
        self._figures_task: asyncio.Task[None] | None = None
        # (An attached client) readable once the core process has exited (Linux pidfd): a call in flight gives
        # up at once instead of at its timeout, before API process 0's notice arrives.
        self._core_fd: int | None = None

    @classmethod
    def attach(cls, config: Config, addresses: CoreAddresses, info: CoreInfo, *, api_index: int) -> MPClient:
        """A client of API process `api_index` > 0 for the running core of API process 0."""
        client = cls(config, api_index=api_index, addresses=addresses)
        client._pull = client._actx.socket(zmq.PULL)
        client._pull.setsockopt(zmq.RCVHWM, wire.SOCKET_HWM)
        client._pull.setsockopt(zmq.LINGER, 0)
        client._pull.bind(addresses.outputs[api_index])
        client.info = info
        client._follow(info.pid)
        client._open_calls()
        client._alive = client._serving = True
        try:
            client._last_stats = client._stats_call()
        except BaseException:
            client._close_transport()
            raise
        return client

    @property
    def addresses(self) -> CoreAddresses:
        return self._addresses

    # ------------------------------------------------------------ start-up

    def launch(self) -> CoreInfo:
        """Start the engine-core process and wait until its engine is built (blocking, like building
        the engine in-process). CoreStartError if it fails."""
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, wire.SOCKET_HWM)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._addresses.outputs[self._api])
        try:
            self.info = self._spawn()
        except BaseException:
            self._close_transport()
            raise
        self._open_calls()
        self._alive = self._serving = True
        self._last_stats = self._stats_call()
        return self.info

    def _spawn(self) -> CoreInfo:
        ctx = multiprocessing.get_context("spawn")
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_engine_core, name="orpheus-engine-core", daemon=True,
                              args=(self._config.model_dump(mode="json"), self._addresses, sender))
        process.start()
        sender.close()
        try:
            wait_for_any([receiver, process.sentinel])  # the engine build has no bound of its own
            if not receiver.poll():
                process.join()
                raise CoreStartError(f"the engine-core process exited with code {process.exitcode} before it was ready")
            try:
                status, payload = receiver.recv()
            except EOFError:
                process.join()
                raise CoreStartError(f"the engine-core process exited with code {process.exitcode} before it was ready") from None
        finally:
            receiver.close()
        if status != "ready":
            process.join(_JOIN_S)
            raise CoreStartError(f"the engine core failed to start:\n{payload}")
        if self._stopping:  # a restart that finished after shutdown() began: this core is not wanted
            process.kill()
            process.join()
            raise CoreStartError("the server stopped while the engine core was starting")
        self._process = process
        log.info("engine core running in process %d (%d slots, max_seq_len %d)", payload.pid, payload.num_slots,
                 payload.max_seq_len)
        return payload

    def _open_calls(self) -> None:
        if self._calls is not None:
            self._unwatch_calls()
            self._calls.close(0)
            self._fail_replies("the engine core was started again before it answered")
        self._calls = self._ctx.socket(zmq.DEALER)
        self._calls.setsockopt(zmq.SNDHWM, wire.SOCKET_HWM)
        self._calls.setsockopt(zmq.RCVHWM, wire.SOCKET_HWM)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.connect(self._addresses.input)
        self._watch_calls()

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

    def _fail_replies(self, reason: str) -> None:
        for future in self._replies.values():
            if not future.done():
                future.set_exception(ServiceUnavailableError(reason))

    @property
    def core_pid(self) -> int | None:
        if self._process is not None:
            return self._process.pid
        return self.info.pid if self.info is not None else None

    def _core_running(self) -> bool:
        if self._owner:
            return self._process is not None and self._process.is_alive()
        if self._core_fd is not None and select.select([self._core_fd], [], [], 0)[0]:
            return False
        return self._alive

    def _follow(self, pid: int) -> None:
        if self._core_fd is not None:
            os.close(self._core_fd)
            self._core_fd = None
        if hasattr(os, "pidfd_open"):
            try:
                self._core_fd = os.pidfd_open(pid)
            except ProcessLookupError:
                log.warning("the engine core (process %d) is gone already; API process 0's notice follows", pid)

    # ------------------------------------------------------------ the protocol

    @property
    def engine_alive(self) -> bool:
        return self._serving and self._engine_failure is None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._owner and self._process is None:
            raise RuntimeError("MPClient.start() before launch()")
        if self._loop is not None:
            return  # started already (an API process's server starts its service once)
        self._loop = loop
        self._watch_calls()
        self._reader = loop.create_task(self._read_outputs(), name="engine-core-outputs")
        self._reader.add_done_callback(self._reader_done)
        if self.figures_source is not None:
            self._figures_task = loop.create_task(self._send_figures(), name="api-figures")
        if self._process is not None:
            self._watch(self._process)

    async def _send_figures(self) -> None:
        """This API process's counters to the core, when they changed (at most every _FIGURES_S)."""
        assert self.figures_source is not None
        while True:
            figures = self.figures_source()
            if figures != self._figures_sent and self._alive and self._calls is not None:
                try:
                    self._calls.send(wire.pack([wire.FIGURES, self._api, figures]), zmq.NOBLOCK)
                    self._figures_sent = figures
                except zmq.Again:
                    pass  # the core's input queue is full; the next pass sends them
            await asyncio.sleep(_FIGURES_S)

    def api_gone(self, api_index: int) -> None:
        """Tell the core that API process `api_index` died (API process 0 supervises the others)."""
        if self._calls is not None and self._alive:
            self._flush_notes()
            try:
                self._calls.send(wire.pack([wire.API_GONE, api_index]), zmq.NOBLOCK)
            except zmq.Again:
                log.error("the engine core's input queue is full; it was not told that API process %d is gone",
                          api_index)

    def core_down(self, reason: str) -> None:
        """(An attached client) API process 0 saw the core die: fail the open streams, refuse new ones."""
        self._core_lost(reason)

    def core_up(self, info: CoreInfo) -> None:
        """(An attached client) the core was started again and warmed up: serve again."""
        if self._stopping:
            return
        self._open_calls()  # a fresh socket: nothing queued for the old core reaches the new one
        self.info = info
        self._follow(info.pid)
        self.restarts += 1  # API process 0 counts the same restarts
        self._figures_sent = None  # the new core has none of them yet
        self._engine_failure = self._core_failure = None
        self._alive = self._serving = True
        log.warning("the engine core is back (process %d)", info.pid)

    def _tell(self, event: str, detail: Any) -> None:
        for listener in self.core_listeners:
            listener(event, detail)

    def shutdown(self) -> None:
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        if self._figures_task is not None:
            self._figures_task.cancel()
        if not self._owner:  # the core is API process 0's; it stops it once every API process has drained
            self._flush_notes()
            self._alive = self._serving = False
            if self._reader is not None:
                self._reader.cancel()
            self._close_transport()
            return
        process = self._process
        if process is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(process.sentinel)
            if process.is_alive() and self._alive:
                try:
                    self._call(CALL_SHUTDOWN, timeout_s=_JOIN_S)
                except ServiceUnavailableError as exc:
                    log.error("the engine core did not take the stop request (%s); terminating it", exc)
            process.join(_JOIN_S)
            if process.is_alive():
                log.error("the engine core did not stop within %.0f s; terminating it", _JOIN_S)
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        self._alive = self._serving = False
        if self._reader is not None:
            self._reader.cancel()
        self._close_transport()

    def _close_transport(self) -> None:
        self._unwatch_calls()
        for sock in (self._calls, self._pull):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
        self._actx.term()
        if self._core_fd is not None:
            os.close(self._core_fd)
            self._core_fd = None
        if self._dir is not None:
            shutil.rmtree(self._dir)

    async def submit(self, request: SessionRequest) -> None:
        if not self._serving:
            raise ServiceUnavailableError(f"the engine core is not running: {self._core_failure}")
        if self._warmup is None:
            self._warmup = request
        await self._submit(request)

    async def _submit(self, request: SessionRequest) -> None:
        session_id = request.request_id
        # The mailbox comes first: the output handler may read the session's first outputs before this
        # coroutine sees the core's answer. (An id in use keeps its mailbox: the core refuses the request.)
        fresh = session_id not in self._mailboxes
        if fresh:
            self._mailboxes[session_id] = asyncio.Queue()
        try:
            status, *detail = await self._acall(wire.CALL_SUBMIT, self._api, wire.encode_request(request))
        except (ServiceUnavailableError, asyncio.CancelledError):
            # No answer in time, or its client left while waiting: the core may have admitted it, for
            # nobody. Cancel it there, and let the core forget whom its outputs were for.
            if fresh:
                self._mailboxes.pop(session_id, None)
            self.cancel(session_id)
            self._releases.append(session_id)
            raise
        if status == wire.OK:
            return
        if fresh:
            self._mailboxes.pop(session_id, None)
        message, extra = detail
        if status == wire.FULL:
            raise SchedulerFullError(message, retry_after_s=extra)
        if status == wire.INVALID:
            raise InvalidSessionError(message, param=extra)
        self._engine_failure = message
        raise ServiceUnavailableError(message)

    def outputs(self, session_id: str) -> asyncio.Queue[SessionOutput]:
        return self._mailboxes[session_id]

    def note_delivered(self, session_id: str, samples: int) -> None:
        self._delivered[session_id] = self._delivered.get(session_id, 0) + samples
        self._schedule_flush()

    def note_loop_lag(self, seconds: float) -> None:
        if self._calls is not None and self._alive:
            # A full input queue at the core drops this report: the next tick's replaces it anyway.
            with contextlib.suppress(zmq.Again):
                self._calls.send(wire.pack([wire.LOOP_LAG, self._api, seconds]), zmq.NOBLOCK)

    def cancel(self, session_id: str) -> None:
        self._cancels.append(session_id)
        self._schedule_flush()

    def release(self, session_id: str) -> None:
        if self._mailboxes.pop(session_id, None) is not None:
            self._releases.append(session_id)
            self._schedule_flush()

    def open_sessions(self) -> list[str]:
        return list(self._mailboxes)

    def stats(self) -> EngineCoreStats:
        """The core's snapshot; while it is down, the last one with the engine marked not alive."""
        if self._alive:
            try:
                self._last_stats = self._stats_call()
                return self._last_stats
            except ServiceUnavailableError as exc:
                failure = str(exc)
        else:
            failure = self._core_failure or "the engine core is not running"
        assert self._last_stats is not None  # launch() took one
        return replace(self._last_stats, engine_alive=False, engine_failure=failure, core_restarts=self.restarts)

    def _stats_call(self) -> EngineCoreStats:
        _, values, figures = self._call(wire.CALL_STATS)
        self.api_figures = dict(figures)
        stats = replace(wire.decode_stats(values), core_pid=self.core_pid, core_restarts=self.restarts)
        if stats.engine_failure is not None:
            self._engine_failure = stats.engine_failure
        return stats

    # ------------------------------------------------------------ transport

    def _send_call(self, kind: int, args: tuple[Any, ...]) -> int:
        """Send one call, after the notes this loop pass produced; its sequence number."""
        assert self._calls is not None
        self._flush_notes()
        self._seq += 1
        try:
            self._calls.send(wire.pack([kind, self._seq, *args]), zmq.NOBLOCK)
        except zmq.Again:
            raise ServiceUnavailableError("the engine core is not taking requests (its input queue is full)") from None
        return self._seq

    async def _acall(self, kind: int, *args: Any) -> list[Any]:
        """`_call` without blocking the loop: the answer resolves a future (`_take_replies`)."""
        assert self._calls is not None and self._loop is not None
        timeout = self._timeout_s
        seq = self._send_call(kind, args)
        future = self._replies[seq] = self._loop.create_future()
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._take_replies()  # an answer that came before the loop looked at the socket again
                remaining = deadline - time.monotonic()
                if remaining <= 0:
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
        if not self._stopping and self._owner and self._core_running():
            # Its input thread answers at once whatever the engine does: silence means it is stuck.
            # Treated as dead: killed, its streams failed, and started again (see _on_process_exit).
            assert self._process is not None
            log.error("%s; killing it (process %d)", message, self._process.pid)
            self._process.kill()
        return ServiceUnavailableError(message)

    def _call(self, kind: int, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Send one call and wait for its answer (blocking the loop: one round trip to a core that
        answers from its input thread). ServiceUnavailableError if it cannot be sent, the core dies, or
        no answer comes within `timeout_s` (server.core_call_timeout_s)."""
        assert self._calls is not None
        timeout = self._timeout_s if timeout_s is None else timeout_s
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

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_notes)

    def _flush_notes(self) -> None:
        self._flush_scheduled = False
        if not (self._delivered or self._cancels or self._releases) or self._calls is None or not self._alive:
            return
        message = wire.pack([wire.NOTES, list(self._delivered.items()), self._cancels, self._releases])
        try:
            self._calls.send(message, zmq.NOBLOCK)
        except zmq.Again:
            # The core's input queue is full: keep the notes (one entry per session at most) for the next pass.
            log.warning("the engine core's input queue is full; delivery notes wait for the next pass")
            return
        self._delivered = {}
        self._cancels = []
        self._releases = []

    async def _read_outputs(self) -> None:
        assert self._pull is not None
        while True:
            batch = wire.unpack(await self._pull.recv())
            for entry in batch:
                decoded = wire.decode_output(entry)
                if isinstance(decoded, wire.EngineDead):
                    self._engine_failure = decoded.error
                    continue
                session_id, item = decoded
                mailbox = self._mailboxes.get(session_id)
                if mailbox is not None:  # None: released; the client has gone
                    mailbox.put_nowait(item)

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopping:
            return
        error = task.exception()
        log.error("the engine-core output handler failed: %r", error)
        self._core_lost(f"the engine core's output handler failed: {error!r}")
        if not self._owner:  # the core is fine; this process is not: it stops, and API process 0 with it
            self.fatal.set()

    # ------------------------------------------------------------ supervision

    def _watch(self, process: multiprocessing.process.BaseProcess) -> None:
        assert self._loop is not None
        self._loop.add_reader(process.sentinel, self._on_process_exit, process)

    def _on_process_exit(self, process: multiprocessing.process.BaseProcess) -> None:
        assert self._loop is not None
        self._loop.remove_reader(process.sentinel)
        process.join(1.0)
        if self._stopping:
            return
        self._core_lost(f"the engine-core process died (exit code {process.exitcode})")
        if process.is_alive():  # lost for another reason (its output handler): make sure it is gone
            process.kill()
            process.join()

    def _core_lost(self, reason: str) -> None:
        if not self._alive or self._stopping:
            return
        log.error("%s; failing %d open streams", reason, len(self._mailboxes))
        self._alive = self._serving = False
        self._core_failure = reason
        self._fail_replies(reason)
        for mailbox in self._mailboxes.values():
            mailbox.put_nowait(SessionDone(Outcome.UNAVAILABLE, error=reason))
        self._delivered, self._cancels, self._releases = {}, [], []
        if not self._owner:
            return  # API process 0 restarts the core, and says when it is back (core_up)
        self._tell("down", reason)
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < CRASH_LOOP_S] + [now]
        if not self._config.server.restart_core:
            log.critical("server.restart_core is off: the server stops")
            self.fatal.set()
        elif len(self._deaths) > CRASH_LOOP_RESTARTS:
            log.critical("the engine core died %d times within %.0f s; not starting it again: the server stops",
                         len(self._deaths), CRASH_LOOP_S)
            self.fatal.set()
        else:
            assert self._loop is not None
            self._restart_task = self._loop.create_task(self._restart(), name="engine-core-restart")

    async def _restart(self) -> None:
        assert self._loop is not None
        self.restarts += 1
        log.warning("starting the engine core again (restart %d)", self.restarts)
        try:
            self._open_calls()  # a fresh socket: nothing queued for the old core reaches the new one
            self.info = await self._loop.run_in_executor(None, self._spawn)
            assert self._process is not None
            self._watch(self._process)
            self._alive = True
            self._figures_sent = None  # the new core has none of this process's counters yet
            self._engine_failure = None
            await self._warm_up()
            self._serving = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._restart_task is not asyncio.current_task():
                return  # the new core died too; a later restart has taken over
            log.exception("restarting the engine core failed")
            self._alive = self._serving = False
            self._core_failure = f"restarting the engine core failed: {exc}"
            self.fatal.set()
            return
        self._core_failure = None
        log.warning("engine core restarted (process %d)", self.core_pid)
        self._tell("up", self.info)

    async def _warm_up(self) -> None:
        """Run the first session this client ever ran again, as the service's warm-up did at start."""
        if self._warmup is None:
            return
        request = replace(self._warmup, request_id=f"{self._warmup.request_id}-restart{self.restarts}",
                          arrival_s=time.monotonic())
        await self._submit(request)
        try:
            await asyncio.wait_for(self._drain(request.request_id), _WARMUP_S)
        finally:
            self.release(request.request_id)

    async def _drain(self, session_id: str) -> None:
        mailbox = self._mailboxes[session_id]
        generated = audio_out = False
        while not (generated and audio_out):
            item = await mailbox.get()
            if isinstance(item, bytes):
                self.note_delivered(session_id, len(item) // 2)
            elif item.error is not None or item.outcome.failed:
                raise CoreStartError(f"the restarted engine core failed its warm-up: {item.error or item.outcome.value}")
            elif item.outcome is Outcome.AUDIO:
                audio_out = True
            else:
                generated = True
