"""The ElevenLabs adapter's own conversions, without a server: output formats, voice settings, and the
character alignment derived from a chunk's word timings."""

from __future__ import annotations

import pytest

from orpheus_serve.api.elevenlabs import (
    OUTPUT_FORMATS,
    Settings,
    VoiceNotFoundError,
    VoiceSettings,
    chunk_alignment,
    orpheus_voice,
    output_format,
    socket_alignment,
)
from orpheus_serve.audio.encoding import check_output_options
from orpheus_serve.request.errors import InvalidRequestError
from orpheus_serve.request.types import ChunkTimings, WordTiming


def test_every_output_format_can_be_served() -> None:
    for name, spec in OUTPUT_FORMATS.items():
        check_output_options(spec.format, sample_rate=spec.sample_rate)
        assert name.split("_")[1] == str(spec.sample_rate) or name == "mp3_44100"
    assert output_format(None).name == "mp3_44100_128"
    assert (output_format("ulaw_8000").format, output_format("opus_48000_64").sample_rate) == ("mulaw", 48000)
    with pytest.raises(InvalidRequestError) as refused:
        output_format("wav_44100")
    assert refused.value.param == "output_format"


def test_voice_settings_map_to_speed_and_temperature() -> None:
    assert Settings.from_wire(None) == Settings(None, 1.0)
    assert Settings.from_wire(VoiceSettings(stability=1.0, similarity_boost=0.3)) == Settings(0.0, 1.0)
    assert Settings.from_wire(VoiceSettings(stability=0.5, speed=1.1)).temperature == pytest.approx(0.6)
    assert Settings.from_wire(VoiceSettings(stability=0.0)).temperature == pytest.approx(1.2)
    assert orpheus_voice("Leo") == "leo" and orpheus_voice("alloy") in ("tara", "leah", "jess", "leo", "dan", "mia",
                                                                         "zac", "zoe")
    with pytest.raises(VoiceNotFoundError):
        orpheus_voice("21m00Tcm4TlvDq8ikWAM")


CHUNK = ChunkTimings(index=1, text="Well <laugh> okay - fine.", start_sample=24_000, end_sample=72_000,
                     words=(WordTiming("Well", 1.1, 1.4), WordTiming("okay", 1.5, 1.9), WordTiming("fine", 2.2, 2.6)))


def test_chunk_alignment_covers_the_chunk() -> None:
    chars, starts, ends = chunk_alignment(CHUNK, origin_sample=0, speed=1.0)
    assert "".join(chars) == "Well <laugh> okay - fine. "
    assert starts[0] == pytest.approx(1.1) and ends[-1] == pytest.approx(3.0)  # the chunk's end, exactly
    assert all(s <= e for s, e in zip(starts, ends, strict=True))
    assert all(e <= s + 1e-9 for e, s in zip(ends, starts[1:], strict=False))
    tag = chars.index("<")
    assert starts[tag] == ends[tag + len("<laugh>") - 1]  # no word: no time
    # Played twice as fast, every time halves; on the WebSockets, ms from the chunk's own start.
    _, fast_starts, fast_ends = chunk_alignment(CHUNK, origin_sample=0, speed=2.0)
    assert fast_starts[0] == pytest.approx(0.55) and fast_ends[-1] == pytest.approx(1.5)
    socket = socket_alignment(CHUNK, 1.0)
    assert socket is not None and socket["charStartTimesMs"][0] == 100
    assert socket["charStartTimesMs"][-1] + socket["charDurationsMs"][-1] == 2000
