"""TTSService end to end, in-process: tiny Llama + tiny SNAC on CPU, or the sim engine."""

from __future__ import annotations

import asyncio
import wave
from pathlib import Path

import numpy as np
import pytest

from orpheus_serve import token_format
from orpheus_serve.config import Config, load_config
from orpheus_serve.request.errors import QueueFullError
from orpheus_serve.request.types import AudioChunk, SynthesisMetrics, SynthesisRequest
from orpheus_serve.service.build import build_service
from orpheus_serve.service.service import TTSService


def make_config(tiny_models: Path, **overrides: object) -> Config:
    base = {
        "engine.model_path": str(tiny_models / "tiny-orpheus"),
        "codec.path": str(tiny_models / "tiny-snac"),
        "codec.noise": False,
        "engine.max_seq_len": 512,
        "scheduler.max_concurrent_sessions": 16,
        "scheduler.max_batch_size": 16,
    }
    base.update({k: v for k, v in overrides.items()})
    return load_config(overrides=base, env={})


async def collect(service: TTSService, req: SynthesisRequest) -> tuple[bytes, SynthesisMetrics]:
    pcm = bytearray()
    metrics = None
    async for item in service.synthesize(req):
        if isinstance(item, AudioChunk):
            pcm += item.pcm
        else:
            metrics = item
    assert metrics is not None
    return bytes(pcm), metrics


def greedy(text: str, rid: str, max_tokens: int = 70) -> SynthesisRequest:
    return SynthesisRequest(text=text, voice="tara", temperature=0.0, max_tokens=max_tokens, request_id=rid)


TEXTS = [f"Sentence number {i} is here." for i in range(16)]


def test_concurrent_greedy_requests_equal_each_alone(tiny_models: Path) -> None:
    async def scenario() -> None:
        # admission by slots alone: all 16 in the engine's batches at once (real-time admission would hold
        # this CPU's SNAC to two streams), which is what this test is about.
        service = build_service(make_config(tiny_models, **{"scheduler.admission": "slots"}),
                                         record_tokens=True)
        await service.start(warmup=False)
        try:
            alone = {}
            for i in (0, 5, 11):
                pcm, m = await collect(service, greedy(TEXTS[i], f"alone-{i}"))
                alone[i] = (pcm, m, service.token_log[f"alone-{i}-0"]["frames"])
            results = await asyncio.gather(*(collect(service, greedy(t, f"batch-{i}")) for i, t in enumerate(TEXTS)))
            for i, (pcm, m) in enumerate(results):
                frames = service.token_log[f"batch-{i}-0"]["frames"]
                assert len(pcm) // 2 == token_format.SAMPLES_PER_FRAME * m.frames == token_format.SAMPLES_PER_FRAME * len(frames)
                assert m.ttfb_s is not None and m.audio_seconds > 0
                if i in alone:
                    assert frames == alone[i][2], f"request {i}: tokens differ from the same request alone"
                    assert m.frames == alone[i][1].frames
            stats = service.stats()
            assert stats["scheduler"]["active_sessions"] == 0
            assert stats["kv_cache"]["used_slots"] == 0
            assert stats["total_batches"] > 0
            # batching happened: fewer steps than the sum of every request's tokens
            assert stats["scheduler"]["mean_batch_size"] > 1.5
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_streamed_pcm_is_the_offline_decode_of_the_sessions_frames(tiny_models: Path) -> None:
    """Content, not just length: the PCM a client receives for a two-chunk text is, sample for sample, what
    decoding each chunk's generated frames in one offline call gives (SNAC noise off)."""
    from orpheus_serve.audio.pcm import float_to_pcm16 as pcm16
    from orpheus_serve.codec import decode_offline, load_snac

    text = ("The first sentence of this text runs long enough to fill most of one chunk on its own, and then "
            "some more words follow it. The second sentence lands in a chunk of its own, which the service "
            "plays right after the first.")
    assert 200 < len(text) <= 250

    async def scenario() -> tuple[bytes, SynthesisMetrics, list[list[list[int]]]]:
        service = build_service(make_config(tiny_models), record_tokens=True)
        await service.start(warmup=False)
        try:
            req = SynthesisRequest(text=text, temperature=0.0, max_tokens=70, request_id="content")
            pcm, metrics = await collect(service, req)
            assert service.token_log is not None
            return pcm, metrics, [service.token_log[f"content-{k}"]["frames"] for k in range(metrics.text_chunks)]
        finally:
            await service.shutdown(grace_s=0)

    pcm, metrics, chunk_frames = asyncio.run(scenario())
    assert metrics.text_chunks == 2 and all(chunk_frames)
    snac = load_snac(str(tiny_models / "tiny-snac"), noise=False)
    expected = b"".join(pcm16(decode_offline(snac, np.asarray(frames))) for frames in chunk_frames)
    assert len(pcm) == len(expected) == 2 * metrics.samples
    got = np.frombuffer(pcm, "<i2").astype(np.int32)
    want = np.frombuffer(expected, "<i2").astype(np.int32)
    assert np.sqrt(np.mean(want.astype(np.float64) ** 2)) > 100  # real signal, not silence
    # The stateful decoder is exact; float32 rounding may move a sample across an int16 step, never more.
    assert np.abs(got - want).max() <= 1
    assert np.mean(got == want) > 0.99
    # What the comparison catches: audio shifted by one frame (a dropped or repeated frame) is far off.
    shift = token_format.SAMPLES_PER_FRAME
    assert np.abs(got[shift:] - want[:-shift]).max() > 100


def test_cancel_mid_stream_frees_the_slot(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = build_service(make_config(tiny_models))
        await service.start(warmup=False)
        try:
            gen = service.synthesize(greedy("A long sentence that keeps going for a while.", "cancel-me", 700))
            first = await gen.__anext__()
            assert isinstance(first, AudioChunk)
            assert service.stats()["kv_cache"]["used_slots"] == 1
            steps_before = service.stats()["engine"]["steps"]
            await gen.aclose()
            for _ in range(200):
                if service.stats()["kv_cache"]["used_slots"] == 0:
                    break
                await asyncio.sleep(0.01)
            stats = service.stats()
            assert stats["kv_cache"]["used_slots"] == 0
            assert stats["scheduler"]["cancelled"] == 1
            # the step in flight when the client left, then the plan that releases the slot
            # (+1: a step may complete between reading the counter and closing the stream)
            assert stats["engine"]["steps"] - steps_before <= 3
            assert stats["requests"]["requests_cancelled"] == 1
            # the server keeps serving
            pcm, m = await collect(service, greedy("Still here.", "after"))
            assert len(pcm) == 2 * token_format.SAMPLES_PER_FRAME * m.frames
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


@pytest.mark.parametrize(("admission", "accepted"), [
    ("slots", 32 + 8),  # every slot, then max_queue waiting
    ("queue", 4 + 8),  # a cold server's first admissions (nothing measured yet: 4), then max_queue waiting
])
def test_queue_bound_refuses_at_once_past_what_can_be_admitted(tiny_models: Path, admission: str,
                                                               accepted: int) -> None:
    cfg = make_config(
        tiny_models,
        # 20 ms modelled steps: nothing can finish while the requests are being submitted
        **{"engine.backend": "sim", "engine.sim.realtime": True, "engine.sim.step_base_ms": 20.0,
           "engine.sim.end_after_frames": 3, "codec.decoder": "sim", "codec.sim.realtime": False,
           "scheduler.max_concurrent_sessions": 32, "scheduler.max_batch_size": 16, "scheduler.max_queue": 8,
           "scheduler.admission": admission},
    )

    async def scenario() -> None:
        service = build_service(cfg)
        await service.start(warmup=False)
        try:
            gens = [service.synthesize(greedy(f"Request {i}.", f"q-{i}")) for i in range(accepted + 1)]
            # Start them all without letting any finish: the last must be refused immediately.
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens[:accepted]]
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError) as info:
                await gens[accepted].__anext__()
            assert "waiting" in str(info.value).lower() and info.value.retry_after_s > 0
            await asyncio.gather(*firsts)

            async def drain(g):
                n = 0
                async for item in g:
                    n += isinstance(item, SynthesisMetrics)
                return n

            done = await asyncio.gather(*(drain(g) for g in gens[:accepted]))
            assert done == [1] * accepted
            assert service.stats()["requests"]["requests_rejected"] == 1
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_synthesize_cli_writes_chunked_wav_without_gaps(tiny_models: Path, tmp_path: Path) -> None:
    from orpheus_serve.__main__ import main

    text = " ".join(f"This is sentence number {i}, and it carries on for a little while." for i in range(9))
    assert 580 <= len(text) <= 700
    out, tokens = tmp_path / "out.wav", tmp_path / "tokens.json"
    rc = main([
        "synthesize", "--text", text, "--voice", "tara", "--out", str(out), "--seed", "1",
        "--tokens-out", str(tokens),
        "--set", f"engine.model_path={tiny_models / 'tiny-orpheus'}", "--set", f"codec.path={tiny_models / 'tiny-snac'}",
        "--set", "sampling.max_tokens=70", "--set", "sampling.min_tokens=14", "--set", "codec.noise=false",
    ])
    assert rc == 0
    import json

    log = json.loads(tokens.read_text())
    assert len(log["chunks"]) >= 3
    total_frames = 0
    for chunk in log["chunks"]:
        assert chunk["prompt_ids"][0] == token_format.START_OF_HUMAN and chunk["prompt_ids"][-1] == token_format.START_OF_SPEECH
        total_frames += len(token_format.parse_token_ids(chunk["generated_ids"]))
    with wave.open(str(out)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    # no gap, no overlap: the WAV is exactly every chunk's frames back to back
    assert len(samples) == total_frames * token_format.SAMPLES_PER_FRAME



def test_first_flush_comes_as_soon_as_the_stateful_decoder_can_return_audio(tiny_snac: Path) -> None:
    from orpheus_serve.codec import load_snac
    from orpheus_serve.codec.stateful import StatefulDecoder
    from orpheus_serve.core.client import audible_lookahead
    from orpheus_serve.scheduler import FlushPolicy

    decoder = StatefulDecoder(load_snac(str(tiny_snac), noise=False))
    lookahead = audible_lookahead(decoder)
    policy = FlushPolicy.from_config(load_config(env={}).scheduler, lookahead)
    # 3 frames = 21 tokens: no later than the windowed default (1 frame + 2 of lookahead)
    assert policy.first_frames * 7 == 21
    assert policy.first_frames * token_format.SAMPLES_PER_FRAME > decoder.lookahead_samples
