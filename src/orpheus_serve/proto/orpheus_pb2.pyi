from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    AUDIO_FORMAT_MULAW: _ClassVar[AudioFormat]
    AUDIO_FORMAT_ALAW: _ClassVar[AudioFormat]
AUDIO_FORMAT_UNSPECIFIED: AudioFormat
AUDIO_FORMAT_PCM: AudioFormat
AUDIO_FORMAT_WAV: AudioFormat
AUDIO_FORMAT_MP3: AudioFormat
AUDIO_FORMAT_OPUS: AudioFormat
AUDIO_FORMAT_AAC: AudioFormat
AUDIO_FORMAT_FLAC: AudioFormat
AUDIO_FORMAT_MULAW: AudioFormat
AUDIO_FORMAT_ALAW: AudioFormat

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "seed")
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
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "voice", "format", "sample_rate", "speed", "sampling", "request_id")
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
    def __init__(self, text: _Optional[str] = ..., voice: _Optional[str] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., sample_rate: _Optional[int] = ..., speed: _Optional[float] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("audio", "sample_rate", "index")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    sample_rate: int
    index: int
    def __init__(self, audio: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class SynthesisMetrics(_message.Message):
    __slots__ = ("request_id", "ttfb_ms", "queue_ms", "wall_ms", "audio_seconds", "rtf", "samples", "tokens", "frames", "text_chunks", "finish_reason")
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
    def __init__(self, request_id: _Optional[str] = ..., ttfb_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., wall_ms: _Optional[float] = ..., audio_seconds: _Optional[float] = ..., rtf: _Optional[float] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ..., frames: _Optional[int] = ..., text_chunks: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("audio", "metrics")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    audio: AudioChunk
    metrics: SynthesisMetrics
    def __init__(self, audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., metrics: _Optional[_Union[SynthesisMetrics, _Mapping]] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Voice(_message.Message):
    __slots__ = ("id", "name", "aliases")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ...) -> None: ...
