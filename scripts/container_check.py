#!/usr/bin/env python3
"""Checks `scripts/test_container.sh` runs against the server of a built image, with that image's Python.

    python3 container_check.py free-ports
    python3 container_check.py unhealthy  --healthcheck JSON
    python3 container_check.py ready      --url URL --server-pid PID [--timeout-s 300]
    python3 container_check.py serve      --url URL --grpc ADDR --server-pid PID --healthcheck JSON
    python3 container_check.py drain      --url URL --grpc ADDR --server-pid PID --healthcheck JSON

The script runs it inside the image (chroot, as the image's user), so the clients are the image's own
packages: httpx, websockets, grpcio and the package's generated stubs; nothing from the host's environment.
`--healthcheck` is the image's HEALTHCHECK as `podman image inspect` gives it ({"Test": ["CMD", ...]}),
run as Docker would run it. Every check prints one line; the first failure raises with what was seen.
tests/test_container_drain.py runs `drain` against a server process on the host, on the same tiny models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect as ws_connect

from orpheus_serve.config import load_config
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc

SAMPLES_PER_FRAME = 2048  # one SNAC frame at 24 kHz (ARCHITECTURE §4)
FRAME_S = SAMPLES_PER_FRAME / 24000
TOKENS_PER_FRAME = 7
SIGNAL_AFTER_FRAMES = 10
# The drain's streams: at most ~8.5 s of audio (100 frames), paced by flow control (the client may hold
# scheduler.max_client_buffer_s unplayed, ARCHITECTURE §5a), so they are still running when SIGTERM comes after
# their first 10 frames. On a slower (or busier) machine they are shorter: sized from the speed measured just
# before, so that what is left of them after the signal needs at most DRAIN_BUDGET of the image's drain window
# (server.shutdown_grace_s). A fixed size once outran the window with a CPU hog beside the server.
DRAIN_MAX_FRAMES = 100
DRAIN_MIN_FRAMES = SIGNAL_AFTER_FRAMES + 10
DRAIN_BUDGET = 0.5
CALIBRATION_TOKENS = 140  # 20 frames: inside the client's allowed lead, so generated as fast as the server can


class CheckFailed(AssertionError):
    pass


def check(condition: bool, what: str, seen: object = "") -> None:
    if not condition:
        raise CheckFailed(f"{what}: {seen}" if seen != "" else what)
    print(f"  ok  {what}", flush=True)


def free_ports(count: int = 2) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def server_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def healthcheck_command(healthcheck: dict) -> list[str]:
    """The command Docker runs for a HEALTHCHECK (CMD: exec form; CMD-SHELL: through /bin/sh -c)."""
    test = healthcheck["Test"]
    if test[0] == "CMD":
        return list(test[1:])
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", test[1]]
    raise CheckFailed(f"the image has no usable HEALTHCHECK: {test}")


def run_healthcheck(healthcheck: dict) -> tuple[int, str]:
    timeout_s = healthcheck.get("Timeout", 30 * 10**9) / 1e9
    done = subprocess.run(healthcheck_command(healthcheck), capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    return done.returncode, (done.stdout + done.stderr).strip()


def wait_ready(url: str, server_pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not server_alive(server_pid):
            raise CheckFailed(f"the server (pid {server_pid}) exited before /ready said ready ({last})")
        try:
            response = httpx.get(f"{url}/ready", timeout=5)
            last = f"{response.status_code} {response.text}"
            if response.status_code == 200:
                print(f"  ok  /ready: {response.text}", flush=True)
                return
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise CheckFailed(f"/ready did not answer 200 within {timeout_s:g}s (last: {last})")


def process_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Uid:"):
                return int(line.split()[1])  # real uid
    raise CheckFailed(f"no Uid line for pid {pid}")


async def grpc_health(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def serve_checks(args: argparse.Namespace) -> None:
    healthcheck = json.loads(args.healthcheck)
    uid = process_uid(args.server_pid)
    check(uid != 0, "the server runs as a non-root user", f"uid {uid}")
    check(uid == os.getuid(), "the checks run as the server's user (the image's USER)", f"{uid} vs {os.getuid()}")
    code, said = run_healthcheck(healthcheck)
    check(code == 0, f"the image's HEALTHCHECK {healthcheck['Test']} passes ({said})", f"exit {code}")

    models = httpx.get(f"{args.url}/v1/models", timeout=10).json()
    card = models["data"][0]
    check(card["tiny"] and "TINY" in (card["warning"] or ""),
          "with nothing at /models it serves the tiny models and says so", card)

    response = httpx.post(f"{args.url}/v1/audio/speech", timeout=120,
                          json={"model": "orpheus", "input": "Hello from the container.", "voice": "tara",
                                "response_format": "wav", "max_tokens": 140, "seed": 3})
    check(response.status_code == 200 and response.headers["content-type"].startswith("audio/wav"),
          "POST /v1/audio/speech answers audio/wav", f"{response.status_code} {response.text[:300]}")
    body = response.content
    check(body[:4] == b"RIFF" and body[8:12] == b"WAVE" and len(body) > 44 + 2 * SAMPLES_PER_FRAME * 5,
          f"a WAV of {(len(body) - 44) / 2 / 24000:.2f} s", len(body))

    bad = httpx.post(f"{args.url}/v1/audio/speech", json={"model": "orpheus", "input": ""}, timeout=10)
    check(bad.status_code == 400 and "error" in bad.json(), "an empty input is a 400 with an OpenAI error body",
          f"{bad.status_code} {bad.text[:200]}")

    status = asyncio.run(grpc_health(args.grpc))
    check(status == "SERVING", "gRPC health: SERVING", status)
    frames, finish_reason, samples, audio_bytes = asyncio.run(grpc_synthesize(args.grpc, "Hello over gRPC.", 140))
    check(finish_reason in ("stop", "length") and frames > 0 and audio_bytes == 2 * samples > 0,
          f"gRPC Synthesize streams {samples / 24000:.2f} s of audio and ends with {finish_reason!r}",
          (frames, finish_reason, samples, audio_bytes))


async def grpc_synthesize(address: str, text: str, max_tokens: int) -> tuple[int, str, int, int]:
    """(audio messages, finish reason, samples the metrics report, audio bytes received)."""
    messages, audio_bytes, finish_reason, samples = 0, 0, "", 0
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.SynthesizerStub(channel).Synthesize(
            pb.SynthesizeRequest(text=text, sampling=pb.SamplingOptions(max_tokens=max_tokens, seed=4)), timeout=120)
        async for response in call:
            if response.HasField("audio"):
                messages += 1
                audio_bytes += len(response.audio.audio)
            else:
                finish_reason, samples = response.metrics.finish_reason, response.metrics.samples
    return messages, finish_reason, samples, audio_bytes


@dataclass
class Stream:
    """One stream as the client saw it across the signal."""

    protocol: str
    audio_bytes: int = 0
    arrivals: list[float] = field(default_factory=list)
    finish_reason: str = ""
    samples: int = 0
    first_message_bytes: int = 0
    going: asyncio.Event = field(default_factory=asyncio.Event)

    def received(self, data: bytes) -> None:
        if not self.arrivals:
            self.first_message_bytes = len(data)
        self.audio_bytes += len(data)
        self.arrivals.append(time.monotonic())
        if self.audio_bytes >= 2 * SAMPLES_PER_FRAME * SIGNAL_AFTER_FRAMES:
            self.going.set()

    @property
    def frames_per_s(self) -> float:
        """Frames per second from its first audio message to its last (what came with the first is not timed)."""
        span = self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0
        timed_frames = (self.audio_bytes - self.first_message_bytes) / (2 * SAMPLES_PER_FRAME)
        return timed_frames / span if span > 0 else float("inf")


def check_whole(stream: Stream, asked_frames: int, when: str) -> None:
    """A stream asked for `asked_frames` frames (max_tokens = 7 a frame) got all of their audio: it ran to
    its limit (`length`: with their seeds, the tiny models do not end these streams early, up to
    DRAIN_MAX_FRAMES; and a server that cut one short could report `length` too) and its client received
    every sample of every frame, as many as the server's own metrics count. Bytes that match a short count,
    or a count that matches short bytes, fail."""
    expected = asked_frames * SAMPLES_PER_FRAME
    check(stream.finish_reason == "length" and stream.samples == expected and stream.audio_bytes == 2 * expected,
          f"the {stream.protocol} stream ended whole {when}: {asked_frames} frames asked, "
          f"{stream.audio_bytes // 2} samples received ({stream.audio_bytes / 2 / 24000:.2f} s), "
          f"finish_reason {stream.finish_reason!r}",
          f"finish_reason {stream.finish_reason!r}, {stream.audio_bytes} bytes received and {stream.samples} "
          f"samples reported, {expected} samples ({2 * expected} bytes) asked")


async def ws_stream(url: str, stream: Stream, max_tokens: int) -> Stream:
    ws_url = url.replace("http://", "ws://", 1) + "/v1/audio/stream"
    async with ws_connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"text": "Finish me, please, whatever happens.", "response_format": "pcm",
                                  "max_tokens": max_tokens, "seed": 1}))
        async for frame in ws:
            if isinstance(frame, bytes):
                stream.received(frame)
                continue
            reply = json.loads(frame)
            if "error" in reply:
                raise CheckFailed(f"the WebSocket stream got an error: {reply}")
            if reply.get("done"):
                stream.finish_reason, stream.samples = reply["metrics"]["finish_reason"], reply["metrics"]["samples"]
                return stream
    raise CheckFailed("the WebSocket closed before its request finished")


async def grpc_stream(address: str, stream: Stream, max_tokens: int) -> Stream:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.SynthesizerStub(channel).Synthesize(
            pb.SynthesizeRequest(text="Me too, to the very last sample.",
                                 sampling=pb.SamplingOptions(max_tokens=max_tokens, seed=2)), timeout=120)
        async for response in call:
            if response.HasField("audio"):
                stream.received(response.audio.audio)
            else:
                stream.finish_reason, stream.samples = response.metrics.finish_reason, response.metrics.samples
    return stream


async def measured_frames_per_s(args: argparse.Namespace) -> float:
    """The slower of a WebSocket and a gRPC stream run together, as the drain's two streams will run: short
    enough that flow control does not pace them, so this is the server's own speed on this machine now."""
    ws, rpc = Stream("WebSocket"), Stream("gRPC")
    await asyncio.wait_for(asyncio.gather(ws_stream(args.url, ws, CALIBRATION_TOKENS),
                                          grpc_stream(args.grpc, rpc, CALIBRATION_TOKENS)), 300)
    for stream in (ws, rpc):
        check_whole(stream, CALIBRATION_TOKENS // TOKENS_PER_FRAME, "(the speed measurement)")
    return min(ws.frames_per_s, rpc.frames_per_s)


def drain_frames(frames_per_s: float, grace_s: float, client_buffer_s: float) -> int:
    """The longest drain stream (frames) whose rest after the signal fits in DRAIN_BUDGET of the drain window:
    that rest is bounded by generation (frames left at the measured speed) and by real-time pacing (its audio
    past the client's allowed lead)."""
    budget_s = DRAIN_BUDGET * grace_s

    def after_signal_s(frames: int) -> float:
        return max((frames - SIGNAL_AFTER_FRAMES) / frames_per_s, frames * FRAME_S - client_buffer_s)

    fitting = [n for n in range(DRAIN_MIN_FRAMES, DRAIN_MAX_FRAMES + 1) if after_signal_s(n) <= budget_s]
    if not fitting:
        raise CheckFailed(f"this machine generates {frames_per_s:.1f} frames/s per stream now: even a "
                          f"{DRAIN_MIN_FRAMES}-frame stream needs {after_signal_s(DRAIN_MIN_FRAMES):.1f} s after "
                          f"the signal, over {DRAIN_BUDGET:g} of the image's {grace_s:g} s drain window")
    return fitting[-1]


async def drain_checks(args: argparse.Namespace) -> None:
    healthcheck = json.loads(args.healthcheck)
    # The image's own settings (its config file and ENV, as the server read them): the drain window under test.
    config = load_config()
    grace_s, client_buffer_s = config.server.shutdown_grace_s, config.scheduler.max_client_buffer_s
    frames_per_s = await measured_frames_per_s(args)
    frames = drain_frames(frames_per_s, grace_s, client_buffer_s)
    check(DRAIN_MIN_FRAMES <= frames <= DRAIN_MAX_FRAMES and math.isfinite(frames_per_s) and frames_per_s > 0,
          f"measured {frames_per_s:.1f} frames/s per stream: drain streams of {frames} frames "
          f"({frames * FRAME_S:.1f} s of audio) in a {grace_s:g} s window", (frames_per_s, frames))
    ws, rpc = Stream("WebSocket"), Stream("gRPC")
    tasks = [asyncio.create_task(ws_stream(args.url, ws, frames * TOKENS_PER_FRAME)),
             asyncio.create_task(grpc_stream(args.grpc, rpc, frames * TOKENS_PER_FRAME))]
    going = asyncio.ensure_future(asyncio.gather(ws.going.wait(), rpc.going.wait()))
    done, _ = await asyncio.wait([*tasks, going], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if going not in done:  # a stream that ended (or failed) before both had their frames out, or a timeout
        for task in (*tasks, going):
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        raise CheckFailed(f"the streams were not both under way before the signal: {ws.audio_bytes} WebSocket "
                          f"and {rpc.audio_bytes} gRPC audio bytes; {outcomes}")
    under_way = 2 * SAMPLES_PER_FRAME * SIGNAL_AFTER_FRAMES
    check(ws.audio_bytes >= under_way and rpc.audio_bytes >= under_way and not any(t.done() for t in tasks),
          f"a WebSocket and a gRPC stream have {SIGNAL_AFTER_FRAMES} frames out each and are still running",
          f"{ws.audio_bytes} and {rpc.audio_bytes} bytes")

    signalled = time.monotonic()
    os.kill(args.server_pid, signal.SIGTERM)
    async with httpx.AsyncClient(timeout=5) as http:
        while (ready := await http.get(f"{args.url}/ready")).status_code != 503:
            if time.monotonic() - signalled > 5:
                raise CheckFailed(f"/ready still answers {ready.status_code} 5 s after SIGTERM")
            await asyncio.sleep(0.02)
        check(ready.json()["status"] == "shutting_down", "after SIGTERM /ready answers 503 shutting_down",
              ready.text)
        code, said = await asyncio.to_thread(run_healthcheck, healthcheck)
        check(code != 0, f"the image's HEALTHCHECK fails while draining ({said})", f"exit {code}")
        refused = await http.post(f"{args.url}/v1/audio/speech", json={"model": "orpheus", "input": "Too late."})
        check(refused.status_code == 503, "a new request while draining is refused with 503",
              f"{refused.status_code} {refused.text[:200]}")
    status = await grpc_health(args.grpc)
    check(status == "NOT_SERVING", "gRPC health while draining: NOT_SERVING", status)

    for stream in await asyncio.wait_for(asyncio.gather(*tasks), 120):
        check_whole(stream, frames, "across SIGTERM")
        after = sum(1 for arrival in stream.arrivals if arrival > signalled)
        check(after > 0, f"the {stream.protocol} stream received {after} audio messages after the signal")
    finished_s = time.monotonic() - signalled
    check(finished_s <= grace_s, f"both streams finished {finished_s:.2f} s after SIGTERM, inside the "
                                 f"{grace_s:g} s drain window", f"{finished_s:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("free-ports", "unhealthy", "ready", "serve", "drain"))
    parser.add_argument("--url", help="the server's HTTP base URL")
    parser.add_argument("--grpc", help="the server's gRPC host:port")
    parser.add_argument("--server-pid", type=int, help="the server's process id")
    parser.add_argument("--healthcheck", help="the image's HEALTHCHECK as JSON")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    try:
        if args.check == "free-ports":
            print(*free_ports())
        elif args.check == "unhealthy":
            code, said = run_healthcheck(json.loads(args.healthcheck))
            check(code != 0, f"the image's HEALTHCHECK fails while no server listens ({said})", f"exit {code}")
        elif args.check == "ready":
            wait_ready(args.url, args.server_pid, args.timeout_s)
        elif args.check == "serve":
            serve_checks(args)
        else:
            asyncio.run(drain_checks(args))
    except CheckFailed as exc:
        print(f"FAIL  {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
