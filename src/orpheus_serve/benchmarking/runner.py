"""Benchmark modes, run from the client side against real servers (ARCHITECTURE §8).

    single    one request at a time: TTFB and RTF with nothing else running
    scaling   concurrency 1 -> N (closed loop); the largest concurrency whose p95
              TTFB is under the target with no underrun
    tuning    the same load against servers started with other settings
              (max_batch_size, decoder / window settings)
    sim       the sim engine + sim codec with an H100 cost model behind the real
              gateway at 128+ concurrent streams: what the gateway, scheduler and
              codec plumbing cost, and real-time streams against the analytic bound
    compare   (--compare baseline) the same load against `engine.mode: batched`
              and `engine.mode: baseline` servers started one after the other

Every server is a subprocess started here (or an existing one given by --url).
Numbers from one run are comparable with each other; absolute times on a CPU
say little about a GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import platform
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..client.records import percentile, summarize
from ..config import SimConfig
from ..replay import CardProfile
from ..request.types import PROTOCOLS
from ..token_format import FRAME_SECONDS, TOKENS_PER_SECOND_REALTIME
from .workload import make_workload


@dataclass
class Target:
    """Where requests go: a launched server or an existing one."""

    url: str
    grpc_addr: str
    label: str = "server"

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/v1/stats", timeout=10.0).json()


@dataclass
class LoadSpec:
    requests: int
    concurrency: int
    protocol: str = "rest"  # rest | ws | grpc | mixed
    seed: int = 0
    max_tokens: int | None = None
    voice_mix: tuple[str, ...] = ("tara", "leah", "leo", "zoe")
    text_mix: tuple[float, float, float] = (0.6, 0.3, 0.1)
    max_chars: int | None = None  # the server profile's max_text_chars
    ramp_s: float = 0.0  # the first `concurrency` requests start spread evenly over this time
    input_tokens_per_s: float | None = None  # text streamed in (WebSocket contexts): words sent at this rate
    extra: dict[str, Any] = field(default_factory=dict)


async def run_load(target: Target, spec: LoadSpec, *, progress: Callable[[int], None] | None = None,
                   lags: list[float] | None = None) -> tuple[list[Any], float]:
    """Closed loop: `spec.requests` requests, at most `spec.concurrency` in flight. Returns (results, wall_s);
    `lags` gets this client's event-loop lag every 50 ms."""
    lags = [] if lags is None else lags
    from ..client.protocols import synthesize, synthesize_ws_context

    workload = make_workload(spec.requests, seed=spec.seed, mix=spec.text_mix, voices=spec.voice_mix,
                             max_chars=spec.max_chars)
    protocols = itertools.cycle(PROTOCOLS) if spec.protocol == "mixed" else itertools.repeat(spec.protocol)
    jobs = list(zip(workload.texts, workload.voices, protocols, strict=False))
    sampling = {"max_tokens": spec.max_tokens, **spec.extra}
    semaphore = asyncio.Semaphore(spec.concurrency)
    limits = httpx.Limits(max_connections=spec.concurrency + 8, max_keepalive_connections=spec.concurrency + 8)

    # Connections are opened once and reused, as a long-running client would: TTFB then measures
    # the server, not TCP and HTTP/2 set-up.
    import grpc

    async with httpx.AsyncClient(timeout=600.0, limits=limits) as http, grpc.aio.insecure_channel(
        target.grpc_addr
    ) as channel:

        async def one(index: int, text: str, voice: str, protocol: str) -> Any:
            async with semaphore:
                # The first `concurrency` requests arrive spread over the ramp; each later one when a request
                # before it has ended (closed loop). The ramp's wait holds a place, so the later requests
                # cannot all arrive at once while the first ones wait for their turn.
                if spec.ramp_s and index < spec.concurrency:
                    await asyncio.sleep(spec.ramp_s * index / spec.concurrency)  # arrival schedule
                kwargs: dict[str, Any] = {"voice": voice, "fmt": "pcm", **sampling}
                if protocol in ("rest", "elevenlabs"):
                    kwargs["client"] = http
                elif protocol in ("grpc", "riva"):
                    kwargs["channel"] = channel
                if spec.input_tokens_per_s is not None:
                    result = await synthesize_ws_context(target.url, text, tokens_per_s=spec.input_tokens_per_s,
                                                         **kwargs)
                else:
                    result = await synthesize(protocol, text, url=target.url, grpc_addr=target.grpc_addr, **kwargs)
            if progress is not None:
                progress(1)
            return result

        t0 = time.perf_counter()
        lag = asyncio.ensure_future(_watch_loop_lag(lags))
        try:
            results = await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))
        finally:
            lag.cancel()
        wall = time.perf_counter() - t0
    return list(results), wall


async def _watch_loop_lag(lags: list[float]) -> None:
    """How late this client's own event loop runs (every 50 ms): a client too busy to read its sockets
    records underruns the server did not cause, so the benchmark reports it beside them."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + 0.05
        await asyncio.sleep(0.05)
        lags.append(max(0.0, loop.time() - due))


class _GatewayLagSampler:
    """The server's flow.gateway_lag_ms, and its admission state (sessions generating, the capacity estimate,
    whether admission is closed, and every sample's flow section), sampled every `every_s` from /v1/stats on a
    thread of its own."""

    def __init__(self, target: Target, every_s: float = 0.5) -> None:
        self._target = target
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-lag-sampler", daemon=True)
        self.samples: list[float] = []
        self.admitted: list[int] = []  # scheduler.active_sessions: streams generating at once
        self.saturated_capacity: list[int] = []  # flow.capacity_streams while admission was closed
        self.flows: list[dict[str, Any]] = []  # every sample's flow section (the admission decision's inputs)
        # The latest `core_host` record (where the engine-core process's host time goes); None: none reported.
        self.core_host: dict[str, Any] | None = None

    def __enter__(self) -> _GatewayLagSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            stats = self._target.stats()
            flow = stats.get("flow", {})
            self.flows.append(flow)
            if stats.get("core_host") is not None:
                self.core_host = stats["core_host"]
            lag = flow.get("gateway_lag_ms")
            if lag is not None:
                self.samples.append(float(lag))
            self.admitted.append(int(stats.get("scheduler", {}).get("active_sessions", 0)))
            if flow.get("capacity_streams") is not None and not flow.get("admission_open", True):
                self.saturated_capacity.append(int(flow["capacity_streams"]))


# The inputs of the admission decision, from the `flow` section of GET /v1/stats (ARCHITECTURE §5a).
ADMISSION_NUMBERS = ("capacity_streams", "engine_capacity_streams", "codec_capacity_streams", "engine_margin",
                     "codec_margin", "loop_period_ms_p50", "loop_period_ms_p99", "codec_pass_ms_p50",
                     "codec_pass_ms_p99", "codec_frames_per_pass", "lead_p5_s", "playing_streams",
                     "keeping_streams", "falling_streams", "slowest_production", "codec_busy")


def summarize_admission_inputs(flows: list[dict[str, Any]]) -> dict[str, Any]:
    """The inputs of the admission decision over one level's samples of `flow` (GET /v1/stats): per number,
    min / median / max over the samples that reported it (None when none did: a server without the field),
    and how many samples gave each `limit_reason`."""
    numbers: dict[str, dict[str, float] | None] = {}
    for name in ADMISSION_NUMBERS:
        values = sorted(v for flow in flows if isinstance(v := flow.get(name), int | float)
                        and not isinstance(v, bool))
        numbers[name] = {"min": values[0], "median": round(statistics.median(values), 4),
                         "max": values[-1]} if values else None
    reasons = Counter(str(reason) for flow in flows if (reason := flow.get("limit_reason")) is not None)
    return {"samples": len(flows), "numbers": numbers, "limit_reasons": dict(sorted(reasons.items())) or None}


def measure(target: Target, spec: LoadSpec, *, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One load level: client-side summary plus what the server says it spent, the inputs of its admission
    decision sampled every 0.5 s while the level ran (`admission_inputs`), and the last of those samples'
    `core_host` record, where the engine-core process's host time went (`core_host`; the stats taken after
    the level when the level was too short for a sample; None from a server that does not report it)."""
    before = target.stats()
    client_lags: list[float] = []
    with _GatewayLagSampler(target) as gateway:
        results, wall = asyncio.run(run_load(target, spec, progress=progress, lags=client_lags))
    after = target.stats()
    row: dict[str, Any] = {"concurrency": spec.concurrency, "protocol": spec.protocol, **summarize(results, wall)}
    # Each stream's length: with fixed-length utterances (max_tokens) a short one means the model stopped early.
    lengths = [r.audio_seconds for r in results if r.ok]
    row["stream_audio_s_min"] = round(min(lengths), 3) if lengths else None
    row["stream_audio_s_max"] = round(max(lengths), 3) if lengths else None
    # Whose lateness the underruns may be: the server's API process(es), or this client's own loop.
    row["gateway_lag_ms_max"] = max(gateway.samples, default=None)
    # Streams generating at once (server side; a stream's audio plays on after its generation ends, so fewer
    # than those playing at once), and the capacity estimate while admission was closed.
    row["admitted_peak"] = max(gateway.admitted, default=None)
    row["capacity_at_saturation"] = (sorted(gateway.saturated_capacity)[len(gateway.saturated_capacity) // 2]
                                     if gateway.saturated_capacity else None)
    row["admission_inputs"] = summarize_admission_inputs(gateway.flows)
    row["core_host"] = gateway.core_host if gateway.core_host is not None else after.get("core_host")
    row["client_loop_lag_ms_p99"] = _ms(percentile(client_lags, 0.99))
    row["client_loop_lag_ms_max"] = _ms(max(client_lags, default=None))
    cpu = after["process"]["cpu_s"] - before["process"]["cpu_s"]
    tokens = after["total_tokens"] - before["total_tokens"]
    row["server_cpu_s"] = round(cpu, 3)
    row["server_cpu_s_per_audio_s"] = round(cpu / row["audio_seconds"], 4) if row["audio_seconds"] else None
    row["tokens_per_s"] = round(tokens / wall, 2) if wall > 0 else None
    if spec.input_tokens_per_s is not None:
        row["input_tokens_per_s"] = spec.input_tokens_per_s
        row.update(input_stream_summary(results))
    row.update(plumbing_cost(before, after))
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def input_stream_summary(results: Sequence[Any]) -> dict[str, Any]:
    """Text streamed in: first audio from the first word and from the end of the first clause, and how many
    streams spoke before their last word was sent."""
    ok = [r for r in results if r.ok and r.chunks and r.input_marks]
    from_clause = [r.chunks[0][0] - r.input_marks["first_clause_s"] for r in ok]
    from_word = [r.chunks[0][0] - r.input_marks["first_word_s"] for r in ok]
    early = sum(r.chunks[0][0] < r.input_marks["last_word_s"] for r in ok)
    writing = [r.input_marks["last_word_s"] - r.input_marks["first_word_s"] for r in ok]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000 * x, 1)

    return {
        "ttfb_from_first_word_p50_ms": ms(percentile(from_word, 0.5)),
        "ttfb_from_first_word_p95_ms": ms(percentile(from_word, 0.95)),
        "ttfb_from_first_clause_p50_ms": ms(percentile(from_clause, 0.5)),
        "ttfb_from_first_clause_p95_ms": ms(percentile(from_clause, 0.95)),
        "input_writing_p50_ms": ms(percentile(writing, 0.5)),  # first word to last word sent
        "first_audio_before_last_word": early,
        "input_streams": len(ok),
    }


def plumbing_cost(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Between two /v1/stats snapshots: CPU per generated token in the engine-core process and in the API
    process (the core's share is 0 when it runs in the server's process), and the engine core's mean
    loop period per step against what the engine says its steps took (the sim engine: its cost model)."""
    tokens = after["total_tokens"] - before["total_tokens"]
    core_cpu = after["process"].get("engine_core_cpu_s", 0.0) - before["process"].get("engine_core_cpu_s", 0.0)
    api_cpu = after["process"]["cpu_s"] - before["process"]["cpu_s"] - core_cpu
    engine_a, engine_b = before["engine"], after["engine"]
    steps = engine_b["steps"] - engine_a["steps"]
    out: dict[str, Any] = {
        "core_cpu_us_per_token": round(1e6 * core_cpu / tokens, 1) if tokens else None,
        "api_cpu_us_per_token": round(1e6 * api_cpu / tokens, 1) if tokens else None,
        "steps": steps, "loop_ms_per_step": None, "step_call_ms_per_step": None, "engine_ms_per_step": None,
        "loop_over_engine": None,
    }
    if steps and "loop_s" in engine_b:
        loop = (engine_b["loop_s"] - engine_a["loop_s"]) / steps
        engine = (engine_b["engine_elapsed_s"] - engine_a["engine_elapsed_s"]) / steps
        out["loop_ms_per_step"] = round(1000 * loop, 3)
        out["step_call_ms_per_step"] = round(1000 * (engine_b["busy_s"] - engine_a["busy_s"]) / steps, 3)
        out["engine_ms_per_step"] = round(1000 * engine, 3)
        out["loop_over_engine"] = round(loop / engine, 4) if engine > 0 else None
    # The codec inside the server: its passes between the snapshots (against the kit's codec alone).
    codec_a, codec_b = before.get("codec") or {}, after.get("codec") or {}
    passes = codec_b.get("passes", 0) - codec_a.get("passes", 0)
    out["codec_ms_per_pass"] = round(1000 * (codec_b["decode_s"] - codec_a["decode_s"]) / passes, 3) \
        if passes > 0 else None
    out["codec_frames_per_pass"] = round((codec_b["frames_decoded"] - codec_a["frames_decoded"]) / passes, 2) \
        if passes > 0 else None
    return out


# ------------------------------------------------------------------- modes


def scaling_levels(max_concurrency: int) -> list[int]:
    levels = [1]
    while levels[-1] * 2 <= max_concurrency:
        levels.append(levels[-1] * 2)
    if levels[-1] != max_concurrency:
        levels.append(max_concurrency)
    return levels


def best_realtime_level(rows: Sequence[dict[str, Any]], ttfb_target_ms: float) -> int | None:
    """Largest concurrency whose p95 TTFB is under the target, with no underrun and no failure."""
    good = [
        r["concurrency"] for r in rows
        if r["succeeded"] == r["requests"] and r["underrun_streams"] == 0
        and r["ttfb_p95_ms"] is not None and r["ttfb_p95_ms"] < ttfb_target_ms
    ]
    return max(good) if good else None


def analytic_realtime_bound(cost: SimConfig, *, prompt_tokens: int, utterance_tokens: int, max_batch: int) -> int:
    """Most streams the cost model keeps at real-time speed (82 tokens/s each) when every stream
    decodes every step: the largest N with step_ms(N) <= 1000 / 82. Mean context per stream is the
    prompt plus half an utterance. Prefill is ignored (it is a small share in steady state)."""
    budget_ms = 1000.0 / TOKENS_PER_SECOND_REALTIME
    ctx = prompt_tokens + utterance_tokens / 2
    best = 0
    for n in range(1, max_batch + 1):
        step = cost.step_base_ms + cost.step_per_seq_ms * n + cost.step_per_ctx_token_ms * ctx * n
        if step <= budget_ms:
            best = n
    return best


def ttfb_feasible_bound(cost: SimConfig, *, prompt_tokens: int, utterance_tokens: int, max_batch: int,
                        first_audio_tokens: int, ttfb_ms: float) -> int:
    """Most streams for which a full-batch step is still fast enough that a new session's first
    `first_audio_tokens` tokens take under `ttfb_ms` (and every stream stays real-time). At the
    throughput bound a step takes 1000/82 = 12.2 ms, so 21 tokens of first-audio delay alone take
    256 ms: no schedule that decodes every stream each step meets a 150 ms TTFB there."""
    ctx = prompt_tokens + utterance_tokens / 2
    best = 0
    for n in range(1, max_batch + 1):
        step = cost.step_base_ms + cost.step_per_seq_ms * n + cost.step_per_ctx_token_ms * ctx * n
        prefill = cost.prefill_per_token_ms * prompt_tokens
        if step <= 1000.0 / TOKENS_PER_SECOND_REALTIME and first_audio_tokens * step + prefill <= ttfb_ms:
            best = n
    return best


def profile_ttfb_bound(profile: CardProfile, *, prompt_tokens: int, bound: int, first_audio_tokens: int,
                       ttfb_ms: float) -> int:
    """`ttfb_feasible_bound` on a replayed card: the most streams (up to its real-time bound) whose full-batch
    step lets a new session's first `first_audio_tokens` tokens, after its prefill, come within `ttfb_ms`."""
    best = 0
    for n in range(1, bound + 1):
        step = profile.step_ms(n, prompt_tokens)
        if first_audio_tokens * step + profile.step_ms(n, prompt_tokens, prompt_tokens) <= ttfb_ms:
            best = n
    return best


def h100_fp8_cost() -> SimConfig:
    """Decode-step cost of Orpheus 3B as an FP8 TensorRT-LLM engine on one H100 SXM (modelled, not
    measured): the FP8 weights (3.2 GB of transformer + 16-bit embeddings) stream in ~1.5 ms at
    ~2.8 TB/s; CUDA-graph launch, sampling over the 157k vocabulary and the runtime's bookkeeping add
    ~2.5 ms; each sequence adds ~0.03 ms (logits, sampling, per-request work) and each context token
    40 ns of KV reads (112 KiB at ~2.8 TB/s)."""
    return SimConfig(step_base_ms=4.0, step_per_seq_ms=0.03, step_per_ctx_token_ms=0.00004,
                     prefill_per_token_ms=0.01, end_after_frames=None, realtime=True)


def sim_overrides(cost: SimConfig, *, slots: int, frames: int, max_batch: int) -> list[str]:
    return [
        "engine.backend=sim", "codec.decoder=sim",
        f"engine.sim.step_base_ms={cost.step_base_ms}", f"engine.sim.step_per_seq_ms={cost.step_per_seq_ms}",
        f"engine.sim.step_per_ctx_token_ms={cost.step_per_ctx_token_ms}",
        f"engine.sim.prefill_per_token_ms={cost.prefill_per_token_ms}",
        f"engine.sim.end_after_frames={frames}", "engine.sim.realtime=true",
        f"scheduler.max_concurrent_sessions={slots}", f"scheduler.max_batch_size={min(max_batch, slots)}",
        f"scheduler.max_queue={4 * slots}", "server.max_connections=2048",
    ]


def environment() -> dict[str, Any]:
    import os

    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_results(path: Path, results: dict[str, Any]) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    from .plots import plot_results

    return plot_results(results, path.with_suffix(""))


def frames_for_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds / FRAME_SECONDS))
