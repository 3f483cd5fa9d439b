"""A LiveKit `AgentSession` driven without a room, for barge-in tests against the real server: a scripted LLM
that writes each reply word by word, and an in-memory audio output that plays what it gets in real time (so
the agent is still speaking when the user interrupts) and keeps every frame.

Only the LLM and the speaker are stand-ins; the session, its turn handling and the TTS plugin (ElevenLabs or
Cartesia, pointed at the server by its base URL) are LiveKit's own code, unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from livekit import rtc
from livekit.agents import Agent, AgentSession, tts
from livekit.agents.llm import LLM, ChatChunk, ChatContext, ChoiceDelta, LLMStream, Tool
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions
from livekit.agents.voice.io import AudioOutput, AudioOutputCapabilities

from orpheus_serve.api.launch import ServerThread
from tests.cartesia_support import Stop, await_stop, before_cancel, cancelled_streams, context_sessions

SAMPLE_RATE = 24000
# An answer the LLM is still writing when its first sentence plays (a word every 50 ms: about 4 s in all).
AGENT_INTERRUPTED = ("This answer is interrupted by the user, who starts talking over it right away, long before its "
                     "end. It would go on to say a great deal more, one sentence after another. The weather today is "
                     "sunny, with a light breeze from the west. Tomorrow looks a little cooler, so bring a jacket if "
                     "you go out. The day after that it may rain, though nobody can say for certain yet. Anything "
                     "else you would like to know about the week ahead?")
AGENT_NEXT = "Sure, ask me anything you like."


class ScriptedLLM(LLM):
    """Answers each chat with the next of `replies`, one word every `gap_s` (as a streaming LLM writes)."""

    def __init__(self, replies: list[str], gap_s: float) -> None:
        super().__init__()
        self._replies = list(replies)
        self._gap_s = gap_s

    def chat(self, *, chat_ctx: ChatContext, tools: list[Tool] | None = None,
             conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS, **_: Any) -> LLMStream:
        return _ScriptedStream(self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options,
                               reply=self._replies.pop(0), gap_s=self._gap_s)


class _ScriptedStream(LLMStream):
    def __init__(self, llm: ScriptedLLM, *, reply: str, gap_s: float, **kwargs: Any) -> None:
        super().__init__(llm, **kwargs)
        self._reply = reply
        self._gap_s = gap_s

    async def _run(self) -> None:
        for k, word in enumerate(self._reply.split(" ")):
            await asyncio.sleep(self._gap_s)
            self._event_ch.send_nowait(ChatChunk(id="scripted", delta=ChoiceDelta(
                role="assistant", content=(" " if k else "") + word)))


class MemoryAudioOutput(AudioOutput):
    """The agent's speaker: keeps every frame and plays each segment in real time (its playout ends when its
    audio would have, or at once when cleared by an interruption)."""

    def __init__(self) -> None:
        super().__init__(label="memory", capabilities=AudioOutputCapabilities(pause=False), sample_rate=SAMPLE_RATE)
        self.frames: list[tuple[float, rtc.AudioFrame]] = []
        self.audio_arrived = asyncio.Event()
        self._pushed_s = 0.0
        self._started_at = 0.0
        self._finish: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._pushed_s:
            self._started_at = time.time()
            self.on_playback_started(created_at=self._started_at)
        self._pushed_s += frame.duration
        self.frames.append((time.perf_counter(), frame))
        self.audio_arrived.set()

    def flush(self) -> None:
        super().flush()
        if not self._pushed_s:
            return
        pushed_s = self._pushed_s

        def played() -> None:
            self._pushed_s = 0.0
            self.on_playback_finished(playback_position=pushed_s, interrupted=False)

        if self._finish is not None:
            self._finish.cancel()
        self._finish = asyncio.get_running_loop().call_later(
            max(0.0, pushed_s - (time.time() - self._started_at)), played)

    def clear_buffer(self) -> None:
        if not self._pushed_s:
            return
        if self._finish is not None:
            self._finish.cancel()
            self._finish = None
        self.on_playback_finished(playback_position=min(self._pushed_s, time.time() - self._started_at),
                                  interrupted=True)
        self._pushed_s = 0.0

    def audio_since(self, since: float) -> bytes:
        return b"".join(bytes(f.data.cast("b")) for at, f in self.frames if at >= since)


@dataclass(frozen=True, slots=True)
class BargeIn:
    """What a barge-in cost the server, from its own records (the token log, streams closed as cancelled)."""

    stop: Stop  # how the interrupted turn's generation ended, counted from the client's close
    cancelled: int  # streams of the protocol the gateway closed as cancelled meanwhile
    finish_reasons: list[str | None]  # of the interrupted turn's sessions, in order
    next_turn: bytes  # the audio of the turn after it


async def agent_barge_in(server: ServerThread, plugin: tts.TTS, protocol: str, interrupted: str, next_reply: str,
                         *, gap_s: float = 0.05, closes_at_next_turn: bool = False) -> BargeIn:
    """An agent answers with `interrupted`; once its first audio plays the user barges in
    (`AgentSession.interrupt()`), then the agent answers `next_reply`. `closes_at_next_turn`: the plugin tells
    the server only when it next synthesizes (LiveKit's Cartesia plugin drops the socket then), so the
    close is counted from the next turn's start."""
    session = AgentSession(llm=ScriptedLLM([interrupted, next_reply], gap_s), tts=plugin)
    speaker = MemoryAudioOutput()
    session.output.audio = speaker
    await session.start(Agent(instructions="Answer the user."))
    try:
        session.generate_reply(user_input="Tell me everything.")
        await asyncio.wait_for(speaker.audio_arrived.wait(), 120)  # the agent speaks; the LLM is still writing
        cancelled_before = cancelled_streams(server, protocol)
        at_interrupt = before_cancel(server, interrupted[:20], protocol)
        await asyncio.wait_for(session.interrupt(), 30)
        next_started = time.perf_counter()
        if closes_at_next_turn:
            at_interrupt = before_cancel(server, interrupted[:20], protocol)
        reply = session.generate_reply(user_input="And then?")
        stop = await await_stop(server, interrupted[:20], at_interrupt, protocol=protocol)
        await asyncio.wait_for(reply.wait_for_playout(), 120)
        return BargeIn(stop=stop, cancelled=cancelled_streams(server, protocol) - cancelled_before,
                       finish_reasons=[e["finish_reason"] for e in context_sessions(server, interrupted[:20])],
                       next_turn=speaker.audio_since(next_started))
    finally:
        await session.aclose()
        await plugin.aclose()


def run_with_session(scenario: Callable[[Any], Awaitable[BargeIn]]) -> BargeIn:
    """`scenario(http_session)` on a fresh event loop with an aiohttp session the plugin can use."""
    import aiohttp

    async def main() -> BargeIn:
        async with aiohttp.ClientSession() as http:
            return await scenario(http)

    return asyncio.run(main())
