"""Slow readers and clients that stop reading cost bounded memory and nobody else's audio (DESIGN §5a).

A real server subprocess (sim engine and sim codec: deterministic per seed, so a stream's audio is
the same bytes however loaded the server is, and GPU-like pacing so 48 streams fit on a small
CPU). Slow and stalled clients are raw sockets with a 4 KiB receive buffer, so that the kernel does
not quietly absorb seconds of audio for them: what they do not read really stays at the server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from orpheus_serve.benchmarking.launch import LaunchedServer
from tests.gateway_support import settled_stats

NORMAL = 8
SLOW = 20  # read 1 KB/s
STOPPED = 20  # read the response head, then nothing
STALL_TIMEOUT_S = 3.0


def _overrides(tiny_orpheus: Path) -> list[str]:
    return [
        "engine.backend=sim", f"engine.model_path={tiny_orpheus}", "codec.decoder=sim",
        f"codec.path={tiny_orpheus.parent / 'tiny-snac'}", "engine.sim.step_base_ms=4.0",
        "scheduler.max_concurrent_sessions=64", "scheduler.max_batch_size=64", "scheduler.max_queue=64",
        "sampling.max_tokens=2800", f"server.stalled_client_timeout_s={STALL_TIMEOUT_S}",
        "server.max_connections=256", "server.log_level=warning",
    ]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _normal(http: httpx.AsyncClient, url: str, i: int) -> bytes:
    response = await http.post(url, json={"input": f"Listener {i} hears the whole story.", "response_format": "pcm",
                                          "seed": 1000 + i, "max_tokens": 700})
    assert response.status_code == 200, response.text
    return response.content


async def _raw_client(port: int, i: int, read_bytes_per_s: float, stop: asyncio.Event) -> dict:
    """POST by hand on a socket with a tiny receive buffer; read at `read_bytes_per_s` (0: never after the
    head) until `stop`. Returns what it read and whether the server closed the connection."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps({"input": f"Slow listener {i} wants a very long story read aloud.", "response_format": "pcm",
                       "max_tokens": 2800, "seed": i}).encode()
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    await loop.sock_sendall(sock, head + body)
    received = 0
    closed_at = None
    started = time.monotonic()
    try:
        first = await asyncio.wait_for(loop.sock_recv(sock, 1024), 30)
        received += len(first)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        while not stop.is_set():
            if read_bytes_per_s <= 0:
                await asyncio.sleep(0.25)
                # Not reading: only look whether the server has closed (a zero-byte peek would read).
                continue
            await asyncio.sleep(1024 / read_bytes_per_s)
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 1024), 5)
            except asyncio.TimeoutError:
                continue
            if not data:
                closed_at = time.monotonic() - started
                break
            received += len(data)
        if read_bytes_per_s <= 0 and closed_at is None:
            # Drain what is there to see whether the server hung up (EOF or reset after its buffers). Its FIN
            # queues behind the data, so only reading shows it; a client not cut yet is cut within the
            # stall timeout plus the time its sockets take to fill.
            while True:
                data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 20.0)
                if not data:
                    closed_at = time.monotonic() - started
                    break
                received += len(data)
    except (ConnectionResetError, BrokenPipeError):
        closed_at = time.monotonic() - started
    except TimeoutError:
        pass  # still open: the assertion on closed_at says so
    finally:
        sock.close()
    return {"received": received, "closed_at": closed_at}


@pytest.mark.slow
def test_slow_and_stalled_readers_do_not_touch_normal_streams(tiny_orpheus: Path, tmp_path: Path) -> None:
    with LaunchedServer(_overrides(tiny_orpheus), log_path=tmp_path / "server.log") as server:
        url = f"{server.url}/v1/audio/speech"
        port = server.http_port
        assert server.process is not None
        pid = server.process.pid

        async def baseline() -> list[bytes]:
            async with httpx.AsyncClient(timeout=120.0) as http:
                return await asyncio.gather(*(_normal(http, url, i) for i in range(NORMAL)))

        alone = asyncio.run(baseline())
        rss_before = _rss_kib(pid)

        cut_times: list[float] = []  # when the server had cut how many stalled clients, from its own counters

        async def crowded() -> tuple[list[bytes], list[dict], list[dict], int]:
            async with httpx.AsyncClient(timeout=120.0) as http:
                started = time.monotonic()
                stop = asyncio.Event()
                slow = [asyncio.create_task(_raw_client(port, i, 1024, stop)) for i in range(SLOW)]
                stopped = [asyncio.create_task(_raw_client(port, 100 + i, 0, stop)) for i in range(STOPPED)]
                await asyncio.sleep(1.0)  # the slow ones are in, and their buffers are filling
                normal = await asyncio.gather(*(_normal(http, url, i) for i in range(NORMAL)))
                peak = _rss_kib(pid)
                # Until the server has cut every client that stopped reading (bounded: a minute).
                while len(cut_times) < STOPPED and time.monotonic() - started < 60.0:
                    outcomes = (await http.get(f"{server.url}/v1/stats")).json()["gateway"]["requests"]["rest"]
                    peak = max(peak, _rss_kib(pid))
                    while len(cut_times) < outcomes.get("client_stalled", 0):
                        cut_times.append(time.monotonic() - started)
                    await asyncio.sleep(0.25)
                stop.set()
                return normal, await asyncio.gather(*slow), await asyncio.gather(*stopped), peak

        normal, slow, stopped, rss_peak = asyncio.run(crowded())
        growth_mb = (max(rss_peak, _rss_kib(pid)) - rss_before) / 1024

        # Normal streams: the same bytes as with nobody else around.
        assert [len(a) for a in normal] == [len(a) for a in alone]
        assert normal == alone

        # Clients that stopped reading were cut off: the server closed their connections (they find the
        # end once they read what their buffers held) within the run, the timeout after their sockets filled.
        assert all(c["closed_at"] is not None for c in stopped), stopped
        assert len(cut_times) >= STOPPED, cut_times
        assert cut_times[0] >= STALL_TIMEOUT_S  # never before the timeout
        cut = cut_times[:STOPPED]

        # Everything ends: no slot, no session, no codec state is left behind.
        stats = settled_stats(server.stats)
        assert stats["kv_cache"]["used_slots"] == 0 and stats["scheduler"]["active_sessions"] == 0
        assert stats["codec"]["queued_sessions"] == 0 and stats["codec"]["backlog_frames"] == 0
        stalled = stats["gateway"]["requests"]["rest"].get("client_stalled", 0)
        assert stalled >= STOPPED, stats["gateway"]["requests"]
        flow = stats["flow"]
        print(f"RSS {rss_before / 1024:.1f} MB -> peak {rss_peak / 1024:.1f} MB (+{growth_mb:.1f} MB, "
              f"{growth_mb * 1024 / (SLOW + STOPPED):.0f} KiB per slow or stalled client); stopped clients cut "
              f"after {min(cut):.1f}-{max(cut):.1f} s; slow clients read {sum(c['received'] for c in slow)} bytes, "
              f"{sum(c['closed_at'] is not None for c in slow)} of {SLOW} cut; outcomes "
              f"{stats['gateway']['requests']['rest']}; backpressure skips {flow['backpressure_skips']}")
        assert growth_mb < 100
