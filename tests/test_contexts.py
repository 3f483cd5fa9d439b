"""Incremental-text requests (contexts) through TTSService: tiny Llama + tiny SNAC on CPU."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest

from orpheus_serve import token_format
from orpheus_serve.request.text_stream import TextStream
from orpheus_serve.request.types import AudioChunk, ChunkTimings, SynthesisMetrics, SynthesisRequest
from orpheus_serve.service.build import build_service
from orpheus_serve.service.service import TTSService
from orpheus_serve.service.word_timings import words_of
from tests.test_service import make_config

REPLY = "Sure, I can help with that. The weather today is sunny, with a light breeze. Anything else?"
LONG_REPLY = ("Sure, I can help with that. " + "The weather today is sunny, with a light breeze from the west, "
              "and it should stay that way until the evening. " * 2 + "Anything else I can check for you?")


def service_for(tiny_models: Path, **overrides: object) -> TTSService:
    return build_service(make_config(tiny_models, **{"scheduler.admission": "slots", **overrides}),
                                  record_tokens=True)


def same_speech(service: TTSService, a_id: str, a: bytes, b_id: str, b: bytes, chunks: int) -> None:
    """The engine's tokens bit-identical chunk by chunk; the audio too, but for the codec's batched float
    arithmetic (sessions that share SNAC passes), which moves a sample by a unit or two at most."""
    log = service.token_log
    for k in range(chunks):
        assert log[f"{a_id}-{k}"]["frames"] == log[f"{b_id}-{k}"]["frames"], f"chunk {k}: tokens differ"
    assert len(a) == len(b)
    diff = np.abs(np.frombuffer(a, "<i2").astype(np.int32) - np.frombuffer(b, "<i2").astype(np.int32))
    assert diff.max() <= 2, diff.max()


def context(service: TTSService, rid: str, *, timestamps: bool = False) -> tuple[SynthesisRequest, TextStream]:
    text = TextStream(service.config.stream_input)
    return SynthesisRequest(text="", voice="tara", temperature=0.0, max_tokens=70, request_id=rid,
                            text_input=text, timestamps=timestamps), text


async def drain(service: TTSService, req: SynthesisRequest, events: list[tuple[str, object]] | None = None
                ) -> tuple[bytes, list[ChunkTimings], SynthesisMetrics]:
    pcm = bytearray()
    timings: list[ChunkTimings] = []
    metrics = None
    async for item in service.synthesize(req):
        if events is not None:
            events.append(("audio" if isinstance(item, AudioChunk) else type(item).__name__, item))
        if isinstance(item, AudioChunk):
            assert item.start_sample == len(pcm) // 2  # in order, no gap
            pcm += item.pcm
        elif isinstance(item, ChunkTimings):
            timings.append(item)
        else:
            metrics = item
    assert metrics is not None
    return bytes(pcm), timings, metrics


def test_text_pushed_word_by_word_speaks_before_the_input_ends(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            req, text = context(service, "ctx", timestamps=True)
            events: list[tuple[str, object]] = []
            consumer = asyncio.create_task(drain(service, req, events))
            ended_at_event = None
            for word in LONG_REPLY.split(" "):
                text.push(word + " ")
                await asyncio.sleep(0.05)  # an LLM writing its reply
            ended_at_event = len(events)
            text.end()
            pcm, timings, metrics = await asyncio.wait_for(consumer, 120)

            assert any(kind == "audio" for kind, _ in events[:ended_at_event]), "no audio before the input ended"
            assert metrics.samples == len(pcm) // 2 > 0
            assert metrics.text_chunks == len(timings) >= 2
            # chunk bounds are exact and contiguous; the chunks carry the whole reply, in order
            assert timings[0].start_sample == 0 and timings[-1].end_sample == metrics.samples
            for a, b in itertools.pairwise(timings):
                assert a.end_sample == b.start_sample
            assert [w for t in timings for w in words_of(t.text)] == words_of(LONG_REPLY)
            words = [w for t in timings for w in t.words]
            assert [w.word for w in words] == words_of(LONG_REPLY)
            for a, b in itertools.pairwise(words):
                assert a.start_s <= a.end_s <= b.start_s
            assert words[-1].end_s <= metrics.samples / token_format.SAMPLE_RATE
            stats = service.stats()
            assert stats["kv_cache"]["used_slots"] == 0
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_a_context_given_all_its_text_sounds_like_the_whole_text(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            whole, _, whole_metrics = await drain(service, SynthesisRequest(
                text=REPLY, voice="tara", temperature=0.0, max_tokens=70, request_id="whole"))
            req, text = context(service, "ctx")
            text.push(REPLY)
            text.end()
            pcm, timings, metrics = await drain(service, req)
            same_speech(service, "whole", whole, "ctx", pcm, whole_metrics.text_chunks)
            assert metrics.text_chunks == whole_metrics.text_chunks == len(timings)
            assert all(t.words == () for t in timings)  # bounds only, unless timestamps were asked for
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_flushes_are_reported_after_their_audio(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            req, text = context(service, "ctx")
            text.push("A first thought without an end")
            first = text.flush()
            events: list[tuple[str, object]] = []
            consumer = asyncio.create_task(drain(service, req, events))
            second = text.flush()  # nothing new buffered: a marker after the first chunk's audio
            text.push("and a second one.")
            text.end()
            _pcm, timings, _ = await asyncio.wait_for(consumer, 120)
            assert [t.flush_id for t in timings] == [first, second, None]
            assert timings[1].text == "" and timings[1].start_sample == timings[1].end_sample == timings[0].end_sample
            kinds = [kind for kind, _ in events]
            first_done = kinds.index("ChunkTimings")
            assert "audio" in kinds[:first_done] and "audio" in kinds[first_done + 2:]
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_cancelling_one_context_frees_its_slot_and_leaves_another_untouched(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            alone_req, alone_text = context(service, "alone")
            alone_text.push(REPLY)
            alone_text.end()
            alone, _, alone_metrics = await drain(service, alone_req)

            keep_req, keep_text = context(service, "keep")
            stop_req, stop_text = context(service, "stop")
            keep = asyncio.create_task(drain(service, keep_req))
            stop_items = service.synthesize(stop_req)
            stop_text.push("This reply is interrupted by the user, who starts talking over it right away. ")
            keep_text.push(REPLY)
            keep_text.end()
            first = await anext(stop_items)  # audio is playing
            assert isinstance(first, AudioChunk)
            steps_at_cancel = service.snapshot().core.steps
            await stop_items.aclose()  # barge-in
            # The slot is freed at the next step. Bounded wait on the engine's own step counter; then only the
            # other context (one chunk generating at a time) may hold a slot.
            for _ in range(4000):
                core = service.snapshot().core
                if core.steps >= steps_at_cancel + 2 or core.scheduler.active_sessions == 0:
                    break
                await asyncio.sleep(0.002)
            assert core.scheduler.used_slots <= 1
            kept, _, _ = await asyncio.wait_for(keep, 120)
            same_speech(service, "alone", alone, "keep", kept, alone_metrics.text_chunks)
            assert service.stats()["kv_cache"]["used_slots"] == 0
            assert service.tally.active == 0
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_timestamps_on_a_whole_text(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            _pcm, timings, metrics = await drain(service, SynthesisRequest(
                text=REPLY, voice="tara", temperature=0.0, max_tokens=70, timestamps=True))
            words = [w for t in timings for w in t.words]
            assert [w.word for w in words] == words_of(REPLY)
            assert all(t.estimated for t in timings)
            assert words[0].start_s >= 0 and words[-1].end_s <= metrics.samples / token_format.SAMPLE_RATE
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


@pytest.mark.parametrize("pieces", [[], ["... ", "!!"]])
def test_a_context_with_nothing_to_say_finishes_without_audio(tiny_models: Path, pieces: list[str]) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            req, text = context(service, "empty")
            for piece in pieces:
                text.push(piece)
            text.end()
            pcm, timings, metrics = await drain(service, req)
            assert pcm == b"" and timings == [] and metrics.samples == 0
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_a_context_left_while_waiting_for_text_is_counted_as_cancelled(tiny_models: Path) -> None:
    async def scenario() -> None:
        service = service_for(tiny_models)
        await service.start(warmup=False)
        try:
            req, text = context(service, "waiting")
            text.push("Hello")  # no boundary, no complete word: nothing can start yet
            consumer = asyncio.create_task(drain(service, req))
            for _ in range(100):  # let it reach the wait for text
                await asyncio.sleep(0)
            assert service.tally.active == 1 and not consumer.done()
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            assert (service.tally.active, service.tally.cancelled, service.tally.completed) == (0, 1, 0)
            assert service.stats()["kv_cache"]["used_slots"] == 0
        finally:
            await service.shutdown(grace_s=0)

    asyncio.run(scenario())
