#!/usr/bin/env python3
"""Time to first audio over orpheus.v1 gRPC and over Riva's API, side by side on one server.

    PYTHONPATH=src python scripts/bench_riva.py --tokenizer models/tiny-orpheus [--requests 60] [--in-flight 4]

Starts one server with the sim engine and sim codec (GPU-like pacing, no model; the tokenizer comes from
the given model folder) and sends the same workload interleaved over three paths: orpheus.v1
`Synthesize` (pcm, 24 kHz), Riva `SynthesizeOnline` (LINEAR_PCM, 24 kHz) and Riva `SynthesizeOnline`
(MULAW, 8 kHz), `--in-flight` requests at a time, after a warm-up round. Prints TTFB p50 / p95 per path:
what the Riva adapter (a context per call, G.711 coding) adds to the native path. Timings on a shared
machine are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PATHS = (("grpc", "pcm"), ("riva", "pcm"), ("riva", "mulaw"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="model folder with tokenizer.json")
    ap.add_argument("--requests", type=int, default=60, help="per path")
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=140)
    args = ap.parse_args(argv)

    import grpc

    from orpheus_serve.api.launch import ServerThread
    from orpheus_serve.client import protocols as client
    from orpheus_serve.config import load_config

    config = load_config(overrides={
        "server.host": "127.0.0.1", "server.http_port": 0, "server.grpc_port": 0, "server.log_level": "warning",
        "engine.backend": "sim", "codec.decoder": "sim", "engine.model_path": str(args.tokenizer),
        "codec.path": str(args.tokenizer), "scheduler.max_concurrent_sessions": 32,
        "scheduler.max_batch_size": 32}, env={})
    server = ServerThread(config).start()

    async def round_() -> list[tuple[str, str, client.ClientResult]]:
        gate = asyncio.Semaphore(args.in_flight)
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            async def one(i: int, protocol: str, fmt: str) -> tuple[str, str, client.ClientResult]:
                async with gate:
                    return protocol, fmt, await client.synthesize(
                        protocol, f"Request number {i} says hello there.", grpc_addr=server.grpc_address, fmt=fmt,
                        max_tokens=args.max_tokens, seed=i, channel=channel)
            return await asyncio.gather(*(one(i, *PATHS[i % len(PATHS)])
                                          for i in range(args.requests * len(PATHS))))

    try:
        asyncio.run(round_())  # warm-up
        results = asyncio.run(round_())
    finally:
        server.stop()
    print("| path | requests | failed | TTFB p50 ms | TTFB p95 ms |\n|---|---|---|---|---|")
    for protocol, fmt in PATHS:
        rows = [r for p, f, r in results if (p, f) == (protocol, fmt)]
        ttfb = sorted(r.ttfb_s * 1000 for r in rows if r.ok and r.ttfb_s is not None)
        failed = sum(not r.ok for r in rows)
        p95 = ttfb[max(0, round(0.95 * len(ttfb)) - 1)] if ttfb else float("nan")
        print(f"| {protocol} {fmt} | {len(rows)} | {failed} | {statistics.median(ttfb):.1f} | {p95:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
