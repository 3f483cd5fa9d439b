"""Soak: thousands of requests over REST, WebSocket and gRPC, a fifth cancelled at random points and one
in twenty dropped mid-stream; afterwards nothing is left behind and every counter balances (DESIGN §5a).

CI runs a few hundred requests; `ORPHEUS_SOAK_REQUESTS=5000` runs the full size (docs/PERFORMANCE.md).
The server is a subprocess (its RSS is measured), on the sim engine; the sim codec keeps no per-session
state, so a smaller run repeats the exercise with the real stateful SNAC decoder (tiny weights), whose
state pool must be empty at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest
import websockets

from orpheus_serve.api.client import stream_url
from orpheus_serve.api.proto import orpheus_pb2 as pb
from orpheus_serve.api.proto import orpheus_pb2_grpc as pb_grpc
from orpheus_serve.benchmarking.launch import LaunchedServer
from tests.gateway_support import request_outcomes, settled_stats

CONCURRENCY = 32


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class _Soak:
    """Runs one request per call, in one of three fates: to the end, cancelled after a random number of
    audio messages, or the connection dropped after a random number. Counts what the client saw."""

    def __init__(self, server: LaunchedServer, max_tokens: int, seed: int) -> None:
        self.server = server
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.sent: Counter[str] = Counter()  # protocol -> requests sent
        self.fates: Counter[tuple[str, str]] = Counter()
        self.errors: list[str] = []

    def _fate(self) -> tuple[str, int]:
        roll = self.rng.random()
        fate = "cancel" if roll < 0.20 else "drop" if roll < 0.25 else "whole"
        return fate, self.rng.randint(0, 3)  # after this many audio messages

    async def rest(self, http: httpx.AsyncClient, i: int) -> None:
        fate, after = self._fate()
        self.sent["rest"] += 1
        body = {"input": f"Soak request {i} reads a line.", "response_format": "pcm", "max_tokens": self.max_tokens}
        async with http.stream("POST", f"{self.server.url}/v1/audio/speech", json=body) as response:
            if response.status_code != 200:
                self.errors.append(f"rest {response.status_code}: {(await response.aread())[:200]!r}")
                return
            seen = 0
            async for _ in response.aiter_raw():
                seen += 1
                if fate != "whole" and seen > after:
                    break  # REST has no cancel message: leaving the stream closes the connection
        self.fates[("rest", fate)] += 1

    async def ws(self, i: int) -> None:
        fate, after = self._fate()
        self.sent["ws"] += 1
        async with websockets.connect(stream_url(self.server.url), max_size=None) as ws:
            await ws.send(json.dumps({"text": f"Soak request {i} reads a line.", "max_tokens": self.max_tokens,
                                      "request_id": f"soak-{i}"}))
            seen = 0
            while True:
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, bytes):
                    seen += 1
                    if fate == "drop" and seen > after:
                        ws.transport.abort()  # gone without a close frame
                        self.fates[("ws", fate)] += 1
                        return
                    if fate == "cancel" and seen > after:
                        await ws.send(json.dumps({"cancel": True}))
                        fate = "cancelling"
                    continue
                reply = json.loads(message)
                if reply.get("done") or reply.get("cancelled") is True:
                    break
                if reply.get("cancelled") is False:  # it finished before the cancel arrived
                    break
                self.errors.append(f"ws: {reply}")
                return
        self.fates[("ws", "cancel" if fate == "cancelling" else fate)] += 1

    async def grpc(self, channel: grpc.aio.Channel, i: int) -> None:
        fate, after = self._fate()
        self.sent["grpc"] += 1
        if fate == "drop":  # a channel of its own, closed under the call
            channel = grpc.aio.insecure_channel(self.server.grpc_addr)
        call = pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(
            text=f"Soak request {i} reads a line.", sampling=pb.SamplingOptions(max_tokens=self.max_tokens)))
        seen = 0
        try:
            async for _ in call:
                seen += 1
                if fate != "whole" and seen > after:
                    if fate == "cancel":
                        call.cancel()
                    else:
                        await channel.close(grace=None)
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(f"grpc {exc.code()}: {exc.details()}")
                return
        finally:
            if fate == "drop":
                await channel.close(grace=None)
        self.fates[("grpc", fate)] += 1

    async def run(self, requests: int) -> None:
        semaphore = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as http, \
                grpc.aio.insecure_channel(self.server.grpc_addr) as channel:

            async def one(i: int) -> None:
                async with semaphore:
                    kind = i % 3
                    if kind == 0:
                        await self.rest(http, i)
                    elif kind == 1:
                        await self.ws(i)
                    else:
                        await self.grpc(channel, i)

            await asyncio.gather(*(one(i) for i in range(requests)))


def _soak(server: LaunchedServer, requests: int, max_tokens: int) -> tuple[_Soak, dict, float]:
    assert server.process is not None
    pid = server.process.pid
    warm = _Soak(server, max_tokens, seed=1)
    asyncio.run(warm.run(min(60, requests // 5)))  # warm every code path before the baseline RSS
    before = settled_stats(server.stats)
    rss_before = _rss_mib(pid)
    soak = _Soak(server, max_tokens, seed=2)
    started = time.perf_counter()
    asyncio.run(soak.run(requests))
    wall = time.perf_counter() - started
    after = settled_stats(server.stats, outcomes=request_outcomes(before) + requests)
    growth = _rss_mib(pid) - rss_before
    s0, s1 = before["scheduler"], after["scheduler"]
    print(f"soak: {requests} requests in {wall:.1f} s ({requests / wall:.0f}/s); RSS {rss_before:.1f} MB "
          f"+{growth:.1f} MB; fates {dict(soak.fates)}; scheduler finished {s1['finished'] - s0['finished']}, "
          f"cancelled {s1['cancelled'] - s0['cancelled']}, failed {s1['failed'] - s0['failed']}, "
          f"timed out {s1['timed_out'] - s0['timed_out']}; gateway {after['gateway']['requests']}")

    assert not soak.errors, soak.errors[:5]
    # Nothing left behind.
    assert after["kv_cache"]["used_slots"] == 0
    assert s1["active_sessions"] == 0 and s1["pending_sessions"] == 0
    codec = after["codec"]
    assert codec["queued_sessions"] == 0 and codec["backlog_frames"] == 0
    assert codec["decoder_sessions"] in (None, 0)
    assert after["flow"]["draining_streams"] == 0 and after["flow"]["in_codec_frames"] == 0
    assert after["gateway"]["open_connections"] == 0
    # Every counter balances: each admitted session ended exactly one way, each request has one outcome.
    ended = sum(s1[k] - s0[k] for k in ("finished", "cancelled", "failed", "timed_out"))
    admitted = s1["total_sessions"] - s0["total_sessions"]
    assert admitted == ended == requests, (admitted, ended, requests)  # short texts: one session each
    assert s1["failed"] == s0["failed"] and s1["timed_out"] == s0["timed_out"]
    r0, r1 = before["requests"], after["requests"]
    assert r1["active"] == 0
    assert (r1["requests_total"] - r0["requests_total"]) == requests == sum(
        r1[k] - r0[k] for k in ("requests_completed", "requests_cancelled", "requests_failed", "requests_rejected"))
    for protocol, sent in soak.sent.items():
        outcomes = after["gateway"]["requests"][protocol]
        previous = before["gateway"]["requests"].get(protocol, {})
        counted = sum(outcomes.values()) - sum(previous.values())
        assert counted == sent, (protocol, counted, sent, outcomes, previous, dict(soak.fates))
    return soak, after, growth


@pytest.mark.soak
def test_soak_sim_engine_three_protocols(tiny_orpheus: Path, tmp_path: Path) -> None:
    requests = int(os.environ.get("ORPHEUS_SOAK_REQUESTS", "450"))
    overrides = [
        "engine.backend=sim", f"engine.model_path={tiny_orpheus}", "codec.decoder=sim",
        f"codec.path={tiny_orpheus.parent / 'tiny-snac'}", "engine.sim.step_base_ms=2.0",
        "scheduler.max_concurrent_sessions=64", "scheduler.max_batch_size=64", "scheduler.max_queue=256",
        "server.log_level=warning",
    ]
    with LaunchedServer(overrides, log_path=tmp_path / "server.log") as server:
        soak, _, growth = _soak(server, requests, max_tokens=140)
    assert growth < 50
    assert soak.fates[("rest", "cancel")] + soak.fates[("ws", "cancel")] + soak.fates[("grpc", "cancel")] > 0
    assert soak.fates[("ws", "drop")] + soak.fates[("grpc", "drop")] > 0


@pytest.mark.soak
def test_soak_with_the_stateful_snac_decoder_leaves_no_decoder_state(tiny_models: Path, tmp_path: Path) -> None:
    overrides = [
        "engine.backend=sim", f"engine.model_path={tiny_models / 'tiny-orpheus'}", "engine.sim.step_base_ms=2.0",
        f"codec.path={tiny_models / 'tiny-snac'}", "codec.device=cpu", "codec.noise=false",
        "scheduler.max_concurrent_sessions=16", "scheduler.max_batch_size=16", "scheduler.max_queue=64",
        "server.log_level=warning",
    ]
    with LaunchedServer(overrides, log_path=tmp_path / "server.log") as server:
        _, after, _ = _soak(server, 60, max_tokens=70)
    assert after["codec"]["decoder_sessions"] == 0
