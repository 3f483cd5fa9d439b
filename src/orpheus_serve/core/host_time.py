"""Where the engine-core process's host time goes: the `core_host` record of GET /v1/stats.

The engine-core loop (engine_core.py) times each iteration in phases with a chain of `time.perf_counter()`
marks: every stretch between two marks belongs to exactly one phase, so the phases of an iteration add up
to its wall time. A few marks and two `time.thread_time()` calls a step; the figures of the last
`WINDOW_STEPS` iterations stay in rings of fixed length (nothing grows with the steps). The codec worker keeps
its passes' wall and thread-CPU times the same way (`codec.pass_clock.PassClock`).

The summary (`CoreHostSampler.sample`) is made when stats are asked for, not per step: percentiles over the
rings, every thread's CPU time (Linux: /proc/self/task), the process's CPU share over about the steps'
window, torch's thread counts, the process's CPU share while the loop had no session at all, the codec
pass, and what a prompt token adds to a step. Shape (docs/ARCHITECTURE.md, "core_host"):

    window_steps, step_ms{plan, launch, device_wait, codec_handoff, output, other, total: {p50, p90, mean}},
    step_cpu_ms{p50, mean}, threads[{name, tid, cpu_s, cpu_share}], process_cpu_share,
    intra_op_threads, interop_threads, idle_cpu_share, codec_pass{wall_ms_p50, wall_ms_p90, host_ms_p50,
    frames_p50} | None, prefill_ms_per_token
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codec.pass_clock import PROC_TASKS, PassClock, rounded

# Loop iterations (and codec passes) the figures cover: a few seconds of steps on a card.
WINDOW_STEPS = 512

# The phases of one loop iteration, in the order of the record.
PHASES = ("plan", "launch", "device_wait", "codec_handoff", "output", "other")
PLAN, LAUNCH, DEVICE_WAIT, CODEC_HANDOFF, OUTPUT, OTHER = range(len(PHASES))

# CPU shares are measured between two readings at least this far apart (stats may be asked ten times a second).
MIN_CPU_WINDOW_S = 1.0
# Readings kept for that, at most one per SNAPSHOT_EVERY_S: enough to reach back over the step window.
SNAPSHOTS_KEPT = 64
SNAPSHOT_EVERY_S = 0.25
# A summary younger than this is answered again instead of made anew (the API side polls stats often).
SUMMARY_MAX_AGE_S = 0.25
# Decode-only steps within this share of a prefill step's rows (at least one row) are its baseline.
SIMILAR_BATCH = 0.25

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


class LoopClock:
    """Phase marks of the engine-core loop (module docstring). Marked by the loop thread only. Each ring slot
    holds one tuple, replaced whole (one store, atomic under the interpreter lock), so whoever asks for stats
    copies the rings without a lock and never sees half a row."""

    def __init__(self, window: int = WINDOW_STEPS) -> None:
        self._window = window
        # One per iteration: the phases' seconds (PHASES order), total seconds, thread CPU seconds, and
        # perf_counter when it ended.
        self._steps: list[tuple[float, ...] | None] = [None] * window
        self._count = 0
        # One per step read back: its loop period, decode rows, prefill chunks and prefill tokens.
        self._plans: list[tuple[float, int, int, int] | None] = [None] * window
        self._plan_count = 0
        self._acc = [0.0] * len(PHASES)
        self._started = self._last = time.perf_counter()
        self._cpu_started = 0.0
        # Time the loop waited with no session at all, and the process CPU spent meanwhile.
        self.idle_wall_s = 0.0
        self.idle_cpu_s = 0.0
        self._idle_since: tuple[float, float] | None = None

    def begin(self) -> float:
        """A loop iteration starts; returns its perf_counter start."""
        self._acc = [0.0] * len(PHASES)
        self._cpu_started = time.thread_time()
        self._started = self._last = time.perf_counter()
        return self._started

    def mark(self, phase: int) -> None:
        """The stretch since the previous mark belongs to `phase`."""
        now = time.perf_counter()
        self._acc[phase] += now - self._last
        self._last = now

    def finish(self) -> None:
        """The iteration ran a step (launched or read one back): record it. The rest of it is `other`."""
        self.mark(OTHER)
        self._steps[self._count % self._window] = (*self._acc, self._last - self._started,
                                                   time.thread_time() - self._cpu_started, self._last)
        self._count += 1

    def record_plan(self, period_s: float, decode_rows: int, prefill_rows: int, prefill_tokens: int) -> None:
        """A step read back: its loop period (what a stream waited between two tokens) and its load."""
        self._plans[self._plan_count % self._window] = (period_s, decode_rows, prefill_rows, prefill_tokens)
        self._plan_count += 1

    def idle_begin(self) -> None:
        """The loop waits with no session at all."""
        self._idle_since = (time.perf_counter(), time.process_time())

    def idle_end(self) -> None:
        if self._idle_since is None:
            return
        wall0, cpu0 = self._idle_since
        self._idle_since = None
        self.idle_cpu_s += time.process_time() - cpu0
        self.idle_wall_s += time.perf_counter() - wall0

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The recorded rows: iterations (n x (phases, total, cpu, ended at)) and plans (m x 4)."""
        steps = [row for row in self._steps[:] if row is not None]
        plans = [row for row in self._plans[:] if row is not None]
        return (np.array(steps, dtype=np.float64).reshape(len(steps), len(PHASES) + 3),
                np.array(plans, dtype=np.float64).reshape(len(plans), 4))


@dataclass(frozen=True, slots=True)
class ThreadTime:
    tid: int
    name: str
    cpu_s: float


def thread_times() -> list[ThreadTime]:
    """Every thread of this process with its CPU seconds since it started (utime + stime of
    /proc/self/task/TID/stat), named as Python named it where it is a Python thread, else by its kernel name.
    Empty where /proc is not there."""
    python_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = []
    try:
        tasks = os.listdir(PROC_TASKS)
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"{PROC_TASKS}/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        tid = int(task)
        # "TID (comm) state ...": the name may hold spaces and parentheses, the fields after it do not.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        utime, stime = int(fields[11]), int(fields[12])  # stat fields 14 and 15
        out.append(ThreadTime(tid, python_names.get(tid, comm), (utime + stime) / _CLOCK_TICKS))
    return sorted(out, key=lambda t: t.tid)


@dataclass(frozen=True, slots=True)
class _CpuReading:
    at: float  # time.perf_counter()
    process_s: float  # time.process_time(): every thread of the process
    threads: list[ThreadTime]

    @property
    def by_tid(self) -> dict[int, float]:
        return {t.tid: t.cpu_s for t in self.threads}


@dataclass(slots=True)
class CoreHostSampler:
    """Makes the `core_host` record from the loop's and the codec's clocks (module docstring). Whoever answers
    stats calls `sample`; it keeps a few CPU readings to measure shares over about the steps' window."""

    _readings: deque[_CpuReading] = field(default_factory=lambda: deque(maxlen=SNAPSHOTS_KEPT))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last: tuple[float, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        self._readings.append(_read_cpu())

    def sample(self, loop: LoopClock, codec_pass: PassClock | None, *,
               max_age_s: float = SUMMARY_MAX_AGE_S) -> dict[str, Any]:
        """The record; the last one again if it is younger than `max_age_s`."""
        with self._lock:
            now = time.perf_counter()
            if self._last is not None and now - self._last[0] < max_age_s:
                return self._last[1]
            summary = self._summarize(loop, codec_pass)
            self._last = (time.perf_counter(), summary)
            return summary

    def _summarize(self, loop: LoopClock, codec_pass: PassClock | None) -> dict[str, Any]:
        import torch

        steps, plans = loop.window()
        reading = _read_cpu()
        base = self._baseline(reading.at, float(steps[:, -1].min()) if len(steps) else None)
        if reading.at - self._readings[-1].at >= SNAPSHOT_EVERY_S:
            self._readings.append(reading)
        span = max(reading.at - base.at, 1e-9)
        before = base.by_tid
        step_ms: dict[str, dict[str, float]] | None = None
        step_cpu_ms = None
        if len(steps):
            ms = steps[:, :-1] * 1000.0  # phases, total, cpu
            p50, p90 = np.percentile(ms, (50, 90), axis=0)
            mean = ms.mean(axis=0)
            step_ms = {name: {"p50": rounded(p50[i]), "p90": rounded(p90[i]), "mean": rounded(mean[i])}
                       for i, name in enumerate((*PHASES, "total"))}
            step_cpu_ms = {"p50": rounded(p50[-1]), "mean": rounded(mean[-1])}
        return {
            "window_steps": len(steps),
            "step_ms": step_ms,
            "step_cpu_ms": step_cpu_ms,
            "threads": [{"name": t.name, "tid": t.tid, "cpu_s": round(t.cpu_s, 3),
                         "cpu_share": round(max(0.0, t.cpu_s - before.get(t.tid, 0.0)) / span, 4)}
                        for t in reading.threads],
            "process_cpu_share": round(max(0.0, reading.process_s - base.process_s) / span, 4),
            "intra_op_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "idle_cpu_share": round(loop.idle_cpu_s / loop.idle_wall_s, 4) if loop.idle_wall_s > 0 else None,
            "codec_pass": codec_pass.summary() if codec_pass is not None else None,
            "prefill_ms_per_token": prefill_ms_per_token(plans),
        }

    def _baseline(self, now: float, oldest_step_at: float | None) -> _CpuReading:
        """The reading to measure CPU shares from: the latest one taken before the steps' window began, and at
        least MIN_CPU_WINDOW_S ago; the oldest kept if none is that old."""
        latest = now - MIN_CPU_WINDOW_S
        if oldest_step_at is not None:
            latest = min(latest, oldest_step_at)
        before = [r for r in self._readings if r.at <= latest]
        return before[-1] if before else self._readings[0]


def prefill_ms_per_token(plans: np.ndarray) -> float | None:
    """What a prompt token adds to a step's wall time: over the steps with prefill rows, the median of
    (its loop period - the median period of decode-only steps at a similar batch) / its prefill tokens.
    None until a prefill step with such a decode-only neighbour was seen. `plans`: rows of
    (period_s, decode_rows, prefill_rows, prefill_tokens)."""
    if not len(plans):
        return None
    period, decode, prefill_rows, tokens = plans[:, 0], plans[:, 1], plans[:, 2], plans[:, 3]
    decode_only = (tokens == 0) & (decode > 0)
    if not decode_only.any():
        return None
    base_rows, base_period = decode[decode_only], period[decode_only]
    baselines: dict[float, float | None] = {}  # batch rows -> median decode-only period near it
    extra = []
    for i in np.flatnonzero(tokens > 0):
        rows = float(decode[i] + prefill_rows[i])
        if rows not in baselines:
            near = np.abs(base_rows - rows) <= max(1.0, SIMILAR_BATCH * rows)
            baselines[rows] = float(np.median(base_period[near])) if near.any() else None
        base = baselines[rows]
        if base is not None:
            extra.append((period[i] - base) / tokens[i])
    return rounded(1000.0 * float(np.median(extra)), 5) if extra else None


def _read_cpu() -> _CpuReading:
    return _CpuReading(time.perf_counter(), time.process_time(), thread_times())
