"""TextStream: incremental text cut into generation chunks (pure, with a hand-driven clock)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from orpheus_serve.config import StreamInputConfig
from orpheus_serve.request.errors import InvalidRequestError
from orpheus_serve.request.text import speech_chunks
from orpheus_serve.request.text_stream import TextStream
from orpheus_serve.request.types import TextChunk
from orpheus_serve.service.word_timings import AudioEnvelope, estimate_word_timings, speech_bounds, words_of
from orpheus_serve.token_format import SAMPLE_RATE


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stream(clock: Clock, **settings: float) -> TextStream:
    return TextStream(StreamInputConfig(**settings), clock=clock)


def test_a_sentence_end_cuts_once_a_space_follows_it() -> None:
    clock = Clock()
    text = stream(clock)
    for token in ["Hello", " there", "."]:
        text.push(token)
        assert text.take() is None  # a dot at the end of the buffer may be "3." of "3.5"
    text.push(" How")
    assert text.take() == TextChunk("Hello there.")
    assert text.take() is None
    text.push(" are you?")
    text.end()
    assert text.take() == TextChunk("How are you?")
    assert text.take() is None and text.exhausted


def test_a_clause_cuts_only_after_enough_text() -> None:
    clock = Clock()
    text = stream(clock, min_chunk_chars=20)
    text.push("Well, ")
    assert text.take() is None  # "Well," is too short to speak on its own
    text.push("if you ask me about the weather, ")
    assert text.take() == TextChunk("Well, if you ask me about the weather,")


def test_everything_that_arrived_is_packed_into_the_next_chunk() -> None:
    clock = Clock()
    text = stream(clock)
    text.push("One. Two. Three. Four")
    assert text.take() == TextChunk("One. Two. Three.")
    text.end()
    assert text.take() == TextChunk("Four")


def test_after_the_delay_complete_words_are_cut_and_a_partial_word_waits() -> None:
    clock = Clock()
    text = stream(clock, max_buffer_delay_ms=300)
    text.push("so I was thinking we could")
    clock.now += 0.299
    assert text.take() is None
    clock.now += 0.002
    # "could" may go on ("couldn't"): only the words a space follows are cut
    assert text.take() == TextChunk("so I was thinking we")
    text.push("n't go")
    text.end()
    assert text.take() == TextChunk("couldn't go")


def test_flush_cuts_everything_and_marks_the_last_chunk() -> None:
    clock = Clock()
    text = stream(clock)
    text.push("Half a thought")
    flush = text.flush()
    assert text.take() == TextChunk("Half a thought", flush_id=flush)
    # a flush with nothing buffered still yields a marker, so its client hears when the audio is out
    second = text.flush()
    assert second == flush + 1
    assert text.take() == TextChunk("", flush_id=second)


def test_a_flush_after_a_cut_chunk_marks_that_chunk() -> None:
    clock = Clock()
    text = stream(clock)
    text.push("Done. ")
    fid = text.flush()
    assert text.take() == TextChunk("Done.", flush_id=fid)


def test_text_without_speech_is_dropped_and_long_text_is_split() -> None:
    clock = Clock()
    text = stream(clock)
    text.push("... !!! ")
    text.push("word " * 60)
    text.end()
    chunks = []
    while (chunk := text.take()) is not None:
        chunks.append(chunk.text)
    assert chunks == speech_chunks("word " * 60)
    assert all(len(c) <= 200 for c in chunks)


def test_a_whole_text_is_a_complete_stream_of_its_chunks() -> None:
    chunks = speech_chunks("First sentence. " * 30)
    text = TextStream.complete(chunks)
    assert text.ended
    assert [text.take().text for _ in chunks] == chunks
    assert text.exhausted


def test_pushes_are_checked() -> None:
    clock = Clock()
    text = stream(clock, max_buffered_chars=300)
    with pytest.raises(InvalidRequestError, match="string"):
        text.push(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        text.push("bad \ud800 surrogate")
    text.push("x" * 250)
    with pytest.raises(InvalidRequestError, match="max_buffered_chars"):
        text.push("y" * 60)
    text.end()
    with pytest.raises(InvalidRequestError, match="ended"):
        text.push("more")


def test_an_idle_context_ends_with_what_it_had() -> None:
    clock = Clock()
    text = stream(clock, idle_timeout_s=5)
    text.push("trailing words")
    clock.now += 5
    assert text.take() == TextChunk("trailing")  # the buffer delay has long passed: the complete word first
    assert not text.ended
    assert text.take() == TextChunk("words")  # then the idle timeout ends the context with the rest
    assert text.ended and text.exhausted


def test_wait_returns_at_the_cut_deadline_or_on_new_text() -> None:
    async def scenario() -> None:
        text = TextStream(StreamInputConfig(max_buffer_delay_ms=50))
        text.push("three whole words ")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(text.wait(), 2)  # the delay passes: take() can cut now
        assert loop.time() - started >= 0.04
        assert text.take() == TextChunk("three whole words")

        waiter = asyncio.ensure_future(text.wait())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing buffered: waits for text (or the idle timeout)
        text.push("Next. ")
        await asyncio.wait_for(waiter, 2)
        assert text.take() == TextChunk("Next.")

    asyncio.run(scenario())


# ------------------------------------------------------------------ word timings


def test_word_timings_cover_the_speech_in_order() -> None:
    # 0.2 s of silence, 1 s of "speech", 0.3 s of silence
    rng = np.random.default_rng(0)
    audio = np.concatenate([np.zeros(int(0.2 * SAMPLE_RATE)), 0.3 * rng.standard_normal(SAMPLE_RATE),
                            np.zeros(int(0.3 * SAMPLE_RATE))])
    envelope = AudioEnvelope()
    pcm = (audio * 32767).astype("<i2").tobytes()
    for k in range(0, len(pcm), 4801 * 2):  # pushed in uneven pieces
        envelope.add(pcm[k:k + 4801 * 2])
    lo, hi = speech_bounds(envelope.rms(), envelope.samples)
    assert abs(lo / SAMPLE_RATE - 0.2) < 0.011 and abs(hi / SAMPLE_RATE - 1.2) < 0.011

    start = 48_000  # the chunk starts 2 s into the response
    text = "Hello, <laugh> wonderful world. It's 2024!"
    words = estimate_word_timings(text, start, envelope)
    assert [w.word for w in words] == words_of(text) == ["Hello", "wonderful", "world", "It's", "2024"]
    assert words[0].start_s == pytest.approx(2.2, abs=0.011)
    assert words[-1].end_s == pytest.approx(3.2, abs=0.011)
    for a, b in itertools.pairwise(words):
        assert a.start_s < a.end_s <= b.start_s
    # the comma and the full stop leave pauses; "wonderful" (3 syllables) is longer than "world" (1)
    assert words[1].start_s > words[0].end_s
    assert (words[1].end_s - words[1].start_s) > 2 * (words[2].end_s - words[2].start_s)
