"""The serve stage: the production shape: production_server.py with the engine core in its own process
(server.engine_process), torch backend, bf16, CUDA graphs, the codec on its own stream, the 3B-shaped model; a
warm-up level, then stepped concurrency levels over gRPC with arrivals spread over a ramp and fixed-length
utterances (the model is random, so --max-tokens sets the length; each stream's length is checked). Real-time
streams held at p95 TTFB under 150 ms and under 300 ms, server CPU per audio second (API and engine-core
processes), GPU utilisation sampled during the levels only, and the inputs of the admission decision (`flow` in
GET /v1/stats: capacity and its limit reason, engine and codec bounds, margins, loop period, codec pass, lead p5)
sampled every 0.5 s per level. Then the top level measured runs again on a second server with
`scheduler.admission=slots` (admitted while a slot is free): the pipeline's own capacity, apart from the
admission control's estimate. And one more round at the highest level with the engine core profiling 50 of its
steps (engine.profile_dir): serve.json's `profile`, shaped as engine.json's; one that recorded no kernel is
failed, not a number.

The stage can run twice in a call with other server settings: `--override KEY=VALUE` (appended to the stage's
own, recorded as `extra_overrides`) and `--tag NAME` (NAME.json, NAME-*.log; the stage inside stays `serve`).
Each level's row is saved as soon as it is measured.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scripts.gpu.report import render_serve
from scripts.gpu.stages.common import (
    DEADLINE,
    Shapes,
    StageRun,
    ensure_models,
    nvidia_smi,
    substep_failed,
    substep_skipped,
)

TTFB_TARGETS_MS = (150.0, 300.0)


class GpuSampler:
    """GPU utilisation and memory from nvidia-smi twice a second, kept only inside `window()`s (the
    levels): start-up and idle gaps between levels are not averaged in. Zero readings are kept (an idle
    GPU during a level is a finding); "[N/A]" readings are counted, not parsed."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self._window: list[tuple[float, float]] | None = None
        self._not_available = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self.available = bool(nvidia_smi("utilization.gpu"))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                if self._window is None:
                    continue
            for line in nvidia_smi("utilization.gpu,memory.used")[:1]:
                reading = parse_smi_numbers(line)
                with self._lock:
                    if self._window is None:
                        continue
                    if reading is None:
                        self._not_available += 1
                    else:
                        self._window.append((reading[0], reading[1]))

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @contextmanager
    def window(self) -> Iterator[dict[str, Any]]:
        """Samples taken inside; the dict is filled with their summary on exit."""
        summary: dict[str, Any] = {}
        with self._lock:
            self._window, self._not_available = [], 0
        try:
            yield summary
        finally:
            with self._lock:
                samples, not_available, self._window = self._window or [], self._not_available, None
            summary.update(summarize_gpu_samples(samples, not_available))


def parse_smi_numbers(line: str) -> tuple[float, ...] | None:
    """'37, 1234' -> (37.0, 1234.0); None when any field is '[N/A]' or not a number."""
    try:
        return tuple(float(x) for x in line.split(","))
    except ValueError:
        return None


def summarize_gpu_samples(samples: list[tuple[float, float]], not_available: int = 0) -> dict[str, Any]:
    if not samples:
        return {"samples": 0, "not_available": not_available}
    utils = [u for u, _ in samples]
    return {"samples": len(samples), "not_available": not_available,
            "util_mean_pct": round(sum(utils) / len(utils), 1), "util_max_pct": max(utils),
            "util_zero_samples": sum(u == 0 for u in utils), "memory_used_max_mib": max(m for _, m in samples)}


def realtime_held(rows: list[dict[str, Any]], ttfb_ms: float) -> int | None:
    """Largest concurrency whose p95 TTFB is under `ttfb_ms` with every request served at full length,
    no underrun and no failure."""
    good = [r["concurrency"] for r in rows
            if r["succeeded"] == r["requests"] and r["underrun_streams"] == 0 and not r.get("short_streams")
            and r["ttfb_p95_ms"] is not None and r["ttfb_p95_ms"] < ttfb_ms]
    return max(good) if good else None


def expected_audio_s(max_tokens: int) -> float:
    from orpheus_serve.token_format import FRAME_SECONDS, TOKENS_PER_FRAME

    return (max_tokens // TOKENS_PER_FRAME) * FRAME_SECONDS


def serve_overrides(shapes: Shapes, llama: Path, snac_dir: Path) -> list[str]:
    slots = max(shapes.serve_levels)
    return [
        f"engine.model_path={llama}", f"codec.path={snac_dir}", "engine.backend=torch", "engine.mode=batched",
        f"engine.device={shapes.device}", f"engine.dtype={shapes.dtype}", "engine.cuda_graphs=true",
        f"engine.max_seq_len={shapes.serve_max_seq_len}", f"codec.device={shapes.device}", "codec.decoder=stateful",
        "server.engine_process=true",
        f"scheduler.max_concurrent_sessions={slots}", f"scheduler.max_batch_size={slots}",
        f"codec.max_batch={slots}", f"server.max_connections={2 * slots + 16}",
        f"scheduler.max_queue={4 * slots}", "server.playground=false",
    ]


def serve_level_worst_s(shapes: Shapes, expected_s: float, queue_timeout_s: float) -> float:
    """The longest a level can take: the ramp, a request's whole wait in the queue, then its utterances
    (at most twice real time), and the level's own set-up."""
    return shapes.serve_ramp_s + queue_timeout_s + 2 * expected_s * shapes.serve_requests_per_stream + 5


def stage_serve(run: StageRun, extra_overrides: list[str] | None = None) -> None:
    """Warm-up, the levels, then one level on a second server with admission fixed at the slot count (the
    top level measured, one utterance per stream): the levels with the admission control, that one without.
    `extra_overrides` (KEY=VALUE) follow the stage's own server settings, so they win."""
    from orpheus_serve.benchmarking.launch import LaunchedServer
    from orpheus_serve.benchmarking.runner import LoadSpec, Target, measure
    from orpheus_serve.config import SchedulerConfig

    shapes = run.shapes
    llama, snac_dir = ensure_models(run)
    name = run.tag or run.stage  # a second pass (a tag) keeps the first's logs and profile
    extra = list(extra_overrides or [])
    profile_dir = run.work / f"{name}-profile"
    overrides = [*serve_overrides(shapes, llama, snac_dir), f"engine.profile_dir={profile_dir}", *extra]
    expected = expected_audio_s(shapes.serve_max_tokens)
    frame_s = expected / max(1, shapes.serve_max_tokens // 7)
    level_worst_s = serve_level_worst_s(shapes, expected, SchedulerConfig().queue_timeout_s)
    rows: list[dict[str, Any]] = []
    run.data.update(overrides=overrides, extra_overrides=extra, protocol="grpc", max_tokens=shapes.serve_max_tokens,
                    expected_stream_audio_s=round(expected, 3), ttfb_targets_ms=list(TTFB_TARGETS_MS),
                    warmup=None, rows=rows, realtime_held={}, admission_fixed=None, level_worst_s=level_worst_s)

    def spec(concurrency: int, seed: int, per_stream: int = shapes.serve_requests_per_stream) -> LoadSpec:
        # Short texts only (voice-agent turns, one sentence): one chunk each, so max_tokens fixes every length.
        return LoadSpec(requests=concurrency * per_stream, concurrency=concurrency, protocol="grpc", seed=seed,
                        max_tokens=shapes.serve_max_tokens, ramp_s=shapes.serve_ramp_s, text_mix=(1.0, 0.0, 0.0))

    def level(target: Target, gpu: GpuSampler, load: LoadSpec) -> dict[str, Any]:
        """One level, with GPU use and the admission inputs (`measure`: admission_inputs) sampled while it runs."""
        with gpu.window() as usage:
            row = measure(target, load)
        row["gpu"] = usage
        return row

    def check_lengths(row: dict[str, Any]) -> None:
        shortest = row.get("stream_audio_s_min")
        row["short_streams"] = int(shortest is not None and shortest < expected - frame_s / 2)
        if row["short_streams"]:
            run.problem(f"{row['concurrency']} streams: shortest stream {shortest} s < {expected:.3f} s expected "
                        f"(the model ended an utterance early)")
        longest = row.get("stream_audio_s_max")
        if longest is not None and longest > expected + frame_s / 2:
            run.problem(f"{row['concurrency']} streams: longest stream {longest} s > {expected:.3f} s expected "
                        f"(a text was split into several chunks)")

    def render() -> None:
        run.data["realtime_held"] = {f"{t:g}": realtime_held(rows, t) for t in TTFB_TARGETS_MS}
        run.table = render_serve(run.data)

    started = time.monotonic()
    server = LaunchedServer(overrides, log_path=run.logs / f"{name}-server.log",
                            ready_timeout_s=max(30.0, run.left() - 60))
    with server, GpuSampler() as gpu:
        run.data["server_start_s"] = round(time.monotonic() - started, 1)
        print(f"server ready in {run.data['server_start_s']} s", flush=True)
        # Kept for the level with admission fixed: a second server start, then one level.
        fixed_reserve_s = run.data["server_start_s"] + level_worst_s
        target = Target(server.url, server.grpc_addr)
        run.data["warmup"] = level(target, gpu, spec(shapes.serve_warmup_concurrency, seed=99))
        run.save()
        for index, concurrency in enumerate(shapes.serve_levels):
            if run.left() < level_worst_s + fixed_reserve_s + 10:
                run.problem(f"levels {shapes.serve_levels[index:]} not measured {DEADLINE}")
                break
            row = level(target, gpu, spec(concurrency, seed=index))
            check_lengths(row)
            rows.append(row)
            print(f"serve {concurrency}: TTFB p95 {row['ttfb_p95_ms']} ms, {row['succeeded']}/{row['requests']} ok, "
                  f"underruns {row['underrun_events']}, GPU {row['gpu'].get('util_mean_pct')}%, admission "
                  f"{row['admission_inputs']['limit_reasons']}", flush=True)
            render()
            run.save()
        if rows:  # only if it and the level with admission fixed both still fit
            run.data["profile"] = serve_profile(run, target, spec(rows[-1]["concurrency"], seed=77), profile_dir,
                                                rows[-1], level_worst_s + fixed_reserve_s)
            run.save()
        stats = target.stats()
        run.data["server_stats_end"] = {k: stats.get(k) for k in ("process", "memory", "engine", "codec") if k in stats}
    if not rows:
        run.problem("no level was measured")
    failed = [r["concurrency"] for r in rows if r["errors"]]
    if failed:
        run.problem(f"requests failed at concurrency {failed}")
    render()
    run.save()
    fixed = _serve_admission_fixed(run, overrides, max((r["concurrency"] for r in rows), default=None),
                                   level, spec, level_worst_s)
    if fixed is not None:
        check_lengths(fixed)
        run.data["admission_fixed"] = fixed
        if fixed["errors"]:
            run.problem(f"requests failed at concurrency {fixed['concurrency']} with admission fixed at the slots")
    render()
    run.data["complete"] = len(rows) == len(shapes.serve_levels) and fixed is not None


def _serve_admission_fixed(run: StageRun, overrides: list[str], concurrency: int | None,
                           level: Callable[..., dict[str, Any]], spec: Callable[..., Any],
                           level_worst_s: float) -> dict[str, Any] | None:
    """The top level measured, one utterance per stream, on a second server with `scheduler.admission=slots`:
    every request is admitted while a slot is free, so what the pipeline carries shows apart from admission."""
    from orpheus_serve.benchmarking.launch import LaunchedServer
    from orpheus_serve.benchmarking.runner import Target

    if concurrency is None:
        run.problem("the level with admission fixed at the slots not measured: no level to repeat")
        return None
    start_s = run.data.get("server_start_s") or 30.0
    if run.left() < start_s + level_worst_s:
        run.problem(f"the level with admission fixed at the slots not measured: {run.left():.0f} s left, "
                    f"{start_s + level_worst_s:.0f} s needed {DEADLINE}")
        return None
    fixed_overrides = [*overrides, "scheduler.admission=slots"]
    started = time.monotonic()
    server = LaunchedServer(fixed_overrides, log_path=run.logs / f"{run.tag or run.stage}-slots-server.log",
                            ready_timeout_s=max(30.0, run.left() - level_worst_s))
    with server, GpuSampler() as gpu:
        print(f"server (admission=slots) ready in {time.monotonic() - started:.1f} s", flush=True)
        row = level(Target(server.url, server.grpc_addr), gpu, spec(concurrency, seed=77, per_stream=1))
    row.update(admission="slots", overrides=["scheduler.admission=slots"])
    print(f"serve {concurrency} (admission=slots): TTFB p95 {row['ttfb_p95_ms']} ms, "
          f"{row['succeeded']}/{row['requests']} ok, underruns {row['underrun_events']}", flush=True)
    return row


def serve_profile(run: StageRun, target: Any, load: Any, folder: Path, top: dict[str, Any],
                  estimate_s: float) -> dict[str, Any]:
    """One more round at the serve stage's highest level, `serve_profile_steps` of its engine-core steps
    profiled inside the server (engine.profile_dir, engines/profiling.ArmedStepProfiler): from the first step
    with at least 3/4 of that level's peak of admitted streams. serve.json's `profile`, shaped as engine.json's."""
    from orpheus_serve.benchmarking.runner import measure

    name = "profile of the engine core's steps"
    if run.left() < estimate_s + 20:
        return substep_skipped(run, name, f"{run.left():.0f} s left, {estimate_s + 20:.0f} s needed")
    result, arm = folder / "profile.json", folder / "arm"
    result.unlink(missing_ok=True)
    min_rows = max(1, int(0.75 * (top.get("admitted_peak") or 1)))
    arm.write_text(f"{run.shapes.serve_profile_steps} {min_rows}")
    measure(target, load)
    arm.unlink(missing_ok=True)  # not taken (too few rows ever): no later profile
    if not result.exists():
        return substep_failed(run, name, f"the engine core ran fewer than {run.shapes.serve_profile_steps} steps "
                                          f"with {min_rows} or more decode rows")
    summary = json.loads(result.read_text())
    if not summary.get("kernels_per_step"):
        return substep_failed(run, name, f"the profile of {summary.get('steps')} steps recorded no kernels")
    return {"status": "measured", "variant": "serve", "concurrency": load.concurrency,
            "batches": [{"batch": summary["decode_rows_mean"], **summary}]}
