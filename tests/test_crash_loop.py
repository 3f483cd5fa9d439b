"""The crash-loop cap (core/crash_loop.py, ARCHITECTURE §9): a process that keeps dying is not started again,
and the server exits 1 for its orchestrator to act on. For the engine-core process and for an API process,
on a real server in a subprocess: each process is killed, started again CRASH_LOOP_RESTARTS times, and the
death after those ends the server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from orpheus_serve.benchmarking.launch import LaunchedServer
from orpheus_serve.core.crash_loop import CRASH_LOOP_RESTARTS
from tests.gateway_support import wait_for

pytestmark = pytest.mark.slow  # four process restarts each: about a minute on two loaded cores


def _launch(tiny_orpheus: Path, tmp_path: Path, **extra: Any) -> LaunchedServer:
    settings = {
        "engine.backend": "sim", "engine.model_path": tiny_orpheus, "codec.decoder": "sim",
        "codec.path": tiny_orpheus.parent / "tiny-snac", "server.engine_process": "true",
        "server.shutdown_grace_s": 1.0, "server.log_level": "info", **extra,
    }
    launched = LaunchedServer([f"{key}={value}" for key, value in settings.items()], ready_timeout_s=120,
                              log_path=tmp_path / "server.log")
    launched.start()
    return launched


def _stats(launched: LaunchedServer) -> dict[str, Any] | None:
    """/v1/stats over a new connection, or None while nothing answers (an API process being restarted)."""
    try:
        with httpx.Client(timeout=10.0) as client:
            return client.get(f"{launched.url}/v1/stats").json()
    except httpx.TransportError:
        return None


def _exit_code(launched: LaunchedServer, what: str) -> int:
    assert launched.process is not None
    try:
        return launched.process.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server kept running after {what} died {CRASH_LOOP_RESTARTS + 1} times")


def test_a_core_that_keeps_dying_is_not_started_again_and_the_server_exits_1(tiny_orpheus: Path,
                                                                            tmp_path: Path) -> None:
    launched = _launch(tiny_orpheus, tmp_path)
    try:
        snapshot = launched.stats()
        for death in range(CRASH_LOOP_RESTARTS + 1):
            core_pid = snapshot["process"]["engine_core_pid"]
            os.kill(core_pid, signal.SIGKILL)
            if death == CRASH_LOOP_RESTARTS:
                break

            def restarted(dead: int = core_pid) -> bool:
                nonlocal snapshot
                current = _stats(launched)
                if current is None or not current["engine"]["alive"] or current["process"]["engine_core_pid"] == dead:
                    return False
                snapshot = current
                return True

            wait_for(restarted, 90, f"the core started again after death {death + 1}")
            assert launched.process is not None and launched.process.poll() is None
        assert _exit_code(launched, "the engine core") == 1
        log = (tmp_path / "server.log").read_text()
        assert f"the engine core died {CRASH_LOOP_RESTARTS + 1} deaths within" in log, log[-2000:]
        assert log.count("starting the engine core again") == CRASH_LOOP_RESTARTS
    finally:
        launched.stop()


def test_an_api_process_that_keeps_dying_is_not_started_again_and_the_server_exits_1(tiny_orpheus: Path,
                                                                                    tmp_path: Path) -> None:
    launched = _launch(tiny_orpheus, tmp_path, **{"server.api_processes": 2})
    log_path = tmp_path / "server.log"

    def serving_pids() -> list[int]:
        """API process 1's pids, as API process 0 logs them once each is ready (a kill before that would be a
        failed start, which stops the server by another path)."""
        lines = log_path.read_text().splitlines()
        first = [line for line in lines if "more API processes serving" in line]
        again = [line for line in lines if "API process 1 is serving again" in line]
        pids = [int(re.search(r"pids \[(\d+)", line).group(1)) for line in first]  # type: ignore[union-attr]
        return pids + [int(re.search(r"pid (\d+)", line).group(1)) for line in again]  # type: ignore[union-attr]

    try:
        wait_for(lambda: len(serving_pids()) == 1, 30, "API process 1 serving")
        for death in range(CRASH_LOOP_RESTARTS + 1):
            os.kill(serving_pids()[-1], signal.SIGKILL)
            if death == CRASH_LOOP_RESTARTS:
                break
            wait_for(lambda n=death + 2: len(serving_pids()) == n, 90,
                     f"API process 1 started again after death {death + 1}")
            assert launched.process is not None and launched.process.poll() is None
        assert _exit_code(launched, "API process 1") == 1
        log = log_path.read_text()
        assert f"API processes died: {CRASH_LOOP_RESTARTS + 1} deaths within" in log, log[-2000:]
        assert len(set(serving_pids())) == CRASH_LOOP_RESTARTS + 1
    finally:
        launched.stop()
