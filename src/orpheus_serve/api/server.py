"""One process, one asyncio loop: uvicorn (HTTP + WebSocket) and grpc.aio in front of one TTSService.

With `server.engine_process` the service's engine core runs in a process of its own, which the
service's client starts and supervises (core/mp_client.py); if it dies for good the server stops with
exit code 1. With `server.api_processes` > 1, API process 0 also starts and supervises the other API
processes (its `peers`), each an OrpheusServer of its own on the same ports: launch.py decides which
(ARCHITECTURE §7); this module knows neither the process group nor the multiprocess client.

Start-up order: bind both ports (so /health answers and /ready says
`warming_up` at once), then `service.start()` warms the model, then /ready and
the gRPC health service turn to serving. Shutdown (SIGTERM/SIGINT in
production_server.py, or `OrpheusServer.shutdown()`): stop admitting (new
requests get 503 / UNAVAILABLE), let in-flight streams finish within
server.shutdown_grace_s, cancel the rest, then close the listeners.

`OrpheusServer` is usable in-process with port 0 (tests, benchmarks): the
bound ports are in `http_port` / `grpc_port` once `start()` returns.
`launch.ServerThread` runs one on a loop of its own in a background thread,
for synchronous callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import struct
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import uvicorn

from ..config import Config
from ..metrics.stats import api_process_figures
from .gateway import Gateway
from .grpc_server import GrpcGateway
from .http import create_app
from .riva import RivaSpeechSynthesisService
from .websocket import WebSocketProtocol

if TYPE_CHECKING:
    from ..service.service import TTSService

log = logging.getLogger(__name__)

# How long uvicorn waits for connections after the service has drained: only idle keep-alives are left by then.
_LISTENER_CLOSE_S = 2.0


class ApiPeers(Protocol):
    """The other API processes that API process 0 starts and stops (api.process_group.ApiProcessGroup)."""

    failed: asyncio.Event  # set when one died and is not started again: the server stops with exit code 1

    async def start(self, http_port: int, grpc_port: int) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


class CounterRelay(Protocol):
    """Carries each API process's own counters to the others (core.mp_client.MPClient)."""

    figures_source: Callable[[], dict[str, Any]] | None
    api_figures: dict[int, dict[str, Any]]

    def stats(self) -> Any: ...


class _UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Signals belong to OrpheusServer, which drains the service before uvicorn stops.
        yield


def _bind(host: str, port: int, send_buffer_bytes: int | None = None, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # several API processes on one port (server.api_processes): the kernel spreads connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if send_buffer_bytes:
        # Inherited by every accepted connection. Without it the kernel grows a connection's send buffer
        # to megabytes (a minute and more of PCM) for a client that does not read: memory the flow control
        # cannot see, and a stall it cannot detect until that buffer is full.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def tiny_model_banner(info: Any) -> str:
    warning = info.warning or "the audio is noise, not speech"
    line = "!" * 78
    return (f"\n{line}\n!! SERVING THE TINY RANDOM-WEIGHT MODEL ({info.model_path}): {warning}\n"
            f"!! Put real weights in models/ (scripts/download_models.py) to serve speech.\n{line}")


class OrpheusServer:
    """One API process's listeners in front of its `TTSService`. `peers`: the other API processes, when this
    is API process 0 of several (launch.build_server); they start before this one warms up and stop first."""

    def __init__(self, config: Config, service: TTSService, *, api_index: int = 0,
                 peers: ApiPeers | None = None) -> None:
        self.config = config
        self.service = service
        self.api_index = api_index
        self.gateway = Gateway(service, config)
        self._peers = peers
        self.gateway.connection_resetter = self._reset_connection
        self.app = create_app(service, config, gateway=self.gateway)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._uvicorn: _UvicornServer | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self._grpc: GrpcGateway | None = None
        self._shutdown: asyncio.Task[None] | None = None
        self.exit_code = 0  # 1 when the server stopped because its engine core (or an API process) died
        self._stop = asyncio.Event()  # set by SIGTERM/SIGINT or request_stop(): serve_until_signalled stops

    def share_counters(self, client: CounterRelay) -> None:
        """Every API process's /v1/stats sums all of their counters (server.api_processes > 1)."""
        tally = self.service.tally
        metrics = self.gateway.metrics

        def own() -> dict[str, Any]:
            return api_process_figures(tally, self.gateway.figures(), metrics.samples())

        def every() -> tuple[int, dict[int, dict[str, Any]]]:
            return self.api_index, {**client.api_figures, self.api_index: own()}

        def peers() -> list[dict[str, Any]]:
            client.stats()  # the core's latest copy of every process's counters
            return [figures for index, figures in client.api_figures.items() if index != self.api_index]

        client.figures_source = own
        self.gateway.api_processes = every
        metrics.peer_figures = peers
        metrics.api_process_figures = lambda: every()[1]

    @property
    def host(self) -> str:
        return self.config.server.host

    async def open_listeners(self) -> None:
        """Bind and serve HTTP/WebSocket and gRPC; /ready and gRPC health say not-ready until `start()`."""
        server_cfg = self.config.server
        info = self.service.model_info
        if info.tiny:
            log.warning(tiny_model_banner(info))
        sock = _bind(server_cfg.host, server_cfg.http_port, server_cfg.socket_send_buffer_bytes,
                     reuse_port=server_cfg.api_processes > 1)
        self.http_port = sock.getsockname()[1]
        uv_config = uvicorn.Config(
            self.app, log_level=server_cfg.log_level, log_config=None, lifespan="off", ws=WebSocketProtocol,
            ws_max_size=self.config.ws_message_bytes, timeout_graceful_shutdown=_LISTENER_CLOSE_S,
            access_log=server_cfg.log_level == "debug")
        self._uvicorn = _UvicornServer(uv_config)
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]), name="uvicorn")
        self._grpc = GrpcGateway(self.gateway, server_cfg.host, server_cfg.grpc_port)
        RivaSpeechSynthesisService(self.gateway).register(self._grpc)  # Riva's TTS API on the same port
        self.grpc_port = self._grpc.port
        await self._grpc.start()
        log.info("listening: HTTP/WebSocket on %s:%d, gRPC on %s:%d (model %s, backend %s); warming up",
                 server_cfg.host, self.http_port, server_cfg.host, self.grpc_port, info.id, info.backend)

    def _reset_connection(self, client: Any) -> bool:
        """Reset the HTTP/WebSocket connection whose peer is `client` (an ASGI scope's (host, port)).

        uvicorn only closes connections gracefully: the socket stays open until its unsent bytes are
        written, so a client that stopped reading would keep it, its kernel buffers and the transport's
        write buffer for as long as it likes. Linger 0 then abort: the socket is closed at once with a
        reset, and its buffers are freed."""
        if self._uvicorn is None:
            return False
        address = tuple(client)
        for protocol in list(self._uvicorn.server_state.connections):
            transport = getattr(protocol, "transport", None)
            if getattr(protocol, "client", None) != address or transport is None:
                continue
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return True
        return False

    async def start(self) -> None:
        """Open the listeners (unless open), then warm the service up; returns once /ready is true."""
        if self._uvicorn_task is None:
            await self.open_listeners()
        assert self._uvicorn_task is not None and self._grpc is not None
        if self._peers is not None:
            # The other API processes warm up first: once this one is ready, all are.
            assert self.http_port is not None and self.grpc_port is not None
            await self._peers.start(self.http_port, self.grpc_port)
        await self.service.start()
        # Starlette streams every response through anyio, whose asyncio backend loads on first use: load it
        # now rather than inside the first client's time to first byte (hundreds of ms on a busy disk).
        await anyio.sleep(0)
        if self._uvicorn_task.done():
            # uvicorn failed to start: surface its error instead of serving gRPC alone.
            await self._uvicorn_task
        await self._grpc.set_serving(True)
        log.info("ready to serve")

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Graceful stop; concurrent and repeated calls share one shutdown."""
        if self._shutdown is None:
            self._shutdown = asyncio.create_task(self._do_shutdown(grace_s), name="shutdown")
        await asyncio.shield(self._shutdown)

    async def _do_shutdown(self, grace_s: float | None) -> None:
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: no new requests; in-flight streams get %.1fs to finish", grace)
        self.gateway.shutting_down = True
        if self._grpc is not None:
            await self._grpc.set_serving(False)
        if self._peers is not None:
            # This process's streams go on meanwhile; the core stops only after every API process is done.
            started = asyncio.get_running_loop().time()
            await self._peers.stop(grace)
            grace = max(0.0, grace - (asyncio.get_running_loop().time() - started))
        await self.service.shutdown(grace)
        # The service has finished or cancelled every session; let the gateway write what is left.
        if not await self.gateway.wait_idle(_LISTENER_CLOSE_S):
            log.warning("streams still open %.1fs after the service drained; closing them", _LISTENER_CLOSE_S)
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True
            await self._uvicorn_task
        if self._grpc is not None:
            await self._grpc.stop(_LISTENER_CLOSE_S)
        self.gateway.close()
        log.info("stopped")

    async def __aenter__(self) -> OrpheusServer:
        try:
            await self.start()
        except BaseException:
            await self.shutdown(0)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def request_stop(self) -> None:
        """Begin the graceful stop of `serve_until_signalled` (as SIGTERM does)."""
        self._stop.set()

    async def serve_until_signalled(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully (the production entry point).
        `on_ready` is called once the server serves."""
        loop = asyncio.get_running_loop()
        stop = self._stop

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                log.warning("%s again: already shutting down", sig.name)
                return
            log.info("%s received", sig.name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        # An engine core in its own process that died and is not restarted (server.restart_core: false).
        fatal: asyncio.Event | None = getattr(self.service.client, "fatal", None)
        try:
            async with self:
                if on_ready is not None:
                    on_ready()
                waits = [asyncio.ensure_future(stop.wait())]
                if fatal is not None:
                    waits.append(asyncio.ensure_future(fatal.wait()))
                if self._peers is not None:
                    waits.append(asyncio.ensure_future(self._peers.failed.wait()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits:
                        waiting.cancel()
                if fatal is not None and fatal.is_set():
                    log.critical("the engine core is gone and is not restarted; stopping with exit code 1")
                    self.exit_code = 1
                if self._peers is not None and self._peers.failed.is_set():
                    log.critical("an API process died; stopping with exit code 1")
                    self.exit_code = 1
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
