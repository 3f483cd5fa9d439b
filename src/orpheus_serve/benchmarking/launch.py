"""Start a server as a subprocess for a benchmark run, wait for /ready, stop it.

The benchmark client and the server run in separate processes so the client's
work does not share the server's interpreter; on this project's small CI
machines they still share cores, so compare numbers from one run only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchedServer:
    overrides: list[str]
    config: str | None = None
    ready_timeout_s: float = 300.0
    log_path: Path | None = None
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    # CPUs the server's processes may run on (its engine-core process inherits them); None: any. Pinning the
    # server to one core shows what admission does on a host with less CPU than the one it was tuned on.
    cpus: tuple[int, ...] | None = None
    _log: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        cmd = [sys.executable, str(REPO_ROOT / "production_server.py"), "--host", "127.0.0.1",
               "--port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        if self.config:
            cmd += ["--config", self.config]
        for item in self.overrides:
            cmd += ["--set", item]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        if self.cpus is not None:
            # taskset(1), not a preexec_fn (unsafe beside threads): the affinity holds for the server and every
            # process it starts.
            cmd = ["taskset", "--cpu-list", ",".join(map(str, self.cpus)), *cmd]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode} before /ready "
                                       f"(log: {self.log_path or 'not kept'})")
                try:
                    if client.get(f"{self.url}/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.25)  # a readiness probe, like any orchestrator's
        self.stop()
        raise TimeoutError(f"server not ready within {self.ready_timeout_s:.0f} s")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/stats", timeout=10.0).json()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if hasattr(self._log, "close"):
            self._log.close()
        self._log = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

