"""Helpers for the Cartesia-compatible WebSocket tests: a greedy tiny-model server and a raw wire client."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from orpheus_serve.api.launch import ServerThread

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


def request_entries(server: ServerThread, first_text: str) -> dict[str, dict[str, Any]]:
    """Session id -> token-log entry (one per generated text chunk, in order) of the latest request whose
    first chunk starts with `first_text`."""
    log = server.server.service.token_log
    assert log is not None
    entries = log.snapshot()
    request_ids = [key.rsplit("-", 1)[0] for key, e in entries.items()
                   if key.endswith("-0") and e["text"].startswith(first_text)]
    if not request_ids:
        return {}
    latest = request_ids[-1]  # the log keeps submission order
    return {key: e for key, e in entries.items() if key.rsplit("-", 1)[0] == latest}


def context_sessions(server: ServerThread, first_text: str) -> list[dict[str, Any]]:
    """Token-log entries (one per generated text chunk, in order) of the latest request whose first chunk
    starts with `first_text`."""
    return list(request_entries(server, first_text).values())


def cancelled_streams(server: ServerThread, protocol: str = "cartesia") -> int:
    return server.server.gateway.figures()["requests"][protocol].get("cancelled", 0)


# What must hold after a barge-in's close on any machine, however loaded (the server's own latency, from the
# close reaching its socket to the engine core dropping the session, is a benchmark figure:
# scripts/bench_barge_in.py, docs/PERFORMANCE.md). Both count from the client's close, so the client library's
# way to the server is in them too.
# - The interrupted answer's sessions end within STOP_WITHIN_S of the close (wall time, the core's own stamp).
STOP_WITHIN_S = 5.0
# - Generation stops far short of the answer: after the close its sessions generate at most this share of the
#   frames their budgets had left (each text chunk's, sampling.max_tokens_for; the answers here have tens of
#   frames left, hundreds of engine steps), and never less than one flush (two frames) is allowed.
SHARE_AFTER_CLOSE = 0.5


@dataclass(frozen=True, slots=True)
class BeforeClose:
    """Read just before a client closes (or cancels) an answer's stream."""

    at: float  # time.monotonic()
    steps: int  # the engine core's steps
    cancelled: int  # the protocol's streams the gateway closed as cancelled
    frames: dict[str, int]  # session id -> frames generated so far, of the answer being interrupted


@dataclass(frozen=True, slots=True)
class Stop:
    """How an interrupted answer's generation ended, counted from the client's close (`BeforeClose`)."""

    seconds: float  # to the core ending the answer's last session (its token-log `ended_at`)
    steps: int  # engine steps to that end (information: their length is the machine's)
    frames_after: int  # frames the answer's sessions generated after the close
    frames_left: int  # frames their budgets had left at the close
    finish_reasons: list[str | None]  # of the answer's sessions, in order

    def check(self) -> None:
        """What holds on any machine: the answer was cancelled, promptly, far short of its end."""
        assert self.finish_reasons and self.finish_reasons[-1] == "cancelled", self.finish_reasons
        assert self.seconds <= STOP_WITHIN_S, self
        assert self.frames_after <= max(2.0, SHARE_AFTER_CLOSE * self.frames_left), self


def before_cancel(server: ServerThread, first_text: str, protocol: str = "cartesia") -> BeforeClose:
    """Read just before a client cancels the answer whose first chunk starts with `first_text`."""
    frames = {key: len(e["frames"]) for key, e in request_entries(server, first_text).items()}
    return BeforeClose(at=time.monotonic(), steps=steps(server), cancelled=cancelled_streams(server, protocol),
                       frames=frames)


async def await_stop(server: ServerThread, first_text: str, before: BeforeClose, *, protocol: str = "cartesia"
                     ) -> Stop:
    """Wait until every session of the answer whose first chunk starts with `first_text` has finished (polls
    the token log), and say how it ended. The gateway must have closed its stream as cancelled by then. Fails
    once STOP_WITHIN_S have passed since the close with a session still running (a server that ignores the
    close keeps it until its session timeout, two minutes)."""
    deadline = before.at + STOP_WITHIN_S
    while time.monotonic() < deadline:
        # The entries first: a session the core has finished was cancelled by a stream the gateway had
        # closed before (with the core in a process of its own, it may finish between two reads here).
        entries = request_entries(server, first_text)
        closed = cancelled_streams(server, protocol) > before.cancelled
        if entries and all(e["finish_reason"] is not None for e in entries.values()):
            assert closed, "the sessions finished while the stream stayed open"
            sampling = server.server.config.sampling
            last = max(entries.values(), key=lambda e: e["ended_at"])
            return Stop(seconds=last["ended_at"] - before.at, steps=last["ended_step"] - before.steps,
                        frames_after=sum(len(e["frames"]) - before.frames.get(key, 0) for key, e in entries.items()),
                        frames_left=sum(sampling.max_tokens_for(e["text"]) // 7 - before.frames.get(key, 0)
                                        for key, e in entries.items()),
                        finish_reasons=[e["finish_reason"] for e in entries.values()])
        await asyncio.sleep(0.001)
    reasons = [e["finish_reason"] for e in request_entries(server, first_text).values()]
    raise AssertionError(f"the sessions of {first_text!r} were still generating {STOP_WITHIN_S} s after the close "
                         f"(finish reasons {reasons})")


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
