#!/usr/bin/env python3
"""The engine core alone: its loop period per step against the sim engine's modelled step time.

    PYTHONPATH=src python scripts/bench_engine_core.py --sessions 120 192 [--unpaced]

No sockets, no API process, no event loop: `core.client.CoreRuntime` (the scheduler,
the engine core thread and the codec worker, what both process modes run) with the sim
engine and sim codec on the benchmark's H100 FP8 cost model, N sessions that never end,
and every output taken at once (a thread reports delivery every 20 ms, so flow control
never holds a session back). What the loop period adds to the modelled step time here is
the engine core's own bookkeeping (schedule, update, codec pushes) and the interpreter
lock it shares with the codec thread: the floor under what `benchmark.py --mode sim`
measures with a server around it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from orpheus_serve.benchmarking.runner import h100_fp8_cost, sim_overrides
from orpheus_serve.codec.sim import SimDecoder
from orpheus_serve.config import load_config
from orpheus_serve.core.client import CoreRuntime, SessionOutput
from orpheus_serve.engines.sim_engine import SimEngine
from orpheus_serve.scheduler import SessionRequest
from orpheus_serve.scheduler.step import SamplingParams

PROMPT = tuple(range(128000, 128040))  # 40 prompt tokens, as the sim benchmark's


def measure(sessions: int, warm_s: float, measure_s: float, *, unpaced: bool) -> dict[str, float]:
    # unpaced: client buffers without bound, so every session decodes in every step (the largest batches).
    pacing = ["scheduler.max_client_buffer_s=100000", "scheduler.max_server_buffer_s=100000"] if unpaced else []
    config = load_config(overrides=[
        *sim_overrides(h100_fp8_cost(), slots=max(sessions, 1), frames=100_000, max_batch=4096),
        "scheduler.admission=slots", "engine.max_seq_len=100000", *pacing,
    ], env={})
    taken: list[tuple[str, int]] = []
    taken_lock = threading.Lock()

    def post(session_id: str, item: SessionOutput) -> None:
        if isinstance(item, bytes):
            with taken_lock:
                taken.append((session_id, len(item) // 2))

    runtime = CoreRuntime(config, SimEngine.from_config(config), SimDecoder(), post)
    stop = threading.Event()

    def deliver() -> None:
        while not stop.wait(0.02):
            with taken_lock:
                items = taken[:]
                taken.clear()
            for session_id, samples in items:
                runtime.note_delivered(session_id, samples)
            runtime.wake()

    runtime.start()
    deliverer = threading.Thread(target=deliver, daemon=True)
    deliverer.start()
    try:
        for i in range(sessions):
            runtime.submit(SessionRequest(f"s{i}", PROMPT, SamplingParams(max_tokens=90_000), time.monotonic()))
        time.sleep(warm_s)  # the measurement window, not a wait for state
        before, cpu_before = runtime.stats(), time.process_time()
        time.sleep(measure_s)
        after, cpu_after = runtime.stats(), time.process_time()
    finally:
        stop.set()
        deliverer.join()
        runtime.shutdown()
    steps = after.steps - before.steps
    tokens = after.scheduler.total_tokens - before.scheduler.total_tokens
    loop = (after.loop_s - before.loop_s) / steps
    model = (after.engine_elapsed_s - before.engine_elapsed_s) / steps
    return {"sessions": sessions, "steps": steps, "loop_ms": 1000 * loop, "model_ms": 1000 * model,
            "step_call_ms": 1000 * (after.busy_s - before.busy_s) / steps, "over": loop / model - 1,
            "cpu_us_per_token": 1e6 * (cpu_after - cpu_before) / tokens}


def host_clock_cost(steps: int = 20_000) -> dict[str, float]:
    """What the loop's host-time record costs (core/host_time.py): the marks of one loop iteration as the
    overlapped loop makes them (begin, eight marks, finish, one plan row), and one `core_host` summary."""
    from orpheus_serve.core.host_time import (
        CODEC_HANDOFF,
        DEVICE_WAIT,
        LAUNCH,
        OTHER,
        OUTPUT,
        PLAN,
        CoreHostSampler,
        LoopClock,
        PassClock,
    )

    clock, passes = LoopClock(), PassClock()
    marks = (PLAN, OTHER, LAUNCH, OTHER, DEVICE_WAIT, OUTPUT, CODEC_HANDOFF, OUTPUT)
    start = time.perf_counter()
    for i in range(steps):
        clock.begin()
        for phase in marks:
            clock.mark(phase)
        clock.record_plan(0.007, 100, i % 2, 40 * (i % 2))
        clock.finish()
        passes.record(0.003, 0.001, 16)
    per_step_us = 1e6 * (time.perf_counter() - start) / steps
    bare = time.perf_counter()
    for _ in range(steps):  # the same loop without the clock: what the loop costs by itself
        for _phase in marks:
            pass
    per_step_us -= 1e6 * (time.perf_counter() - bare) / steps
    sampler = CoreHostSampler()
    sampler.sample(clock, passes)  # the first one pays for numpy's and torch's first calls
    start = time.perf_counter()
    for _ in range(20):
        sampler.sample(clock, passes, max_age_s=0.0)  # made anew each time
    return {"per_step_us": per_step_us, "summary_ms": 1000 * (time.perf_counter() - start) / 20}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[120, 192])
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--measure-s", type=float, default=5.0)
    ap.add_argument("--unpaced", action="store_true", help="no flow-control pacing: every session in every step")
    args = ap.parse_args(argv)
    sys.setswitchinterval(load_config(env={}).server.switch_interval_ms / 1000.0)
    print("sessions  steps  loop ms  model ms  engine call ms  loop over model  CPU us/token")
    for n in args.sessions:
        r = measure(n, args.warm_s, args.measure_s, unpaced=args.unpaced)
        print(f"{r['sessions']:>8}  {r['steps']:>5}  {r['loop_ms']:>7.3f}  {r['model_ms']:>8.3f}  "
              f"{r['step_call_ms']:>14.3f}  {r['over']:>15.1%}  {r['cpu_us_per_token']:>12.1f}")
    cost = host_clock_cost()
    print(f"host-time record (core_host): {cost['per_step_us']:.2f} us of marks per loop iteration, "
          f"{cost['summary_ms']:.2f} ms per summary (when stats are asked for)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
