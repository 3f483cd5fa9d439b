"""`MPClient`: the engine-core client for an engine core in a process of its own (vLLM v1's MPClient).

    API process (asyncio loop)                         engine-core process (core/process.py)
    submit / stats  ── DEALER, answered at once ──▶    ROUTER: scheduler.submit, stats snapshot
    delivered, cancel, release ── batched, one message per loop pass ──▶
    output handler task ◀── PULL ─── one msgpack batch of outputs per wake-up ─── PUSH
        └─▶ per-session asyncio.Queue (what `outputs()` returns, as in-process)

Messages are msgpack (core/wire.py): ids, numbers and PCM bytes, nothing pickled. The sockets and
calls are transport.py's, the core process's start, watch and stop supervisor.py's, and the crash-loop
guard crash_loop.py's; this module is the client protocol over them, restarts and the counter relay.

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
import logging
import os
import select
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import Config
from ..request.errors import ServiceUnavailableError
from ..scheduler import SessionRequest
from . import wire
from .client import EngineCoreStats, Outcome, SessionDone, SessionOutput
from .frame_log import FrameEntries
from .supervisor import JOIN_S, CoreStartError, CoreSupervisor
from .transport import CoreTransport
from .wire import CALL_SHUTDOWN, CoreAddresses, CoreInfo

log = logging.getLogger(__name__)

_WARMUP_S = 120.0  # a restarted core's warm-up session
_FIGURES_S = 0.25  # how often an API process's counters may go to the core (when they changed)
_RECENT_STATS_S = 0.1  # how often the loop's own copy of the core's stats is refreshed (recent_stats)


class MPClient:
    """The EngineCoreClient protocol over ZeroMQ to an engine-core process (see the module docstring)."""

    def __init__(self, config: Config, *, api_index: int = 0, addresses: CoreAddresses | None = None,
                 record_tokens: bool = False) -> None:
        self._config = config
        self._api = api_index
        self._timeout_s = config.server.core_call_timeout_s
        # The owner (API process 0, no addresses given) starts, watches and restarts the core: it has a
        # supervisor. Otherwise this client was attached to the core of another API process, which tells it
        # when the core dies and comes back.
        owner = addresses is None
        self._dir: Path | None = None
        if addresses is None:
            self._dir = Path(tempfile.mkdtemp(prefix="orpheus-core-"))
            addresses = CoreAddresses(
                input=f"ipc://{self._dir}/input",
                outputs=tuple(f"ipc://{self._dir}/output-{i}" for i in range(config.server.api_processes)))
        self._addresses = addresses
        self._supervisor = CoreSupervisor(config, addresses, record_tokens=record_tokens) if owner else None
        self._transport = CoreTransport(addresses, api_index, self._timeout_s,
                                        file_timeout_s=config.voices.read_timeout_s, core_running=self._core_running,
                                        on_silence=self._on_silence)
        self.info: CoreInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._mailboxes: dict[str, asyncio.Queue[SessionOutput]] = {}
        self._serving = False  # and it takes sessions: up, and warmed up after a restart
        self._core_failure: str | None = None  # why the process is gone
        self._engine_failure: str | None = None  # the core declared its engine dead
        self._last_stats: EngineCoreStats | None = None
        self._warmup: SessionRequest | None = None
        self._stopping = False
        self.restarts = 0
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
        self._stats_task: asyncio.Task[None] | None = None
        # (Attached) readable once the core process has exited (Linux pidfd): a call in flight gives up at once.
        self._core_fd: int | None = None

    @classmethod
    def attach(cls, config: Config, addresses: CoreAddresses, info: CoreInfo, *, api_index: int) -> MPClient:
        """A client of API process `api_index` > 0 for the running core of API process 0."""
        client = cls(config, api_index=api_index, addresses=addresses)
        client._transport.bind_outputs()
        client.info = info
        client._follow(info.pid)
        client._transport.open_calls()
        client._transport.up = client._serving = True
        try:
            client._take_stats(*client._transport.call_from_any_thread(wire.CALL_STATS)[1:])
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
        assert self._supervisor is not None, "launch() is API process 0's; the others attach()"
        self._transport.bind_outputs()
        try:
            self.info = self._supervisor.spawn(lambda: self._stopping)
        except BaseException:
            self._close_transport()
            raise
        self._transport.open_calls()
        self._transport.up = self._serving = True
        self._take_stats(*self._transport.call_from_any_thread(wire.CALL_STATS)[1:])
        return self.info

    @property
    def core_pid(self) -> int | None:
        if self._supervisor is not None and self._supervisor.process is not None:
            return self._supervisor.process.pid
        return self.info.pid if self.info is not None else None

    def _core_running(self) -> bool:
        if self._supervisor is not None:
            return self._supervisor.running
        if self._core_fd is not None and select.select([self._core_fd], [], [], 0)[0]:
            return False
        return self._transport.up

    def _on_silence(self, message: str) -> None:
        if not self._stopping and self._supervisor is not None:
            self._supervisor.kill_silent(message)  # its death then fails its streams and restarts it

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
        return self._serving and self._engine_failure is None and self._transport.answering()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._supervisor is not None and self._supervisor.process is None:
            raise RuntimeError("MPClient.start() before launch()")
        if self._loop is not None:
            return  # started already (an API process's server starts its service once)
        self._loop = loop
        self._transport.attach_loop(loop)
        self._reader = loop.create_task(self._read_outputs(), name="engine-core-outputs")
        self._reader.add_done_callback(self._reader_done)
        if self.figures_source is not None:
            self._figures_task = loop.create_task(self._send_figures(), name="api-figures")
        self._stats_task = loop.create_task(self._transport.poll(  # keeps recent_stats() recent
            wire.CALL_STATS, _RECENT_STATS_S, lambda reply: self._take_stats(*reply[1:])), name="core-stats")
        if self._supervisor is not None:
            self._watch()

    async def _send_figures(self) -> None:
        """This API process's counters to the core, when they changed (at most every _FIGURES_S)."""
        assert self.figures_source is not None
        while True:
            figures = self.figures_source()
            # A full input queue at the core keeps them for the next pass.
            if figures != self._figures_sent and self._transport.open and self._transport.send_nowait(
                    [wire.FIGURES, self._api, figures]):
                self._figures_sent = figures
            await asyncio.sleep(_FIGURES_S)

    def api_gone(self, api_index: int) -> None:
        """Tell the core that API process `api_index` died (API process 0 supervises the others)."""
        if self._transport.open:
            self._transport.flush_notes()
            if not self._transport.send_nowait([wire.API_GONE, api_index]):
                log.error("the engine core's input queue is full; it was not told that API process %d is gone",
                          api_index)

    def core_down(self, reason: str) -> None:
        """(An attached client) API process 0 saw the core die: fail the open streams, refuse new ones."""
        self._core_lost(reason)

    def core_up(self, info: CoreInfo) -> None:
        """(An attached client) the core was started again and warmed up: serve again."""
        if self._stopping:
            return
        self._transport.open_calls()  # a fresh socket: nothing queued for the old core reaches the new one
        self.info = info
        self._follow(info.pid)
        self.restarts += 1  # API process 0 counts the same restarts
        self._figures_sent = None  # the new core has none of them yet
        self._engine_failure = self._core_failure = None
        self._transport.up = self._serving = True
        log.warning("the engine core is back (process %d)", info.pid)

    def _tell_listeners(self, event: str, detail: Any) -> None:
        for listener in self.core_listeners:
            listener(event, detail)

    def shutdown(self) -> None:
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        for task in (self._figures_task, self._stats_task):
            if task is not None:
                task.cancel()
        if self._supervisor is None:  # the core is API process 0's; it stops it once every API process has drained
            self._transport.flush_notes()
            self._transport.up = self._serving = False
            if self._reader is not None:
                self._reader.cancel()
            self._close_transport()
            return
        self._supervisor.stop(self._ask_core_to_stop if self._transport.up else None)
        self._transport.up = self._serving = False
        if self._reader is not None:
            self._reader.cancel()
        self._close_transport()

    def _ask_core_to_stop(self) -> None:
        try:
            self._transport.call(CALL_SHUTDOWN, timeout_s=JOIN_S)
        except ServiceUnavailableError as exc:
            log.error("the engine core did not take the stop request (%s); terminating it", exc)

    def _close_transport(self) -> None:
        self._transport.close()
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
        if request.adapter is not None:  # its files are read on the core's file thread, not its input thread
            await self._transport.prefetch(request.adapter)
        # The mailbox comes first: the output handler may read the session's first outputs before this
        # coroutine sees the core's answer. (An id in use keeps its mailbox: the core refuses the request.)
        fresh = session_id not in self._mailboxes
        if fresh:
            self._mailboxes[session_id] = asyncio.Queue()
        try:
            status, *detail = await self._transport.acall(wire.CALL_SUBMIT, self._api, wire.encode_request(request))
        except (ServiceUnavailableError, asyncio.CancelledError):
            # No answer in time, or its client left while waiting: the core may have admitted it, for
            # nobody. Cancel it there, and let the core forget whom its outputs were for.
            if fresh:
                self._mailboxes.pop(session_id, None)
            self.cancel(session_id)
            self._transport.note_release(session_id)
            raise
        if status == wire.OK:
            return
        if fresh:
            self._mailboxes.pop(session_id, None)
        if status == wire.UNAVAILABLE:
            self._engine_failure = detail[0]
        raise wire.refusal_error(status, *detail)

    def outputs(self, session_id: str) -> asyncio.Queue[SessionOutput]:
        return self._mailboxes[session_id]

    def note_delivered(self, session_id: str, samples: int) -> None:
        self._transport.note_delivered(session_id, samples)

    def note_loop_lag(self, seconds: float) -> None:
        if self._transport.open:
            # A full input queue at the core drops this report: the next tick's replaces it anyway.
            self._transport.send_nowait([wire.LOOP_LAG, self._api, seconds])

    def cancel(self, session_id: str) -> None:
        self._transport.note_cancel(session_id)

    def release(self, session_id: str) -> None:
        if self._mailboxes.pop(session_id, None) is not None:
            self._transport.note_release(session_id)

    def open_sessions(self) -> list[str]:
        return list(self._mailboxes)

    def stats(self) -> EngineCoreStats:
        try:
            if not self._transport.up:
                return self.recent_stats()
            return self._take_stats(*self._transport.call_from_any_thread(wire.CALL_STATS, True)[1:])
        except ServiceUnavailableError as exc:
            return self.recent_stats(str(exc))

    async def adapters(self, op: str, name: str | None = None) -> list[dict[str, Any]]:
        return await self._transport.adapters(op, name)

    def recent_stats(self, failure: str | None = None) -> EngineCoreStats:
        """The core's snapshot as of at most _RECENT_STATS_S ago, never waiting for it (the loop's per-request
        checks; stats() asks now). While it is down: the last one with the engine marked not alive."""
        assert self._last_stats is not None  # launch() took one
        if self._transport.up and failure is None:
            return self._last_stats
        return replace(self._last_stats, engine_alive=False, core_restarts=self.restarts,
                       engine_failure=failure or self._core_failure or "the engine core is not running")

    def token_frames(self, session_ids: list[str]) -> FrameEntries:
        return self._transport.token_frames(session_ids)

    def _take_stats(self, values: list[Any], figures: list[Any]) -> EngineCoreStats:
        self.api_figures = dict(figures)
        self._last_stats = replace(wire.decode_stats(values), core_pid=self.core_pid, core_restarts=self.restarts)
        self._engine_failure = self._last_stats.engine_failure or self._engine_failure
        return self._last_stats

    # ------------------------------------------------------------ outputs and supervision

    async def _read_outputs(self) -> None:
        while True:
            batch = await self._transport.receive_outputs()
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
        if self._supervisor is None:  # the core is fine; this process is not: it stops, and API process 0 with it
            self.fatal.set()

    def _watch(self) -> None:
        assert self._loop is not None and self._supervisor is not None
        self._supervisor.watch(self._loop, self._core_lost, lambda: self._stopping)

    def _core_lost(self, reason: str) -> None:
        if not self._transport.up or self._stopping:
            return
        log.error("%s; failing %d open streams", reason, len(self._mailboxes))
        self._transport.up = self._serving = False
        self._core_failure = reason
        self._transport.fail_replies(reason)
        for mailbox in self._mailboxes.values():
            mailbox.put_nowait(SessionDone(Outcome.UNAVAILABLE, error=reason))
        self._transport.drop_notes()
        if self._supervisor is None:
            return  # API process 0 restarts the core, and says when it is back (core_up)
        self._tell_listeners("down", reason)
        restart_allowed = self._supervisor.crash_loop.died()
        if not self._config.server.restart_core:
            log.critical("server.restart_core is off: the server stops")
            self.fatal.set()
        elif not restart_allowed:
            log.critical("the engine core died %s; not starting it again: the server stops",
                         self._supervisor.crash_loop)
            self.fatal.set()
        else:
            assert self._loop is not None
            self._restart_task = self._loop.create_task(self._restart(), name="engine-core-restart")

    async def _restart(self) -> None:
        assert self._loop is not None
        self.restarts += 1
        log.warning("starting the engine core again (restart %d)", self.restarts)
        try:
            self._transport.open_calls()  # a fresh socket: nothing queued for the old core reaches the new one
            assert self._supervisor is not None
            self.info = await self._loop.run_in_executor(None, self._supervisor.spawn, lambda: self._stopping)
            self._watch()
            self._transport.up = True
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
            self._transport.up = self._serving = False
            self._core_failure = f"restarting the engine core failed: {exc}"
            self.fatal.set()
            return
        self._core_failure = None
        log.warning("engine core restarted (process %d)", self.core_pid)
        self._tell_listeners("up", self.info)

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
