"""audio/encoding.py: every format streams chunk by chunk and decodes back (PyAV) to about the right duration."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from orpheus_serve.audio.encoding import (
    AUDIO_FORMATS,
    CONTENT_TYPES,
    WAV_UNKNOWN_SIZE,
    AudioOptionError,
    AudioStreamEncoder,
    atempo_factors,
    check_output_options,
    decode_audio,
    wav_header,
)
from orpheus_serve.token_format import SAMPLE_RATE, SAMPLES_PER_FRAME


def _tone(seconds: float, rate: int = SAMPLE_RATE, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * hz * t) * 12000).astype("<i2")


def _stream(encoder: AudioStreamEncoder, pcm: np.ndarray, chunk_samples: int = 2 * SAMPLES_PER_FRAME) -> list[bytes]:
    parts = [encoder.encode(pcm[i : i + chunk_samples].tobytes()) for i in range(0, len(pcm), chunk_samples)]
    parts.append(encoder.flush())
    return parts


# Encoder delay/padding (mp3, aac) and atempo edges cost a few tens of ms.
TOLERANCE_S = 0.1


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_each_format_streams_and_decodes_to_the_right_duration(fmt: str) -> None:
    pcm = _tone(1.5)
    encoder = AudioStreamEncoder(fmt)
    parts = _stream(encoder, pcm)
    # Audio leaves while streaming, not only at flush: most chunks carry bytes.
    assert sum(1 for p in parts[:-1] if p) >= len(parts[:-1]) - 2
    samples, rate = decode_audio(b"".join(parts), fmt)
    assert abs(len(samples) / rate - 1.5) < TOLERANCE_S
    assert encoder.content_type == CONTENT_TYPES[fmt]


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac"])
def test_lossless_formats_reproduce_the_samples(fmt: str) -> None:
    pcm = _tone(0.5)
    samples, rate = decode_audio(b"".join(_stream(AudioStreamEncoder(fmt), pcm)), fmt)
    assert rate == SAMPLE_RATE
    np.testing.assert_array_equal(samples, pcm)


def test_lossy_formats_keep_the_tone() -> None:
    pcm = _tone(1.0, hz=500.0)
    for fmt in ("mp3", "aac", "opus"):
        samples, rate = decode_audio(b"".join(_stream(AudioStreamEncoder(fmt), pcm)), fmt)
        spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
        peak_hz = np.argmax(spectrum) * rate / len(samples)
        assert abs(peak_hz - 500.0) < 10.0, fmt


def test_streaming_wav_header_carries_the_unknown_length_sentinel() -> None:
    first = AudioStreamEncoder("wav").encode(_tone(0.1).tobytes())
    assert first[:4] == b"RIFF" and first[8:16] == b"WAVEfmt "
    riff_size, = struct.unpack_from("<I", first, 4)
    rate, = struct.unpack_from("<I", first, 24)
    data_size, = struct.unpack_from("<I", first, 40)
    assert (riff_size, data_size, rate) == (WAV_UNKNOWN_SIZE, WAV_UNKNOWN_SIZE, SAMPLE_RATE)
    assert len(first) == 44 + int(0.1 * SAMPLE_RATE) * 2


def test_wav_header_with_known_length() -> None:
    header = wav_header(16000, num_samples=100)
    assert struct.unpack_from("<I", header, 4)[0] == 36 + 200
    assert struct.unpack_from("<I", header, 40)[0] == 200


@pytest.mark.parametrize("fmt,rate", [("pcm", 16000), ("wav", 8000), ("mp3", 44100), ("opus", 48000),
                                      ("aac", 16000), ("flac", 22050)])
def test_resampling_to_another_rate(fmt: str, rate: int) -> None:
    encoder = AudioStreamEncoder(fmt, sample_rate=rate)
    samples, got_rate = decode_audio(b"".join(_stream(encoder, _tone(1.0))), fmt, sample_rate=rate)
    # Ogg Opus always decodes at 48 kHz, whatever rate it was encoded at.
    assert got_rate == (48000 if fmt == "opus" else rate)
    assert abs(len(samples) / got_rate - 1.0) < TOLERANCE_S


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 3.0, 4.0])
def test_speed_changes_duration_not_pitch(speed: float) -> None:
    pcm = _tone(2.0, hz=400.0)
    samples, rate = decode_audio(b"".join(_stream(AudioStreamEncoder("pcm", speed=speed), pcm)), "pcm")
    assert abs(len(samples) / rate - 2.0 / speed) < 0.1
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
    peak_hz = np.argmax(spectrum) * rate / len(samples)
    assert abs(peak_hz - 400.0) < 10.0


def test_atempo_chain_stays_inside_one_filter_range() -> None:
    for speed in (0.25, 0.3, 0.5, 1.0, 2.0, 3.7, 4.0):
        factors = atempo_factors(speed)
        assert all(0.5 <= f <= 2.0 for f in factors)
        assert np.prod(factors) == pytest.approx(speed)
    assert len(atempo_factors(4.0)) == 2 and len(atempo_factors(0.25)) == 2


@pytest.mark.parametrize("kwargs,param", [
    ({"fmt": "ogg"}, "response_format"),
    ({"fmt": "mp3", "speed": 0.1}, "speed"),
    ({"fmt": "mp3", "speed": 4.5}, "speed"),
    ({"fmt": "mp3", "speed": float("nan")}, "speed"),
    ({"fmt": "pcm", "sample_rate": 4000}, "sample_rate"),
    ({"fmt": "pcm", "sample_rate": 96000}, "sample_rate"),
    ({"fmt": "opus", "sample_rate": 44100}, "sample_rate"),
    ({"fmt": "mp3", "sample_rate": 17000}, "sample_rate"),
])
def test_bad_output_options_name_the_parameter(kwargs: dict, param: str) -> None:
    fmt = kwargs.pop("fmt")
    with pytest.raises(AudioOptionError) as info:
        check_output_options(fmt, **kwargs)
    assert info.value.param == param


def test_encoder_rejects_misuse() -> None:
    encoder = AudioStreamEncoder("pcm")
    with pytest.raises(ValueError):
        encoder.encode(b"\x00\x01\x02")
    encoder.flush()
    with pytest.raises(RuntimeError):
        encoder.encode(b"\x00\x00")
    assert encoder.flush() == b""


def test_without_pyav_pcm_and_wav_still_stream_and_the_rest_is_refused_clearly() -> None:
    """A machine without PyAV (a bare GPU box given only the wheels that fit) serves pcm and wav."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = textwrap.dedent("""
        import sys
        sys.modules["av"] = None  # import av -> ImportError, as when it is not installed
        from orpheus_serve.audio import encoding as audio
        assert audio.av is None
        pcm = (b"\\x01\\x00" * 2048)
        wav = audio.AudioStreamEncoder("wav")
        out = wav.encode(pcm) + wav.encode(pcm) + wav.flush()
        assert out[:4] == b"RIFF" and len(out) == audio.WAV_HEADER_BYTES + 2 * len(pcm)
        raw = audio.AudioStreamEncoder("pcm")
        assert raw.encode(pcm) + raw.flush() == pcm
        for fmt, kwargs, param in (("mp3", {}, "response_format"), ("wav", {"speed": 1.5}, "speed"),
                                   ("pcm", {"sample_rate": 16000}, "sample_rate")):
            try:
                audio.AudioStreamEncoder(fmt, **kwargs)
            except audio.AudioOptionError as exc:
                assert exc.param == param and "PyAV" in str(exc), (fmt, exc)
            else:
                raise AssertionError(fmt)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(root / "src"), "PATH": ""})
    assert proc.stdout.strip() == "ok", proc.stderr


def test_pcm_conversion_clips_rounds_and_reads_back() -> None:
    from orpheus_serve.audio.pcm import float_to_pcm16, pcm16_to_float

    samples = np.array([-2.0, -1.0, -0.25, 0.0, 0.25, 1.0, 3.0], dtype=np.float32)
    pcm = float_to_pcm16(samples)
    # struct, not numpy: little-endian int16, clipped to [-1, 1] and scaled by 32767 (0.25 * 32767 = 8191.75)
    assert struct.unpack("<7h", pcm) == (-32767, -32767, -8192, 0, 8192, 32767, 32767)
    back = pcm16_to_float(struct.pack("<3h", -32768, 16384, 32767))
    assert back.dtype == np.dtype("<f4") and back.tolist() == [-1.0, 0.5, 32767 / 32768]
