"""What the engine core generated per session: frames and finish reason, kept where the core runs.

Opt-in (token logs for tooling and for tests that compare streamed audio with an offline decode of the
same frames). The engine core thread writes it; readers take copies under its lock, in the core's own
process (in-process client) or over the wire (`wire.CALL_TOKEN_LOG`, split core), so a token log reads
the same in either mode (ARCHITECTURE §6). It grows with every session while on: tooling and tests only.
"""

from __future__ import annotations

import threading

from ..scheduler import FramesReady, SchedulerEvent, SessionFinished

# session id -> (frames as lists of 7 codes, finish reason or None while running)
FrameEntries = dict[str, tuple[list[list[int]], str | None]]


class FrameLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frames: dict[str, list[list[int]]] = {}
        self._finish: dict[str, str] = {}

    def on_frames(self, event: FramesReady) -> None:
        """Engine core thread."""
        frames = event.frames.tolist()
        with self._lock:
            self._frames.setdefault(event.request_id, []).extend(frames)

    def on_event(self, event: SchedulerEvent) -> None:
        """Engine core thread."""
        if isinstance(event, SessionFinished):
            with self._lock:
                self._finish[event.request_id] = event.reason
                self._frames.setdefault(event.request_id, [])

    def read(self, session_ids: list[str]) -> FrameEntries:
        """Copies of the entries of `session_ids` the core has seen (others are left out)."""
        with self._lock:
            return {session_id: (list(self._frames[session_id]), self._finish.get(session_id))
                    for session_id in session_ids if session_id in self._frames}
