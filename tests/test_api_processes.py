"""Two API processes in front of one engine core (server.api_processes: 2), as production_server.py runs them.

A real server in a subprocess on loopback: both processes share the HTTP and gRPC ports (SO_REUSEPORT),
every connection lands on one of them, and /v1/stats in either sums the counters of both.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from orpheus_serve.benchmarking.launch import LaunchedServer
from orpheus_serve.client import protocols as api_client
from orpheus_serve.request.types import PROTOCOLS
from tests.gateway_support import metric_values, wait_for
from tests.test_engine_process import (
    WholeStream,
    _grpc_until_error,
    _grpc_whole,
    _sse_until_error,
    _ws_until_error,
    _ws_whole,
)

LONG = "This stream keeps talking for a good while, long enough to be cut off in the middle."


def _launch(tiny_orpheus: Path, tmp_path: Path, **extra: Any) -> LaunchedServer:
    settings = {
        "engine.backend": "sim", "engine.model_path": tiny_orpheus, "codec.decoder": "sim",
        "codec.path": tiny_orpheus.parent / "tiny-snac", "server.engine_process": "true",
        "server.api_processes": 2, "server.log_level": "info", "scheduler.admission": "slots",
        # Long streams (300 frames, 25 s of audio paced in real time) are well under way when something dies.
        "engine.sim.end_after_frames": 300, **extra,
    }
    launched = LaunchedServer([f"{key}={value}" for key, value in settings.items()], ready_timeout_s=120,
                              log_path=tmp_path / "server.log")
    launched.start()
    return launched


def _stats(launched: LaunchedServer) -> dict[str, Any]:
    """/v1/stats over a new connection (which may land on either API process)."""
    with httpx.Client(timeout=10.0) as client:
        return client.get(f"{launched.url}/v1/stats").json()


def _stats_of_each(launched: LaunchedServer, within_s: float = 20.0) -> dict[int, dict[str, Any]]:
    """One /v1/stats answer from each API process (new connections until both have answered)."""
    answers: dict[int, dict[str, Any]] = {}

    def both() -> bool:
        snapshot = _stats(launched)
        answers[snapshot["api_process_index"]] = snapshot
        return len(answers) == 2

    wait_for(both, within_s, "both API processes answered /v1/stats")
    return answers


def _per_process(snapshot: dict[str, Any], field: str) -> list[int]:
    return [row["requests"][field] for row in snapshot["api_processes"]]


def _burst(launched: LaunchedServer, count: int, text: str = "Hello there.") -> list[api_client.ClientResult]:
    """`count` requests of each of REST, WebSocket and gRPC at once, each on its own connection."""
    async def run() -> list[api_client.ClientResult]:
        return list(await asyncio.gather(*(
            api_client.synthesize(protocol, text, url=launched.url, grpc_addr=launched.grpc_addr, max_tokens=140,
                                  timeout_s=60)
            for protocol in ("rest", "ws", "grpc") for _ in range(count))))

    return asyncio.run(run())


async def _sse_cut_off(base_url: str) -> None:
    """An SSE stream whose client goes away after its first audio."""
    async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", f"{base_url}/v1/audio/speech",
            json={"input": LONG, "stream_format": "sse", "response_format": "pcm", "max_tokens": 2800}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if '"speech.audio.delta"' in line:
                return  # leaving the block closes the connection mid-stream


def test_two_api_processes_share_the_ports_stats_core_deaths_and_a_drain(tiny_orpheus: Path, tmp_path: Path) -> None:
    launched = _launch(tiny_orpheus, tmp_path, **{"server.shutdown_grace_s": 15.0})
    try:
        assert launched.process is not None
        first = _stats_of_each(launched)
        pids = {index: snapshot["api_processes"][index]["pid"] for index, snapshot in first.items()}
        core_pid = first[0]["process"]["engine_core_pid"]
        assert pids[0] == launched.process.pid and pids[1] != pids[0]
        assert first[1]["process"]["engine_core_pid"] == core_pid and core_pid not in pids.values()

        # Requests of every protocol from many connections: both processes serve some, all audio arrives.
        results = _burst(launched, 8)
        for result in results:
            assert result.status == "ok" and result.chunks and result.audio_bytes, (result.protocol, result.error)

        def counted(snapshot: dict[str, Any]) -> bool:
            gateway = snapshot["gateway"]["requests"]
            return (snapshot["requests"]["requests_completed"] == 24
                    and sum(gateway[protocol].get("ok", 0) for protocol in ("rest", "ws", "grpc")) == 24)

        # Each process sends its counters to the core within a fraction of a second of a change.
        wait_for(lambda: all(counted(s) for s in _stats_of_each(launched).values()), 10,
                 "both processes' requests summed in both")
        for snapshot in _stats_of_each(launched).values():
            assert snapshot["requests"]["requests_total"] == 24, snapshot["requests"]
            assert all(count > 0 for count in _per_process(snapshot, "requests_completed")), \
                snapshot["api_processes"]
            assert {protocol: snapshot["gateway"]["requests"][protocol] for protocol in ("rest", "ws", "grpc")} == \
                {"rest": {"ok": 8}, "ws": {"ok": 8}, "grpc": {"ok": 8}}
            process = snapshot["process"]  # CPU time: every API process's and the core's
            assert process["cpu_s"] == pytest.approx(
                sum(row["cpu_s"] for row in snapshot["api_processes"]) + process["engine_core_cpu_s"], abs=0.01)
            assert snapshot["throughput"]["audio_seconds_total"] == pytest.approx(
                sum(result.audio_bytes for result in results) / 2 / 24000, abs=0.05)

        # /metrics in either process: every process's counters and histograms, summed.
        with httpx.Client(timeout=10.0) as client:
            for _ in range(6):  # new connections: both processes answer some
                text = client.get(f"{launched.url}/metrics", headers={"connection": "close"}).text
                requests = metric_values(text, "orpheus:requests_total")
                assert {protocol: requests.get(f'{{protocol="{protocol}",status="ok"}}')
                        for protocol in ("rest", "ws", "grpc")} == {"rest": 8.0, "ws": 8.0, "grpc": 8.0}, requests
                assert metric_values(text, "orpheus:time_to_first_audio_seconds_count") == {"": 24.0}
                assert metric_values(text, "orpheus:active_streams") == {
                    f'{{protocol="{protocol}"}}': 0.0 for protocol in PROTOCOLS}
                assert set(metric_values(text, "orpheus:underrunning_streams").values()) == {0.0}
                # Every stream that had audio, counted once whichever process served it (real-time or not).
                played = metric_values(text, "orpheus:streams_played_total")
                assert {protocol: sum(v for k, v in played.items() if f'protocol="{protocol}"' in k)
                        for protocol in ("rest", "ws", "grpc")} == {"rest": 8.0, "ws": 8.0, "grpc": 8.0}, played
                # One row per API process, not summed: together, every request.
                rows = metric_values(text, "orpheus:api_process_requests_total")
                assert set(rows) == {'{api_process="0"}', '{api_process="1"}'} and sum(rows.values()) == 24, rows
                assert all(value > 0 for value in rows.values()), rows
                assert set(metric_values(text, "orpheus:api_process_cpu_seconds_total")) == set(rows)
                assert metric_values(text, "orpheus:engine_alive") == {"": 1.0}

        # Clients that go away mid-stream free their slots, whichever process served them.
        async def cut_off() -> None:
            await asyncio.wait_for(asyncio.gather(*(_sse_cut_off(launched.url) for _ in range(4))), 60)

        asyncio.run(cut_off())
        wait_for(lambda: (lambda s: s["scheduler"]["active_sessions"] == 0 and s["kv_cache"]["used_slots"] == 0
                          and s["requests"]["requests_cancelled"] == 4)(_stats(launched)),
                 20, "the cut-off streams' slots are free")

        # The core dies mid-stream: streams in both processes fail with the same error, both say not ready,
        # and both serve again once the core is back.
        async def streams_until_the_core_dies() -> list[Any]:
            # 12 connections: the chance that the kernel puts them all on one process is 1 in 2,048.
            started = [asyncio.Event() for _ in range(12)]
            streams = asyncio.gather(*(_sse_until_error(launched.url, started[i]) for i in range(4)),
                                     *(_ws_until_error(launched.url, started[i]) for i in range(4, 8)),
                                     *(_grpc_until_error(launched.grpc_addr, started[i]) for i in range(8, 12)))
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            # Both processes hold some of them (their counters reach the core within a fraction of a second).
            await asyncio.to_thread(wait_for, lambda: all(n > 0 for n in _per_process(_stats(launched), "active")),
                                    10, "both processes stream")
            os.kill(core_pid, signal.SIGKILL)
            return list(await asyncio.wait_for(streams, 30))

        failed = asyncio.run(streams_until_the_core_dies())
        for outcome in failed[:8]:
            assert outcome["code"] == "engine_unavailable" and "engine-core process died" in outcome["message"], \
                outcome
        for _, code, details in failed[8:]:
            assert code == grpc.StatusCode.UNAVAILABLE and "engine-core process died" in details
        # Until the new core is up (a new interpreter: seconds), both processes say so.
        for snapshot in _stats_of_each(launched).values():
            assert snapshot["engine"]["alive"] is False, snapshot["api_process_index"]
        with httpx.Client(timeout=10.0) as client:
            for _ in range(4):
                ready = client.get(f"{launched.url}/ready", headers={"connection": "close"})
                assert (ready.status_code, ready.json()) == (503, {"status": "engine_failed"})
        wait_for(lambda: all(s["engine"]["alive"] and s["process"]["engine_core_pid"] != core_pid
                             and s["process"]["engine_core_restarts"] == 1 and s["requests"]["requests_failed"] == 12
                             for s in _stats_of_each(launched).values()), 120,
                 "both processes see the new core (and each other's counters again)")
        with httpx.Client(timeout=10.0) as client:
            for _ in range(4):
                text = client.get(f"{launched.url}/metrics", headers={"connection": "close"}).text
                assert metric_values(text, "orpheus:engine_core_restarts_total") == {"": 1.0}
                assert metric_values(text, "orpheus:engine_alive") == {"": 1.0}
        snapshot = _stats(launched)
        for result in _burst(launched, 3, "Back again."):
            assert result.status == "ok" and result.chunks, (result.protocol, result.error)
        core_pid = snapshot["process"]["engine_core_pid"]

        # SIGTERM to API process 0 alone: both processes drain their streams to the end, then all exit.
        async def streams_across_sigterm() -> list[WholeStream]:
            started = [asyncio.Event() for _ in range(6)]
            streams = asyncio.gather(*(_ws_whole(launched.url, started[i]) for i in range(3)),
                                     *(_grpc_whole(launched.grpc_addr, started[i]) for i in range(3, 6)))
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            assert launched.process is not None
            signalled_at.append(time.perf_counter())
            launched.process.send_signal(signal.SIGTERM)
            return list(await asyncio.wait_for(streams, 30))

        signalled_at: list[float] = []
        for stream in asyncio.run(streams_across_sigterm()):
            stream.check_whole_across(signalled_at[0])
        assert launched.process.wait(30) == 0
        for pid in (pids[1], core_pid):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # gone, reaped by API process 0 before it exited
    finally:
        launched.stop()


def test_an_api_process_that_dies_is_started_again_while_the_others_streams_go_on(tiny_orpheus: Path,
                                                                                 tmp_path: Path) -> None:
    launched = _launch(tiny_orpheus, tmp_path)
    try:
        assert launched.process is not None
        dead = _stats_of_each(launched)[1]["api_processes"][1]["pid"]

        async def streams_then_kill() -> int:
            started = [asyncio.Event() for _ in range(12)]  # all on one process: 1 in 2,048
            streams = [asyncio.ensure_future(_ws_until_error(launched.url, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            await asyncio.to_thread(wait_for, lambda: all(n > 0 for n in _per_process(_stats(launched), "active")),
                                    10, "both processes stream")
            on_survivor = _per_process(_stats_of_each(launched)[0], "active")[0]  # its own count, live
            os.kill(dead, signal.SIGKILL)
            # The dead process's connections break at once; the survivor's streams (25 s of audio) go on.
            broken, going_on = await asyncio.wait(streams, timeout=8)
            for stream in broken:
                assert stream.exception() is not None  # the connection dropped, no "error" message on it
            for stream in going_on:
                stream.cancel()
            assert len(going_on) == on_survivor, (len(going_on), on_survivor)
            return len(broken)

        assert asyncio.run(streams_then_kill()) > 0

        def restarted() -> bool:
            rows = _stats(launched)["api_processes"]
            return len(rows) == 2 and rows[1]["pid"] not in (None, dead)

        wait_for(restarted, 90, "API process 1 started again")
        assert launched.process.poll() is None  # the server never stopped

        def restart_counted() -> bool:  # in either process's /metrics (process 0's count reaches the other)
            with httpx.Client(timeout=10.0) as client:
                return all(metric_values(client.get(f"{launched.url}/metrics", headers={"connection": "close"}).text,
                                         "orpheus:api_process_restarts_total") == {"": 1.0} for _ in range(4))

        wait_for(restart_counted, 10, "the restart counted")
        # The new process serves audio: the core sends to its index again.
        before = _per_process(_stats_of_each(launched)[0], "requests_completed")
        results = _burst(launched, 4)
        for result in results:
            assert result.status == "ok" and result.chunks and result.audio_bytes, (result.protocol, result.error)
        # Each process counts its own requests live and the other's as last relayed through the core: the
        # burst has counted once both views say so (a view read at once may still miss the other's part).
        def burst_counted() -> bool:
            views = _stats_of_each(launched).values()
            return all(sum(_per_process(view, "requests_completed")) == sum(before) + 12 for view in views)

        wait_for(burst_counted, 20, "the burst counted in both processes' views")
        after = _per_process(_stats_of_each(launched)[0], "requests_completed")
        assert after[1] > before[1], (before, after)  # all 12 on process 0: 1 in 4,096
        log = (tmp_path / "server.log").read_text()
        assert "API process 1 is gone; cancelled its" in log and "API process 1 is serving again" in log
    finally:
        launched.stop()


def test_an_api_process_that_dies_with_restarts_off_has_its_sessions_cancelled_and_stops_the_server(
        tiny_orpheus: Path, tmp_path: Path) -> None:
    launched = _launch(tiny_orpheus, tmp_path, **{"server.shutdown_grace_s": 2.0,
                                                  "server.restart_api_processes": "false"})
    try:
        assert launched.process is not None
        other = _stats_of_each(launched)[1]["api_processes"][1]["pid"]

        async def streams_then_kill() -> None:
            started = [asyncio.Event() for _ in range(12)]  # all on one process: 1 in 2,048
            streams = [asyncio.ensure_future(_ws_until_error(launched.url, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            await asyncio.to_thread(wait_for, lambda: all(n > 0 for n in _per_process(_stats(launched), "active")),
                                    10, "both processes stream")
            os.kill(other, signal.SIGKILL)
            # The streams of the dead process break; the others end when the server stops.
            await asyncio.wait(streams, timeout=30)
            for stream in streams:
                stream.cancel()

        asyncio.run(streams_then_kill())
        try:
            code = launched.process.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server kept running after an API process died")
        assert code == 1
        log = (tmp_path / "server.log").read_text()
        assert "API process 1" in log and "died" in log
        cancelled = [line for line in log.splitlines() if "API process 1 is gone; cancelled its" in line]
        assert cancelled and " 0 sessions" not in cancelled[0], cancelled
    finally:
        launched.stop()
