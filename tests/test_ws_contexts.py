"""Contexts on the native WebSocket (/v1/audio/stream): text streamed in while audio streams out.

A real uvicorn server on loopback with the tiny random-weight model (noise off), driven by the
`websockets` client the way a voice agent would: its LLM's words arrive 50 ms apart.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client.protocols import stream_url
from orpheus_serve.service.build import build_service
from orpheus_serve.service.word_timings import words_of
from orpheus_serve.token_format import SAMPLE_RATE
from tests.gateway_support import stats, tiny_config

REPLY = "Sure, I can help with that. The weather today is sunny, with a light breeze. Anything else?"
# A reply as long as an agent's usual turn: ~60 words, three seconds of writing at 50 ms a word.
LONG_REPLY = ("Sure, I can help with that. " + "The weather today is sunny, with a light breeze from the west, "
              "and it should stay that way until the evening. " * 2 + "If you go out later, take a jacket. "
              "Anything else I can check for you?")
GREEDY = {"temperature": 0.0, "max_tokens": 42}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None):
    config = tiny_config(tiny_orpheus, tiny_snac, **{"scheduler.admission": "slots"})
    srv = ServerThread(config, build_service(config, record_tokens=True)).start()
    yield srv
    srv.stop()


async def receive_until(ws: Any, done: Any, audio: bytearray, messages: list[dict[str, Any]],
                        timeline: list[tuple[float, str]] | None = None) -> dict[str, Any]:
    """Collect binary audio and JSON messages until `done(message)` holds for a JSON message."""
    while True:
        message = await asyncio.wait_for(ws.recv(), 120)
        if isinstance(message, bytes):
            audio += message
            if timeline is not None:
                timeline.append((time.perf_counter(), "audio"))
            continue
        body = json.loads(message)
        messages.append(body)
        if done(body):
            return body


@pytest.mark.core_in_process
def test_words_pushed_as_an_llm_writes_them_are_spoken_before_the_reply_ends(server: ServerThread) -> None:
    async def scenario() -> tuple[bytearray, list[dict[str, Any]], list[tuple[float, str]], float]:
        audio = bytearray()
        messages: list[dict[str, Any]] = []
        timeline: list[tuple[float, str]] = []
        async with connect(stream_url(server.base_url), max_size=None) as ws:
            words = LONG_REPLY.split(" ")
            await ws.send(json.dumps({"context_id": "reply-1", "text": words[0] + " ", "voice": "tara",
                                      "response_format": "pcm", "timestamps": True, **GREEDY}))
            reader = asyncio.create_task(receive_until(ws, lambda b: "done" in b or "error" in b, audio, messages,
                                                       timeline))
            for word in words[1:]:
                await asyncio.sleep(0.05)
                await ws.send(json.dumps({"context_id": "reply-1", "text": word + " "}))
            ended_at = time.perf_counter()
            await ws.send(json.dumps({"context_id": "reply-1", "end": True}))
            await reader
        return audio, messages, timeline, ended_at

    audio, messages, timeline, ended_at = asyncio.run(scenario())
    done = messages[-1]
    assert done.get("done") is True and done["context_id"] == "reply-1", done
    assert timeline and timeline[0][0] < ended_at, "no audio before the reply's last word was sent"
    assert done["metrics"]["samples"] == len(audio) // 2 > 0
    stamps = [m for m in messages if "timestamps" in m]
    assert stamps and all(m["context_id"] == "reply-1" for m in stamps)
    words = [w for m in stamps for w in m["timestamps"]["words"]]
    assert [w["word"] for w in words] == words_of(LONG_REPLY)
    assert all(m["timestamps"]["estimated"] is True for m in stamps)
    starts = [w["start_s"] for w in words]
    assert starts == sorted(starts) and words[-1]["end_s"] <= len(audio) / 2 / SAMPLE_RATE + 1e-3
    chunks = [m["timestamps"]["chunk"] for m in stamps]
    assert chunks[0]["start_s"] == 0.0
    assert all(a["end_s"] == b["start_s"] for a, b in itertools.pairwise(chunks))


@pytest.mark.core_in_process
def test_cancelling_the_running_context_leaves_the_queued_one_untouched(server: ServerThread) -> None:
    other = "The second reply is spoken in full."

    async def alone() -> tuple[bytes, dict[str, Any]]:
        audio = bytearray()
        async with connect(stream_url(server.base_url), max_size=None) as ws:
            await ws.send(json.dumps({"context_id": "b", "text": other, "end": True, **GREEDY}))
            done = await receive_until(ws, lambda b: "done" in b or "error" in b, audio, [])
        return bytes(audio), done

    async def barge_in() -> tuple[bytes, dict[str, Any], list[dict[str, Any]], int]:
        async with connect(stream_url(server.base_url), max_size=None) as ws:
            await ws.send(json.dumps({"context_id": "a", "text": "This reply gets interrupted by the user, who "
                                      "starts talking right away. ", **GREEDY}))
            await ws.send(json.dumps({"context_id": "b", "text": other, **GREEDY}))  # queued, takes text meanwhile
            await ws.send(json.dumps({"context_id": "b", "end": True}))
            first = await asyncio.wait_for(ws.recv(), 120)
            assert isinstance(first, bytes)  # a is speaking
            await ws.send(json.dumps({"context_id": "a", "cancel": True}))
            messages: list[dict[str, Any]] = []
            stale = bytearray()
            cancelled = await receive_until(ws, lambda b: b.get("cancelled") is not None, stale, messages)
            # text still in flight for the cancelled reply is refused, not spoken as a new context
            await ws.send(json.dumps({"context_id": "a", "text": "late words. "}))
            audio = bytearray()
            done = await receive_until(ws, lambda b: "done" in b, audio, messages)
        return bytes(audio), done, [cancelled, *messages], len(stale)

    alone_audio, alone_done = asyncio.run(alone())
    audio, done, messages, _ = asyncio.run(barge_in())
    assert messages[0]["cancelled"] is True and messages[0]["context_id"] == "a"
    late = [m for m in messages if "error" in m]
    assert len(late) == 1 and late[0]["context_id"] == "a" and "has ended" in late[0]["error"]["message"]
    assert done["context_id"] == "b"
    log = server.server.service.token_log.snapshot()
    assert log[f"{done['metrics']['request_id']}-0"]["frames"] == log[f"{alone_done['metrics']['request_id']}-0"]["frames"]
    assert len(audio) == len(alone_audio)
    diff = np.abs(np.frombuffer(audio, "<i2").astype(np.int32) - np.frombuffer(alone_audio, "<i2").astype(np.int32))
    assert diff.max() <= 2
    settled = stats(server)
    assert settled["kv_cache"]["used_slots"] == 0


@pytest.mark.core_in_process
def test_flush_is_acknowledged_after_its_audio(server: ServerThread) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], list[tuple[float, str]]]:
        messages: list[dict[str, Any]] = []
        timeline: list[tuple[float, str]] = []
        async with connect(stream_url(server.base_url), max_size=None) as ws:
            await ws.send(json.dumps({"context_id": "f", "text": "Half a thought", "flush": True, **GREEDY}))
            flushed = await receive_until(ws, lambda b: "flushed" in b or "error" in b, bytearray(), messages,
                                          timeline)
            timeline.append((time.perf_counter(), "flushed"))
            await ws.send(json.dumps({"context_id": "f", "text": "and the rest.", "end": True}))
            await receive_until(ws, lambda b: "done" in b or "error" in b, bytearray(), messages, timeline)
        assert flushed["flushed"] is True and flushed["flush_id"] == 1 and flushed["context_id"] == "f", flushed
        return messages, timeline

    messages, timeline = asyncio.run(scenario())
    kinds = [kind for _, kind in timeline]
    flushed_at = kinds.index("flushed")
    assert "audio" in kinds[:flushed_at] and "audio" in kinds[flushed_at:]
    assert messages[-1]["done"] is True


def test_context_messages_that_cannot_be_used_get_errors_and_the_socket_stays_open(server: ServerThread) -> None:
    async def scenario() -> list[dict[str, Any]]:
        replies = []
        async with connect(stream_url(server.base_url), max_size=None) as ws:
            for message in (
                {"context_id": "", "text": "x"},
                {"context_id": "c", "text": 5},
                {"context_id": "c", "cancel": "yes"},
                {"context_id": "nobody", "cancel": True},
                {"context_id": "c", "text": "Hello ", "voice": "nobody-knows"},
            ):
                await ws.send(json.dumps(message))
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            await ws.send(json.dumps({"context_id": "d", "text": "Hello ", **GREEDY}))
            await ws.send(json.dumps({"context_id": "d", "voice": "leo"}))  # options belong to the first message
            replies.append(await receive_until(ws, lambda b: True, bytearray(), []))
            await ws.send(json.dumps({"context_id": "d", "end": True}))
            replies.append(await receive_until(ws, lambda b: "done" in b or "error" in b, bytearray(), []))
        return replies

    replies = asyncio.run(scenario())
    assert replies[0]["error"]["param"] == "context_id"
    assert replies[1]["error"]["param"] == "text" and replies[1]["context_id"] == "c"
    assert replies[2]["error"]["param"] == "cancel"
    assert replies[3] == {"cancelled": False, "request_id": None, "context_id": "nobody",
                          "message": "no such context is open"}
    assert replies[4]["error"]["param"] == "voice" and replies[4]["context_id"] == "c"
    assert replies[5]["error"]["param"] == "voice" and "first message" in replies[5]["error"]["message"]
    assert replies[6].get("done") is True and replies[6]["context_id"] == "d"


def test_the_benchmark_client_streams_text_at_llm_speed(server: ServerThread) -> None:
    from orpheus_serve.benchmarking.runner import input_stream_summary
    from orpheus_serve.benchmarking.workload import LONG
    from orpheus_serve.client.protocols import llm_pieces, synthesize_ws_context

    text = LONG[0]
    assert "".join(llm_pieces(text)) == text
    result = asyncio.run(synthesize_ws_context(server.base_url, text, tokens_per_s=30.0, voice="tara",
                                               **GREEDY))
    assert result.ok, result.error
    marks = result.input_marks
    assert marks["first_word_s"] == result.sent_s < marks["first_clause_s"] < marks["last_word_s"]
    # ~90 words at 30 a second: the reply takes 3 s to write, and its first sentence is spoken before that
    assert marks["last_word_s"] - marks["first_word_s"] >= (len(llm_pieces(text)) - 1) / 30.0 - 0.05
    summary = input_stream_summary([result])
    assert summary["first_audio_before_last_word"] == 1 and summary["input_streams"] == 1
    assert 0 < summary["ttfb_from_first_clause_p50_ms"] < summary["ttfb_from_first_word_p50_ms"]
