"""Text normalisation and sentence chunking."""

from __future__ import annotations

import re

import pytest

from orpheus_serve.request.text import normalize_text, split_text
from orpheus_serve.token_format import EMOTION_TAGS


def test_normalize_quotes_dashes_spaces_and_invisible_characters() -> None:
    raw = "  \u201cHello,\u201d she said\u2014it\u2019s 1990\u20131995\u2026\n\n\treally?\u00a0Yes\u200b!\x07 "
    assert normalize_text(raw) == "\"Hello,\" she said - it's 1990-1995... really? Yes!"
    assert normalize_text("co\u00adoperate  ,  fine .") == "cooperate, fine."
    assert normalize_text("") == ""
    assert normalize_text(normalize_text(raw)) == normalize_text(raw)


def test_short_text_is_one_chunk_and_sentences_are_packed_up_to_the_limit() -> None:
    assert split_text("Hello there.") == ["Hello there."]
    assert split_text("   ") == []
    text = "One two three. Four five six! Seven eight nine? Ten eleven twelve."
    assert split_text(text, max_chars=35) == ["One two three. Four five six!", "Seven eight nine?", "Ten eleven twelve."]
    assert split_text(text, max_chars=36) == ["One two three. Four five six!", "Seven eight nine? Ten eleven twelve."]


def test_sentence_boundaries_skip_abbreviations_and_initials() -> None:
    text = "Dr. Smith met J. R. Tolkien at 3.5 p.m. on Baker St. today. Then they left, e.g. by train."
    chunks = split_text(text, max_chars=60)
    assert chunks == ["Dr. Smith met J. R. Tolkien at 3.5 p.m. on Baker St. today.", "Then they left, e.g. by train."]


def test_long_sentence_is_cut_at_clauses_then_words() -> None:
    sentence = (
        "When the rain finally stopped, the children ran outside; they splashed in every puddle they could find "
        "and laughed until the sun went down over the hills behind the old farmhouse."
    )
    chunks = split_text(sentence, max_chars=60)
    assert all(len(c) <= 60 for c in chunks)
    assert chunks[0] == "When the rain finally stopped, the children ran outside;"
    assert " ".join(chunks) == sentence  # nothing lost, nothing reordered
    words = split_text("a " * 10 + "supercalifragilisticexpialidocious", max_chars=12)
    assert all(len(c) <= 12 for c in words)
    assert "".join(words).replace(" ", "") == ("a" * 10 + "supercalifragilisticexpialidocious")


def test_emotion_tags_are_never_split() -> None:
    text = ("Well <laugh> that was something. " * 12 + "Anyway<sigh>okay<chuckle>fine<gasp>!") * 2
    for limit in (9, 10, 17, 40, 200):
        chunks = split_text(text, max_chars=limit)
        assert all(len(c) <= limit for c in chunks)
        for c in chunks:
            assert all(tag in EMOTION_TAGS for tag in re.findall(r"<[^<>]*>", c))
            assert not re.search(r"[<>]", re.sub(r"<[^<>]*>", "", c)), (limit, c)  # no half tag
        assert "".join(chunks).replace(" ", "") == normalize_text(text).replace(" ", "")
    with pytest.raises(ValueError, match="shorter than the tag"):
        split_text("Ha <chuckle>", max_chars=5)
    with pytest.raises(ValueError):
        split_text("x", max_chars=0)


def test_600_characters_become_chunks_of_whole_sentences() -> None:
    sentences = [f"This is sentence number {i}, which says something mildly interesting." for i in range(10)]
    text = " ".join(sentences)
    assert len(text) > 600
    chunks = split_text(text, max_chars=200)
    assert len(chunks) == 5  # 68-character sentences, two per chunk
    assert all(len(c) <= 200 for c in chunks)
    assert all(c.endswith(".") for c in chunks)
    assert " ".join(chunks) == text
