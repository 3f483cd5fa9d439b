"""Riva's TTS API (`nvidia.riva.tts.RivaSpeechSynthesis`) on the gRPC port, driven by the clients voice agents use.

The clients are the real ones from PyPI: nvidia-riva-client's
`SpeechSynthesisService`, livekit-plugins-nvidia's `TTS`, and Pipecat's
`NvidiaTTSService` under Pipecat's own `run_test`. The server is the real one:
the tiny random-weight model on CPU (audio length and format checks), and the
sim engine where an utterance must run long enough to be cancelled mid-stream.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import riva.client
from riva.client.proto import riva_tts_pb2 as rtts
from riva.client.proto import riva_tts_pb2_grpc as rtts_grpc
from riva.client.proto.riva_audio_pb2 import AudioEncoding
from riva.client.proto.riva_common_pb2 import RequestId

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.api.riva import RIVA_SUBVOICES, riva_voice_names
from orpheus_serve.audio.encoding import decode_audio, g711_encode
from orpheus_serve.client import protocols as api_client
from orpheus_serve.token_format import SAMPLE_RATE, SAMPLES_PER_FRAME, VOICES
from tests.gateway_support import sim_config, start_server, stats, tiny_config, wait_for
from tests.pace import MachinePace

GREEDY = {"temperature": 0.0, "seed": 1, "max_tokens": 28}
CUSTOM = {k: str(v) for k, v in GREEDY.items()}  # Orpheus options ride in Riva's custom_configuration
KEY = "riva-test-key"


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path):
    srv = start_server(tiny_config(tiny_orpheus, tiny_snac))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tts(server: ServerThread) -> riva.client.SpeechSynthesisService:
    return riva.client.SpeechSynthesisService(riva.client.Auth(uri=server.grpc_address))


@pytest.fixture(scope="module")
def reference_pcm(server: ServerThread) -> np.ndarray:
    """The greedy utterance as the native API gives it (24 kHz PCM): what every Riva answer must match."""
    response = httpx.post(f"{server.base_url}/v1/audio/speech", timeout=120,
                          json={"input": "Hello there.", "response_format": "pcm", **GREEDY})
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, dtype="<i2")


def _seconds(reference: np.ndarray) -> float:
    return len(reference) / SAMPLE_RATE


# ------------------------------------------------------------------ nvidia-riva-client


def test_synthesize_linear_pcm_at_16khz(server: ServerThread, tts: riva.client.SpeechSynthesisService,
                                        reference_pcm: np.ndarray) -> None:
    response = tts.synthesize("Hello there.", voice_name="English-US.Female-1", language_code="en-US",
                              encoding=AudioEncoding.LINEAR_PCM, sample_rate_hz=16000, custom_configuration=CUSTOM)
    samples = np.frombuffer(response.audio, dtype="<i2")  # Riva's LINEAR_PCM: raw samples, no header
    assert abs(len(samples) - len(reference_pcm) * 2 // 3) <= 32
    assert response.meta.text == "Hello there." and response.meta.processed_text == "Hello there."
    # English-US.Female-1 is tara: greedy, noise off, one request at a time, the same audio as the native API's.
    native = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello there.", voice="tara", fmt="pcm",
                                                  sample_rate=16000, **GREEDY))
    assert native.ok and response.audio == bytes(native.audio)


@pytest.mark.parametrize("encoding,fmt", [(AudioEncoding.MULAW, "mulaw"), (AudioEncoding.ALAW, "alaw")])
def test_synthesize_g711_at_8khz_is_the_same_audio_coded(server: ServerThread, tts: riva.client.SpeechSynthesisService,
                                                         encoding: int, fmt: str) -> None:
    pcm_8k = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello there.", fmt="pcm", sample_rate=8000,
                                                  **GREEDY))
    assert pcm_8k.ok, pcm_8k.error
    response = tts.synthesize("Hello there.", voice_name="tara", encoding=encoding, sample_rate_hz=8000,
                              custom_configuration=CUSTOM)
    assert response.audio == g711_encode(bytes(pcm_8k.audio), fmt)  # one byte per 8 kHz sample


def test_synthesize_flac_when_asked(server: ServerThread, tts: riva.client.SpeechSynthesisService) -> None:
    native = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello there.", fmt="pcm", sample_rate=22050,
                                                  **GREEDY))
    response = tts.synthesize("Hello there.", voice_name="tara", encoding=AudioEncoding.FLAC, sample_rate_hz=22050,
                              custom_configuration=CUSTOM)
    samples, rate = decode_audio(response.audio, "flac")
    assert rate == 22050 and samples.tobytes() == bytes(native.audio)  # lossless


def test_synthesize_oggopus(tts: riva.client.SpeechSynthesisService, reference_pcm: np.ndarray) -> None:
    # riva.client's default rate, 22050, is not an Opus rate: it is coded at 24 kHz.
    response = tts.synthesize("Hello there.", voice_name="tara", encoding=AudioEncoding.OGGOPUS,
                              custom_configuration=CUSTOM)
    assert response.audio[:4] == b"OggS"
    samples, rate = decode_audio(response.audio, "opus")
    assert rate == 48000 and abs(len(samples) / rate - _seconds(reference_pcm)) < 0.1


def test_synthesize_echoes_the_request_id_and_gives_word_times_when_asked(server: ServerThread) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        response = rtts_grpc.RivaSpeechSynthesisStub(channel).Synthesize(rtts.SynthesizeSpeechRequest(
            text="Hello there, friend.", language_code="en-US", encoding=AudioEncoding.LINEAR_PCM,
            sample_rate_hz=24000, id=RequestId(value="call-42"), enable_word_time_offsets=True,
            custom_configuration=CUSTOM))
    assert response.id.value == "call-42"
    assert [w.word for w in response.meta.words] == ["Hello", "there", "friend"]
    ends_ms = len(response.audio) / 2 / 24000 * 1000
    times = [(w.start_time, w.end_time) for w in response.meta.words]  # whole milliseconds, estimated
    assert all(0 <= s < e <= ends_ms + 1 for s, e in times) and times == sorted(times)


def test_synthesize_online_streams_audio_before_the_last_chunk(tts: riva.client.SpeechSynthesisService) -> None:
    arrivals = []
    started = time.perf_counter()
    for response in tts.synthesize_online("Once upon a time there was a long story.", voice_name="English-US.Male-1",
                                          sample_rate_hz=24000,
                                          custom_configuration={**CUSTOM, "max_tokens": "280"}):
        if response.audio:
            arrivals.append((time.perf_counter() - started, len(response.audio)))
    assert len(arrivals) >= 3, arrivals
    total_samples = sum(n for _, n in arrivals) // 2
    assert total_samples == 40 * SAMPLES_PER_FRAME  # greedy on random weights runs to max_tokens: 40 frames
    first, last = arrivals[0][0], arrivals[-1][0]
    assert first < last / 2, arrivals  # the first audio left long before the utterance was done


class _PacedPieces(list):
    """Text pieces for `synthesize_online`, handed out by the client's sending thread: everything after the
    first waits until the first audio has arrived (bounded), and records whether it had.

    A list because riva.client 2.27.0 sends any other iterable through `isinstance(text, Iterable[str])`, which
    raises TypeError for a subscripted generic; a list it iterates, and this one iterates lazily."""

    def __init__(self, pieces: list[str]) -> None:
        super().__init__(pieces)
        self.first_audio = threading.Event()
        self.audio_before_last_piece: bool | None = None

    def __iter__(self) -> Iterator[str]:
        pieces = list(super().__iter__())
        yield pieces[0]
        self.audio_before_last_piece = self.first_audio.wait(timeout=60)
        yield from pieces[1:]


def test_synthesize_online_with_text_pieces_is_one_context_that_starts_before_the_last_piece(
        server: ServerThread, tts: riva.client.SpeechSynthesisService) -> None:
    before = stats(server)["gateway"]["requests"]["riva"].get("ok", 0)
    pieces = _PacedPieces(["Hello there, this is the first part of the reply.", "Here comes the second sentence.",
                           "And this is the last one."])
    audio = bytearray()
    for response in tts.synthesize_online(pieces, voice_name="leah", sample_rate_hz=24000,
                                          custom_configuration=CUSTOM):
        if response.audio:
            pieces.first_audio.set()
            audio += response.audio
    assert pieces.audio_before_last_piece is True
    # At least two generation chunks (the first piece alone, then the rest), 4 frames each at max_tokens 28.
    assert len(audio) // 2 >= 8 * SAMPLES_PER_FRAME and len(audio) % (2 * SAMPLES_PER_FRAME) == 0
    # One call, one context: counted as one request.
    wait_for(lambda: stats(server)["gateway"]["requests"]["riva"].get("ok", 0) == before + 1, 5.0,
             "one riva request counted")


def test_get_riva_synthesis_config_lists_every_voice(tts: riva.client.SpeechSynthesisService) -> None:
    config = tts.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest())
    assert [c.parameters["orpheus_voice"] for c in config.model_config] == list(VOICES)
    for model in config.model_config:
        assert model.parameters["language_code"] == "en-US"
        names = [f"{model.parameters['voice_name']}.{s.split(':')[0]}" for s in model.parameters["subvoices"].split(",")]
        assert names == riva_voice_names(model.parameters["orpheus_voice"])
    one = tts.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(model_name="orpheus-zoe"))
    assert [c.parameters["orpheus_voice"] for c in one.model_config] == ["zoe"]
    assert sorted(RIVA_SUBVOICES.values()) == sorted(VOICES)


@pytest.mark.parametrize("call,details", [
    (lambda t: t.synthesize("Hello there.", language_code="de-DE"), "language_code"),
    (lambda t: t.synthesize("", language_code="en-US"), "empty"),
    (lambda t: list(t.synthesize_online("")), "empty"),
    (lambda t: t.synthesize("Hello there.", voice_name="English-US.Female-9"), "English-US.Female-1"),
    (lambda t: t.synthesize("Hello there.", voice_name="nobody"), "voice"),
    (lambda t: t.synthesize("Hello there.", custom_configuration={"temperature": "hot"}), "temperature"),
    (lambda t: t.synthesize("Hello there.", custom_configuration={"pitch": "1"}), "pitch"),
    (lambda t: t.synthesize("Hello there.", sample_rate_hz=4000), "sample_rate"),
    (lambda t: t.synthesize("Hello there.", custom_dictionary={"NVIDIA": "ɛn.vɪ.diː.ʌ"}), "custom_dictionary"),
    (lambda t: t.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(model_name="magpie")), "magpie"),
])
def test_bad_requests_get_invalid_argument(tts: riva.client.SpeechSynthesisService, call: Any, details: str) -> None:
    with pytest.raises(grpc.RpcError) as rpc:
        call(tts)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc.value
    assert details in rpc.value.details()


def test_a_later_message_that_changes_the_voice_fails_the_stream(server: ServerThread) -> None:
    def requests() -> Iterator[rtts.SynthesizeSpeechRequest]:
        yield rtts.SynthesizeSpeechRequest(text="Hello there,", voice_name="tara", custom_configuration=CUSTOM)
        yield rtts.SynthesizeSpeechRequest(text="and more.", voice_name="leo", custom_configuration=CUSTOM)

    with grpc.insecure_channel(server.grpc_address) as channel, pytest.raises(grpc.RpcError) as rpc:
        list(rtts_grpc.RivaSpeechSynthesisStub(channel).SynthesizeOnline(requests()))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "first message" in rpc.value.details()


def test_client_cli_speaks_riva(server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    code = api_client.main(["--text", "Hello there.", "--protocol", "riva", "--grpc-addr", server.grpc_address,
                            "--format", "alaw", "--output", str(out), "--temperature", "0", "--max-tokens", "28"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    samples, rate = decode_audio(out.read_bytes(), "wav")
    assert rate == 8000 and len(samples) > 0  # A-law at 8 kHz on the wire, written out as linear PCM


# ------------------------------------------------------------------ agent frameworks


def test_livekit_plugins_nvidia_lists_voices_and_synthesizes_at_16khz(server: ServerThread) -> None:
    from livekit.plugins import nvidia

    async def run() -> tuple[dict, list[Any]]:
        lk = nvidia.TTS(server=server.grpc_address, use_ssl=False, voice="English-US.Female-2")
        voices = lk.list_voices()
        frames = []
        async with lk.synthesize("Hello there.") as stream:
            async for event in stream:
                frames.append(event.frame)
        return voices, frames

    voices, frames = asyncio.run(run())
    assert set(voices) == {"en-US"}
    assert voices["en-US"]["voices"] == [name for v in VOICES for name in riva_voice_names(v)]
    assert frames and {f.sample_rate for f in frames} == {16000}
    assert sum(f.samples_per_channel for f in frames) > 0.1 * 16000


# Pipecat's NvidiaTTSService under Pipecat's run_test, in a process of its own: importing pipecat replaces
# asyncio.wait_for process-wide on Python < 3.12 (pipecat/__init__.py), which must not reach the server under test.
# per_sentence: one SynthesizeOnline call per sentence; stitched: one call for the whole LLM turn, its sentences
# streamed in as separate messages (one context here).
_PIPECAT_RUN = """
import asyncio, json, sys
from pipecat.frames.frames import (ErrorFrame, LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame,
                                   TTSAudioRawFrame)
from pipecat.services.nvidia.tts import NvidiaTTSService, NvidiaTTSSynthesisMode
from pipecat.tests.utils import run_test

service = NvidiaTTSService(server=sys.argv[1], use_ssl=False, settings=NvidiaTTSService.Settings(
    voice="English-US.Male-2", synthesis_mode=NvidiaTTSSynthesisMode(sys.argv[2])))
turn = [LLMFullResponseStartFrame(), LLMTextFrame("Hello there, how are you today? "),
        LLMTextFrame("I am fine, thanks. "), LLMTextFrame("Bye now."), LLMFullResponseEndFrame()]
down, up = asyncio.run(run_test(service, frames_to_send=turn))
audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
print(json.dumps({"frames": [type(f).__name__ for f in down], "sample_rates": sorted({f.sample_rate for f in audio}),
                  "sizes": [len(f.audio) for f in audio],
                  "errors": [str(f.error) for f in [*down, *up] if isinstance(f, ErrorFrame)]}))
"""


@pytest.mark.skipif(importlib.util.find_spec("pipecat") is None, reason="pipecat-ai needs Python 3.11")
@pytest.mark.parametrize("mode,calls", [("per_sentence", 3), ("stitched", 1)])
def test_pipecat_nvidia_tts_service_produces_audio_frames(server: ServerThread, mode: str, calls: int) -> None:
    before = stats(server)["gateway"]["requests"]["riva"].get("ok", 0)
    done = subprocess.run([sys.executable, "-c", _PIPECAT_RUN, server.grpc_address, mode], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["errors"], result
    assert "TTSStartedFrame" in result["frames"] and "TTSStoppedFrame" in result["frames"]
    assert result["sizes"] and all(result["sizes"]) and len(result["sample_rates"]) == 1
    # At least two generation chunks (stitched: the first sentence, then the rest), each at least min_tokens
    # (4 frames) of audio, at Pipecat's output rate.
    assert sum(result["sizes"]) / 2 / result["sample_rates"][0] >= 2 * 4 * SAMPLES_PER_FRAME / SAMPLE_RATE - 0.01
    assert stats(server)["gateway"]["requests"]["riva"].get("ok", 0) == before + calls


# ------------------------------------------------------------------ API keys


def test_a_bad_key_is_unauthenticated_and_the_right_one_works(tiny_orpheus: Path, tiny_snac: Path) -> None:
    srv = start_server(tiny_config(tiny_orpheus, tiny_snac, **{"server.api_keys": [KEY]}))
    try:
        for metadata in ([], [["authorization", "Bearer wrong"]]):
            tts = riva.client.SpeechSynthesisService(riva.client.Auth(uri=srv.grpc_address, metadata_args=metadata))
            for call in (lambda t: t.synthesize("Hello there."), lambda t: list(t.synthesize_online("Hello there.")),
                         lambda t: t.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest())):
                with pytest.raises(grpc.RpcError) as rpc:
                    call(tts)
                assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refused = httpx.get(f"{srv.base_url}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert refused["gateway"]["requests"]["riva"] == {"invalid_api_key": 4}
        tts = riva.client.SpeechSynthesisService(riva.client.Auth(
            uri=srv.grpc_address, metadata_args=[["authorization", f"Bearer {KEY}"]]))
        assert tts.synthesize("Hello there.", custom_configuration=CUSTOM).audio
    finally:
        srv.stop()


# ------------------------------------------------------------------ cancellation


@pytest.fixture(scope="module")
def sim_server(tiny_orpheus: Path):
    srv = start_server(sim_config(tiny_orpheus))
    yield srv
    srv.stop()


def _active_sessions(server: ServerThread) -> int:
    snapshot = stats(server)
    return snapshot["scheduler"]["active_sessions"] + snapshot["scheduler"]["pending_sessions"]


@pytest.mark.parametrize("method", ["SynthesizeOnline", "Synthesize"])
def test_cancelling_a_riva_call_frees_its_slot(sim_server: ServerThread, method: str, pace: MachinePace) -> None:
    request = rtts.SynthesizeSpeechRequest(text="A long story.", language_code="en-US", sample_rate_hz=24000,
                                           custom_configuration={"max_tokens": "1400"})
    with grpc.insecure_channel(sim_server.grpc_address) as channel:
        stub = rtts_grpc.RivaSpeechSynthesisStub(channel)
        if method == "SynthesizeOnline":
            call = stub.SynthesizeOnline(iter([request]))
            assert next(call).audio
        else:
            call = stub.Synthesize.future(request)
            wait_for(lambda: _active_sessions(sim_server) >= 1, 10.0, "the unary call running")
        assert _active_sessions(sim_server) >= 1
        call.cancel()
    # Within a second on the reference machine (tests/pace.py).
    wait_for(lambda: _active_sessions(sim_server) == 0, pace.window(1.0), "slot freed after the Riva call was cancelled")
    wait_for(lambda: stats(sim_server)["gateway"]["active_streams"]["riva"] == 0, pace.window(1.0), "stream closed")
