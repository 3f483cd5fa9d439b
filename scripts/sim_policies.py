#!/usr/bin/env python3
"""Compare the `fair` and `deadline` scheduling policies on the sim engine, in virtual time.

    PYTHONPATH=src python scripts/sim_policies.py [--slots 64] [--batch 16] [--seed 1]

The scheduler runs as in the server against SimEngine(realtime=False) with the
H100-like cost model (engines/sim_engine.h100_cost_model); sessions arrive at
seeded random times; a client starts playback at its first audio and counts an
underrun whenever it runs dry. Prints three tables: 64 concurrent sessions,
a concurrency sweep (N sessions arriving within `--window` seconds), and an
offered-load sweep (the same sessions spread over longer arrival windows).
See orpheus_serve/benchmarking/simulate.py.
"""

from __future__ import annotations

import argparse
import time

from orpheus_serve.benchmarking.simulate import (
    SimulationSetup,
    Workload,
    compare_policies,
    format_table,
    realtime_capacity,
)
from orpheus_serve.config import SchedulerConfig
from orpheus_serve.engines.sim_engine import h100_cost_model


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=64, help="KV-cache slots (max concurrent sessions)")
    parser.add_argument("--batch", type=int, default=16, help="scheduler.max_batch_size")
    parser.add_argument("--sessions", type=int, default=64, help="sessions in the headline comparison")
    parser.add_argument("--window", type=float, default=2.0, help="arrival window (s) for 'concurrent' sessions")
    parser.add_argument("--sweep", type=_ints, default=_ints("8,16,24,32,48,64"), help="concurrency sweep")
    parser.add_argument("--load-windows", type=_floats, default=_floats("8,15,25,40"), help="arrival windows (s)")
    parser.add_argument("--lookahead", type=int, default=2, help="codec lookahead frames")
    parser.add_argument("--codec-latency-ms", type=float, default=10.0, help="FramesReady -> audio at the client")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    cost = h100_cost_model()
    scheduler = SchedulerConfig(
        max_concurrent_sessions=args.slots,
        max_batch_size=args.batch,
        max_queue=1000,
        queue_timeout_s=600.0,
        session_timeout_s=600.0,
    )
    setup = SimulationSetup(
        scheduler=scheduler,
        num_slots=args.slots,
        cost=cost,
        lookahead_frames=args.lookahead,
        codec_latency_s=args.codec_latency_ms / 1000,
    )
    print(
        f"cost model: step_ms = {cost.step_base_ms} + {cost.step_per_seq_ms}*batch + "
        f"{cost.step_per_ctx_token_ms}*context + {cost.prefill_per_token_ms}*prefill tokens; "
        f"codec lookahead {args.lookahead} frames, codec latency {args.codec_latency_ms:.0f} ms"
    )
    print(
        f"real-time capacity at batch {args.batch} (1000-token contexts): "
        f"~{realtime_capacity(cost, args.batch, 1000):.1f} voices; utterances 2-12 s, prompts 30-90 tokens\n"
    )
    started = time.perf_counter()

    def table(title: str, workloads: list[Workload]) -> None:
        print(title)
        print(format_table([r for w in workloads for r in compare_policies(setup, w)]))
        print()

    table(
        f"{args.sessions} concurrent sessions (arriving within {args.window:g} s)",
        [Workload(args.sessions, args.window, seed=args.seed)],
    )
    table(
        f"concurrency sweep (N sessions arriving within {args.window:g} s)",
        [Workload(n, args.window, seed=args.seed) for n in args.sweep],
    )
    table(
        f"offered load ({args.sessions} sessions arriving over W s)",
        [Workload(args.sessions, w, seed=args.seed) for w in args.load_windows],
    )
    print(f"({time.perf_counter() - started:.1f} s wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
