"""What every session generated, recorded for tooling (--tokens-out) and for tests that compare streamed
audio with an offline decode of the same frames. Taps the engine core's threads, so it needs the core in
this process (service.build.assemble_service)."""

from __future__ import annotations

from typing import Any

from ..scheduler import FramesReady, SchedulerEvent, SessionFinished


class TokenLog(dict[str, dict[str, Any]]):
    """session id -> text, prompt ids, frames and finish reason of every session (tooling: --tokens-out,
    and tests that compare streamed audio with an offline decode of the same frames)."""

    def record(self, session_id: str, text: str, prompt_ids: tuple[int, ...]) -> None:
        self[session_id] = {"text": text, "prompt_ids": list(prompt_ids), "frames": [], "finish_reason": None}

    def on_frames(self, event: FramesReady) -> None:
        """Engine core thread."""
        entry = self.get(event.request_id)
        if entry is not None:
            entry["frames"].extend(event.frames.tolist())

    def on_event(self, event: SchedulerEvent) -> None:
        """Engine core thread."""
        if isinstance(event, SessionFinished) and event.request_id in self:
            self[event.request_id]["finish_reason"] = event.reason
