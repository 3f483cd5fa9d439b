"""How a server is started: one API process, or API process 0 of N in front of one engine core.

`build_server` is the one place that decides. With `server.api_processes` > 1 (which needs
`server.engine_process`) the service's client is an `MPClient`: this process then shares its counters
with the others and starts and supervises API processes 1..N-1 (process_group.py) as the server's peers.
`run_server` is the production entry point (production_server.py); `ServerThread` runs a server on a loop
of its own in a background thread, for synchronous callers (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..config import Config
from ..core.mp_client import MPClient
from ..service.build import build_service
from ..service.service import TTSService
from .process_group import ApiProcessGroup
from .server import OrpheusServer

T = TypeVar("T")


def build_server(config: Config, service: TTSService | None = None) -> OrpheusServer:
    """API process 0's server: the service built from config unless given, and, with several API processes,
    the others as its peers."""
    if service is None:
        service = build_service(config)
    client = getattr(service, "client", None)  # a stand-in service (tests) may have none
    if config.server.api_processes > 1 and isinstance(client, MPClient):
        server = OrpheusServer(config, service, peers=ApiProcessGroup(config, client))
        server.share_counters(client)
        return server
    return OrpheusServer(config, service)


def run_server(config: Config) -> int:
    """Build the service from config and serve until a signal (production_server.py)."""
    # The engine, codec and event-loop threads hand the interpreter lock to each other many
    # times per decode step; Python's default 5 ms switch interval would add up to that much
    # to every step a thread waits for. A process-wide setting, so it is made here, once.
    sys.setswitchinterval(config.server.switch_interval_ms / 1000.0)
    server = build_server(config)
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
        return build_server(config, service)

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
