"""More than one API process in front of one engine core (`server.api_processes`, vLLM's --api-server-count).

One interpreter serves HTTP, WebSocket, gRPC and audio encoding for every
stream; past a few hundred streams that loop is the bottleneck even with the
engine core in a process of its own. With `server.api_processes: N` (which
needs `server.engine_process`) N API processes share the listening ports and
the one core:

    API process 0 (production_server.py)        engine-core process (core/process.py)
      owns and supervises the core ─── ROUTER input, PUSH output-0 ──────▶ │
      spawns and supervises API 1..N-1 ─ pipe: ready / stop / core down, up │
    API process i (spawned)                                                 │
      MPClient.attach(): DEALER -> the same ROUTER, PULL output-i ◀─────────┘

- **Ports**: every process binds the HTTP and gRPC ports itself with
  SO_REUSEPORT (Linux); the kernel spreads new connections across them.
  Process 0 binds first (a port of 0 resolves there) and hands the ports on.
- **Start-up**: process 0 builds the core, opens its listeners, starts API
  processes 1..N-1 and waits until each has warmed up through the core, then
  warms up itself; so once process 0's /ready is 200, every process serves.
- **Core death**: process 0 watches the core, as with one API process; it
  tells the others (`down`), whose open streams fail with the same
  `engine_unavailable` error and whose /ready turns 503, and once the new core
  is warmed up (`up`) they open a fresh call socket (the ipc paths stay the
  same: their output sockets stay bound) and serve again.
- **An API process dies**: its clients' connections break with it; process 0
  tells the core, which cancels its sessions and drops the outputs queued for
  it, and starts a new process with the same index in its place (the kernel
  sends new connections to the others meanwhile). The core sends to that
  index again once the new process submits (its warm-up). More than
  CRASH_LOOP_RESTARTS deaths within CRASH_LOOP_S (core/crash_loop.py), or
  `server.restart_api_processes: false`, stop the server instead: the other
  processes drain and process 0 exits with code 1, for the orchestrator.
- **Shutdown**: SIGTERM/SIGINT to process 0 (or to the whole group) stops
  admission everywhere; the others drain their streams while process 0 drains
  its own, then process 0 stops the core.
- **Stats**: each process sends its own request and gateway counters to the
  core when they change (at most every quarter second, mp_client.py); the
  core returns all of them with every stats answer, so /v1/stats in any
  process sums them (`stats.merge_api_processes`) and lists them per process
  (`api_processes`, with `api_process_index` for the one that answered);
  `process.cpu_s` is every API process's CPU time plus the core's. /metrics
  adds the others' Prometheus counters, histograms and gateway gauges to its
  own the same way (they travel with those counters). The engine part of both
  is the core's, the same everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import sys
import traceback
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from typing import Any

from ..config import Config
from ..core.build import resolve_models
from ..core.crash_loop import CrashLoopGuard
from ..core.mp_client import MPClient
from ..core.wire import CoreAddresses, CoreInfo
from ..service.build import load_tokenizer
from ..service.service import TTSService
from .server import OrpheusServer

log = logging.getLogger(__name__)

_READY_S = 180.0  # an API process's start: imports, tokenizer, warm-up through the core
_STOP_MARGIN_S = 15.0  # after the drain grace: closing listeners, interpreter exit


class ApiProcessGroup:
    """API processes 1..N-1, started and supervised by API process 0 (see the module docstring)."""

    def __init__(self, config: Config, client: MPClient) -> None:
        self._config = config
        self._client = client
        self._processes: dict[int, tuple[multiprocessing.process.BaseProcess, Connection]] = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._config_data: dict[str, Any] = {}
        self._crash_loop = CrashLoopGuard()  # the same guard as the engine core's
        self._restarts: set[asyncio.Task[None]] = set()
        self.restarts = 0
        # Set when an API process died and is not started again: the server stops with exit code 1.
        self.failed = asyncio.Event()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process, _ in self._processes.values() if process.pid is not None]

    async def start(self, http_port: int, grpc_port: int) -> None:
        """Start API processes 1..N-1 on the bound ports and wait until each serves."""
        self._loop = asyncio.get_running_loop()
        data = self._config.model_dump(mode="json")
        data["server"]["http_port"] = http_port
        data["server"]["grpc_port"] = grpc_port
        self._config_data = data
        for index in range(1, self._config.server.api_processes):
            self._spawn(index)
        for index, (process, conn) in self._processes.items():
            await self._loop.run_in_executor(None, _wait_ready, index, process, conn)
            self._loop.add_reader(process.sentinel, self._on_exit, index)
        self._client.core_listeners.append(self._core_event)
        log.info("%d more API processes serving (pids %s)", len(self._processes), self.pids)

    def _spawn(self, index: int) -> None:
        assert self._client.info is not None
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=run_api_process, name=f"orpheus-api-{index}", daemon=True,
            args=(self._config_data, index, self._client.addresses, self._client.info, theirs))
        process.start()
        theirs.close()
        self._processes[index] = (process, ours)

    def _core_event(self, event: str, detail: Any) -> None:
        """The core died ("down", reason) or is back ("up", CoreInfo): tell every API process."""
        for index, (process, conn) in self._processes.items():
            if process.is_alive():
                try:
                    conn.send((event, detail))
                except OSError as exc:  # it died just now; _on_exit handles that
                    log.error("API process %d did not take the core's state: %s", index, exc)

    def _on_exit(self, index: int) -> None:
        assert self._loop is not None
        process, _ = self._processes[index]
        self._loop.remove_reader(process.sentinel)
        process.join(1.0)
        if self._stopping:
            return
        self._client.api_gone(index)
        restart_allowed = self._crash_loop.died()
        if not self._config.server.restart_api_processes or not restart_allowed:
            why = ("server.restart_api_processes is off" if not self._config.server.restart_api_processes else
                   f"API processes died: {self._crash_loop}")
            log.critical("API process %d (pid %s) died with exit code %s; its streams are cancelled and the server "
                         "stops (%s)", index, process.pid, process.exitcode, why)
            self.failed.set()
            return
        log.error("API process %d (pid %s) died with exit code %s; its streams are cancelled; starting it again",
                  index, process.pid, process.exitcode)
        task = self._loop.create_task(self._restart(index), name=f"api-process-{index}-restart")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, index: int) -> None:
        assert self._loop is not None
        self._processes[index][1].close()
        self._spawn(index)
        process, conn = self._processes[index]
        try:
            await self._loop.run_in_executor(None, _wait_ready, index, process, conn)
        except RuntimeError as exc:
            if not self._stopping:
                log.critical("API process %d could not be started again (%s); the server stops", index, exc)
                self.failed.set()
            return
        if self._stopping:
            return  # stop() sent it the stop request with the others
        self._loop.add_reader(process.sentinel, self._on_exit, index)
        self.restarts += 1
        log.info("API process %d is serving again (pid %s)", index, process.pid)

    async def stop(self, grace_s: float) -> None:
        """Let every API process drain its streams (within `grace_s`) and exit; kill what does not."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        for index, (process, conn) in self._processes.items():
            loop.remove_reader(process.sentinel)
            if process.is_alive():
                try:
                    conn.send(("stop", grace_s))
                except OSError as exc:
                    log.error("API process %d did not take the stop request: %s", index, exc)
        for index, (process, conn) in self._processes.items():
            await loop.run_in_executor(None, process.join, grace_s + _STOP_MARGIN_S)
            if process.is_alive():
                log.error("API process %d did not stop in time; killing it", index)
                process.kill()
                await loop.run_in_executor(None, process.join)
            elif process.exitcode:
                log.error("API process %d exited with code %s", index, process.exitcode)
            conn.close()


def _wait_ready(index: int, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
    if not wait_for_any([conn, process.sentinel], _READY_S):
        process.kill()
        raise RuntimeError(f"API process {index} did not start within {_READY_S:.0f} s")
    try:
        status, detail = conn.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"API process {index} exited with code {process.exitcode} before it was ready") from None
    if status != "ready":
        process.join(5.0)
        raise RuntimeError(f"API process {index} failed to start:\n{detail}")


# ---------------------------------------------------------------- in API process i > 0


def run_api_process(config_data: dict[str, Any], index: int, addresses: CoreAddresses, info: CoreInfo,
                    conn: Connection) -> None:
    """API process `index`'s entry point (a spawn target)."""
    config = Config.model_validate(config_data)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api-{index} %(name)s: %(message)s")
    sys.setswitchinterval(config.server.switch_interval_ms / 1000.0)
    try:
        code = asyncio.run(_serve(config, index, addresses, info, conn))
    except BaseException:
        # OSError: API process 0 is gone; the traceback is in this process's log below.
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise
    sys.exit(code)


async def _serve(config: Config, index: int, addresses: CoreAddresses, info: CoreInfo, conn: Connection) -> int:
    resolved = resolve_models(config)
    config = resolved.config
    tokenizer = load_tokenizer(resolved.tokenizer_path)
    client = MPClient.attach(config, addresses, info, api_index=index)
    service = TTSService(config, client=client, tokenizer=tokenizer, model_info=resolved.info,
                         max_seq_len=info.max_seq_len)
    server = OrpheusServer(config, service, api_index=index)
    server.share_counters(client)
    loop = asyncio.get_running_loop()

    def on_message() -> None:
        try:
            event, detail = conn.recv()
        except EOFError:
            loop.remove_reader(conn.fileno())
            log.error("API process 0 is gone; stopping")
            server.request_stop()
            return
        if event == "stop":
            server.request_stop()
        elif event == "down":
            client.core_down(detail)
        elif event == "up":
            client.core_up(detail)
        else:
            log.error("unknown message %r from API process 0; ignored", event)

    loop.add_reader(conn.fileno(), on_message)
    try:
        await server.serve_until_signalled(on_ready=lambda: conn.send(("ready", None)))
    finally:
        loop.remove_reader(conn.fileno())
    return server.exit_code
