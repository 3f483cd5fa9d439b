"""`ModelledCard`: one measured card, replayed in real time, shared by a process's sim engine and sim codec.

What it keeps that a smooth cost model drops:

- **Interpreter time.** Launching work on a GPU is Python on the host: the codec's stateful decoder issues a
  few hundred small kernels a pass, an engine step its input copies and a graph replay. That time holds the
  GIL, so the engine-core loop, the codec worker and the output thread of one process queue for it. The
  replay spends it the same way, in a pure-Python busy loop (`hold_interpreter`), which lets other threads in
  only at the interpreter's switch interval, as launch code does; waiting for the device sleeps, releasing
  it, as a CUDA event wait does.
- **One device.** Engine steps run one after another on the device's timeline; a codec pass runs beside
  them on its own stream, and an engine step that shares the device with a pass is slowed by the measured
  contention (`CardProfile.engine_slowdown_under_codec`) for the time they overlap.

Thread-safe: the engine core thread and the codec worker thread call it at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .profile import CardProfile

CODEC_INTERVALS_KEPT = 64  # recent codec passes an engine step can have overlapped (a step is ~5-30 ms)


@dataclass(slots=True)
class StepTiming:
    start: float  # perf_counter when the device starts the step
    device_s: float  # its device time, before contention
    done_at: float | None = None  # set at collect: when it finished, contention included


class ModelledCard:
    def __init__(self, profile: CardProfile) -> None:
        self.profile = profile
        self._lock = threading.Lock()
        self._engine_free_at = 0.0  # perf_counter when the device finishes the engine steps queued so far
        self._codec_busy: deque[tuple[float, float]] = deque(maxlen=CODEC_INTERVALS_KEPT)

    @staticmethod
    def hold_interpreter(seconds: float) -> None:
        """Keep the interpreter busy for `seconds` of wall time, as Python launching kernels does."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    # ------------------------------------------------------------ engine

    def launch_step(self, rows: int, kv_len: float, prefill_tokens: int) -> StepTiming:
        """The host's launch of a step of `rows` decoded (and prefill chunks) at a mean KV length; the step is
        queued behind the engine's earlier steps."""
        self.hold_interpreter(self.profile.launch_ms(rows) / 1000.0)
        device_s = self.profile.step_ms(rows, kv_len, prefill_tokens) / 1000.0
        with self._lock:
            start = max(time.perf_counter(), self._engine_free_at)
            self._engine_free_at = start + device_s
        return StepTiming(start, device_s)

    def step_done_at(self, timing: StepTiming) -> float:
        """When the step finishes: its device time, plus the contention of the codec passes it overlapped (all
        known by the time it is read back). Later steps queue behind the delay."""
        if timing.done_at is not None:
            return timing.done_at
        end = timing.start + timing.device_s
        with self._lock:
            shared = sum(max(0.0, min(e, end) - max(s, timing.start)) for s, e in self._codec_busy)
            extra = (self.profile.engine_slowdown_under_codec - 1.0) * shared
            self._engine_free_at += extra
        timing.done_at = end + extra
        return timing.done_at

    # ------------------------------------------------------------ codec

    def codec_pass(self, frames: int) -> float:
        """One pass of `frames` frames: its launch holds the interpreter, then the caller waits for the device.
        Returns the modelled pass in seconds."""
        if frames <= 0:
            return 0.0
        started = time.perf_counter()
        device_s = self.profile.codec_pass_ms(frames) / 1000.0
        with self._lock:
            self._codec_busy.append((started, started + device_s))
        self.hold_interpreter(min(self.profile.codec_launch_ms / 1000.0, device_s))
        remaining = started + device_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return device_s
