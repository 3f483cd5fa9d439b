"""Audio framing and incremental encoding for streamed responses.

The service produces 16-bit little-endian mono PCM at 24 kHz in chunks of a
few frames. Gateways turn each chunk into bytes of the format the client asked
for *as it arrives*, so the first bytes leave with the first decoded frame:

- `pcm`: the samples as they are.
- `wav`: a 44-byte RIFF header whose sizes carry the unknown-length sentinel
  0xFFFFFFFF (the length is not known when the header leaves), then PCM.
- `mulaw`, `alaw`: ITU-T G.711 companded 8-bit samples, no header (telephony),
  8 kHz unless another rate is asked. Exact G.711 (the bit patterns of the
  ITU-T G.191 reference coder) through a 65,536-entry table, one numpy lookup
  per chunk.
- `mp3`, `aac` (ADTS), `flac`, `opus` (Ogg): PyAV encoders and muxers writing
  into an in-memory sink that is drained after every chunk. The Ogg muxer gets
  a short page duration so a page (and thus audio) leaves with every chunk
  instead of once per second.

Optional per-stream processing runs before the encoder, also incrementally:
`speed` (0.25–4.0) through FFmpeg's pitch-preserving `atempo` filter, chained
because one `atempo` only covers 0.5–2.0; and resampling to another output
rate. Everything here is synchronous. Raw PCM and WAV at the model's rate
and speed are plain copies, which the gateway does inline; compressed
encoding, resampling and tempo cost milliseconds per chunk, so the gateway
runs them in its encoding thread pool (PyAV releases the GIL while it works)
instead of on the event loop that serves every stream.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, get_args

import numpy as np

try:
    import av
    import av.filter
except ImportError:  # PyAV is optional: without it, pcm and wav at the model's rate and normal speed only
    av = None

from ..token_format import SAMPLE_RATE

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm", "mulaw", "alaw"]
AUDIO_FORMATS: tuple[str, ...] = get_args(AudioFormat)

# G.711 formats: headerless 8-bit companded samples, 8 kHz unless the client asks for another rate.
TELEPHONY_FORMATS: tuple[str, ...] = ("mulaw", "alaw")
TELEPHONY_SAMPLE_RATE = 8000

CONTENT_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mulaw": "audio/basic",  # RFC 2046: 8-bit G.711 mu-law, mono, 8 kHz
    "alaw": "audio/x-alaw-basic",
}

MIN_SPEED = 0.25
MAX_SPEED = 4.0
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000

# 0xFFFFFFFF in the RIFF and data sizes: "length unknown, read until the stream ends".
WAV_UNKNOWN_SIZE = 0xFFFFFFFF
WAV_HEADER_BYTES = 44

# Ogg page duration in microseconds: short enough that every chunk closes a page.
OGG_PAGE_DURATION_US = 20_000


@dataclass(frozen=True, slots=True)
class _CodecSpec:
    container: str
    codec: str
    sample_format: str
    sample_rates: tuple[int, ...] | None  # None: any rate in MIN..MAX_SAMPLE_RATE
    container_options: dict[str, str] = field(default_factory=dict)
    codec_options: dict[str, str] = field(default_factory=dict)
    bit_rate: int | None = None


_CODECS: dict[str, _CodecSpec] = {
    "mp3": _CodecSpec("mp3", "libmp3lame", "s16p", (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
                      bit_rate=64_000),
    "opus": _CodecSpec("ogg", "libopus", "s16", (8000, 12000, 16000, 24000, 48000),
                       container_options={"page_duration": str(OGG_PAGE_DURATION_US)}, bit_rate=48_000),
    "aac": _CodecSpec("adts", "aac", "fltp",
                      (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000), bit_rate=64_000),
    # A 1024-sample block keeps the first FLAC frame from waiting for 4608 samples.
    "flac": _CodecSpec("flac", "flac", "s16", None, codec_options={"frame_size": "1024"}),
}


def supported_sample_rates(fmt: str) -> tuple[int, ...] | None:
    """The output rates `fmt` can be coded at; None: any rate in MIN_SAMPLE_RATE..MAX_SAMPLE_RATE."""
    spec = _CODECS.get(fmt)
    return None if spec is None else spec.sample_rates


def default_sample_rate(fmt: str, input_rate: int = SAMPLE_RATE) -> int:
    """The output rate when the client names none: telephony's 8 kHz for G.711, else the model's own rate."""
    return TELEPHONY_SAMPLE_RATE if fmt in TELEPHONY_FORMATS else input_rate


# ----------------------------------------------------------------- G.711
# Written from ITU-T G.711 as its reference coder (ITU-T G.191 STL, g711.c) computes it: negative inputs take
# the one's complement before quantisation, so e.g. -1 and 0 land in the two codes nearest zero. Evaluated once
# over every 16-bit input, vectorised, into a table indexed by the sample's bit pattern.


def _mulaw_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32)
    magnitude = np.where(x < 0, ~x, x) >> 2  # 14-bit magnitude
    biased = np.minimum(magnitude + 33, 0x1FFF)
    segment = np.zeros_like(biased)  # number of bits of biased >> 6, i.e. 1 + the segment number
    rest = biased >> 6
    while rest.any():
        segment += rest != 0
        rest >>= 1
    segment += 1
    code = ((8 - segment) << 4) | (0x0F - ((biased >> segment) & 0x0F))
    code |= np.where(x >= 0, 0x80, 0)
    return _by_bit_pattern(code)


def _alaw_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32)
    magnitude = np.where(x < 0, ~x, x) >> 4  # 12-bit magnitude
    exponent = np.zeros_like(magnitude)
    mantissa = magnitude.copy()
    # Segments above the first two: shift the mantissa down until it fits 4 bits after the leading one.
    big = mantissa > 15
    exponent[big] = 1
    while True:
        over = mantissa > 31
        if not over.any():
            break
        mantissa = np.where(over, mantissa >> 1, mantissa)
        exponent += over
    code = np.where(big, (mantissa - 16) + (exponent << 4), magnitude)
    code |= np.where(x >= 0, 0x80, 0)
    return _by_bit_pattern(code ^ 0x55)


def _by_bit_pattern(codes_from_min: np.ndarray) -> np.ndarray:
    """Reorder a table built over -32768..32767 so that it is indexed by the int16's uint16 view."""
    return np.roll(codes_from_min.astype(np.uint8), -32768)


def _mulaw_expand_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent = (code >> 4) & 0x07
    value = (((code & 0x0F) << 3) + 0x84 << exponent) - 0x84
    return np.where(code & 0x80, -value, value).astype(np.int16)


def _alaw_expand_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    exponent = (code >> 4) & 0x07
    mantissa = code & 0x0F
    value = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(code & 0x80, value, -value).astype(np.int16)


_G711_COMPRESS: dict[str, np.ndarray] = {"mulaw": _mulaw_table(), "alaw": _alaw_table()}
_G711_EXPAND: dict[str, np.ndarray] = {"mulaw": _mulaw_expand_table(), "alaw": _alaw_expand_table()}


def g711_encode(pcm: bytes | np.ndarray, fmt: str) -> bytes:
    """16-bit signed PCM (little-endian bytes or int16 samples) -> one G.711 byte per sample."""
    samples = np.frombuffer(pcm, dtype="<i2") if isinstance(pcm, bytes | bytearray | memoryview) else pcm
    return _G711_COMPRESS[fmt][samples.astype("<i2", copy=False).view("<u2")].tobytes()


def g711_decode(data: bytes, fmt: str) -> np.ndarray:
    """G.711 bytes -> int16 samples."""
    return _G711_EXPAND[fmt][np.frombuffer(data, dtype=np.uint8)]


class AudioOptionError(ValueError):
    """An output option (format, sample rate, speed) that cannot be served; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_output_options(fmt: str, *, sample_rate: int = SAMPLE_RATE, speed: float = 1.0) -> None:
    """Raise AudioOptionError unless `fmt` at `sample_rate` and `speed` can be streamed."""
    if fmt not in AUDIO_FORMATS:
        raise AudioOptionError(f"unsupported audio format {fmt!r}; supported: {', '.join(AUDIO_FORMATS)}",
                               "response_format")
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not math.isfinite(speed) \
            or not MIN_SPEED <= speed <= MAX_SPEED:
        raise AudioOptionError(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}", "speed")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) \
            or not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioOptionError(
            f"sample_rate must be an integer between {MIN_SAMPLE_RATE} and {MAX_SAMPLE_RATE}, got {sample_rate!r}",
            "sample_rate")
    spec = _CODECS.get(fmt)
    if spec is not None and spec.sample_rates is not None and sample_rate not in spec.sample_rates:
        rates = ", ".join(str(r) for r in spec.sample_rates)
        raise AudioOptionError(f"{fmt} supports sample rates {rates}; got {sample_rate}", "sample_rate")
    if av is None and not _raw_output(fmt, sample_rate, SAMPLE_RATE, speed):
        param = "response_format" if fmt not in ("pcm", "wav") else ("speed" if speed != 1.0 else "sample_rate")
        raise AudioOptionError(f"this server has no PyAV: only pcm and wav at {SAMPLE_RATE} Hz and speed 1.0 "
                               f"can be served (asked: {fmt} at {sample_rate} Hz, speed {speed})", param)


def _raw_output(fmt: str, out_rate: int, input_rate: int, speed: float) -> bool:
    """The PCM goes out as it came (after a WAV header): no encoder, resampler or tempo filter."""
    return fmt in ("pcm", "wav") and out_rate == input_rate and speed == 1.0


def wav_header(sample_rate: int, *, num_samples: int | None = None, channels: int = 1) -> bytes:
    """A 44-byte PCM16 RIFF/WAVE header; with num_samples=None both sizes carry the streaming sentinel."""
    block_align = 2 * channels
    if num_samples is None:
        riff_size = data_size = WAV_UNKNOWN_SIZE
    else:
        data_size = num_samples * block_align
        riff_size = 36 + data_size
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff_size, b"WAVE", b"fmt ", 16, 1, channels, sample_rate,
                       sample_rate * block_align, block_align, 16, b"data", data_size)


def _pcm_frame(pcm: bytes, sample_rate: int, pts: int) -> av.AudioFrame:
    samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = sample_rate
    frame.pts = pts
    frame.time_base = Fraction(1, sample_rate)
    return frame


def atempo_factors(speed: float) -> list[float]:
    """Split `speed` into atempo stages, each within atempo's 0.5–2.0."""
    factors: list[float] = []
    remaining = float(speed)
    while remaining > 2.0:
        factors.append(2.0)
        remaining /= 2.0
    while remaining < 0.5:
        factors.append(0.5)
        remaining /= 0.5
    factors.append(remaining)
    return factors


class _Tempo:
    """Pitch-preserving tempo change of an s16 mono stream through chained `atempo` filters."""

    def __init__(self, sample_rate: int, speed: float) -> None:
        self._graph = av.filter.Graph()
        source = self._graph.add_abuffer(format="s16", sample_rate=sample_rate, layout="mono",
                                         time_base=Fraction(1, sample_rate))
        node = source
        for factor in atempo_factors(speed):
            stage = self._graph.add("atempo", f"{factor:.6f}")
            node.link_to(stage)
            node = stage
        sink = self._graph.add("abuffersink")
        node.link_to(sink)
        self._graph.configure()

    def process(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
        self._graph.push(frame)
        out: list[av.AudioFrame] = []
        while True:
            try:
                out.append(self._graph.pull())
            except (BlockingIOError, EOFError):
                # Nothing more until the next input (BlockingIOError) or the stream is done (EOFError).
                return out


class _Sink(io.RawIOBase):
    """Write-only, non-seekable byte sink that PyAV's muxers write into and gateways drain.

    Being non-seekable matters: muxers that would seek back to patch a header
    (FLAC STREAMINFO, an MP3 Xing frame) must not rewrite bytes already sent.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data) -> int:  # type: ignore[override]
        self._buffer += data
        return len(data)

    def drain(self) -> bytes:
        out = bytes(self._buffer)
        self._buffer.clear()
        return out


class _Stage:
    """Turns s16 mono frames at the output rate into the bytes of one format."""

    def frames(self, frames: list[av.AudioFrame]) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        raise NotImplementedError


class _RawStage(_Stage):
    def __init__(self, header: bytes = b"") -> None:
        self._header = header

    def frames(self, frames: list[av.AudioFrame]) -> bytes:
        body = b"".join(bytes(f.to_ndarray().astype("<i2", copy=False).tobytes()) for f in frames)
        head, self._header = self._header, b""
        return head + body

    def finish(self) -> bytes:
        head, self._header = self._header, b""
        return head


class _G711Stage(_Stage):
    def __init__(self, fmt: str) -> None:
        self._fmt = fmt

    def frames(self, frames: list[av.AudioFrame]) -> bytes:
        if not frames:
            return b""
        return g711_encode(np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), self._fmt)

    def finish(self) -> bytes:
        return b""


class _ContainerStage(_Stage):
    def __init__(self, spec: _CodecSpec, sample_rate: int) -> None:
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=spec.container, options=spec.container_options)
        self._stream = self._container.add_stream(spec.codec, rate=sample_rate, options=spec.codec_options)
        self._stream.layout = "mono"
        if spec.bit_rate is not None:
            self._stream.bit_rate = spec.bit_rate
        self._resampler = av.AudioResampler(format=spec.sample_format, layout="mono", rate=sample_rate)

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def frames(self, frames: list[av.AudioFrame]) -> bytes:
        for frame in frames:
            for converted in self._resampler.resample(frame):
                self._mux(converted)
        return self._sink.drain()

    def finish(self) -> bytes:
        for converted in self._resampler.resample(None):
            self._mux(converted)
        self._mux(None)
        self._container.close()
        return self._sink.drain()


class AudioStreamEncoder:
    """Incremental encoder of one response: `encode(pcm) -> bytes` per chunk, then `flush()` once.

    Input is 16-bit LE mono PCM at `input_rate`. Output is `fmt` at
    `sample_rate` (unless another is asked: 8 kHz for G.711, the input rate
    for the rest), played back at `speed` without changing pitch.
    """

    def __init__(self, fmt: str, *, input_rate: int = SAMPLE_RATE, sample_rate: int | None = None,
                 speed: float = 1.0) -> None:
        out_rate = default_sample_rate(fmt, input_rate) if sample_rate is None else sample_rate
        check_output_options(fmt, sample_rate=out_rate, speed=speed)
        self.format = fmt
        self.content_type = CONTENT_TYPES[fmt]
        self.input_rate = input_rate
        self.sample_rate = out_rate
        self.speed = float(speed)
        self.samples_in = 0
        self.bytes_out = 0
        self._tempo = _Tempo(input_rate, speed) if speed != 1.0 else None
        raw = _raw_output(fmt, out_rate, input_rate, speed)
        self._to_output = None if raw else av.AudioResampler(format="s16", layout="mono", rate=out_rate)
        self._stage: _Stage
        if fmt == "pcm":
            self._stage = _RawStage()
        elif fmt == "wav":
            self._stage = _RawStage(wav_header(out_rate))
        elif fmt in TELEPHONY_FORMATS:
            self._stage = _G711Stage(fmt)
        else:
            self._stage = _ContainerStage(_CODECS[fmt], out_rate)
        self._finished = False
        # PCM or WAV at the input rate and speed: the bytes go out as they came (after the header).
        self._raw_copy = raw

    def _through(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
        """Tempo, then conversion to s16 mono at the output rate; `None` drains both."""
        if self._tempo is not None:
            frames = self._tempo.process(frame)
        elif frame is not None:
            frames = [frame]
        else:
            frames = []
        out = [converted for f in frames for converted in self._to_output.resample(f)]
        if frame is None:
            out.extend(f for f in self._to_output.resample(None) if f is not None)
        return out

    def encode(self, pcm: bytes) -> bytes:
        if self._finished:
            raise RuntimeError("encode() after flush()")
        if len(pcm) % 2:
            raise ValueError("PCM16 input must have an even number of bytes")
        if not pcm:
            return b""
        if self._raw_copy:
            self.samples_in += len(pcm) // 2
            out = self._stage.finish() + pcm  # finish() hands out the header once
            self.bytes_out += len(out)
            return out
        frame = _pcm_frame(pcm, self.input_rate, self.samples_in)
        self.samples_in += len(pcm) // 2
        out = self._stage.frames(self._through(frame))
        self.bytes_out += len(out)
        return out

    def flush(self) -> bytes:
        """Everything still buffered, and the stream's trailer; the encoder is done afterwards."""
        if self._finished:
            return b""
        self._finished = True
        if self._raw_copy:
            out = self._stage.finish()  # the header, if no chunk carried it yet
            self.bytes_out += len(out)
            return out
        out = self._stage.frames(self._through(None)) + self._stage.finish()
        self.bytes_out += len(out)
        return out


def decode_audio(data: bytes, fmt: str, *, sample_rate: int | None = None) -> tuple[np.ndarray, int]:
    """Decode a whole response back to int16 mono samples and its sample rate (clients and tests).

    `pcm`, `mulaw` and `alaw` have no header: their `sample_rate` is the server's default for the format
    unless given.
    """
    if sample_rate is None:
        sample_rate = default_sample_rate(fmt)
    if fmt == "pcm":
        return np.frombuffer(data[: len(data) - len(data) % 2], dtype="<i2").copy(), sample_rate
    if fmt in TELEPHONY_FORMATS:
        return g711_decode(data, fmt).copy(), sample_rate
    container_format = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}[fmt]
    if fmt == "wav" and data[:4] == b"RIFF" and struct.unpack_from("<I", data, 40)[0] == WAV_UNKNOWN_SIZE:
        # The streaming sentinel: the data runs to the end of the bytes.
        rate = struct.unpack_from("<I", data, 24)[0]
        body = data[WAV_HEADER_BYTES:]
        return np.frombuffer(body[: len(body) - len(body) % 2], dtype="<i2").copy(), rate
    with av.open(io.BytesIO(data), mode="r", format=container_format) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        parts = [f.to_ndarray().reshape(-1) for frame in container.decode(stream) for f in resampler.resample(frame)]
        parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    samples = np.concatenate(parts).astype(np.int16, copy=False) if parts else np.zeros(0, dtype=np.int16)
    return samples, rate
