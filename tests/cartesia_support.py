"""Helpers for the Cartesia-compatible WebSocket tests: a greedy tiny-model server and a raw wire client."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from orpheus_serve.api.launch import ServerThread
from tests.pace import MachinePace

REPLY = ("Sure, I can help with that. The weather today is sunny, with a light breeze from the west. "
         "Tomorrow looks a little cooler, so bring a jacket if you go out. Anything else?")
INTERRUPTED = "This answer is interrupted by the user, who starts talking over it right away, long before its end."


def ws_url(server: ServerThread) -> str:
    return f"ws://127.0.0.1:{server.http_port}/tts/websocket"


def generation(context_id: str, transcript: str, *, more: bool = False, voice: str | None = "tara",
               encoding: str = "pcm_s16le", sample_rate: int = 24000, **extra: Any) -> str:
    """A generation request as the Cartesia clients write it."""
    return json.dumps({"context_id": context_id, "transcript": transcript, "continue": more, "model_id": "sonic-2",
                       "voice": {"mode": "id", "id": voice}, "language": "en",
                       "output_format": {"container": "raw", "encoding": encoding, "sample_rate": sample_rate},
                       **extra})


@dataclass
class ContextLog:
    """What one context received, in order."""

    audio: bytearray = field(default_factory=bytearray)
    messages: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [m["type"] for _, m in self.messages]

    @property
    def final(self) -> dict[str, Any] | None:
        last = self.messages[-1][1] if self.messages else None
        return last if last is not None and last["type"] in ("done", "error") else None


async def receive_until(ws: Any, logs: dict[str, ContextLog], finished: set[str], *, timeout_s: float = 120.0
                        ) -> None:
    """Read messages into `logs` until every context in `finished` has its `done` or `error`."""
    async def loop() -> None:
        while not all(logs.get(c) is not None and logs[c].final is not None for c in finished):
            message = json.loads(await ws.recv())
            log = logs.setdefault(message["context_id"], ContextLog())
            log.messages.append((time.perf_counter(), message))
            if message["type"] == "chunk":
                log.audio += base64.b64decode(message["data"])

    await asyncio.wait_for(loop(), timeout_s)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def assert_same_audio(a: bytes, b: bytes) -> None:
    """Greedy decoding gives the same tokens; the codec's batched float arithmetic (sessions that share SNAC
    passes) may move a sample by a unit or two."""
    assert len(a) == len(b) > 0, (len(a), len(b))
    diff = np.abs(pcm16(a) - pcm16(b))
    assert diff.max() <= 2, diff.max()


def steps(server: ServerThread) -> int:
    return server.server.service.snapshot().core.steps


def context_sessions(server: ServerThread, first_text: str) -> list[dict[str, Any]]:
    """Token-log entries (one per generated text chunk, in order) of the latest request whose first chunk
    starts with `first_text`."""
    log = server.server.service.token_log
    assert log is not None
    entries = log.snapshot()
    request_ids = [key.rsplit("-", 1)[0] for key, e in entries.items()
                   if key.endswith("-0") and e["text"].startswith(first_text)]
    if not request_ids:
        return []
    latest = request_ids[-1]  # the log keeps submission order
    return [e for key, e in entries.items() if key.rsplit("-", 1)[0] == latest]


def cancelled_streams(server: ServerThread, protocol: str = "cartesia") -> int:
    return server.server.gateway.figures()["requests"][protocol].get("cancelled", 0)


# Engine steps from the server's cancel to the session's end: the cancel lands between two steps and ends the
# session at once, and its end goes out with the next step's output; with a step in flight (engine.overlap)
# that output may be one step later.
STEPS_AFTER_SERVER_CANCEL = 3
# From the client's interruption: the way to the server (the client library's own tasks, the socket, the
# gateway, all sharing the test process's interpreter with a tiny model stepping every ~10 ms) has measured
# 0-6 steps more on the reference machine alone (tests/pace.py), and 9 beside the suite's other shard, whose
# load comes and goes within a test and so escapes the run's one calibration; that part is host time, so a
# slower machine stretches it (`steps_after_client_cancel`). A server that ignored the cancel would run the
# rest of the answer, hundreds of steps. The server's own bound is STEPS_AFTER_SERVER_CANCEL.
STEPS_AFTER_CLIENT_CANCEL = STEPS_AFTER_SERVER_CANCEL + 10


def steps_after_client_cancel(pace: MachinePace) -> int:
    """Engine steps a session may still take after its client's interruption, on this machine."""
    return STEPS_AFTER_SERVER_CANCEL + math.ceil((STEPS_AFTER_CLIENT_CANCEL - STEPS_AFTER_SERVER_CANCEL) * pace.slowness)


def before_cancel(server: ServerThread, protocol: str = "cartesia") -> tuple[int, int]:
    """(engine steps, the protocol's streams closed as cancelled), read just before a client cancels."""
    return steps(server), cancelled_streams(server, protocol)


async def stop_steps(server: ServerThread, first_text: str, before: tuple[int, int], *, within_s: float = 30.0,
                     protocol: str = "cartesia") -> tuple[int, int]:
    """Engine steps until every session of the request whose first chunk starts with `first_text` has
    finished: from `before` (read before the client cancelled, so the way to the server counts), and from
    the moment the server closed that request's stream (its session cancelled then). Bounded; polls the
    engine's and the gateway's own counters."""
    since, cancelled = before
    closed_at: int | None = None
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        # The entries first: a session the core has finished was cancelled by a stream the gateway had
        # closed before (with the core in a process of its own, it may finish between two reads here).
        entries = context_sessions(server, first_text)
        now = steps(server)
        if closed_at is None and cancelled_streams(server, protocol) > cancelled:
            closed_at = now
        if entries and all(e["finish_reason"] is not None for e in entries):
            assert closed_at is not None, "the sessions finished while the stream stayed open"
            return now - since, now - closed_at
        await asyncio.sleep(0.001)
    raise AssertionError(f"the sessions of {first_text!r} did not finish within {within_s}s")


async def replay(server: ServerThread, chunks: list[str]) -> bytes:
    """The audio of one context given `chunks` as its generation chunks (each pushed and flushed at once):
    what a response cut into those chunks sounds like, whatever the timing of its text was."""
    logs: dict[str, ContextLog] = {}
    keys = server.server.config.server.api_keys
    async with connect(ws_url(server), additional_headers={"X-API-Key": keys[0]} if keys else {}) as ws:
        for text in chunks:
            await ws.send(generation("replay", text + " ", more=True, flush=True))
        await ws.send(generation("replay", "", more=False))
        await receive_until(ws, logs, {"replay"})
    assert logs["replay"].final["type"] == "done"
    return bytes(logs["replay"].audio)
