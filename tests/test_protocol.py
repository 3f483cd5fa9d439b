from __future__ import annotations

import itertools

import numpy as np
import pytest

from orpheus_serve import token_format as P


def random_frames(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 4096, size=(n, 7))
    frames[0, :] = 0  # code 0 is valid
    frames[-1, :] = 4095
    return frames


def test_constants_match_design() -> None:
    assert (P.END_OF_TEXT, P.START_OF_SPEECH, P.END_OF_SPEECH) == (128009, 128257, 128258)
    assert (P.START_OF_HUMAN, P.END_OF_HUMAN, P.START_OF_AI, P.END_OF_AI, P.PAD) == (128259, 128260, 128261, 128262, 128263)
    assert P.AUDIO_TOKEN_BASE == 128266
    assert P.VOCAB_SIZE == 156940
    assert P.AUDIO_VOCAB_END <= P.VOCAB_SIZE
    assert round(P.TOKENS_PER_SECOND_REALTIME) == 82


def test_round_trip_codes_tokens_codes_including_0_and_4095() -> None:
    frames = random_frames(50)
    ids = P.frames_to_token_ids(frames, end=True)
    assert ids[-1] == P.END_OF_SPEECH
    assert ids[0] == P.AUDIO_TOKEN_BASE  # frame 0, slot 0, code 0
    parsed = P.parse_token_ids(ids)
    np.testing.assert_array_equal(parsed, frames)
    c0, c1, c2 = P.frames_to_snac_codes(frames)
    assert (c0.shape, c1.shape, c2.shape) == ((50,), (100,), (200,))
    np.testing.assert_array_equal(P.snac_codes_to_frames(c0, c1, c2), frames)


def test_snac_codebook_layout() -> None:
    frame = np.array([[10, 11, 12, 13, 14, 15, 16]])
    c0, c1, c2 = P.frames_to_snac_codes(frame)
    assert c0.tolist() == [10]
    assert c1.tolist() == [11, 14]
    assert c2.tolist() == [12, 13, 15, 16]


@pytest.mark.parametrize("cut_seed", range(5))
def test_stream_cut_anywhere_parses_identically(cut_seed: int) -> None:
    frames = random_frames(20, seed=cut_seed)
    ids = P.frames_to_token_ids(frames, end=True)
    whole = P.parse_token_ids(ids)

    one_by_one = P.FrameParser()
    got = [f for t in ids if (f := one_by_one.feed(t)) is not None]
    np.testing.assert_array_equal(np.stack(got), whole)

    rng = np.random.default_rng(cut_seed)
    cuts = sorted(rng.choice(np.arange(1, len(ids)), size=6, replace=False).tolist())
    parser = P.FrameParser()
    pieces = [parser.feed_many(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert parser.ended and parser.dropped_tokens == 0


def test_regression_first_and_last_frames_are_kept() -> None:
    # The reference drops the first frame and the last two of every utterance.
    frames = random_frames(5)
    parsed = P.parse_token_ids(P.frames_to_token_ids(frames, end=True))
    assert len(parsed) == 5
    np.testing.assert_array_equal(parsed[0], frames[0])
    np.testing.assert_array_equal(parsed[-2:], frames[-2:])


def test_regression_code_zero_is_valid_and_never_shifts_positions() -> None:
    # The reference treats code 0 as invalid, skips it, and shifts every later token's slot.
    frames = np.zeros((3, 7), dtype=np.int64)
    frames[1] = [0, 1, 0, 2, 0, 3, 0]
    frames[2] = [4095, 0, 4095, 0, 4095, 0, 4095]
    parser = P.FrameParser()
    parsed = parser.feed_many(P.frames_to_token_ids(frames))
    np.testing.assert_array_equal(parsed, frames)
    assert parser.position == 21


def test_out_of_slot_token_is_an_error_not_a_shift() -> None:
    parser = P.FrameParser()
    parser.feed(P.code_to_token(5, 0))
    with pytest.raises(P.ProtocolError, match="position 1"):
        parser.feed(P.code_to_token(5, 0))  # a slot-0 token at position 1
    with pytest.raises(P.ProtocolError, match="not an audio token"):
        P.FrameParser().feed(1234)


def test_end_mid_frame_reports_dropped_tokens() -> None:
    parser = P.FrameParser()
    ids = [*P.frames_to_token_ids(random_frames(2))[:10], P.END_OF_SPEECH]
    frames = parser.feed_many(ids)
    assert len(frames) == 1 and parser.ended and parser.dropped_tokens == 3
    with pytest.raises(P.ProtocolError, match="after end_of_speech"):
        parser.feed(P.AUDIO_TOKEN_BASE)


def test_slot_ranges_partition_the_audio_vocabulary() -> None:
    ranges = [P.slot_token_range(p) for p in range(7)]
    assert ranges[0][0] == P.AUDIO_TOKEN_BASE
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert ranges[6][1] == P.AUDIO_VOCAB_END
    assert P.slot_token_range(7) == ranges[0]


def test_prompt_ids_follow_the_orpheus_format(tiny_orpheus) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_orpheus / "tokenizer.json"))
    ids = P.build_prompt_ids(tok, "tara", "Hello there.")
    expected_text = tok.encode("tara: Hello there.").ids
    assert expected_text[0] == P.BOS
    assert ids == [P.START_OF_HUMAN, *expected_text, P.END_OF_TEXT, P.END_OF_HUMAN, P.START_OF_AI, P.START_OF_SPEECH]
    # a plain callable works too, and BOS is added when missing
    assert P.build_prompt_ids(lambda s: [1, 2], "leo", "x") == [P.START_OF_HUMAN, P.BOS, 1, 2, *P.PROMPT_SUFFIX]


def test_voices_and_aliases() -> None:
    assert P.resolve_voice("Tara") == "tara"
    assert P.resolve_voice("alloy") in P.VOICES
    assert P.resolve_voice(None) == P.DEFAULT_VOICE
    assert all(v in P.VOICES for v in P.OPENAI_VOICE_ALIASES.values())
    with pytest.raises(P.UnknownVoiceError, match="available: tara, leah"):
        P.resolve_voice("darth")
    assert len(P.EMOTION_TAGS) == 8
