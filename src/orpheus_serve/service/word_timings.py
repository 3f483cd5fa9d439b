"""Word timings for a text chunk: exact chunk bounds, estimated word times.

Orpheus has no aligner and exposes no attention a caller could align with,
so only a chunk's bounds are known exactly: its first and last sample in the
response. Inside a chunk, words are placed by an estimate:

1. The speech inside the chunk is found from its audio: RMS per 10 ms block,
   and leading and trailing blocks under a tenth of the loud level (the 95th
   percentile) are silence.
2. Each word gets a share of the speech proportional to its syllables
   (vowel groups; a number counts one per digit), and each punctuation mark
   after it adds a pause (a clause mark 0.5 syllable, a sentence end 1).

Emotion tags (`<laugh>`, ...) make sounds but are not words: they are left
out of the list, and their time falls to the words around them. The result
is monotonic, and every word lies within the chunk's audio. Every surface
that sends these times marks them as estimated.
"""

from __future__ import annotations

import re

import numpy as np

from ..audio.pcm import pcm16_to_float
from ..request.types import WordTiming
from ..token_format import SAMPLE_RATE

BLOCK_SAMPLES = SAMPLE_RATE // 100  # 10 ms
_TAG = re.compile(r"<[A-Za-z_][A-Za-z0-9_-]*>")
_VOWELS = re.compile(r"[aeiouy]+", re.IGNORECASE)
_EDGE_PUNCT = "\"'()[]{}.,;:!?-"
_CLAUSE_PAUSE = 0.5
_SENTENCE_PAUSE = 1.0
_SILENCE_RATIO = 0.1


class AudioEnvelope:
    """RMS of 16-bit PCM per 10 ms block, accumulated chunk by chunk (a few floats a second of audio)."""

    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []
        self._carry = np.zeros(0, dtype=np.float32)
        self.samples = 0

    def add(self, pcm16: bytes) -> None:
        samples = pcm16_to_float(pcm16)
        self.samples += samples.size
        samples = np.concatenate((self._carry, samples)) if self._carry.size else samples
        whole = samples.size // BLOCK_SAMPLES * BLOCK_SAMPLES
        if whole:
            blocks = samples[:whole].reshape(-1, BLOCK_SAMPLES)
            self._blocks.append(np.sqrt(np.mean(blocks * blocks, axis=1)))
        self._carry = samples[whole:].copy()

    def rms(self) -> np.ndarray:
        """[blocks] RMS per 10 ms, the last partial block included."""
        parts = list(self._blocks)
        if self._carry.size:
            parts.append(np.array([np.sqrt(np.mean(self._carry * self._carry))], dtype=np.float32))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def speech_bounds(rms: np.ndarray, samples: int) -> tuple[int, int]:
    """First and one-past-last sample of speech in a chunk, from its envelope (the whole chunk if unclear)."""
    if samples <= 0 or rms.size == 0:
        return 0, max(samples, 0)
    loud = float(np.percentile(rms, 95))
    if loud <= 0.0:
        return 0, samples
    voiced = np.flatnonzero(rms >= loud * _SILENCE_RATIO)
    start = int(voiced[0]) * BLOCK_SAMPLES
    end = min(samples, (int(voiced[-1]) + 1) * BLOCK_SAMPLES)
    return (start, end) if end > start else (0, samples)


def words_of(text: str) -> list[str]:
    """The spoken words of a normalised chunk: tags left out, edge punctuation stripped."""
    words = []
    for token in _TAG.sub(" ", text).split():
        word = token.strip(_EDGE_PUNCT)
        if any(ch.isalnum() for ch in word):
            words.append(word)
    return words


def _weights(text: str) -> list[tuple[str, float, float]]:
    """(word, syllables, pause after it) for each spoken word."""
    out: list[tuple[str, float, float]] = []
    for token in _TAG.sub(" ", text).split():
        word = token.strip(_EDGE_PUNCT)
        tail = token[len(token.rstrip(_EDGE_PUNCT)):]
        pause = _SENTENCE_PAUSE if any(c in ".!?" for c in tail) else _CLAUSE_PAUSE if any(c in ",;:" for c in tail) \
            else 0.0
        if not any(ch.isalnum() for ch in word):
            if out and pause:  # a lone dash or mark: a pause after the previous word
                w, s, p = out[-1]
                out[-1] = (w, s, max(p, pause))
            continue
        digits = sum(ch.isdigit() for ch in word)
        syllables = digits + len(_VOWELS.findall(re.sub(r"\d", " ", word)))
        out.append((word, float(max(1, syllables)), pause))
    return out


def estimate_word_timings(text: str, start_sample: int, envelope: AudioEnvelope) -> tuple[WordTiming, ...]:
    """Word times (seconds from the start of the response) for a chunk whose audio starts at `start_sample`."""
    weights = _weights(text)
    if not weights:
        return ()
    lo, hi = speech_bounds(envelope.rms(), envelope.samples)
    # The last word's pause is not spoken: the chunk's speech ends with that word.
    total = sum(s for _, s, _ in weights) + sum(p for _, _, p in weights[:-1])
    scale = (hi - lo) / total
    out: list[WordTiming] = []
    position = float(lo)
    for k, (word, syllables, pause) in enumerate(weights):
        begin = position
        end = begin + syllables * scale
        out.append(WordTiming(word, (start_sample + begin) / SAMPLE_RATE, (start_sample + min(end, hi)) / SAMPLE_RATE))
        position = end + (pause * scale if k < len(weights) - 1 else 0.0)
    return tuple(out)
