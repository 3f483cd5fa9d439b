"""What the engine core generated per session: frames, finish reason, and when (CLOCK_MONOTONIC) and after
how many engine steps the session ended, kept where the core runs.

Opt-in (token logs for tooling and for tests that compare streamed audio with an offline decode of the
same frames). The engine core thread writes it; readers take copies under its lock, in the core's own
process (in-process client) or over the wire (`wire.CALL_TOKEN_LOG`, split core), so a token log reads
the same in either mode (ARCHITECTURE §6). It grows with every session while on: tooling and tests only.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from ..scheduler import FramesReady, SchedulerEvent, SessionFinished


class FrameEntry(NamedTuple):
    frames: list[list[int]]  # lists of 7 codes
    finish_reason: str | None  # None while running
    # When the scheduler ended the session (a cancel: when the core applied it): time.monotonic(), comparable
    # across processes, and the engine steps read back by then. None while running.
    ended_at: float | None
    ended_step: int | None


FrameEntries = dict[str, FrameEntry]  # session id -> its entry


class FrameLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frames: dict[str, list[list[int]]] = {}
        self._finish: dict[str, SessionFinished] = {}

    def on_frames(self, event: FramesReady) -> None:
        """Engine core thread."""
        frames = event.frames.tolist()
        with self._lock:
            self._frames.setdefault(event.request_id, []).extend(frames)

    def on_event(self, event: SchedulerEvent) -> None:
        """Engine core thread."""
        if isinstance(event, SessionFinished):
            with self._lock:
                self._finish[event.request_id] = event
                self._frames.setdefault(event.request_id, [])

    def read(self, session_ids: list[str]) -> FrameEntries:
        """Copies of the entries of `session_ids` the core has seen (others are left out)."""
        with self._lock:
            return {session_id: _entry(self._frames[session_id], self._finish.get(session_id))
                    for session_id in session_ids if session_id in self._frames}


def _entry(frames: list[list[int]], end: SessionFinished | None) -> FrameEntry:
    if end is None:
        return FrameEntry(list(frames), None, None, None)
    return FrameEntry(list(frames), end.reason, end.ended_at, end.step)
