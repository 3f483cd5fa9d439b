"""When parsed frames leave for the codec (ARCHITECTURE §5, flush policy).

The codec needs `lookahead_frames` frames after a frame before that frame's
audio is final. So the first push waits for `flush_first_n_tokens` audio
tokens plus the lookahead (1 + lookahead frames with the defaults), which
lets the codec emit the first frame at once; after that a push goes out every
`flush_every_n_tokens` new tokens; at the end everything left goes out with
final=True. Each frame is handed out exactly once, in order.

One refinement: right after the first audio the client holds a single frame
(85 ms), less than the time the next `flush_every_n_tokens` take to generate
even at full speed, so waiting for them would make every stream stall once
at its start. While the client holds less than one regular push of audio the
scheduler asks for an eager push: every whole frame goes out as soon as it is
complete. Larger pushes resume once the buffer has grown, and grow further
(2× or 4× the regular push) while the client holds at least twice the larger
push: the same audio in fewer chunks costs the codec worker, the event loop and
the network less per second of audio, and the buffer never drops below one push.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..config import SchedulerConfig
from ..token_format import FRAME_SECONDS, SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME, join_frames

MAX_PUSH_MULTIPLE = 4  # regular pushes grow to at most 4× flush_every_n_tokens when the client is far ahead


@dataclass(frozen=True, slots=True)
class FlushPolicy:
    first_frames: int  # frames needed before the first push (first window + lookahead)
    every_frames: int  # new frames per later push
    lookahead_frames: int = 0

    def __post_init__(self) -> None:
        if self.first_frames < 1 or self.every_frames < 1 or self.lookahead_frames < 0:
            raise ValueError(f"invalid flush policy {self}")

    @classmethod
    def from_config(cls, config: SchedulerConfig, lookahead_frames: int = 0) -> FlushPolicy:
        return cls(
            first_frames=config.flush_first_n_tokens // TOKENS_PER_FRAME + lookahead_frames,
            every_frames=config.flush_every_n_tokens // TOKENS_PER_FRAME,
            lookahead_frames=lookahead_frames,
        )

    def audible_frames(self, flushed_frames: int, final: bool) -> int:
        """Frames whose audio the codec can have produced after `flushed_frames` were pushed."""
        return flushed_frames if final else max(0, flushed_frames - self.lookahead_frames)

    def first_push_frames(self, wait_s: float | None, lookahead_samples: int, max_frames: int) -> int:
        """Frames the first push waits for, so that its audible part covers `wait_s` (the measured wait
        for the next frame, with its safety factor): the policy's minimum while nothing is measured,
        never more than `max_frames` (the codec backlog a session may have)."""
        if wait_s is None:
            return self.first_frames
        needed = math.ceil((wait_s * SAMPLE_RATE + lookahead_samples) / SAMPLES_PER_FRAME)
        return max(self.first_frames, min(needed, max_frames))

    def push_frames(self, held_s: float | None, max_frames: int) -> int:
        """Frames per regular push: `every_frames`, doubled (up to 4×) while the client holds at least
        twice the larger push (`held_s` of unplayed audio; None before its first audio), so a deep
        buffer takes fewer, bigger chunks. Never more than `max_frames`."""
        if held_s is None:
            return self.every_frames
        held_pushes = held_s / (self.every_frames * FRAME_SECONDS)
        multiple = 1
        while multiple < MAX_PUSH_MULTIPLE and held_pushes >= 4 * multiple:
            multiple *= 2
        return min(self.every_frames * multiple, max_frames)

    def buffer_is_thin(self, held_s: float | None, *, pushed: bool) -> bool:
        """The client holds less audio than one regular push: frames should go out one by one. Before
        the first push's audio reached the client (`held_s` None), the buffer is as thin as it gets."""
        if held_s is None:
            return pushed
        # (less a microsecond, so that exactly one push's worth, summed frame by frame, is not thin)
        return held_s < self.every_frames * FRAME_SECONDS - 1e-6


@dataclass(slots=True)
class FrameBuffer:
    """One session's parsed frames that have not been pushed to the codec yet."""

    policy: FlushPolicy
    flushed_frames: int = 0
    flushes: int = 0
    _pending: list[np.ndarray] = field(default_factory=list)
    _pending_frames: int = 0

    @property
    def pending_frames(self) -> int:
        return self._pending_frames

    def add(self, frames: np.ndarray) -> None:
        if frames.shape[0]:
            self._pending.append(frames)
            self._pending_frames += int(frames.shape[0])

    @property
    def generated_frames(self) -> int:
        """Whole frames parsed so far, pushed or not."""
        return self.flushed_frames + self._pending_frames

    def take_ready(self, *, eager: bool = False, every_frames: int | None = None,
                   first_frames: int | None = None) -> np.ndarray | None:
        """Every pending frame if the policy says a push is due now, else None.
        `eager`: the client's buffer is thin, push any whole frame (after the first push).
        `every_frames`: a larger push size while the client's buffer is deep (fewer, bigger chunks).
        `first_frames`: frames the first push needs, when the scheduler sizes it from measured
        load (never fewer than the policy's)."""
        needed = 1 if eager else (every_frames or self.policy.every_frames)
        if self.flushes == 0:
            needed = max(self.policy.first_frames, first_frames or 0)
        if self._pending_frames < needed:
            return None
        return self._take()

    def take_final(self) -> np.ndarray:
        """Everything left (possibly no frames), for the last push."""
        return self._take()

    def _take(self) -> np.ndarray:
        frames = join_frames(self._pending)
        self._pending = []
        self._pending_frames = 0
        self.flushed_frames += int(frames.shape[0])
        self.flushes += 1
        return frames
