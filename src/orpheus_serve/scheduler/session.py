"""One utterance chunk being generated: its request and its state machine.

    waiting ──admit (slot + first prefill chunk)──▶ prefilling ──last chunk──▶ decoding
       │                                               │                          │
       └──────── cancelled | timed_out ◀───────────────┴──────────────┬───────────┘
                                                 finished (stop | length) | failed

A session owns a KV-cache slot from its first prefill chunk until it leaves
the live states. It also keeps its place in the pipeline (ARCHITECTURE §5a), in
frames and samples:

    generated ─▶ pushed to the codec ─▶ decoded ─▶ delivered to the client ─▶ played
    (parser)     (flushed_frames)       (codec      (the gateway took it)      (client clock:
                                         feedback)                             first byte + time)

and the client's playback model that the `deadline` policy and flow control
schedule by: when the client's buffer runs dry, from the audio actually
delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..token_format import SAMPLE_RATE, FrameParser
from .flush import FrameBuffer
from .step import PrefillChunk, SamplingParams

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
    adapter: str | None = None  # LoRA adapter of a custom voice (engines/lora.py); None: the base model

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
    inflight: int = 0  # tokens of launched steps not read back yet (0 or 1: one step is in flight at most)
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
    decoded_frames: int = 0  # frames the codec has run (its lookahead is not audible until the final push)
    decoded_samples: int = 0  # audio the codec returned
    delivered_samples: int = 0  # audio the client's socket has taken
    first_frames: int | None = None  # frames its first push waits for, sized from the measured load

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

    # ------------------------------------------------------------ flow state

    @property
    def undecoded_frames(self) -> int:
        """Frames generated (pushed or not) that the codec has not run yet."""
        return self.buffer.generated_frames - self.decoded_frames

    @property
    def in_codec_frames(self) -> int:
        """Frames pushed to the codec and not decoded yet."""
        return self.buffer.flushed_frames - self.decoded_frames

    @property
    def server_buffered_s(self) -> float:
        """Decoded audio its client has not taken yet (held by the server for a slow reader)."""
        return max(0, self.decoded_samples - self.delivered_samples) / SAMPLE_RATE

    def client_held_s(self, now: float) -> float | None:
        """Audio the client holds unplayed; None before its first audio."""
        return None if self.playback_end_s is None else max(0.0, self.playback_end_s - now)

    @property
    def planned(self) -> int:
        """Tokens it will have once every launched step is read back."""
        return self.generated + self.inflight

    def decodable(self) -> bool:
        """It may be in the plan being made: its prompt is complete (its last chunk may be in the step in
        flight: the engine runs plans in order) and its tokens so far, in flight included, are under its
        limit."""
        if self.state is SessionState.PREFILLING and (self.prefilled < self.prompt_len or not self.inflight):
            return False
        return self.planned < self.token_limit

    def prefill_chunk(self, budget: int) -> PrefillChunk:
        """The next piece of the prompt, at most `budget` ids, marked as sent now (so a later plan continues
        after it even if the scheduler's update lags a step behind); the last one makes a token."""
        assert self.slot is not None
        start = self.prefilled
        end = min(self.prompt_len, start + budget)
        priority = self.engine_priority
        self.reported_priority = priority
        self.prefilled = end
        if end == self.prompt_len:
            self.inflight += 1
        return PrefillChunk(slot=self.slot, request_id=self.request_id, prompt_ids=self.request.prompt_ids,
                            start=start, end=end, sampling=self.request.sampling, priority=priority,
                            adapter=self.request.adapter)

    def record_flush(self, now: float) -> None:
        """Frames went to the codec (the first time marks the end of the TTFB priority)."""
        if self.first_flush_at is None:
            self.first_flush_at = now

    def record_decoded(self, frames: int, samples: int) -> None:
        self.decoded_frames += frames
        self.decoded_samples += samples

    def record_delivery(self, now: float, samples: int) -> None:
        """The client took `samples` more audio: advance the playback model.

        A client whose buffer ran dry before `now` restarts playback when this
        audio arrives, so the deadline moves from `now`, not from the moment it
        stalled: a stalled stream is not forever the most urgent. The stall is
        counted: the `deadline` policy ranks stalled streams apart."""
        if samples <= 0:
            return
        self.delivered_samples += samples
        if self.playback_end_s is not None and self.playback_end_s < now:
            self.stalls += 1
        start = now if self.playback_end_s is None else max(self.playback_end_s, now)
        self.playback_end_s = start + samples / SAMPLE_RATE
