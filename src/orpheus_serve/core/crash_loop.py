"""The one crash-loop guard: a process that keeps dying is not started again (ARCHITECTURE §9).

Used for the engine-core process (core/mp_client.py) and for API processes 1..N-1
(api/process_group.py): more than CRASH_LOOP_RESTARTS deaths within CRASH_LOOP_S mean something outside
the process is wrong, and each restart would fail streams again; the server stops instead, for the
orchestrator to act on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

CRASH_LOOP_RESTARTS = 3
CRASH_LOOP_S = 300.0


@dataclass(slots=True)
class CrashLoopGuard:
    restarts: int = CRASH_LOOP_RESTARTS  # deaths within the window that are still restarted
    window_s: float = CRASH_LOOP_S
    clock: Callable[[], float] = time.monotonic
    _deaths: list[float] = field(default_factory=list)  # clock times of the deaths within the window

    def died(self) -> bool:
        """Count a death; True while a restart is still allowed."""
        now = self.clock()
        self._deaths = [t for t in self._deaths if now - t < self.window_s] + [now]
        return len(self._deaths) <= self.restarts

    @property
    def recent_deaths(self) -> int:
        return len(self._deaths)

    def __str__(self) -> str:
        return f"{len(self._deaths)} deaths within {self.window_s:.0f} s"
