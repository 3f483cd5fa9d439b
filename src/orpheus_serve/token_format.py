"""The Orpheus token format (ARCHITECTURE §3).

Orpheus is a Llama-3 model whose vocabulary is extended with special ids and
7 × 4096 audio tokens. A prompt is

    [start_of_human] + tokenizer(f"{voice}: {text}") (with BOS) + [end_of_text, end_of_human,
    start_of_ai, start_of_speech]

and the model answers with audio tokens, 7 per 85 ms frame, ended by
end_of_speech. The token at audio position p (counted over every audio token
from the first one) carries `code = id - AUDIO_TOKEN_BASE - (p % 7) * 4096`,
a value in 0..4095 inclusive. Frame i maps onto SNAC's three codebooks as

    c0[i] = t0; c1[2i] = t1; c2[4i] = t2; c2[4i+1] = t3; c1[2i+1] = t4; c2[4i+2] = t5; c2[4i+3] = t6

This module has no torch dependency: codes are numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TEXT_VOCAB_SIZE = 128256
BOS = 128000
END_OF_TEXT = 128009
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
START_OF_HUMAN = 128259
END_OF_HUMAN = 128260
START_OF_AI = 128261
END_OF_AI = 128262
PAD = 128263
AUDIO_TOKEN_BASE = 128266
CODEBOOK_SIZE = 4096
TOKENS_PER_FRAME = 7
AUDIO_VOCAB_END = AUDIO_TOKEN_BASE + TOKENS_PER_FRAME * CODEBOOK_SIZE  # 156938 (exclusive)
VOCAB_SIZE = 156940
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 2048
FRAME_SECONDS = SAMPLES_PER_FRAME / SAMPLE_RATE  # 0.0853 s
TOKENS_PER_SECOND_REALTIME = TOKENS_PER_FRAME / FRAME_SECONDS  # 82.03

PROMPT_SUFFIX = (END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH)

VOICES: tuple[str, ...] = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
DEFAULT_VOICE = "tara"
EMOTION_TAGS: tuple[str, ...] = (
    "<laugh>",
    "<chuckle>",
    "<sigh>",
    "<cough>",
    "<sniffle>",
    "<groan>",
    "<yawn>",
    "<gasp>",
)
# OpenAI's voice names, so that clients with a validated OpenAI voice list work unchanged. Each maps to the
# Orpheus voice nearest in character (register and tone). `marin` and `cedar`, which OpenAI recommends as its
# most natural voices, map to the first female and first male voice of Orpheus's own ranking by conversational
# realism (tara, leah, jess, leo, dan, mia, zac, zoe).
OPENAI_VOICE_ALIASES: dict[str, str] = {
    "alloy": "tara",
    "ash": "dan",
    "ballad": "leo",
    "coral": "leah",
    "echo": "zac",
    "fable": "mia",
    "nova": "jess",
    "onyx": "leo",
    "sage": "zoe",
    "shimmer": "mia",
    "verse": "dan",
    "marin": "tara",
    "cedar": "leo",
}


class ProtocolError(ValueError):
    """A token stream that does not follow the Orpheus audio format."""


class UnknownVoiceError(ValueError):
    """A voice name that is neither an Orpheus voice nor a documented alias."""


def resolve_voice(voice: str | None) -> str:
    """Orpheus voice for a name or alias (case-insensitive); UnknownVoiceError otherwise."""
    if voice is None or not str(voice).strip():
        return DEFAULT_VOICE
    name = str(voice).strip().lower()
    if name in VOICES:
        return name
    if name in OPENAI_VOICE_ALIASES:
        return OPENAI_VOICE_ALIASES[name]
    raise UnknownVoiceError(
        f"unknown voice {voice!r}; available: {', '.join(VOICES)} "
        f"(OpenAI names {', '.join(sorted(OPENAI_VOICE_ALIASES))} are accepted as aliases)"
    )


# --------------------------------------------------------------------- prompts


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` with a leading BOS, for a `tokenizers.Tokenizer`, a
    transformers tokenizer, or any callable str -> ids."""
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        ids = list(tokenizer(text))
    else:
        enc = tokenizer.encode(text)
        ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
    if not ids or ids[0] != BOS:
        ids = [BOS, *ids]
    return ids


def build_prompt_ids(tokenizer: Any | Callable[[str], Sequence[int]], voice: str, text: str) -> list[int]:
    """Prompt ids for one utterance; pass these to an engine, never a re-tokenised string."""
    return [START_OF_HUMAN, *encode_text(tokenizer, f"{voice}: {text}"), *PROMPT_SUFFIX]


# ------------------------------------------------------------- audio tokens


def slot_token_range(position: int) -> tuple[int, int]:
    """[lo, hi) of the token ids allowed at audio position `position`."""
    lo = AUDIO_TOKEN_BASE + (position % TOKENS_PER_FRAME) * CODEBOOK_SIZE
    return lo, lo + CODEBOOK_SIZE


def token_to_code(token_id: int, position: int) -> int:
    code = token_id - AUDIO_TOKEN_BASE - (position % TOKENS_PER_FRAME) * CODEBOOK_SIZE
    if not 0 <= code < CODEBOOK_SIZE:
        lo, hi = slot_token_range(position)
        raise ProtocolError(
            f"token {token_id} at audio position {position} is outside slot {position % 7}'s range [{lo}, {hi})"
        )
    return code


def code_to_token(code: int, position: int) -> int:
    if not 0 <= code < CODEBOOK_SIZE:
        raise ProtocolError(f"code {code} is outside 0..{CODEBOOK_SIZE - 1}")
    return AUDIO_TOKEN_BASE + (position % TOKENS_PER_FRAME) * CODEBOOK_SIZE + code


def join_frames(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Frame arrays [n_i, 7] in order as one [sum n_i, 7] (no copy for a single part)."""
    if not parts:
        return np.zeros((0, TOKENS_PER_FRAME), dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def frames_to_token_ids(frames: np.ndarray | Sequence[Sequence[int]], *, end: bool = False) -> list[int]:
    """Frames of 7 codes -> interleaved audio token ids (+ end_of_speech)."""
    arr = np.asarray(frames, dtype=np.int64).reshape(-1, TOKENS_PER_FRAME)
    if arr.size and (arr.min() < 0 or arr.max() >= CODEBOOK_SIZE):
        raise ProtocolError(f"codes must be in 0..{CODEBOOK_SIZE - 1}")
    offsets = AUDIO_TOKEN_BASE + np.arange(TOKENS_PER_FRAME, dtype=np.int64) * CODEBOOK_SIZE
    ids = (arr + offsets).reshape(-1).tolist()
    return [*ids, END_OF_SPEECH] if end else ids


def frames_to_snac_codes(frames: np.ndarray | Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n, 7] frame codes -> SNAC codebooks (c0 [n], c1 [2n], c2 [4n]), int64."""
    f = np.asarray(frames, dtype=np.int64).reshape(-1, TOKENS_PER_FRAME)
    c0 = f[:, 0].copy()
    c1 = f[:, [1, 4]].reshape(-1)
    c2 = f[:, [2, 3, 5, 6]].reshape(-1)
    return c0, c1, c2


def snac_codes_to_frames(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray) -> np.ndarray:
    """Inverse of frames_to_snac_codes: -> [n, 7] int64."""
    c0 = np.asarray(c0, dtype=np.int64).reshape(-1)
    n = c0.shape[0]
    c1 = np.asarray(c1, dtype=np.int64).reshape(n, 2)
    c2 = np.asarray(c2, dtype=np.int64).reshape(n, 4)
    return np.stack([c0, c1[:, 0], c2[:, 0], c2[:, 1], c1[:, 1], c2[:, 2], c2[:, 3]], axis=1)


@dataclass
class FrameParser:
    """Incremental parser of one session's generated ids into whole frames.

    Every audio token counts towards the position (code 0 is a valid code and
    never shifts later tokens). end_of_speech ends the stream; at a frame
    boundary that is a clean end, mid-frame the partial frame is reported in
    `dropped_tokens` (unconstrained sampling only). Any other token, or an
    audio token outside its slot's range, raises ProtocolError.
    """

    position: int = 0
    ended: bool = False
    dropped_tokens: int = 0
    _pending: list[int] = field(default_factory=list)

    def feed(self, token_id: int) -> np.ndarray | None:
        """Consume one id; return a completed frame ([7] int64) or None."""
        if self.ended:
            raise ProtocolError(f"token {token_id} after end_of_speech")
        if token_id == END_OF_SPEECH:
            self.ended = True
            self.dropped_tokens = len(self._pending)
            self._pending.clear()
            return None
        if not AUDIO_TOKEN_BASE <= token_id < AUDIO_VOCAB_END:
            raise ProtocolError(f"token {token_id} at audio position {self.position} is not an audio token")
        position = self.position
        code = token_id - AUDIO_TOKEN_BASE - (position % TOKENS_PER_FRAME) * CODEBOOK_SIZE
        if not 0 <= code < CODEBOOK_SIZE:  # (token_to_code, inlined: this runs for every generated id)
            token_to_code(token_id, position)  # raises with the slot's range
        self._pending.append(code)
        self.position = position + 1
        if len(self._pending) == TOKENS_PER_FRAME:
            frame = np.asarray(self._pending, dtype=np.int64)
            self._pending.clear()
            return frame
        return None

    def feed_many(self, token_ids: Iterable[int]) -> np.ndarray:
        """Consume ids; return the completed frames as [n, 7] int64."""
        frames = [f for t in token_ids if (f := self.feed(t)) is not None]
        if not frames:
            return np.zeros((0, TOKENS_PER_FRAME), dtype=np.int64)
        return np.stack(frames)


def parse_token_ids(token_ids: Iterable[int]) -> np.ndarray:
    """All whole frames of a generated id sequence, as [n, 7] int64."""
    return FrameParser().feed_many(token_ids)
