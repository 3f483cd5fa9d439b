"""What the scheduler tells its caller after a step: frames to decode, sessions that ended."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..token_format import FRAME_SECONDS


@dataclass(frozen=True, slots=True, eq=False)
class FramesReady:
    """Whole frames of one session to push to the codec now, in order, each exactly once.

    `final=True` is the session's last push (stop/length): the codec flushes its
    lookahead and drops the session. `frames` may then be empty."""

    request_id: str
    frames: np.ndarray  # [n, 7] int64 codes
    final: bool

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


@dataclass(frozen=True, slots=True)
class SessionFinished:
    """The session is over and its slot is (or is about to be) released.

    reason: "stop" (end_of_speech) | "length" (max_tokens) | "cancelled" |
    "timeout" | "error". Times are seconds relative to the request's arrival, except `ended_at`: the
    scheduler's clock when the session ended (a cancel: when it was applied), which in the server is
    `time.monotonic()` and so compares across processes (CLOCK_MONOTONIC is system-wide)."""

    request_id: str
    reason: str
    tokens: int  # generated ids consumed, end_of_speech included
    frames: int  # whole frames handed out in FramesReady
    queue_s: float  # arrival -> first prefill chunk (or -> the end, if never admitted)
    first_token_s: float | None  # arrival -> first generated token
    ended_at: float  # the scheduler's clock at the end
    step: int  # engine steps read back (scheduler updates) before the end

    @property
    def audio_seconds(self) -> float:
        return self.frames * FRAME_SECONDS


@dataclass(frozen=True, slots=True)
class SessionFailed:
    """Engine failure or protocol error; a SessionFinished(reason="error") follows."""

    request_id: str
    error: str


SchedulerEvent = FramesReady | SessionFinished | SessionFailed
