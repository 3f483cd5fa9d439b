#!/usr/bin/env python3
"""What Ray Serve adds: the same load against one server process and against one Serve replica.

    .venv/bin/python scripts/bench_serve_overhead.py [--streams 64] [--rounds 2] [--max-tokens 280]
                                                     [--tiny-models DIR] [--output results/serve_overhead.json]

Both run the sim engine and sim codec (engine.backend=sim, codec.decoder=sim: GPU-like pacing, little
CPU), so what differs is the path a request takes: client -> uvicorn -> app (direct), or client ->
Serve's proxy -> the replica actor -> the same app (Serve). Each side gets `--streams` concurrent REST
streams (workers started over `--ramp-s`), each worker `--rounds` requests back to back. Reported: time to first audio byte at the client (p50/p95) and the CPU
seconds the serving processes spent per second of audio delivered (direct: the server process;
Serve: proxy + replica, and the whole Ray cluster's processes). The direct server runs as its own
process (production_server.py), as the replica does, so neither shares the client's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BYTES_PER_SECOND = 2 * 24000
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pids_named(prefix: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith(prefix):
                found.append(int(entry.name))
    return found


def overrides(tiny: Path, streams: int, max_tokens: int) -> list[str]:
    return ["engine.backend=sim", "codec.decoder=sim", f"engine.model_path={tiny / 'tiny-orpheus'}",
            f"codec.path={tiny / 'tiny-snac'}", f"scheduler.max_concurrent_sessions={streams}",
            f"scheduler.max_batch_size={streams}", "scheduler.admission=slots", f"sampling.max_tokens={max_tokens}",
            "sampling.min_tokens=28", "server.log_level=warning", "server.playground=false"]


async def one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttfb = None
    size = 0
    async with client.stream("POST", f"{url}/v1/audio/speech",
                             json={"input": "Measure the path, not the model.", "response_format": "pcm",
                                   "max_tokens": max_tokens}) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            if ttfb is None:
                ttfb = time.perf_counter() - start
            size += len(chunk)
    assert ttfb is not None
    return ttfb, size


async def load(url: str, streams: int, rounds: int, max_tokens: int,
               ramp_s: float) -> tuple[list[float], int, float]:
    """`streams` workers, each `rounds` requests back to back; their starts spread over `ramp_s` so the
    first round is not one burst of simultaneous connections (which measures the client, not the path)."""
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + 4)) as client:
        for _ in range(4):
            await one(client, url, 28)  # warm the path (connections, first-call imports)
        results: list[tuple[float, int]] = []

        async def worker(i: int) -> None:
            await asyncio.sleep(i * ramp_s / streams)
            for _ in range(rounds):
                results.append(await one(client, url, max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(streams)))
        return [t for t, _ in results], sum(size for _, size in results), time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, ttfbs: list[float], audio_bytes: int, wall_s: float, cpu: dict[str, float]) -> dict[str, Any]:
    audio_s = audio_bytes / BYTES_PER_SECOND
    row = {"name": name, "requests": len(ttfbs), "ttfb_p50_ms": round(1000 * statistics.median(ttfbs), 1),
           "ttfb_p95_ms": round(1000 * percentile(ttfbs, 0.95), 1), "audio_s": round(audio_s, 1),
           "wall_s": round(wall_s, 1), **{f"cpu_{k}_s": round(v, 2) for k, v in cpu.items()},
           **{f"cpu_{k}_per_audio_s": round(v / audio_s, 4) for k, v in cpu.items()}}
    print(json.dumps(row), flush=True)
    return row


def wait_ready(url: str, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready within {within_s}s")


def run_direct(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, str(ROOT / "production_server.py"), "--host", "127.0.0.1", "--port", str(port),
               "--grpc-port", "0"]
    for item in overrides(args.tiny_models, args.streams, args.max_tokens):
        command += ["--set", item]
    server = subprocess.Popen(command, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        before = cpu_seconds(server.pid)
        ttfbs, size, wall = asyncio.run(load(url, args.streams, args.rounds, args.max_tokens, args.ramp_s))
        return summary("direct", ttfbs, size, wall, {"server": cpu_seconds(server.pid) - before})
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from orpheus_serve.config import load_config
    from orpheus_serve.deploy.ray import RaySettings, run_apps

    port = free_port()
    config = load_config(overrides=overrides(args.tiny_models, args.streams, args.max_tokens), env={})
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        run_apps(RaySettings(replicas=1, num_cpus=1), config)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
        replica = stats["replicas"][0]["pid"]
        proxy = pids_named("ray::ProxyActor")
        cluster = [p for p in pids_named("ray::") + pids_named(str(Path(ray.__file__).parent)) if p != os.getpid()]
        groups = {"replica": [replica], "proxy": proxy, "ray_all": sorted(set(cluster) | {replica})}
        before = {k: sum(cpu_seconds(p) for p in v) for k, v in groups.items()}
        ttfbs, size, wall = asyncio.run(load(url, args.streams, args.rounds, args.max_tokens, args.ramp_s))
        after = {k: sum(cpu_seconds(p) for p in v) for k, v in groups.items()}
        cpu = {k: after[k] - before[k] for k in groups}
        cpu["replica_plus_proxy"] = cpu["replica"] + cpu["proxy"]
        return summary("serve", ttfbs, size, wall, cpu)
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ramp-s", type=float, default=2.0, help="the workers' starts spread over this long")
    parser.add_argument("--max-tokens", type=int, default=280, help="per request: 40 frames, 3.4 s of audio")
    parser.add_argument("--tiny-models", type=Path, default=Path(os.environ.get("ORPHEUS_TINY_MODELS", "models/tiny")),
                        help="folder with tiny-orpheus/ (its tokenizer) and tiny-snac/ (scripts/make_tiny_models.py)")
    parser.add_argument("--output", type=Path, default=Path("results/serve_overhead.json"))
    args = parser.parse_args()
    args.tiny_models = args.tiny_models.resolve()
    rows = [run_direct(args), run_serve(args)]
    direct, served = rows
    added = {"ttfb_p50_added_ms": round(served["ttfb_p50_ms"] - direct["ttfb_p50_ms"], 1),
             "ttfb_p95_added_ms": round(served["ttfb_p95_ms"] - direct["ttfb_p95_ms"], 1),
             "cpu_per_audio_s_direct": direct["cpu_server_per_audio_s"],
             "cpu_per_audio_s_serve": served["cpu_replica_plus_proxy_per_audio_s"],
             "cpu_per_audio_s_serve_all_ray": served["cpu_ray_all_per_audio_s"]}
    print(json.dumps(added), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"streams": args.streams, "rounds": args.rounds, "max_tokens": args.max_tokens,
                                       "ramp_s": args.ramp_s,
                                       "cpu_count": os.cpu_count(), "runs": rows, "added": added}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
