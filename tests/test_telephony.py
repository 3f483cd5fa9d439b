"""Telephony audio: G.711 mu-law and A-law, exact against independent coders, on every surface at 8 kHz by default.

The reference coders here are written per sample from ITU-T G.711's segment
rules (sign, 3-bit segment, 4-bit step; mu-law's bias of 33 and inversion,
A-law's even-bit toggling with 0x55), with the input taken as the ITU-T G.191
reference software takes 16-bit samples (one's complement for negative ones).
PyAV's (FFmpeg's) pcm_mulaw / pcm_alaw codecs are a second, outside check.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import av
import grpc
import httpx
import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.audio.encoding import (
    CONTENT_TYPES,
    TELEPHONY_FORMATS,
    AudioStreamEncoder,
    decode_audio,
    g711_decode,
    g711_encode,
)
from orpheus_serve.client import protocols as api_client
from orpheus_serve.proto import AUDIO_FORMAT_NUMBERS
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc
from orpheus_serve.token_format import SAMPLE_RATE
from tests.gateway_support import start_server, tiny_config

ALL_INPUTS = np.arange(-32768, 32768, dtype=np.int16)


def _magnitude(x: int, shift: int) -> int:
    return ((-x - 1) if x < 0 else x) >> shift


def ref_mulaw(x: int) -> int:
    biased = min(_magnitude(x, 2) + 33, 0x1FFF)  # 14-bit magnitude plus the bias, clipped at the top
    segment = biased.bit_length() - 6  # biased lies in [32 << segment, 64 << segment)
    step = (biased >> (segment + 1)) & 0x0F
    return (((x < 0) << 7) | (segment << 4) | step) ^ 0xFF  # every bit inverted on the line


def ref_alaw(x: int) -> int:
    magnitude = _magnitude(x, 4)  # 12-bit magnitude (13-bit signed input)
    if magnitude < 16:
        segment, step = 0, magnitude
    else:
        segment = magnitude.bit_length() - 4  # magnitude lies in [8 << segment, 16 << segment)
        step = (magnitude >> (segment - 1)) & 0x0F
    return (((x >= 0) << 7) | (segment << 4) | step) ^ 0x55  # the even bits toggled on the line


def ref_mulaw_expand(code: int) -> int:
    code ^= 0xFF
    segment, step = (code >> 4) & 7, code & 0x0F
    value = ((2 * step + 33) << segment) - 33  # the middle of the step, in 14-bit units
    return -(value << 2) if code & 0x80 else value << 2


def ref_alaw_expand(code: int) -> int:
    code ^= 0x55
    segment, step = (code >> 4) & 7, code & 0x0F
    value = 2 * step + 1 if segment == 0 else (2 * step + 33) << (segment - 1)  # 13-bit units, step middle
    return value << 3 if code & 0x80 else -(value << 3)


REFERENCE = {"mulaw": (ref_mulaw, ref_mulaw_expand), "alaw": (ref_alaw, ref_alaw_expand)}
PYAV_CODECS = {"mulaw": "pcm_mulaw", "alaw": "pcm_alaw"}


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_every_16_bit_sample_codes_as_the_g711_reference_does(fmt: str) -> None:
    compress, _ = REFERENCE[fmt]
    expected = bytes(compress(int(x)) for x in ALL_INPUTS)
    assert g711_encode(ALL_INPUTS, fmt) == expected
    assert g711_encode(ALL_INPUTS.astype("<i2").tobytes(), fmt) == expected


def test_the_mu_law_segment_end_lies_at_g711s_decision_value() -> None:
    below, at = (g711_encode(np.array([4062 * 4, 4063 * 4], dtype=np.int16), "mulaw"))
    assert (below ^ 0xFF) == 0x6F and (at ^ 0xFF) == 0x70  # segment 6 step 15, then segment 7 step 0


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_every_code_expands_as_the_reference_and_pyav_do(fmt: str) -> None:
    _, expand = REFERENCE[fmt]
    codes = bytes(range(256))
    ours = g711_decode(codes, fmt)
    assert ours.tolist() == [expand(c) for c in codes]
    decoder = av.CodecContext.create(PYAV_CODECS[fmt], "r")
    decoder.sample_rate, decoder.layout = 8000, "mono"
    theirs = np.concatenate([f.to_ndarray().reshape(-1) for f in decoder.decode(av.Packet(codes))])
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_pyav_codes_every_sample_alike_but_at_a_few_decision_values(fmt: str) -> None:
    """FFmpeg builds its table from the midpoints between output levels and negates negative samples in
    two's complement; G.711's decision values at segment ends are not midpoints (mu-law's 4063 in 14-bit
    units lies below the midpoint 4095 of the levels 3999 and 4191), and G.191 takes the one's complement.
    Where the two differ, it is by one level, for under 2% of the inputs."""
    encoder = av.CodecContext.create(PYAV_CODECS[fmt], "w")
    encoder.sample_rate, encoder.format, encoder.layout = 8000, "s16", "mono"
    encoder.open()
    frame = av.AudioFrame.from_ndarray(ALL_INPUTS.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate, frame.pts = 8000, 0
    theirs = np.frombuffer(b"".join(bytes(p) for p in [*encoder.encode(frame), *encoder.encode(None)]), np.uint8)
    ours = np.frombuffer(g711_encode(ALL_INPUTS, fmt), np.uint8)
    differ = np.nonzero(ours != theirs)[0]
    assert 0 < len(differ) < 0.02 * len(ALL_INPUTS)
    levels = np.unique(g711_decode(bytes(range(256)), fmt))
    ours_level = np.searchsorted(levels, g711_decode(ours[differ].tobytes(), fmt))
    theirs_level = np.searchsorted(levels, g711_decode(theirs[differ].tobytes(), fmt))
    assert (np.abs(ours_level - theirs_level) == 1).all()


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_streamed_g711_is_the_reference_coding_of_the_resampled_audio(fmt: str) -> None:
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    pcm = (np.sin(2 * np.pi * 300 * t) * 20000).astype("<i2")
    # At 8 kHz in and out nothing is resampled: the stream is the reference coding, chunk by chunk.
    direct = AudioStreamEncoder(fmt, input_rate=8000)
    assert direct.sample_rate == 8000 and direct.content_type == CONTENT_TYPES[fmt]
    pcm8 = pcm[::3]
    parts = [direct.encode(pcm8[i:i + 700].tobytes()) for i in range(0, len(pcm8), 700)] + [direct.flush()]
    assert all(parts[:-1])  # bytes leave with every chunk
    compress, _ = REFERENCE[fmt]
    assert b"".join(parts) == bytes(compress(int(x)) for x in pcm8)
    # From the model's 24 kHz: 8 kHz by default, the same as resampled PCM coded afterwards.
    encoder = AudioStreamEncoder(fmt)
    assert encoder.sample_rate == 8000
    coded = b"".join([encoder.encode(pcm[i:i + 4096].tobytes()) for i in range(0, len(pcm), 4096)] +
                     [encoder.flush()])
    resampler = AudioStreamEncoder("pcm", sample_rate=8000)
    linear = b"".join([resampler.encode(pcm[i:i + 4096].tobytes()) for i in range(0, len(pcm), 4096)] +
                      [resampler.flush()])
    assert coded == g711_encode(linear, fmt)
    samples, rate = decode_audio(coded, fmt)
    assert rate == 8000 and abs(len(samples) - 8000) <= 32


# ------------------------------------------------------------------ every surface, on a real server

GREEDY = {"temperature": 0.0, "seed": 1, "max_tokens": 28}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path):
    srv = start_server(tiny_config(tiny_orpheus, tiny_snac))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pcm_8k(server: ServerThread) -> bytes:
    """The greedy utterance as 8 kHz linear PCM (WebSocket, sample_rate 8000): what G.711 must code."""
    result = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello there.", fmt="pcm", sample_rate=8000,
                                                  **GREEDY))
    assert result.ok, result.error
    return bytes(result.audio)


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_rest_serves_g711_at_8khz(server: ServerThread, pcm_8k: bytes, fmt: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/audio/speech", timeout=120,
                          json={"input": "Hello there.", "response_format": fmt, **GREEDY})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPES[fmt]
    # Greedy, noise off, one request at a time: the same audio, coded sample by sample.
    assert response.content == g711_encode(pcm_8k, fmt)


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_websocket_serves_g711_at_8khz_by_default_and_at_another_rate_on_request(
        server: ServerThread, pcm_8k: bytes, fmt: str) -> None:
    default = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello there.", fmt=fmt, **GREEDY))
    assert default.ok and default.sample_rate == 8000 and default.metrics["sample_rate"] == 8000
    assert bytes(default.audio) == g711_encode(pcm_8k, fmt)
    wide = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello there.", fmt=fmt, sample_rate=16000,
                                                **GREEDY))
    assert wide.ok and wide.metrics["sample_rate"] == 16000
    assert abs(len(wide.audio) - len(pcm_8k)) <= 64  # one byte per sample at twice the rate: as many bytes


def test_websocket_refuses_a_rate_outside_the_range_for_g711(server: ServerThread) -> None:
    with ws_connect(api_client.stream_url(server.base_url)) as ws:
        ws.send('{"text": "Hello there.", "response_format": "mulaw", "sample_rate": 4000}')
        reply = ws.recv(timeout=30)
    assert isinstance(reply, str) and '"sample_rate"' in reply and "invalid_request" in reply


@pytest.mark.parametrize("fmt", TELEPHONY_FORMATS)
def test_grpc_serves_g711_at_8khz_when_no_rate_is_given(server: ServerThread, pcm_8k: bytes, fmt: str) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        responses = list(pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(
            text="Hello there.", format=AUDIO_FORMAT_NUMBERS[fmt], sampling=pb.SamplingOptions(**GREEDY))))
    chunks = [r.audio for r in responses if r.HasField("audio")]
    assert chunks and {c.sample_rate for c in chunks} == {8000}
    assert b"".join(c.audio for c in chunks) == g711_encode(pcm_8k, fmt)
    assert AUDIO_FORMAT_NUMBERS[fmt] == pb.AudioFormat.Value(f"AUDIO_FORMAT_{fmt.upper()}")
