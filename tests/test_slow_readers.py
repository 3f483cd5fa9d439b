"""Slow readers and clients that stop reading cost bounded memory and nobody else's audio (ARCHITECTURE §5a).

A real server subprocess with the sim engine and the sim codec. Why not the torch engine on the tiny
model: 48 concurrent streams long enough to fill a client's buffers take minutes of CPU on a 2-core
machine, and the sim backend is exact for what is checked here: its tokens depend only on the
request's seed and its audio only on those tokens, so a stream's bytes are the same however loaded
the server is, unless the pipeline loses, repeats or reorders audio. Everything between the socket
and the scheduler is the real code.

Slow and stopped clients are raw sockets with a 4 KiB receive buffer (set before connecting), so the
kernel does not quietly absorb seconds of audio for them: what they do not read stays at the server
and really blocks its writes. "Cut off" is checked from the client's side without reading: the
socket leaves ESTABLISHED only when the server resets it (a FIN would sit behind the unread bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from orpheus_serve.api.gateway import STREAM_QUEUE_ITEMS
from orpheus_serve.benchmarking.launch import LaunchedServer
from orpheus_serve.client import protocols as api_client
from orpheus_serve.config import Config, load_config, parse_overrides
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc
from orpheus_serve.token_format import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.gateway_support import ENGINE_PROCESS
from tests.pace import MachinePace

NORMAL = 8
SLOW = 20  # read 1 KB/s
STOPPED = 20  # read the response head, then nothing
# Long enough that a stopped client's session, were the server-side buffer not capped, would generate several
# times the cap before it is cut off (the memory bound below tells a capped server from one without the cap).
STALL_TIMEOUT_S = 8.0
SERVER_BUFFER_S = 1.0  # the server-side buffer's cap (scheduler.max_server_buffer_s): 47 KiB of PCM
# After the timeout, the time the server may take to notice a client stopped: its socket buffers (~200 KiB
# with server.socket_send_buffer_bytes at 64 KiB) and the bounded server-side buffer (max_server_buffer_s of
# audio) fill first, at the sim's generation speed (about 5 s on the reference machine; `fill_slack_s` stretches
# it to this one, tests/pace.py).
FILL_SLACK_S = 12.0
TCP_ESTABLISHED = 1
RCVBUF = 4096
# What a slow or stopped client may cost the server beyond the audio it holds for it (`per_client_bound_kib`):
# asyncio's write buffer (a transport stops taking writes at its 64 KiB high-water mark, plus the write that
# crossed it), and the connection, its session and the allocator's rounding.
WRITE_BUFFER_HIGH_WATER = 64 * 1024
CONNECTION_OVERHEAD = 48 * 1024


def _overrides(tiny_orpheus: Path) -> list[str]:
    return [
        "engine.backend=sim", f"engine.model_path={tiny_orpheus}", "codec.decoder=sim",
        f"codec.path={tiny_orpheus.parent / 'tiny-snac'}", "engine.sim.step_base_ms=4.0",
        "scheduler.max_concurrent_sessions=64", "scheduler.max_batch_size=64", "scheduler.max_queue=64",
        "sampling.max_tokens=2800", f"server.stalled_client_timeout_s={STALL_TIMEOUT_S}",
        f"scheduler.max_server_buffer_s={SERVER_BUFFER_S}",
        "server.max_connections=256", "server.log_level=warning", f"server.engine_process={ENGINE_PROCESS}",
    ]


def per_client_bound_kib(config: Config) -> float:
    """The most memory a client that stops reading may hold at the server, from its configuration: the audio
    decoded and not taken (the scheduler stops a session past `max_server_buffer_s`, and the frames already at
    the codec, up to `max_undecoded_frames`, still come), the chunks in its stream's pump (STREAM_QUEUE_ITEMS
    queued and one being handed over, each at most `max_frames_per_session` frames: a codec pass's share), and
    the transport's write buffer; plus a connection's overhead. PCM: 2 bytes a sample."""
    frame = SAMPLES_PER_FRAME * 2
    chunk = config.codec.max_frames_per_session * frame
    held = config.scheduler.max_server_buffer_s * SAMPLE_RATE * 2 + config.scheduler.max_undecoded_frames * frame
    pump = (STREAM_QUEUE_ITEMS + 1) * chunk
    return (held + pump + WRITE_BUFFER_HIGH_WATER + chunk + CONNECTION_OVERHEAD) / 1024


@pytest.fixture(scope="module")
def fill_slack_s(pace: MachinePace) -> float:
    return pace.window(FILL_SLACK_S)


def _watch_s(fill_slack_s: float) -> float:
    """How long slow and stopped clients run and watch."""
    return STALL_TIMEOUT_S + fill_slack_s + 3.0


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("slow-readers") / "server.log"
    with LaunchedServer(_overrides(tiny_orpheus), log_path=log) as launched:
        yield launched


@pytest.fixture(scope="module")
def server_config(tiny_orpheus: Path) -> Config:
    """The configuration the server runs with (the same overrides, read as its command line reads them)."""
    return load_config(overrides=parse_overrides(_overrides(tiny_orpheus)))


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _socket_fds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed while listing
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def _tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of a socket (first byte of TCP_INFO), read without touching its data."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    except OSError:
        return -1


def _small_buffer_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connect: it sets the window
    sock.setblocking(False)
    return sock


def _wait_settled(server: LaunchedServer, within_s: float = 30.0) -> dict[str, Any]:
    """Stats once nothing is live any more (sessions, slots, codec work, open streams)."""
    deadline = time.monotonic() + within_s
    while True:
        stats = server.stats()
        busy = (stats["scheduler"]["active_sessions"] or stats["scheduler"]["pending_sessions"]
                or stats["kv_cache"]["used_slots"] or stats["codec"]["queued_sessions"]
                or stats["gateway"]["open_connections"])
        if not busy or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


async def _normal(http: httpx.AsyncClient, url: str, i: int) -> bytes:
    response = await http.post(url, json={"input": f"Listener {i} hears the whole story.", "response_format": "pcm",
                                          "seed": 1000 + i, "max_tokens": 700})
    assert response.status_code == 200, response.text
    return response.content


async def _raw_client(port: int, i: int, read_bytes_per_s: float, duration_s: float) -> dict[str, Any]:
    """POST by hand on a socket with a tiny receive buffer; read at `read_bytes_per_s` (0: nothing after
    the response head) for up to `duration_s`. `reset_at`: seconds from the request to the moment the
    server reset the connection (None: still open at the end)."""
    loop = asyncio.get_running_loop()
    sock = _small_buffer_socket()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = json.dumps({"input": f"Slow listener {i} wants a very long story read aloud.", "response_format": "pcm",
                       "max_tokens": 2800, "seed": i}).encode()
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    started = time.monotonic()
    await loop.sock_sendall(sock, head + body)
    received = 0
    reset_at = None
    try:
        first = await asyncio.wait_for(loop.sock_recv(sock, 1024), 30)
        received += len(first)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        next_read = time.monotonic()
        while time.monotonic() - started < duration_s:
            if _tcp_state(sock) != TCP_ESTABLISHED:
                reset_at = time.monotonic() - started
                break
            if read_bytes_per_s > 0 and time.monotonic() >= next_read:
                next_read += 1024 / read_bytes_per_s
                try:
                    data = await asyncio.wait_for(loop.sock_recv(sock, 1024), 0.5)
                except asyncio.TimeoutError:
                    continue
                if not data:
                    reset_at = time.monotonic() - started
                    break
                received += len(data)
            await asyncio.sleep(0.05)
    except (ConnectionResetError, BrokenPipeError):
        reset_at = time.monotonic() - started
    finally:
        sock.close()
    return {"received": received, "reset_at": reset_at}


@pytest.mark.core_in_process
def test_slow_and_stalled_http_readers_do_not_touch_normal_streams(server: LaunchedServer, server_config: Config,
                                                                  fill_slack_s: float) -> None:
    """8 normal streams beside 20 clients reading 1 KB/s and 20 that stop reading: the normal ones are
    bit-identical to a run alone, the stopped ones are reset after the stall timeout (their sessions
    cancelled, their slots freed), and the server's memory grows by a bounded amount per client.

    The 1 KB/s readers are held back (backpressure) and, at this timeout, cut off as stalled too: the
    server sees a client take audio only when the write of a chunk completes, and once the socket is full
    that waits until asyncio's write buffer has drained from its 64 KiB high-water mark to 16 KiB: 48 KiB,
    about 48 s at 1 KB/s. So a client slower than about 6 KB/s (an eighth of real time) counts as stalled
    at an 8 s timeout. Cut or not, they must not cost the others anything; each one cut counts as stalled."""
    url = f"{server.url}/v1/audio/speech"
    port = server.http_port
    assert server.process is not None
    pid = server.process.pid

    async def baseline() -> list[bytes]:
        async with httpx.AsyncClient(timeout=120.0) as http:
            return await asyncio.gather(*(_normal(http, url, i) for i in range(NORMAL)))

    alone = asyncio.run(baseline())
    before = _wait_settled(server)
    rss_before = _rss_kib(pid)
    fds_before = _socket_fds(pid)

    async def crowded() -> tuple[list[bytes], list[dict], list[dict], int]:
        async with httpx.AsyncClient(timeout=120.0) as http:
            slow = [asyncio.create_task(_raw_client(port, i, 1024, _watch_s(fill_slack_s))) for i in range(SLOW)]
            stopped = [asyncio.create_task(_raw_client(port, 100 + i, 0, _watch_s(fill_slack_s)))
                       for i in range(STOPPED)]
            await asyncio.sleep(1.0)  # the slow ones are in, and their buffers are filling
            normal_task = asyncio.gather(*(_normal(http, url, i) for i in range(NORMAL)))
            peak = _rss_kib(pid)
            while not all(t.done() for t in stopped) or not normal_task.done():
                peak = max(peak, _rss_kib(pid))
                await asyncio.sleep(0.1)
            return await normal_task, await asyncio.gather(*slow), await asyncio.gather(*stopped), peak

    normal, slow, stopped, rss_peak = asyncio.run(crowded())
    growth_mib = (max(rss_peak, _rss_kib(pid)) - rss_before) / 1024
    per_client_kib = growth_mib * 1024 / (SLOW + STOPPED)

    # Normal streams: the same bytes as with nobody else around.
    assert [len(a) for a in normal] == [len(a) for a in alone]
    assert normal == alone

    # Clients that stopped reading were reset by the server, not before the timeout and not long after
    # their buffers filled, while they still held their sockets open and read nothing.
    reset_times = sorted(c["reset_at"] for c in stopped if c["reset_at"] is not None)
    assert len(reset_times) == STOPPED, stopped
    assert reset_times[0] >= STALL_TIMEOUT_S, reset_times
    assert reset_times[-1] <= STALL_TIMEOUT_S + fill_slack_s, reset_times

    # Everything ends: no slot, no session, no codec state, no connection is left behind.
    after = _wait_settled(server)
    assert after["kv_cache"]["used_slots"] == 0 and after["scheduler"]["active_sessions"] == 0
    assert after["scheduler"]["pending_sessions"] == 0
    assert after["codec"]["queued_sessions"] == 0 and after["codec"]["backlog_frames"] == 0
    assert after["gateway"]["open_connections"] == 0
    deadline = time.monotonic() + 2.0  # the stats request's own connection closes a moment after its answer
    while _socket_fds(pid) > fds_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _socket_fds(pid) <= fds_before

    def delta(*path: str) -> int:
        a, b = after, before
        for key in path:
            a, b = a.get(key, 0) if isinstance(a, dict) else 0, b.get(key, 0) if isinstance(b, dict) else 0
        return int(a) - int(b)

    stalled = delta("gateway", "requests", "rest", "client_stalled")
    slow_reset = sum(c["reset_at"] is not None for c in slow)
    # Every cut-off client counted as stalled, and nothing else was.
    assert stalled == STOPPED + slow_reset, (stalled, slow_reset)
    assert delta("gateway", "requests", "rest", "ok") == NORMAL
    # Each stalled client's session was cancelled in the scheduler (one session per request: short texts).
    assert delta("scheduler", "cancelled") == stalled
    assert delta("requests", "requests_cancelled") == stalled
    assert delta("scheduler", "finished") + delta("scheduler", "cancelled") == \
        delta("scheduler", "total_sessions") == NORMAL + SLOW + STOPPED
    assert delta("scheduler", "failed") == delta("scheduler", "timed_out") == 0

    flow = after["flow"]
    print(f"\nRSS {rss_before / 1024:.1f} MiB -> peak {rss_peak / 1024:.1f} MiB (+{growth_mib:.1f} MiB, "
          f"{per_client_kib:.0f} KiB per slow or stopped client); stopped clients reset after "
          f"{reset_times[0]:.1f}-{reset_times[-1]:.1f} s (timeout {STALL_TIMEOUT_S:g} s); slow clients read "
          f"{sum(c['received'] for c in slow)} bytes in all, {slow_reset} of {SLOW} cut off as stalled; "
          f"outcomes {after['gateway']['requests']['rest']}; backpressure skips {flow['backpressure_skips']}")
    # Bounded per client by the server's own caps (`per_client_bound_kib`: about 270 KiB here, 47 KiB of it the
    # server-side buffer); a server without the cap on its side would hold all that a stopped client's session
    # makes in the STALL_TIMEOUT_S before it is cut off (about 400 KiB measured on a 2-core machine).
    bound_kib = per_client_bound_kib(server_config)
    assert per_client_kib < bound_kib, (per_client_kib, bound_kib)


# ------------------------------------------------------------ WebSocket and gRPC


async def _stalled_ws(port: int, i: int, duration_s: float) -> dict[str, Any]:
    """A websockets client on a 4 KiB receive buffer that sends one long request and never reads
    (max_queue=1: the library stops reading the socket once one frame waits)."""
    sock = _small_buffer_socket()
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    ws = await ws_connect(f"ws://127.0.0.1:{port}/v1/audio/stream", sock=sock, max_queue=1, max_size=None)
    started = time.monotonic()
    await ws.send(json.dumps({"text": f"Stalled listener {i} wants a very long story.", "max_tokens": 2800,
                              "seed": 200 + i}))
    reset_at = None
    try:
        while time.monotonic() - started < duration_s:
            if _tcp_state(sock) != TCP_ESTABLISHED:
                reset_at = time.monotonic() - started
                break
            await asyncio.sleep(0.05)
    finally:
        ws.transport.abort()
    return {"reset_at": reset_at}


async def _normal_ws(base_url: str, i: int) -> bytes:
    result = await api_client.synthesize_ws(base_url, f"Listener {i} hears the whole story.", seed=2000 + i,
                                            max_tokens=700, timeout_s=120)
    assert result.ok, result.error
    return bytes(result.audio)


def test_a_stalled_websocket_reader_is_reset_and_others_are_untouched(server: LaunchedServer,
                                                                     fill_slack_s: float) -> None:
    stalled_count, normal_count = 5, 4
    port = server.http_port

    async def baseline() -> list[bytes]:
        return await asyncio.gather(*(_normal_ws(server.url, i) for i in range(normal_count)))

    alone = asyncio.run(baseline())
    before = _wait_settled(server)

    async def crowded() -> tuple[list[bytes], list[dict]]:
        stalled = [asyncio.create_task(_stalled_ws(port, i, _watch_s(fill_slack_s))) for i in range(stalled_count)]
        await asyncio.sleep(0.5)
        normal = await asyncio.gather(*(_normal_ws(server.url, i) for i in range(normal_count)))
        return normal, await asyncio.gather(*stalled)

    normal, stalled = asyncio.run(crowded())
    assert normal == alone
    reset_times = sorted(c["reset_at"] for c in stalled if c["reset_at"] is not None)
    assert len(reset_times) == stalled_count, stalled
    assert reset_times[0] >= STALL_TIMEOUT_S and reset_times[-1] <= STALL_TIMEOUT_S + fill_slack_s, reset_times

    after = _wait_settled(server)
    ws_after, ws_before = after["gateway"]["requests"]["ws"], before["gateway"]["requests"]["ws"]
    assert ws_after.get("client_stalled", 0) - ws_before.get("client_stalled", 0) == stalled_count
    assert ws_after.get("ok", 0) - ws_before.get("ok", 0) == normal_count
    assert after["scheduler"]["cancelled"] - before["scheduler"]["cancelled"] == stalled_count
    assert after["kv_cache"]["used_slots"] == 0 and after["gateway"]["open_connections"] == 0
    print(f"\nWebSocket: stalled readers reset after {reset_times[0]:.1f}-{reset_times[-1]:.1f} s")


def test_a_stalled_grpc_reader_loses_its_session_at_the_timeout(server: LaunchedServer, fill_slack_s: float) -> None:
    """A gRPC client that stops reading (BDP probing off, so its HTTP/2 window stays at 64 KiB instead of
    growing to hold the whole utterance): its session is cancelled and its slot freed after the timeout.
    The call itself stays open until the client reads again (grpc.aio cannot end a call whose writes wait
    on flow control); the client then gets DEADLINE_EXCEEDED after the audio already in flight."""
    before = _wait_settled(server)

    async def scenario() -> tuple[float | None, dict[str, Any], int, grpc.StatusCode | None]:
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(server.grpc_addr, options=options) as channel:
            started = time.monotonic()
            call = pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(
                text="A stalled listener wants a very long story.",
                sampling=pb.SamplingOptions(max_tokens=2800, seed=7)))
            first = await call.read()
            assert first.HasField("audio")
            cancelled_at = None
            async with httpx.AsyncClient(timeout=10) as http:
                while time.monotonic() - started < STALL_TIMEOUT_S + fill_slack_s:
                    stats = (await http.get(f"{server.url}/v1/stats")).json()
                    if stats["scheduler"]["cancelled"] > before["scheduler"]["cancelled"]:
                        cancelled_at = time.monotonic() - started
                        break
                    await asyncio.sleep(0.1)
                deadline = time.monotonic() + 2.0  # the slot is released by the engine's next plan
                held = (await http.get(f"{server.url}/v1/stats")).json()
                while held["kv_cache"]["used_slots"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    held = (await http.get(f"{server.url}/v1/stats")).json()
            messages, code = 1, None
            try:
                while (await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                    messages += 1
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            return cancelled_at, held, messages, code

    cancelled_at, held, messages, code = asyncio.run(scenario())
    assert cancelled_at is not None and cancelled_at >= STALL_TIMEOUT_S, cancelled_at
    assert held["scheduler"]["active_sessions"] == 0 and held["kv_cache"]["used_slots"] == 0
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, messages)
    after = _wait_settled(server)
    grpc_after, grpc_before = after["gateway"]["requests"]["grpc"], before["gateway"]["requests"]["grpc"]
    assert grpc_after.get("client_stalled", 0) - grpc_before.get("client_stalled", 0) == 1
    print(f"\ngRPC: session cancelled {cancelled_at:.1f} s after the request; the call was still open then "
          f"({held['gateway']['open_connections']} connection(s) held); the client read {messages} audio "
          f"messages before {code.name}")
