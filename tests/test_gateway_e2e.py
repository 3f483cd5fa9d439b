"""The whole server on loopback with the tiny random-weight model on CPU: every protocol, every format.

One real uvicorn + grpc.aio server in front of the real TTSService (torch
engine, tiny Llama, tiny SNAC with noise off) for the module. Texts are short
and max_tokens small so each request is a few frames.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.audio.encoding import AUDIO_FORMATS, CONTENT_TYPES, decode_audio
from orpheus_serve.client import protocols as api_client
from orpheus_serve.token_format import SAMPLE_RATE, SAMPLES_PER_FRAME, VOICES
from tests.gateway_support import check_openai_error, start_server, tiny_config

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0.0, "seed": 1, "max_tokens": 28}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path):
    srv = start_server(tiny_config(tiny_orpheus, tiny_snac))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference_pcm(server: ServerThread) -> bytes:
    """The greedy request's PCM over REST: what every other format and protocol must match in length."""
    response = httpx.post(f"{server.base_url}/v1/audio/speech", timeout=120,
                          json={"input": "Hello there.", "voice": "tara", "response_format": "pcm", **GREEDY})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/pcm"
    assert len(response.content) > 0 and len(response.content) % (2 * SAMPLES_PER_FRAME) == 0
    return response.content


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_openai_sdk_streams_decodable_audio_in_every_format(sdk: openai.OpenAI, reference_pcm: bytes,
                                                            fmt: str) -> None:
    chunks: list[bytes] = []
    with sdk.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello there.", response_format=fmt,
            extra_body=GREEDY) as response:
        assert response.headers["content-type"] == CONTENT_TYPES[fmt]
        assert response.headers["x-request-id"]
        for chunk in response.iter_bytes():
            chunks.append(chunk)
    data = b"".join(chunks)
    samples, rate = decode_audio(data, fmt)
    expected_s = len(reference_pcm) / 2 / SAMPLE_RATE
    # Lossy codecs add encoder delay and padding; lossless ones are exact.
    tolerance = 0.0 if fmt in ("pcm", "wav", "flac") else 0.1
    assert abs(len(samples) / rate - expected_s) <= tolerance + 1e-9, (fmt, len(samples) / rate, expected_s)
    if fmt in ("pcm", "wav", "flac"):
        assert samples.tobytes() == reference_pcm  # greedy + noise off: the same audio, bit for bit


@pytest.mark.core_in_process
def test_sse_yields_delta_events_then_done_with_usage(server: ServerThread, reference_pcm: bytes) -> None:
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/audio/speech", timeout=120,
                      json={"input": "Hello there.", "response_format": "pcm", "stream_format": "sse",
                            **GREEDY}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == reference_pcm
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] > 0
    assert done["metrics"]["samples"] == len(reference_pcm) // 2


@pytest.mark.core_in_process
def test_same_greedy_request_gives_the_same_samples_over_rest_ws_and_grpc(server: ServerThread,
                                                                         reference_pcm: bytes) -> None:
    async def all_three():
        return await asyncio.gather(*(
            api_client.synthesize(p, "Hello there.", url=server.base_url, grpc_addr=server.grpc_address,
                                  voice="tara", fmt="pcm", **GREEDY) for p in ("rest", "ws", "grpc")))

    results = asyncio.run(all_three())
    for result in results:
        assert result.ok, (result.protocol, result.error)
    assert {len(r.audio) for r in results} == {len(reference_pcm)}
    ws, grpc_result = results[1], results[2]
    assert ws.metrics["samples"] == grpc_result.metrics["samples"] == len(reference_pcm) // 2
    assert ws.metrics["tokens"] == grpc_result.metrics["tokens"]
    # The same utterance: run side by side the three share batches, and batched float arithmetic moves
    # a sample by a few LSB at most (run alone, the audio is bit-identical: see the format test).
    reference = np.frombuffer(reference_pcm, dtype="<i2").astype(np.int32)
    for result in results:
        got = np.frombuffer(bytes(result.audio), dtype="<i2").astype(np.int32)
        assert np.abs(got - reference).max() <= 64, result.protocol
    assert ws.metrics["ttfb_ms"] is not None and ws.metrics["rtf"] is not None


def test_grpc_and_ws_resample_and_change_speed(server: ServerThread, reference_pcm: bytes) -> None:
    seconds = len(reference_pcm) / 2 / SAMPLE_RATE

    async def both():
        return await asyncio.gather(
            api_client.synthesize_grpc(server.grpc_address, "Hello there.", fmt="wav", sample_rate=16000,
                                       **GREEDY),
            api_client.synthesize_ws(server.base_url, "Hello there.", fmt="pcm", speed=2.0, **GREEDY))

    resampled, faster = asyncio.run(both())
    assert resampled.ok and faster.ok, (resampled.error, faster.error)
    samples, rate = decode_audio(bytes(resampled.audio), "wav")
    assert rate == 16000 and abs(len(samples) / rate - seconds) < 0.02
    assert abs(faster.audio_seconds - seconds / 2) < 0.06


@pytest.mark.core_in_process
def test_models_voices_health_and_ready(server: ServerThread) -> None:
    base = server.base_url
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").status_code == 200
    models = httpx.get(f"{base}/v1/models").json()
    card = models["data"][0]
    info = server.server.service.model_info
    assert card["id"] == info.id and card["object"] == "model" and card["tiny"] is info.tiny
    if info.tiny:
        assert models["warning"]
    voices = httpx.get(f"{base}/v1/audio/voices").json()["voices"]
    assert [v["id"] for v in voices] == list(VOICES) and all(v["name"] for v in voices)


@pytest.mark.core_in_process
def test_stats_have_the_documented_fields(server: ServerThread) -> None:
    snapshot = httpx.get(f"{server.base_url}/v1/stats").json()
    assert {"total_sessions", "active_sessions", "pending_sessions", "max_concurrent"} <= set(snapshot["scheduler"])
    assert {"used_slots", "free_slots"} <= set(snapshot["kv_cache"])
    assert {"total_tokens", "total_batches", "gateway"} <= set(snapshot)
    assert snapshot["gateway"]["requests"]["rest"].get("ok", 0) >= 1


def test_client_cli_writes_a_wav_and_reports(server: ServerThread, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    code = api_client.main(["--text", "Hello there.", "--voice", "tara", "--output", str(out), "--protocol", "grpc",
                            "--grpc-addr", server.grpc_address, "--temperature", "0", "--max-tokens", "28"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "TTFB" in printed and "RTF" in printed
    samples, rate = decode_audio(out.read_bytes(), "wav")
    assert rate == SAMPLE_RATE and len(samples) > 0
    assert out.read_bytes()[40:44] != b"\xff\xff\xff\xff"  # the file has an exact-length header


def test_client_cli_says_when_the_server_is_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for protocol in ("rest", "ws", "grpc"):
        code = api_client.main(["--text", "Hi", "--output", str(tmp_path / "x.wav"), "--protocol", protocol,
                                "--url", "http://127.0.0.1:9", "--grpc-addr", "127.0.0.1:9"])
        assert code == 1
        assert "cannot connect" in capsys.readouterr().err


def test_client_cli_reports_a_rejection(server: ServerThread, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = api_client.main(["--text", "Hi", "--voice", "nobody", "--output", str(tmp_path / "x.wav"),
                            "--url", server.base_url])
    assert code == 1
    assert "unknown voice" in capsys.readouterr().err


def test_production_server_help_needs_no_gpu() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "production_server.py"), "--help"], capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    assert "--grpc-port" in done.stdout and "--profile" in done.stdout


def test_validation_error_is_openai_shaped(server: ServerThread) -> None:
    response = httpx.post(f"{server.base_url}/v1/audio/speech", json={"input": "hi", "voice": "nobody"})
    assert check_openai_error(response, 400)["param"] == "voice"


def test_pcm_audio_is_not_silence(reference_pcm: bytes) -> None:
    samples = np.frombuffer(reference_pcm, dtype="<i2")
    assert np.abs(samples).max() > 0
