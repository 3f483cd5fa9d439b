"""Request validation: every field of a `SynthesisRequest` against what the engines can take.

`TTSService.validate` calls `validate_request` once per request, before
anything reaches the scheduler; no other code decides what a valid request
is. Bounds come from the config's own pydantic field limits where it has
them (`SamplingConfig`), and from the engine where it sets them:

    text                str of Unicode scalar values (no lone surrogates). Normalised
                        (text.py), it must have something to speak (not only tags,
                        punctuation or emoji), at most profile.max_text_chars
                        characters and profile.max_prompt_tokens tokens, and every
                        chunk's prompt must leave room for audio under max_seq_len.
    voice               an Orpheus voice or an OpenAI alias
    temperature         SamplingConfig.temperature's range, [0, 5]
    top_p               SamplingConfig.top_p's range, (0, 1]
    top_k               SamplingConfig.top_k's lower bound (0 = off) up to the vocabulary
    repetition_penalty  SamplingConfig.repetition_penalty's range, [1, 3]
    max_tokens          an integer >= SamplingConfig.max_tokens' lower bound (7, one frame);
                        above max_seq_len it is clamped there: the session then ends
                        with finish reason "length" where its context runs out
    seed                0 .. 2**64 - 1: TensorRT-LLM's random_seed is a uint64, and the
                        torch and sim engines take the same range. A negative seed is
                        refused on every backend (it would be a different seed on each:
                        two's complement, an error, or a wrap)
    constrained         a bool
    request_id          1..128 printable ASCII characters (it is echoed in replies and
                        logs)

Numbers must be real numbers (a bool is not one), finite, in range. Every
failure is an `InvalidRequestError` naming the parameter: 400 on HTTP,
INVALID_ARGUMENT on gRPC, an error message on the WebSocket.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from .. import token_format
from ..config import Config, SamplingConfig
from ..scheduler.step import SEED_MAX, SamplingParams
from .errors import InvalidRequestError
from .text import has_speech, normalize_text, split_text
from .types import SynthesisRequest

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = r"[\x20-\x7e]+"  # printable ASCII
REQUEST_ID_PATTERN = f"^{_REQUEST_ID_CHARS}$"  # for pydantic (whose `$` is the end of the text)


@dataclass(frozen=True, slots=True)
class Range:
    """An interval of numbers; None leaves that side open-ended."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def __str__(self) -> str:
        if self.lo is None and self.hi is None:
            return "any value"
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def with_hi(self, hi: float) -> Range:
        return replace(self, hi=hi, hi_open=False)

    def json_schema(self) -> dict[str, float]:
        """The range as JSON Schema keywords (for API documents)."""
        out: dict[str, float] = {}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["exclusiveMaximum" if self.hi_open else "maximum"] = self.hi
        return out


def documented_ranges() -> dict[str, Range]:
    """The numeric ranges `validate_request` enforces whatever the config, for API documents."""
    return {
        "temperature": field_range(SamplingConfig, "temperature"),
        "top_p": field_range(SamplingConfig, "top_p"),
        "top_k": field_range(SamplingConfig, "top_k").with_hi(token_format.VOCAB_SIZE),
        "repetition_penalty": field_range(SamplingConfig, "repetition_penalty"),
        "seed": Range(0, SEED_MAX),
        "max_tokens": field_range(SamplingConfig, "max_tokens"),
    }


def field_range(model: type[BaseModel], name: str) -> Range:
    """The ge/gt/le/lt limits of a pydantic field, as a Range."""
    lo = hi = None
    lo_open = hi_open = False
    for limit in model.model_fields[name].metadata:
        if getattr(limit, "ge", None) is not None:
            lo = limit.ge
        elif getattr(limit, "gt", None) is not None:
            lo, lo_open = limit.gt, True
        elif getattr(limit, "le", None) is not None:
            hi = limit.le
        elif getattr(limit, "lt", None) is not None:
            hi, hi_open = limit.lt, True
    return Range(lo, hi, lo_open, hi_open)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server accepts: the config's limits plus its engine's context and vocabulary."""

    max_text_chars: int
    max_prompt_tokens: int
    max_seq_len: int
    chunk_chars: int
    temperature: Range
    top_p: Range
    top_k: Range
    repetition_penalty: Range
    max_tokens: Range

    @classmethod
    def from_config(cls, config: Config, *, max_seq_len: int, chunk_chars: int,
                    vocab_size: int = token_format.VOCAB_SIZE) -> Limits:
        profile = config.active_profile
        return cls(
            max_text_chars=profile.max_text_chars,
            max_prompt_tokens=profile.prompt_token_limit,
            max_seq_len=max_seq_len,
            chunk_chars=chunk_chars,
            temperature=field_range(SamplingConfig, "temperature"),
            top_p=field_range(SamplingConfig, "top_p"),
            top_k=field_range(SamplingConfig, "top_k").with_hi(vocab_size),
            repetition_penalty=field_range(SamplingConfig, "repetition_penalty"),
            max_tokens=field_range(SamplingConfig, "max_tokens"),
        )


def check_unicode(value: str, param: str) -> None:
    """Refuse a string that is not a sequence of Unicode scalar values (a lone surrogate: JSON's
    "\\ud800" decodes to one, and no tokenizer or encoder can take it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} holds a lone surrogate (U+{ord(value[exc.start]):04X} at position {exc.start}); "
            "strings must be valid Unicode", param=param) from None


def is_request_id(value: Any) -> bool:
    """1..128 printable ASCII characters."""
    return isinstance(value, str) and len(value) <= MAX_REQUEST_ID_CHARS and bool(re.fullmatch(_REQUEST_ID_CHARS, value))


def check_request_id(value: Any, param: str = "request_id") -> str:
    """A client's request id (`is_request_id`). Returns it."""
    if not is_request_id(value):
        raise InvalidRequestError(
            f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters", param=param)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(value: Any, name: str, allowed: Range) -> None:
    if value is not None and not (_is_number(value) and value in allowed):
        raise InvalidRequestError(f"{name} must be a number in {allowed}", param=name)


def validate_request(req: SynthesisRequest, limits: Limits, *, prompt_len: Callable[[str, str], int]
                     ) -> SynthesisRequest:
    """`req` with its text normalised, its voice resolved and max_tokens clamped to the context;
    InvalidRequestError naming the parameter otherwise. `prompt_len(voice, text)` is the length of
    the prompt ids the engine would be given for one chunk."""
    check_request_id(req.request_id)
    voice = _voice(req.voice)
    # Incremental text is checked piece by piece as it is pushed (text_stream.py), and cut into chunks
    # no longer than a whole text's.
    text = req.text if req.text_input is not None else _text(req.text, limits, voice, prompt_len)

    _check_number(req.temperature, "temperature", limits.temperature)
    _check_number(req.top_p, "top_p", limits.top_p)
    _check_number(req.repetition_penalty, "repetition_penalty", limits.repetition_penalty)
    if req.top_k is not None and not (_is_integer(req.top_k) and req.top_k in limits.top_k):
        raise InvalidRequestError(f"top_k must be an integer in {limits.top_k} (0 = off)", param="top_k")
    max_tokens = req.max_tokens
    if max_tokens is not None:
        if not (_is_integer(max_tokens) and max_tokens in limits.max_tokens):
            raise InvalidRequestError(f"max_tokens must be an integer {limits.max_tokens} (one audio frame is 7)",
                                      param="max_tokens")
        # More than a context holds cannot be generated: the session ends at the context with "length".
        max_tokens = min(max_tokens, limits.max_seq_len)
    if req.seed is not None and not (_is_integer(req.seed) and 0 <= req.seed <= SEED_MAX):
        raise InvalidRequestError(
            "seed must be an integer in [0, 2**64 - 1]; leave it out for a random seed", param="seed")
    if req.constrained is not None and not isinstance(req.constrained, bool):
        raise InvalidRequestError("constrained must be true or false", param="constrained")
    return replace(req, text=text, voice=voice, max_tokens=max_tokens)


def _voice(voice: Any) -> str:
    if isinstance(voice, str):
        check_unicode(voice, "voice")
    try:
        return token_format.resolve_voice(voice)
    except token_format.UnknownVoiceError as exc:
        raise InvalidRequestError(str(exc), param="voice") from None


def _text(raw: Any, limits: Limits, voice: str, prompt_len: Callable[[str, str], int]) -> str:
    if not isinstance(raw, str):
        raise InvalidRequestError("input must be a string", param="input")
    check_unicode(raw, "input")
    text = normalize_text(raw)
    if not text:
        raise InvalidRequestError("input text is empty", param="input")
    if not has_speech(text):
        raise InvalidRequestError(
            "input has nothing to speak: it needs words or numbers, not only emotion tags, punctuation or emoji",
            param="input")
    if len(text) > limits.max_text_chars:
        raise InvalidRequestError(
            f"input is {len(text)} characters after normalisation; at most {limits.max_text_chars} are allowed",
            param="input")
    # Every chunk's real prompt: the tokens the engine will prefill, and the room left for its audio.
    overhead = prompt_len(voice, "")  # voice name and special ids, in every chunk's prompt
    lengths = [prompt_len(voice, chunk) for chunk in split_text(text, max_chars=limits.chunk_chars)]
    tokens = sum(max(0, length - overhead) for length in lengths)
    if tokens > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"input is {tokens} tokens after normalisation; at most {limits.max_prompt_tokens} are allowed",
            param="input")
    if max(lengths) + token_format.TOKENS_PER_FRAME > limits.max_seq_len:
        raise InvalidRequestError(
            f"input has a sentence of {max(lengths)} prompt tokens, which leaves no room for audio within "
            f"max_seq_len={limits.max_seq_len}", param="input")
    return text


def resolve_sampling(s: SamplingConfig, req: SynthesisRequest, text: str) -> SamplingParams:
    """The request's sampling values, the config's defaults for what it leaves out; max_tokens in whole frames."""
    max_tokens = s.max_tokens_for(text) if req.max_tokens is None else req.max_tokens
    max_tokens = max(token_format.TOKENS_PER_FRAME, max_tokens - max_tokens % token_format.TOKENS_PER_FRAME)
    return SamplingParams(
        temperature=s.temperature if req.temperature is None else float(req.temperature),
        top_p=s.top_p if req.top_p is None else float(req.top_p),
        top_k=s.top_k if req.top_k is None else int(req.top_k),
        repetition_penalty=s.repetition_penalty if req.repetition_penalty is None else float(req.repetition_penalty),
        max_tokens=max_tokens,
        seed=req.seed,
        constrained=s.constrained if req.constrained is None else bool(req.constrained),
    )
