"""scripts/container_check.py's drain against a server process on this machine: the checks test_container.sh runs
inside a built image (podman, root: not in the CI lane), run here on the same tiny models and the same default
settings (the image's drain window, server.shutdown_grace_s = 10 s), so each "ok" they print is exercised.

Also the whole-stream check on streams made up for it: a stream a drain cut short fails it whatever it reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orpheus_serve.benchmarking.launch import LaunchedServer
from scripts import container_check
from scripts.container_check import SAMPLES_PER_FRAME, CheckFailed, Stream, check_whole

ROOT = Path(__file__).resolve().parents[1]


def stream(finish_reason: str, samples: int, received_samples: int | None = None) -> Stream:
    made = Stream("WebSocket", finish_reason=finish_reason, samples=samples)
    made.received(b"\0\0" * (samples if received_samples is None else received_samples))
    return made


def test_a_whole_stream_passes(capsys: pytest.CaptureFixture[str]) -> None:
    check_whole(stream("length", 30 * SAMPLES_PER_FRAME), 30, "across SIGTERM")
    assert "ok  the WebSocket stream ended whole across SIGTERM: 30 frames asked" in capsys.readouterr().out


@pytest.mark.parametrize(("finish_reason", "samples", "received"), [
    ("length", 24 * SAMPLES_PER_FRAME, None),  # cut short, and the server's count agrees with what came
    ("length", 30 * SAMPLES_PER_FRAME, 24 * SAMPLES_PER_FRAME),  # the count is right, the audio is not all there
    ("stop", 24 * SAMPLES_PER_FRAME, None),  # ended early (the drain's seeded streams run to their limit)
    ("", 0, 0),  # never finished
])
def test_a_stream_cut_short_fails_the_whole_stream_check(finish_reason: str, samples: int,
                                                         received: int | None) -> None:
    with pytest.raises(CheckFailed, match="ended whole"):
        check_whole(stream(finish_reason, samples, received), 30, "across SIGTERM")


def test_the_drain_checks_against_a_server_process(tiny_orpheus: Path, tiny_snac: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """As test_container.sh runs them after `serve`: admission by slots, the default drain window; then the
    server exits 0."""
    overrides = ["engine.backend=torch", "engine.device=cpu", f"engine.model_path={tiny_orpheus}",
                 f"codec.path={tiny_snac}", "codec.device=cpu", "scheduler.admission=slots",
                 "server.host=127.0.0.1", "server.log_level=warning"]
    server = LaunchedServer(overrides, log_path=tmp_path / "server.log")
    server.start()
    try:
        assert server.process is not None
        monkeypatch.setenv("ORPHEUS_HEALTHCHECK_URL", f"{server.url}/ready")  # docker/healthcheck.py's URL
        healthcheck = {"Test": ["CMD", sys.executable, str(ROOT / "docker" / "healthcheck.py")], "Timeout": 10**10}
        code = container_check.main(["drain", "--url", server.url, "--grpc", server.grpc_addr,
                                     "--server-pid", str(server.process.pid), "--healthcheck",
                                     json.dumps(healthcheck)])
        said = capsys.readouterr()
        assert code == 0, said.out + said.err + (tmp_path / "server.log").read_text()[-3000:]
        for protocol in ("WebSocket", "gRPC"):
            assert f"ok  the {protocol} stream ended whole across SIGTERM" in said.out, said.out
            assert f"ok  the {protocol} stream ended whole (the speed measurement)" in said.out, said.out
        assert server.process.wait(30) == 0
    finally:
        server.stop()
