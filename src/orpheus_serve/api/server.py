"""One process, one asyncio loop: uvicorn (HTTP + WebSocket) and grpc.aio in front of one TTSService.

With `server.engine_process` the service's engine core runs in a process of its own, which this
one starts and supervises (mp_client.py); if it dies for good the server stops with exit code 1.
With `server.api_processes` > 1 this process (API process 0) also starts and supervises the other
API processes, each an OrpheusServer of its own on the same ports (api_processes.py).

Start-up order: bind both ports (so /health answers and /ready says
`warming_up` at once), then `service.start()` warms the model, then /ready and
the gRPC health service turn to serving. Shutdown (SIGTERM/SIGINT in
production_server.py, or `OrpheusServer.shutdown()`): stop admitting (new
requests get 503 / UNAVAILABLE), let in-flight streams finish within
server.shutdown_grace_s, cancel the rest, then close the listeners.

`OrpheusServer` is usable in-process with port 0 (tests, benchmarks): the
bound ports are in `http_port` / `grpc_port` once `start()` returns.
`ServerThread` runs one on a loop of its own in a background thread, for
synchronous callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import uvicorn

from ..config import Config
from ..stats import api_process_figures
from .cartesia import add_cartesia_route
from .gateway import Gateway
from .grpc_server import GrpcGateway
from .http import create_app
from .riva import RivaSpeechSynthesisService
from .websocket import WebSocketProtocol

if TYPE_CHECKING:
    from ..mp_client import MPClient
    from ..service import TTSService
    from .api_processes import ApiProcessGroup

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long uvicorn waits for connections after the service has drained: only idle keep-alives are left by then.
_LISTENER_CLOSE_S = 2.0


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
    def __init__(self, config: Config, service: TTSService | None = None, *, api_index: int = 0) -> None:
        if service is None:
            from ..service import TTSService

            service = TTSService.from_config(config)
        self.config = config
        self.service = service
        self.api_index = api_index
        self.gateway = Gateway(service, config)
        self._api_group: ApiProcessGroup | None = None
        client = self._shared_core_client()
        if client is not None:
            self._share_counters(client)
        self.gateway.connection_resetter = self._reset_connection
        self.app = create_app(service, config, gateway=self.gateway)
        add_cartesia_route(self.app, self.gateway)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._uvicorn: _UvicornServer | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self._grpc: GrpcGateway | None = None
        self._shutdown: asyncio.Task[None] | None = None
        self.exit_code = 0  # 1 when the server stopped because its engine core (or an API process) died
        self._stop = asyncio.Event()  # set by SIGTERM/SIGINT or request_stop(): serve_until_signalled stops

    def _shared_core_client(self) -> MPClient | None:
        """The service's multiprocess client when several API processes share its engine core, else None.

        mp_client (and with it zmq) is imported only then: a server whose engine core runs in this
        process never needs ZeroMQ, so it starts where pyzmq is not installed."""
        if self.config.server.api_processes <= 1:
            return None
        from ..mp_client import MPClient

        client = getattr(self.service, "client", None)
        return client if isinstance(client, MPClient) else None

    def _share_counters(self, client: MPClient) -> None:
        """Every API process's /v1/stats sums all of their counters (api_processes.py)."""
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
            ws_max_size=server_cfg.max_body_bytes, timeout_graceful_shutdown=_LISTENER_CLOSE_S,
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
        client = self._shared_core_client()
        if self.api_index == 0 and client is not None:
            # The other API processes warm up first: once this one is ready, all are.
            from .api_processes import ApiProcessGroup

            assert self.http_port is not None and self.grpc_port is not None
            self._api_group = ApiProcessGroup(self.config, client)
            await self._api_group.start(self.http_port, self.grpc_port)
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
        if self._api_group is not None:
            # This process's streams go on meanwhile; the core stops only after every API process is done.
            started = asyncio.get_running_loop().time()
            await self._api_group.stop(grace)
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
                if self._api_group is not None:
                    waits.append(asyncio.ensure_future(self._api_group.failed.wait()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits:
                        waiting.cancel()
                if fatal is not None and fatal.is_set():
                    log.critical("the engine core is gone and is not restarted; stopping with exit code 1")
                    self.exit_code = 1
                if self._api_group is not None and self._api_group.failed.is_set():
                    log.critical("an API process died; stopping with exit code 1")
                    self.exit_code = 1
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)


def run_server(config: Config) -> int:
    """Build the service from config and serve until a signal (production_server.py)."""
    # The engine, codec and event-loop threads hand the interpreter lock to each other many
    # times per decode step; Python's default 5 ms switch interval would add up to that much
    # to every step a thread waits for. A process-wide setting, so it is made here, once.
    sys.setswitchinterval(config.server.switch_interval_ms / 1000.0)
    server = OrpheusServer(config)
    asyncio.run(server.serve_until_signalled())
    return server.exit_code


class ServerThread:
    """An OrpheusServer on its own event loop in a background thread (tests, benchmarks, notebooks).

        with ServerThread(config, service) as server:
            httpx.get(f"http://127.0.0.1:{server.http_port}/ready")
    """

    def __init__(self, config: Config, service: TTSService | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="orpheus-server", daemon=True)
        self._thread.start()
        self.server: OrpheusServer = self.call(self._build(config, service))

    @staticmethod
    async def _build(config: Config, service: TTSService | None) -> OrpheusServer:
        # Built on the server's loop: the service may bind loop-affine state in its constructor.
        return OrpheusServer(config, service)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 120.0) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def http_port(self) -> int:
        assert self.server.http_port is not None
        return self.server.http_port

    @property
    def grpc_port(self) -> int:
        assert self.server.grpc_port is not None
        return self.server.grpc_port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> ServerThread:
        self.call(self.server.start())
        return self

    def stop(self, grace_s: float | None = None) -> None:
        try:
            self.call(self.server.shutdown(grace_s))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()

    def __enter__(self) -> ServerThread:
        try:
            return self.start()
        except BaseException:
            self.stop(0)
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
