"""Wire models of the HTTP and WebSocket requests, and their conversion to service types.

Strict: wrong JSON types are errors (no "1.5" -> 1.5 coercion, no NaN), and
unknown fields are rejected the way OpenAI rejects them, so a typo never
silently falls back to a default. Checks of content (text hygiene and
length, known voices, sampling bounds) belong to `TTSService.validate`
(validation.py); these models only check shape. The sampling bounds are
also written into the OpenAPI document, from the same source, so that it
describes what the server accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from ..audio.encoding import MAX_SAMPLE_RATE, MAX_SPEED, MIN_SAMPLE_RATE, MIN_SPEED, AudioFormat, default_sample_rate
from ..request.errors import InvalidRequestError
from ..request.types import SynthesisRequest
from ..request.validation import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN, documented_ranges
from .gateway import OutputOptions

_RANGES = documented_ranges()
IGNORED_HEADER = "X-Orpheus-Ignored"  # request fields accepted for compatibility but not honoured, comma-separated


def _integral(value: Any) -> Any:
    """JSON has one number type: 8.0 is the integer 8 (as JSON Schema's "integer" says). 8.5 stays a float and
    is refused; strings are never numbers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[int, BeforeValidator(_integral)]


def _sampling_field(name: str, description: str) -> Any:
    """A sampling extra: None takes the configured default; the range is documented here and enforced by
    validation.py."""
    return Field(None, description=description, json_schema_extra=_RANGES[name].json_schema())


class SpeechFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              json_schema_extra={"anyOf": [  # the text, in `input` or in `text`
                                  {"required": ["input"], "properties": {"input": {"type": "string"}}},
                                  {"required": ["text"], "properties": {"text": {"type": "string"}}}]})

    input: str | None = Field(None, description="Text to speak.")
    text: str | None = Field(None, description="Alias of `input`.")
    voice: str | None = Field(None, description="Orpheus voice or OpenAI alias; default tara.")
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, description="Playback speed, pitch preserved.")
    temperature: float | None = _sampling_field("temperature", "0 is greedy.")
    top_p: float | None = _sampling_field("top_p", "Nucleus sampling; 1 is off.")
    top_k: JsonInt | None = _sampling_field("top_k", "0 is off.")
    repetition_penalty: float | None = _sampling_field("repetition_penalty", "1 is off.")
    seed: JsonInt | None = _sampling_field("seed", "Same seed, same audio; left out, a random one.")
    max_tokens: JsonInt | None = _sampling_field(
        "max_tokens", "Per text chunk (7 per 85 ms frame); more than the context holds ends there, "
                      "with finish reason `length`.")

    def speech_text(self) -> str:
        if self.input is not None and self.text is not None and self.input != self.text:
            raise InvalidRequestError("give the text in `input` or in `text`, not two different texts", param="text")
        value = self.input if self.input is not None else self.text
        if value is None:
            raise InvalidRequestError("missing required parameter: input", param="input")
        return value

    def synthesis_request(self, request_id: str | None = None) -> SynthesisRequest:
        extra: dict[str, str] = {}
        if request_id is not None:
            extra["request_id"] = request_id
        if self.voice is not None:
            extra["voice"] = self.voice
        return SynthesisRequest(
            text=self.speech_text(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_tokens,
            seed=self.seed,
            **extra,
        )


def _english(value: str | None) -> str | None:
    if value is not None and value != "en":
        raise ValueError(f"{value!r} is not supported: the Orpheus voices speak English; send \"en\" or leave it out")
    return value


class SpeechRequestBody(SpeechFields):
    """POST /v1/audio/speech (OpenAI's fields plus the Orpheus extras)."""

    model: str = Field("orpheus", min_length=1, description="Accepted for compatibility; one model is served.")
    response_format: AudioFormat = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    # Voice-agent frameworks (LiveKit, Pipecat) send these OpenAI fields; refusing them would break those clients.
    instructions: str | None = Field(
        None, description="Accepted and ignored: Orpheus cannot follow free-form instructions (steer delivery "
                          "with tags such as `<laugh>` in the text). A response to a request that sets it carries "
                          f"`{IGNORED_HEADER}: instructions`.")
    stream: bool | None = Field(
        None, description="Accepted for compatibility: the audio always streams as it is generated; `false` "
                          "returns the same bytes.")
    language: Annotated[str | None, AfterValidator(_english)] = Field(
        None, description="`en` or left out: the Orpheus voices speak English; any other value is refused.",
        json_schema_extra={"anyOf": [{"type": "string", "enum": ["en"]}, {"type": "null"}]})

    def output_options(self) -> OutputOptions:
        return OutputOptions(format=self.response_format, sample_rate=default_sample_rate(self.response_format),
                             speed=self.speed)

    def ignored_fields(self) -> list[str]:
        """The fields given that the server cannot honour (named in the response's IGNORED_HEADER)."""
        return ["instructions"] if self.instructions else []


class StreamRequestMessage(SpeechFields):
    """One request on WS /v1/audio/stream."""

    response_format: AudioFormat = "pcm"
    sample_rate: JsonInt | None = Field(None, ge=MIN_SAMPLE_RATE, le=MAX_SAMPLE_RATE,
                                        description="Default: 8000 for mulaw and alaw, else 24000 (the model's).")
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN,
                                   description="Echoed in replies: 1 to 128 printable ASCII characters.")

    timestamps: bool = Field(False, description="Also send each text chunk's bounds and estimated word times.")

    def output_options(self) -> OutputOptions:
        rate = default_sample_rate(self.response_format) if self.sample_rate is None else self.sample_rate
        return OutputOptions(format=self.response_format, sample_rate=rate, speed=self.speed)


_CONTEXT_ID = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN,
                    description="Names the context: 1 to 128 printable ASCII characters.")


class ContextOpenMessage(StreamRequestMessage):
    """The first message of a context on WS /v1/audio/stream: a request whose text arrives in pieces."""

    context_id: str = _CONTEXT_ID
    flush: bool = Field(False, description="Speak what has arrived now, whatever it ends with.")
    end: bool = Field(False, description="No more text: the context finishes once its audio is out.")

    def speech_text(self) -> str:
        if self.input is not None and self.text is not None and self.input != self.text:
            raise InvalidRequestError("give the text in `input` or in `text`, not two different texts", param="text")
        return ""  # the text goes into the context's TextStream, piece by piece

    def piece(self) -> str:
        return (self.input if self.input is not None else self.text) or ""


class ContextTextMessage(BaseModel):
    """A later message of an open context: more text, a flush, the end. Options are set by its first message."""

    model_config = ConfigDict(extra="forbid", strict=True)

    context_id: str = _CONTEXT_ID
    text: str | None = None
    input: str | None = None
    flush: bool = False
    end: bool = False

    def piece(self) -> str:
        if self.input is not None and self.text is not None and self.input != self.text:
            raise InvalidRequestError("give the text in `input` or in `text`, not two different texts", param="text")
        return (self.input if self.input is not None else self.text) or ""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the HTTP API answers (OpenAI's shape)."""

    error: ErrorDetail


class ReadinessBody(BaseModel):
    status: Literal["ready", "warming_up", "shutting_down", "engine_failed", "saturated"]


class HealthBody(BaseModel):
    status: Literal["ok"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    backend: str
    model_path: str
    codec_path: str
    tiny: bool = Field(description="The tiny random-weight model: its audio is noise.")
    warning: str | None


class ModelList(BaseModel):
    """GET /v1/models (OpenAI's list shape; `warning` only while the tiny model is served)."""

    object: Literal["list"]
    data: list[ModelCard]
    warning: str | None = None


class Voice(BaseModel):
    id: str
    name: str
    aliases: list[str] = Field(description="OpenAI voice names accepted for this voice.")


class VoiceList(BaseModel):
    voices: list[Voice]


class _Snapshot(BaseModel):
    """A part of the /v1/stats snapshot: the figures named here always, more as the server reports them."""

    model_config = ConfigDict(extra="allow")


class SchedulerStats(_Snapshot):
    total_sessions: int
    active_sessions: int
    pending_sessions: int
    max_concurrent: int


class KvCacheStats(_Snapshot):
    used_slots: int
    free_slots: int


class GatewayStats(_Snapshot):
    uptime_s: float
    open_connections: int
    max_connections: int
    active_streams: dict[str, int] = Field(description="Open streams by protocol.")
    requests: dict[str, dict[str, int]] = Field(description="Finished requests by protocol and outcome.")


class StatsBody(_Snapshot):
    """GET /v1/stats: the scheduler, KV-cache and throughput snapshot (ARCHITECTURE §7)."""

    scheduler: SchedulerStats
    kv_cache: KvCacheStats
    total_tokens: int
    total_batches: int
    gateway: GatewayStats


def parse_error_param(loc: tuple[Any, ...] | list[Any], skip: tuple[str, ...] = ("body",)) -> str | None:
    """`("body", "speed")` -> `"speed"`: the parameter a pydantic error points at."""
    parts = [str(p) for p in loc if str(p) not in skip]
    return ".".join(parts) or None


def first_validation_error(errors: list[Mapping[str, Any]], skip: tuple[str, ...] = ("body",)
                           ) -> InvalidRequestError:
    """A pydantic error list -> one InvalidRequestError naming the first bad parameter."""
    if not errors:
        return InvalidRequestError("invalid request")
    err = errors[0]
    param = parse_error_param(err.get("loc", ()), skip)
    kind = err.get("type", "")
    if kind == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON", param=None)
    if param is None and kind in ("model_attributes_type", "model_type", "dict_type"):
        return InvalidRequestError("the request must be a JSON object (Content-Type: application/json)", param=None)
    if kind == "extra_forbidden":
        return InvalidRequestError(f"unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return InvalidRequestError(f"missing required parameter: {param}", param=param)
    message = str(err.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)
