"""Where the codec worker's time goes: wall and thread-CPU time and frames of its last passes, in a ring of fixed
length (the `codec_pass` of GET /v1/stats' `core_host`, summarised by `core.host_time`), and the thread naming
the engine-core process's threads share so that /proc and `core_host.threads` show them by name."""

from __future__ import annotations

import contextlib
import threading

import numpy as np

WINDOW_PASSES = 512  # as core.host_time.WINDOW_STEPS: a few seconds of passes on a card
PROC_TASKS = "/proc/self/task"  # this process's threads (Linux)


def name_os_thread(name: str) -> None:
    """Give the calling thread its name in the kernel too (/proc/self/task/TID/comm, 15 bytes), so that top,
    py-spy and `core_host.threads` show it; nothing happens where that file cannot be written."""
    with contextlib.suppress(OSError), open(f"{PROC_TASKS}/{threading.get_native_id()}/comm", "w") as f:
        f.write(name[:15])


class PassClock:
    """The codec worker's passes: wall and thread-CPU seconds and frames of the last `window` passes (a ring of
    tuples, as LoopClock's)."""

    def __init__(self, window: int = WINDOW_PASSES) -> None:
        self._window = window
        self._rows: list[tuple[float, float, int] | None] = [None] * window
        self._count = 0

    def record(self, wall_s: float, cpu_s: float, frames: int) -> None:
        self._rows[self._count % self._window] = (wall_s, cpu_s, frames)
        self._count += 1

    def summary(self) -> dict[str, float] | None:
        rows = np.array([row for row in self._rows[:] if row is not None], dtype=np.float64)
        if not len(rows):
            return None
        (wall50, cpu50, frames50), (wall90, _, _) = np.percentile(rows * (1000.0, 1000.0, 1.0), (50, 90), axis=0)
        return {"wall_ms_p50": rounded(wall50), "wall_ms_p90": rounded(wall90), "host_ms_p50": rounded(cpu50),
                "frames_p50": rounded(frames50)}


def rounded(value: float, digits: int = 4) -> float:
    """A figure of the stats records, as a plain float of `digits` decimals."""
    return round(float(value), digits)
