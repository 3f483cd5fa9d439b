"""One utterance chunk being generated: its request and its state machine.

    waiting ──admit (slot + first prefill chunk)──▶ prefilling ──last chunk──▶ decoding
       │                                               │                          │
       └──────── cancelled | timed_out ◀───────────────┴──────────────┬───────────┘
                                                 finished (stop | length) | failed

A session owns a KV-cache slot from its first prefill chunk until it leaves
the live states. It also keeps the client's playback model that the
`deadline` policy schedules by: when the client's buffer would run dry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..engines.base import SamplingParams
from ..protocol import FRAME_SECONDS, FrameParser
from .flush import FrameBuffer

PRIORITY_FIRST_AUDIO = 1.0  # engine priority before a session's first audio (TTFB boost)
PRIORITY_STREAMING = 0.5  # after it


@dataclass(frozen=True, slots=True)
class SessionRequest:
    request_id: str  # unique among live sessions
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # sampling.max_tokens caps the generated ids (end_of_speech included)
    arrival_s: float  # clock time it was submitted
    # A continuation chunk of a long text: when the client's playback started and how much
    # audio earlier chunks delivered, so its deadline continues theirs.
    playback_start_s: float | None = None
    audio_before_s: float = 0.0

    @property
    def is_continuation(self) -> bool:
        return self.playback_start_s is not None


class SessionState(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"
    TIMED_OUT = "timed_out"

    @property
    def live(self) -> bool:
        return self in (SessionState.WAITING, SessionState.PREFILLING, SessionState.DECODING)


@dataclass(eq=False, slots=True)
class Session:
    request: SessionRequest
    order: int  # submission order: the FIFO tie-breaker
    buffer: FrameBuffer
    token_limit: int  # generated ids allowed: max_tokens, or less where max_seq_len binds
    state: SessionState = SessionState.WAITING
    slot: int | None = None
    prefilled: int = 0  # prompt ids already sent to the engine
    generated: int = 0
    parser: FrameParser = field(default_factory=FrameParser)
    admitted_s: float | None = None
    first_token_at: float | None = None
    first_flush_at: float | None = None
    last_decoded_step: int = -1  # step of its last token: the least recently stepped go first
    reported_priority: float | None = None  # the engine priority last put in a plan
    # When the client's playback buffer runs dry, if nothing more arrives. None before the
    # first audio of a session that starts a stream (it is then the most urgent).
    playback_end_s: float | None = None
    stalls: int = 0  # times the playback model ran dry before more audio arrived

    def __post_init__(self) -> None:
        req = self.request
        if req.playback_start_s is not None:
            self.playback_end_s = req.playback_start_s + req.audio_before_s

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def had_first_audio(self) -> bool:
        return self.first_flush_at is not None

    @property
    def engine_priority(self) -> float:
        return PRIORITY_STREAMING if self.had_first_audio else PRIORITY_FIRST_AUDIO

    def in_ttfb_priority(self, ttfb_priority_tokens: int) -> bool:
        """New sessions go first until their first audio is out or they used their token allowance."""
        return not self.had_first_audio and self.generated < ttfb_priority_tokens

    @property
    def deadline_s(self) -> float | None:
        return self.playback_end_s

    def record_flush(self, now: float, frames: int, final: bool) -> None:
        """`frames` more frames were just pushed to the codec: advance the playback model.

        Only audible frames count (the codec holds back its lookahead until the
        final push). A client whose buffer ran dry before `now` restarts playback
        when this audio arrives, so the deadline moves from `now`, not from the
        moment it stalled: a stalled stream is not forever the most urgent.
        The stall is counted: the `deadline` policy ranks stalled streams apart."""
        policy = self.buffer.policy
        after = self.buffer.flushed_frames
        audible_before = policy.audible_frames(after - frames, final=False)
        gained = (policy.audible_frames(after, final) - audible_before) * FRAME_SECONDS
        if self.first_flush_at is None:
            self.first_flush_at = now
        if gained <= 0:
            return
        if self.playback_end_s is not None and self.playback_end_s < now:
            self.stalls += 1
        start = now if self.playback_end_s is None else max(self.playback_end_s, now)
        self.playback_end_s = start + gained
