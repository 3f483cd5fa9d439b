"""The engine-core process: scheduler, token engine and codec worker, apart from every socket.

vLLM v1's `EngineCoreProc` pattern. `MPClient` (mp_client.py) starts this
process with the spawn context; it builds the engine and decoder, says it is
ready over a pipe (or why it failed), and then runs exactly what the
in-process client runs (`core.client.CoreRuntime`: the engine core thread
and the codec worker thread) with ZeroMQ in place of the event loop:

    main thread (input):   ROUTER  <- every API process's DEALER
                           submit: answered at once (admitted, or the scheduler's refusal)
                           stats:  answered with an EngineCoreStats snapshot
                           token log: answered with the frames kept for the sessions asked (record_tokens)
                           notes:  delivered samples, cancels, releases (batched by the sender)
                           figures: each API process's request counters, kept for the stats answer
                           api gone: an API process died: its sessions are cancelled, its outputs dropped
    file thread:           adapter loads and a custom voice's read before its submit (wire.FILE_CALLS):
                           reading an adapter takes as long as the disk does, and the input thread's
                           submits and delivery notes (which every playing stream waits on) must not
                           wait for it; answered through the input thread when done
    engine core thread:    schedule -> engine.step -> update   (never touches a socket)
    codec worker thread:   batched decode -> PCM16
    output thread:         outputs of both -> one msgpack batch per wake-up -> PUSH to the owning API process

Each session's outputs go to the API process that submitted it (the
`api` index of its submit). The outbox between the engine/codec threads and
the output thread is bounded the way the in-process inbox is: the scheduler
holds back sessions whose client has not taken their audio, and the
delivery notes that release them come only from the API processes. Sockets
keep ZeroMQ high-water marks (wire.SOCKET_HWM).

This process ignores SIGINT and SIGTERM: its API process drains the streams
first and then tells it to stop. It exits by itself when that process dies
(its sentinel is polled beside the input socket).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from ..codec.base import StreamingDecoder
from ..codec.pass_clock import name_os_thread
from ..config import Config
from ..engines.base import TokenEngine
from ..engines.lora import AdapterError
from ..request.errors import ServiceUnavailableError
from ..scheduler import InvalidSessionError, SchedulerFullError
from . import wire
from .client import CoreRuntime, SessionOutput
from .frame_log import FrameLog

log = logging.getLogger(__name__)

_PARENT_POLL_MS = 500  # the input loop's longest wait: how soon a dead parent is noticed at the latest


def run_engine_core(config_data: dict[str, Any], addresses: wire.CoreAddresses, ready: Connection,
                    record_tokens: bool = False) -> None:
    """The process's entry point (a spawn target: plain, picklable arguments). `record_tokens`: keep every
    session's frames for CALL_TOKEN_LOG (token logs of tooling and tests)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = Config.model_validate(config_data)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    # Two busy threads (engine core, codec) and two I/O threads share this interpreter; see api.launch.run_server.
    sys.setswitchinterval(config.server.switch_interval_ms / 1000.0)
    try:
        from .build import build_engine_and_decoder

        engine, decoder, codec_device = build_engine_and_decoder(config)
        proc = EngineCoreProc(config, engine, decoder, codec_device, addresses,
                              frame_log=FrameLog() if record_tokens else None)
    except Exception:
        ready.send(("error", traceback.format_exc()))
        ready.close()
        raise SystemExit(1) from None
    ready.send(("ready", wire.CoreInfo(max_seq_len=engine.max_seq_len, num_slots=engine.num_slots, pid=os.getpid())))
    ready.close()
    proc.run()
    # Leave now, whatever a stuck thread is doing: the API process waits for this exit.
    logging.shutdown()
    os._exit(0)


class EngineCoreProc:
    def __init__(self, config: Config, engine: TokenEngine, decoder: StreamingDecoder, codec_device: str,
                 addresses: wire.CoreAddresses, *, frame_log: FrameLog | None = None) -> None:
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.RCVHWM, wire.SOCKET_HWM)
        self._input.setsockopt(zmq.SNDHWM, wire.SOCKET_HWM)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(addresses.input)
        # The output thread's; None once the API process it feeds has died.
        self._output_addresses = addresses.outputs
        self._outputs: list[zmq.Socket | None] = [self._new_output(address) for address in addresses.outputs]
        self._frame_log = frame_log
        self._runtime = CoreRuntime(config, engine, decoder, self._post, codec_device=codec_device,
                                    on_frames=frame_log.on_frames if frame_log is not None else None,
                                    on_event=frame_log.on_event if frame_log is not None else None)
        self._cond = threading.Condition()
        self._outbox: list[tuple[str, SessionOutput]] = []
        self._owner: dict[str, int] = {}  # session id -> API process; guarded by _cond
        self._reset_outputs: set[int] = set()  # API processes that died: their PUSH sockets are closed
        self._gone: set[int] = set()  # API processes that died and have not submitted since (main thread)
        self._reopen_outputs: set[int] = set()  # started again: a fresh PUSH socket to their address
        # Each API process's own request and gateway counters (server.api_processes > 1): every API process's
        # /v1/stats sums them. Main thread only.
        self._figures: dict[int, dict[str, Any]] = {}
        self._stopping = False
        self._engine_dead_sent = False
        self._sender = threading.Thread(target=self._send_outputs, name="core-output", daemon=True)
        self._files = _FileCalls(self._ctx, self._runtime, f"inproc://core-file-replies-{id(self)}")

    # ------------------------------------------------------------------ main thread

    def run(self) -> None:
        self._runtime.start()
        self._sender.start()
        self._files.start()
        parent = multiprocessing.parent_process()
        poller = zmq.Poller()
        poller.register(self._input, zmq.POLLIN)
        poller.register(self._files.replies, zmq.POLLIN)
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(_PARENT_POLL_MS))
                if parent is not None and parent.sentinel in events:
                    log.error("the API process is gone; stopping the engine core")
                    return
                if self._files.replies in events:
                    for identity, reply in self._files.take_replies():
                        self._reply(identity, reply)
                if self._input not in events:
                    continue
                # Everything queued now, without waiting in between.
                while True:
                    try:
                        identity, payload = self._input.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._handle(identity, wire.unpack(payload)):
                        return
        finally:
            self._halt()
            self._close()

    def _handle(self, identity: bytes, message: list[Any]) -> bool:
        """One message from an API process; True when it says stop."""
        kind = message[0]
        if kind == wire.NOTES:
            self._notes(*message[1:])
            return False
        if kind == wire.FIGURES:
            self._figures[message[1]] = message[2]
            return False
        if kind == wire.LOOP_LAG:
            self._runtime.note_gateway_lag(message[1], message[2])
            return False
        if kind == wire.API_GONE:
            self._api_gone(message[1])
            return False
        seq = message[1]
        if kind == wire.CALL_SUBMIT:
            self._reply(identity, [seq, *self._submit(message[2], message[3])])
            return False
        if kind == wire.CALL_STATS:
            # The host-time record only when asked (GET /v1/stats), not for the API side's frequent polls.
            stats = self._runtime.stats(core_cpu_s=time.process_time(), host=len(message) > 2 and bool(message[2]))
            self._reply(identity, [seq, wire.OK, wire.encode_stats(stats), list(self._figures.items())])
            return False
        if kind in wire.FILE_CALLS:
            if not self._files.put(identity, message):
                self._reply(identity, [seq, wire.FULL, f"the engine core has {_FILE_CALLS_QUEUED} adapter reads "
                                                       "queued already; try again shortly"])
            return False
        if kind == wire.CALL_TOKEN_LOG:
            entries = self._frame_log.read(message[2]) if self._frame_log is not None else {}
            self._reply(identity, [seq, wire.OK, [[sid, *entry] for sid, entry in entries.items()]])
            return False
        if kind == wire.CALL_SHUTDOWN:
            self._halt()
            self._reply(identity, [seq, wire.OK])
            return True
        log.error("unknown message kind %r from an API process; ignored", kind)
        return False

    def _notes(self, api: int, delivered: list[Any], cancels: list[str], releases: list[str]) -> None:
        """An API process's delivery notes, cancels and releases, for the sessions it owns: a session id it
        used before and released may belong to another API process by now (the same id submitted there
        after this process's session ended, before its release arrived)."""
        with self._cond:
            owner = self._owner
            delivered = [(sid, samples) for sid, samples in delivered if owner.get(sid) == api]
            cancels = [sid for sid in cancels if owner.get(sid) == api]
            for session_id in releases:
                if owner.get(session_id) == api:
                    del owner[session_id]
        for session_id, samples in delivered:
            self._runtime.note_delivered(session_id, samples)
        for session_id in cancels:
            self._runtime.cancel(session_id)
        if delivered:
            self._runtime.wake()

    def _api_gone(self, api: int) -> None:
        """API process `api` died: nobody reads its outputs any more. Its sessions are cancelled (their
        slots freed) and what is queued for it is dropped."""
        with self._cond:
            sessions = [session_id for session_id, owner in self._owner.items() if owner == api]
            for session_id in sessions:
                del self._owner[session_id]
            self._reset_outputs.add(api)
            self._reopen_outputs.discard(api)
            self._cond.notify()
        self._gone.add(api)
        for session_id in sessions:
            self._runtime.cancel(session_id)
        self._figures.pop(api, None)
        log.error("API process %d is gone; cancelled its %d sessions", api, len(sessions))

    def _submit(self, api: int, fields: list[Any]) -> list[Any]:
        request = wire.decode_request(fields)
        if api in self._gone:  # started again in its place (api/process_group.py): its outputs flow again
            self._gone.discard(api)
            with self._cond:
                self._reopen_outputs.add(api)
        with self._cond:  # owner first: the engine core thread may post its first output before submit returns
            previous = self._owner.get(request.request_id)
            self._owner[request.request_id] = api
        try:
            self._runtime.submit(request)
        except SchedulerFullError as exc:
            refusal = [wire.FULL, str(exc), exc.retry_after_s]
        except InvalidSessionError as exc:
            refusal = [wire.INVALID, str(exc), exc.param]
        except ServiceUnavailableError as exc:
            refusal = [wire.UNAVAILABLE, str(exc), None]
        else:
            return [wire.OK]
        with self._cond:  # refused: a live session of the same id (InvalidSessionError) keeps its owner
            if previous is None:
                del self._owner[request.request_id]
            else:
                self._owner[request.request_id] = previous
        return refusal

    def _reply(self, identity: bytes, message: list[Any]) -> None:
        try:
            self._input.send_multipart([identity, wire.pack(message)], zmq.NOBLOCK)
        except zmq.Again:
            log.error("an API process does not read its replies; one reply dropped")

    def _halt(self) -> None:
        """Stop the engine core and codec, then the output thread once it has sent what they left."""
        if self._stopping:
            return
        self._files.stop()
        self._runtime.shutdown()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._sender.join(5.0)

    def _close(self) -> None:
        if self._sender.is_alive():
            log.error("the output thread is stuck sending to an API process that does not read; leaving it")
            return
        if self._files.alive:
            log.error("the file thread is stuck reading an adapter; leaving it")
            return
        self._files.replies.close(0)
        self._input.close(0)
        for out in self._outputs:
            if out is not None:
                out.close()  # LINGER: the last outputs still go out
        self._ctx.term()

    # ------------------------------------------- from the engine core and codec threads

    def _post(self, session_id: str, item: SessionOutput) -> None:
        with self._cond:
            self._outbox.append((session_id, item))
            if len(self._outbox) == 1:
                self._cond.notify()

    # ------------------------------------------------------------------ output thread

    def _new_output(self, address: str) -> zmq.Socket:
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDHWM, wire.SOCKET_HWM)
        out.setsockopt(zmq.LINGER, 1000)
        out.connect(address)
        return out

    def _send_outputs(self) -> None:
        name_os_thread("core-output")
        while True:
            with self._cond:
                while not self._outbox and not self._stopping and not self._reset_outputs:
                    self._cond.wait()
                resets, self._reset_outputs = self._reset_outputs, set()
                reopens, self._reopen_outputs = self._reopen_outputs, set()
                items, self._outbox = self._outbox, []
                stopping = self._stopping
                batches: dict[int, list[list[Any]]] = {}
                for session_id, item in items:
                    api = self._owner.get(session_id)
                    if api is None:
                        continue  # released or never ours: its client has gone
                    batches.setdefault(api, []).append(wire.encode_output(session_id, item))
            for api in resets:
                # A dead API process's socket: what it queued is for sessions that no longer exist, and a send
                # to it would block this thread at the high-water mark. Nothing is sent there again until a
                # process started in its place submits (api/process_group.py).
                out = self._outputs[api]
                if out is not None:
                    out.close(0)
                    self._outputs[api] = None
            for api in reopens:
                if self._outputs[api] is None:
                    self._outputs[api] = self._new_output(self._output_addresses[api])
            if not self._engine_dead_sent and not self._runtime.engine_alive:
                # Every API process learns at once (its /ready, its submits), whoever's sessions failed.
                self._engine_dead_sent = True
                failure = self._runtime.engine_failure
                for api in range(len(self._outputs)):
                    batches.setdefault(api, []).append(wire.encode_engine_dead(failure))
            for api, batch in batches.items():
                out = self._outputs[api]
                if out is None:
                    continue
                # Blocks at the high-water mark: an API process that does not read holds this thread, and
                # flow control then holds the sessions (their delivery notes stop).
                out.send(wire.pack(batch))
            if stopping:
                return


_FILE_CALLS_QUEUED = 64  # file calls waiting for the file thread at most; more are refused (FULL)


class _FileCalls:
    """The engine-core process's file thread: wire.FILE_CALLS run here one at a time, in arrival order, and
    their answers go back to the input thread over an inproc socket (a ZeroMQ socket has one user; the
    input thread's ROUTER sends them on)."""

    def __init__(self, ctx: zmq.Context, runtime: CoreRuntime, address: str) -> None:
        self._runtime = runtime
        self._calls: queue.Queue[tuple[bytes, list[Any]] | None] = queue.Queue(maxsize=_FILE_CALLS_QUEUED)
        self.replies = ctx.socket(zmq.PULL)  # the input thread's
        self.replies.setsockopt(zmq.LINGER, 0)
        self.replies.bind(address)
        self._push = ctx.socket(zmq.PUSH)  # the file thread's alone, from its start
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._thread = threading.Thread(target=self._run, name="core-files", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def put(self, identity: bytes, message: list[Any]) -> bool:
        """Queue one call from the input thread; False when too many are queued."""
        try:
            self._calls.put_nowait((identity, message))
        except queue.Full:
            return False
        return True

    def take_replies(self) -> list[tuple[bytes, list[Any]]]:
        """The answers ready now (input thread)."""
        replies = []
        while True:
            try:
                identity, payload = self.replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return replies
            replies.append((identity, wire.unpack(payload)))

    def stop(self) -> None:
        """Let the call being run finish (a read cannot be interrupted) and drop the rest."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._calls.get_nowait()
        self._calls.put(None)
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        name_os_thread("core-files")
        try:
            while (call := self._calls.get()) is not None:
                identity, message = call
                self._push.send_multipart([identity, wire.pack(self._answer(message))])
        finally:
            self._push.close(0)

    def _answer(self, message: list[Any]) -> list[Any]:
        kind, seq = message[0], message[1]
        try:
            if kind == wire.CALL_PREFETCH:
                self._runtime.prefetch_adapter(message[2])
                return [seq, wire.OK, None]
            return [seq, wire.OK, self._runtime.adapters(message[2], message[3])]
        except (AdapterError, InvalidSessionError) as exc:
            return [seq, wire.INVALID, str(exc)]
