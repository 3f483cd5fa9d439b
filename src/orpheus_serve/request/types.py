"""What gateways hand to `TTSService` and what comes back: the service's own types.

Gateways convert their wire types (pydantic bodies, protobuf messages, JSON
frames) to these at the edge; nothing inward sees a wire type.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from ..token_format import SAMPLE_RATE

# The wire protocols a request can arrive over; every table of protocols derives from this one.
ProtocolName = Literal["rest", "ws", "grpc", "riva", "cartesia"]
PROTOCOLS: tuple[ProtocolName, ...] = get_args(ProtocolName)


@dataclass(frozen=True, slots=True)
class TextChunk:
    """One generation chunk: normalised text with something to say, or "" for a flush with nothing left."""

    text: str
    flush_id: int | None = None  # the chunk completes flush number N (text_stream.TextStream.flush)


class TextSource(Protocol):
    """Where a request's text chunks come from, as the service reads them: a whole text cut up front, or a
    context's incremental text (request.text_stream.TextStream, ARCHITECTURE §5b). Only the event loop that
    serves the request calls these."""

    @property
    def exhausted(self) -> bool:
        """Ended, and every chunk taken."""
        ...

    def take(self) -> TextChunk | None:
        """The next chunk if one can be cut now, else None."""
        ...

    async def wait(self) -> None:
        """Return once `take` may have something new (or the text ended)."""
        ...


@dataclass(frozen=True, slots=True)
class SynthesisRequest:
    text: str
    voice: str = "tara"
    # Sampling overrides; None takes the configured default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # per text chunk
    seed: int | None = None
    constrained: bool | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Incremental text (a context, ARCHITECTURE §5b): chunks are taken from here as they are cut; `text` is unused.
    text_input: TextSource | None = None
    timestamps: bool = False  # also yield ChunkTimings with estimated word times for every chunk


@dataclass(frozen=True, slots=True)
class AudioChunk:
    pcm: bytes  # 16-bit signed little-endian mono PCM
    sample_rate: int = SAMPLE_RATE
    index: int = 0  # position of this chunk in the response, from 0
    start_sample: int = 0  # offset of its first sample in the response

    @property
    def num_samples(self) -> int:
        return len(self.pcm) // 2


@dataclass(frozen=True, slots=True)
class WordTiming:
    word: str
    start_s: float  # seconds from the start of the response's audio (24 kHz, speed 1.0)
    end_s: float


@dataclass(frozen=True, slots=True)
class ChunkTimings:
    """One text chunk's place in the response audio, sent once the chunk's audio is final.

    The chunk's bounds are exact; the word times inside it are estimated (word_timings.py: Orpheus has no
    aligner). Sent for every chunk of a request with `timestamps`, and of every incremental-text request
    (its clients learn when a flush is spoken)."""

    index: int
    text: str  # the normalised chunk text ("" for a flush that found nothing buffered)
    start_sample: int  # first sample of the chunk in the response (24 kHz)
    end_sample: int  # one past its last sample
    words: tuple[WordTiming, ...] = ()
    flush_id: int | None = None  # the chunk completes TextStream.flush() number N
    estimated: bool = True


@dataclass(slots=True)
class SynthesisMetrics:
    request_id: str
    ttfb_s: float | None = None  # request received -> first audio chunk ready
    queue_s: float = 0.0  # waiting for a KV-cache slot (first text chunk)
    wall_s: float = 0.0
    audio_seconds: float = 0.0
    samples: int = 0
    tokens: int = 0
    frames: int = 0
    text_chunks: int = 0
    finish_reason: str = "stop"  # stop | length | cancelled | timeout | error

    @property
    def rtf(self) -> float:
        """Generation wall time / audio duration (< 1 is faster than real time)."""
        return self.wall_s / self.audio_seconds if self.audio_seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {
            "request_id": self.request_id,
            "ttfb_ms": None if self.ttfb_s is None else round(self.ttfb_s * 1000, 2),
            "queue_ms": round(self.queue_s * 1000, 2),
            "wall_ms": round(self.wall_s * 1000, 2),
            "audio_seconds": round(self.audio_seconds, 4),
            "rtf": round(self.rtf, 4) if self.audio_seconds > 0 else None,
            "samples": self.samples,
            "tokens": self.tokens,
            "frames": self.frames,
            "text_chunks": self.text_chunks,
            "finish_reason": self.finish_reason,
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model a service serves (GET /v1/models)."""

    id: str
    backend: str
    model_path: str
    codec_path: str
    tiny: bool
    warning: str | None = None
