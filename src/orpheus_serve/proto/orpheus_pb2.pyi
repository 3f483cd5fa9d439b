from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_FORMAT_UNSPECIFIED: _ClassVar[AudioFormat]
    AUDIO_FORMAT_PCM: _ClassVar[AudioFormat]
    AUDIO_FORMAT_WAV: _ClassVar[AudioFormat]
    AUDIO_FORMAT_MP3: _ClassVar[AudioFormat]
    AUDIO_FORMAT_OPUS: _ClassVar[AudioFormat]
    AUDIO_FORMAT_AAC: _ClassVar[AudioFormat]
    AUDIO_FORMAT_FLAC: _ClassVar[AudioFormat]
AUDIO_FORMAT_UNSPECIFIED: AudioFormat
AUDIO_FORMAT_PCM: AudioFormat
AUDIO_FORMAT_WAV: AudioFormat
AUDIO_FORMAT_MP3: AudioFormat
AUDIO_FORMAT_OPUS: AudioFormat
AUDIO_FORMAT_AAC: AudioFormat
AUDIO_FORMAT_FLAC: AudioFormat

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "repetition_penalty", "seed", "temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_tokens: int
    seed: int
    def __init__(self, temperature: float | None = ..., top_p: float | None = ..., top_k: int | None = ..., repetition_penalty: float | None = ..., max_tokens: int | None = ..., seed: int | None = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("format", "request_id", "sample_rate", "sampling", "speed", "text", "voice")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    voice: str
    format: AudioFormat
    sample_rate: int
    speed: float
    sampling: SamplingOptions
    request_id: str
    def __init__(self, text: str | None = ..., voice: str | None = ..., format: AudioFormat | str | None = ..., sample_rate: int | None = ..., speed: float | None = ..., sampling: SamplingOptions | _Mapping | None = ..., request_id: str | None = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("audio", "index", "sample_rate")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    sample_rate: int
    index: int
    def __init__(self, audio: bytes | None = ..., sample_rate: int | None = ..., index: int | None = ...) -> None: ...

class SynthesisMetrics(_message.Message):
    __slots__ = ("audio_seconds", "finish_reason", "frames", "queue_ms", "request_id", "rtf", "samples", "text_chunks", "tokens", "ttfb_ms", "wall_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFB_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RTF_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ttfb_ms: float
    queue_ms: float
    wall_ms: float
    audio_seconds: float
    rtf: float
    samples: int
    tokens: int
    frames: int
    text_chunks: int
    finish_reason: str
    def __init__(self, request_id: str | None = ..., ttfb_ms: float | None = ..., queue_ms: float | None = ..., wall_ms: float | None = ..., audio_seconds: float | None = ..., rtf: float | None = ..., samples: int | None = ..., tokens: int | None = ..., frames: int | None = ..., text_chunks: int | None = ..., finish_reason: str | None = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("audio", "metrics")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    audio: AudioChunk
    metrics: SynthesisMetrics
    def __init__(self, audio: AudioChunk | _Mapping | None = ..., metrics: SynthesisMetrics | _Mapping | None = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Voice(_message.Message):
    __slots__ = ("aliases", "id", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: str | None = ..., name: str | None = ..., aliases: _Iterable[str] | None = ...) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Iterable[Voice | _Mapping] | None = ...) -> None: ...
