"""`python -m orpheus_serve.deploy.ray`: a local cluster from the command line, serving on the port given,
stopped by SIGTERM (the replicas drain, the cluster goes)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.ray_support import free_port, wait_until

pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[1]


def test_help_needs_no_cluster() -> None:
    done = subprocess.run([sys.executable, "-m", "orpheus_serve.deploy.ray", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "--replicas" in done.stdout


def test_a_bad_override_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "orpheus_serve.deploy.ray", "--set", "scheduler.nope=1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip() == "config error: scheduler.nope: unknown key (got 1)"


def test_replicas_serve_on_the_port_given_until_sigterm(tiny_orpheus: Path, tmp_path: Path) -> None:
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "orpheus_serve.deploy.ray", "--replicas", "2", "--host", "127.0.0.1",
               "--port", str(port), "--grpc-port", str(grpc_port),
               "--set", "engine.backend=sim", "--set", "codec.decoder=sim",
               "--set", f"engine.model_path={tiny_orpheus}", "--set", f"codec.path={tiny_orpheus.parent / 'tiny-snac'}",
               "--set", "server.log_level=warning", "--set", "server.shutdown_grace_s=1"]
    log = (tmp_path / "cli.log").open("w")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def two_replicas() -> dict | None:
        try:
            stats = httpx.get(f"{base}/v1/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None
        return stats if stats.get("running_replicas") == 2 else None

    try:
        stats = wait_until(two_replicas, 150, "two replicas behind the CLI's port", every_s=1.0)
        assert len(stats["replicas"]) == 2 and all(row["state"] == "RUNNING" for row in stats["replicas"])
        response = httpx.post(f"{base}/v1/audio/speech", timeout=60,
                              json={"input": "Hello.", "response_format": "pcm", "max_tokens": 28})
        assert response.status_code == 200 and response.content
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        log.close()
    assert code == 0, (tmp_path / "cli.log").read_text()[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=5)
