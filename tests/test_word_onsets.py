"""Word times against audio whose word onsets are known: a synthetic voice that speaks each syllable for
SYLLABLE_S (a tone burst per word, a different pitch each), pauses after punctuation, and has silence before
and after. The estimate (service/word_timings.py) must put every word where the voice said it; an even split
of the chunk, or one that ignored the silence at its edges, is off by a tenth of a second or more."""

from __future__ import annotations

import numpy as np
import pytest

from orpheus_serve.service.word_timings import AudioEnvelope, estimate_word_timings
from orpheus_serve.token_format import SAMPLE_RATE

SYLLABLE_S = 0.2
LEAD_S, TAIL_S = 0.3, 0.4
TOLERANCE_S = 0.02  # two 10 ms envelope blocks


def synthetic_voice(words: list[tuple[str, int, float]]) -> tuple[bytes, list[tuple[str, float, float]]]:
    """PCM16 for (word, syllables, pause after it in syllables), and each word's true (word, start, end)."""
    pieces = [np.zeros(int(LEAD_S * SAMPLE_RATE))]
    onsets = []
    t = LEAD_S
    for k, (word, syllables, pause) in enumerate(words):
        n = round(syllables * SYLLABLE_S * SAMPLE_RATE)
        tone = 0.5 * np.sin(2 * np.pi * (180.0 + 40.0 * k) * np.arange(n) / SAMPLE_RATE)
        pieces.append(tone)
        onsets.append((word, t, t + n / SAMPLE_RATE))
        t += n / SAMPLE_RATE
        if k < len(words) - 1 and pause:
            gap = round(pause * SYLLABLE_S * SAMPLE_RATE)
            pieces.append(np.zeros(gap))
            t += gap / SAMPLE_RATE
    pieces.append(np.zeros(int(TAIL_S * SAMPLE_RATE)))
    pcm = (np.concatenate(pieces) * 32767).astype("<i2").tobytes()
    return pcm, onsets


@pytest.mark.parametrize(("text", "words"), [
    # Syllables as vowel groups (a number: one per digit); a clause mark pauses half a syllable, a sentence end one.
    ("Go bananas, then rest.", [("Go", 1, 0.0), ("bananas", 3, 0.5), ("then", 1, 0.0), ("rest", 1, 1.0)]),
    ("Call 4217 tomorrow. Okay?", [("Call", 1, 0.0), ("4217", 4, 0.0), ("tomorrow", 3, 1.0), ("Okay", 2, 1.0)]),
])
@pytest.mark.parametrize("start_sample", [0, 3 * SAMPLE_RATE])  # the chunk first in the response, or later
def test_word_times_land_on_the_known_onsets(text: str, words: list[tuple[str, int, float]],
                                             start_sample: int) -> None:
    pcm, truth = synthetic_voice(words)
    envelope = AudioEnvelope()
    for offset in range(0, len(pcm), 4096):  # as the codec hands it over, in pieces
        envelope.add(pcm[offset:offset + 4096])
    timings = estimate_word_timings(text, start_sample, envelope)
    offset_s = start_sample / SAMPLE_RATE
    assert [t.word for t in timings] == [w for w, _, _ in truth]
    for timing, (word, start_s, end_s) in zip(timings, truth, strict=True):
        assert abs(timing.start_s - offset_s - start_s) <= TOLERANCE_S, (word, timing, start_s)
        assert abs(timing.end_s - offset_s - end_s) <= TOLERANCE_S, (word, timing, end_s)
