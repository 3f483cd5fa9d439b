"""Helpers for the ElevenLabs client tests: a TLS relay for clients that only speak wss://.

The `elevenlabs` SDK's realtime client rewrites its base URL to `wss://` whatever it was given, so in a test
it reaches the server through this relay: TLS with a self-signed certificate for 127.0.0.1 (made by the
`openssl` command), forwarding bytes to the server's plain port. The client trusts the certificate through
`SSL_CERT_FILE`, which OpenSSL reads when a default context loads its verify paths.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from pathlib import Path

import pytest


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) for IP 127.0.0.1 and localhost; skips the test where `openssl` is missing."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate for the TLS relay")
    cert, key = folder / "relay.pem", folder / "relay.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


class TlsRelay:
    """wss://127.0.0.1:`port` -> ws://127.0.0.1:`target_port`, on an event loop in a thread of its own."""

    def __init__(self, target_port: int, cert: Path, key: Path) -> None:
        self.target_port = target_port
        self.cert = cert
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert, key)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-relay", daemon=True)
        self.port = 0

    def start(self) -> TlsRelay:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the TLS relay did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self._context))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._server.close()
        relays = asyncio.all_tasks(self._loop)
        for task in relays:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*relays, return_exceptions=True))
        self._loop.close()

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        server_in, server_out = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, ssl.SSLError):
                pass  # the other side went away: closing below ends both directions
            finally:
                sink.close()

        await asyncio.gather(pipe(client_in, server_out), pipe(server_in, client_out))
