"""Audio framing and incremental encoding for streamed responses.

The service produces 16-bit little-endian mono PCM at 24 kHz in chunks of a
few frames. Gateways turn each chunk into bytes of the format the client asked
for *as it arrives*, so the first bytes leave with the first decoded frame:

- `pcm`: the samples as they are.
- `wav`: a 44-byte RIFF header whose sizes carry the unknown-length sentinel
  0xFFFFFFFF (the length is not known when the header leaves), then PCM.
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

from .protocol import SAMPLE_RATE

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
AUDIO_FORMATS: tuple[str, ...] = get_args(AudioFormat)

CONTENT_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
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
    `sample_rate` (the input rate unless another is asked), played back at
    `speed` without changing pitch.
    """

    def __init__(self, fmt: str, *, input_rate: int = SAMPLE_RATE, sample_rate: int | None = None,
                 speed: float = 1.0) -> None:
        out_rate = input_rate if sample_rate is None else sample_rate
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


def decode_audio(data: bytes, fmt: str, *, sample_rate: int = SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """Decode a whole response back to int16 mono samples and its sample rate (clients and tests).

    `pcm` has no header, so its `sample_rate` must be given.
    """
    if fmt == "pcm":
        return np.frombuffer(data[: len(data) - len(data) % 2], dtype="<i2").copy(), sample_rate
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
