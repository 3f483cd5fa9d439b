"""What every session generated, recorded for tooling (--tokens-out) and for tests that compare streamed
audio with an offline decode of the same frames.

The API side records each session's text and prompt; the frames and finish reason come from where the
engine core runs (core.frame_log.FrameLog): read in this process with the in-process client, over one
wire call with the engine core in a process of its own (`MPClient.token_frames`). Both modes read alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.frame_log import FrameEntries

# session ids -> their frames and finish reasons, from wherever the engine core runs
FrameSource = Callable[[list[str]], FrameEntries]


class TokenLog:
    """session id -> text, prompt ids, frames and finish reason of every session, in submission order."""

    def __init__(self, frames: FrameSource) -> None:
        self._frames = frames
        self._entries: dict[str, dict[str, Any]] = {}

    def record(self, session_id: str, text: str, prompt_ids: tuple[int, ...]) -> None:
        self._entries[session_id] = {"text": text, "prompt_ids": list(prompt_ids), "frames": [],
                                     "finish_reason": None, "ended_at": None, "ended_step": None}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every entry as of now (a copy; a running session's frames so far). With a split core this is a
        round trip to it, so read while the core runs (before the service shuts down). `ended_at`
        (time.monotonic() in the core's process, comparable with this one's) and `ended_step` (the core's
        engine steps by then): when the session ended, a cancel when the core applied it; None while running."""
        entries = {session_id: dict(entry) for session_id, entry in self._entries.items()}
        for session_id, entry in self._frames(list(entries)).items():
            entries[session_id].update(entry._asdict())
        return entries
