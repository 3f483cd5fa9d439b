"""Drives the real engine core (scheduler, engine, sim codec worker) directly, past the service: a batch of
sessions submitted before the core starts, so they share every step, and what each one got back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from orpheus_serve import token_format as P
from orpheus_serve.codec.sim import SimDecoder
from orpheus_serve.codec.worker import CodecWorker
from orpheus_serve.config import SchedulerConfig
from orpheus_serve.core.engine_core import EngineCore
from orpheus_serve.engines.base import PipelinedEngine, TokenEngine
from orpheus_serve.scheduler import FramesReady, Scheduler, SchedulerEvent, SessionFailed, SessionFinished
from orpheus_serve.scheduler.session import SessionRequest
from orpheus_serve.scheduler.step import SamplingParams


def session_request(rid: str, words: int, sampling: SamplingParams) -> SessionRequest:
    """A prompt of `words` distinct text tokens in the Orpheus prompt layout."""
    prompt = (P.START_OF_HUMAN, P.BOS, *range(100 + words, 100 + 2 * words), *P.PROMPT_SUFFIX)
    return SessionRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, arrival_s=time.monotonic())


@dataclass
class Outcome:
    frames: list[list[int]] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None


def run_core(engine: TokenEngine, sessions: list[SessionRequest], *, overlap: bool = True,
             scheduler: Scheduler | None = None, slots: int | None = None,
             ) -> tuple[dict[str, Outcome], EngineCore, Scheduler]:
    """Every session submitted before the engine core starts; returns once all have ended (at most 120 s)."""
    slots = slots or engine.num_slots
    scheduler = scheduler or Scheduler(SchedulerConfig(max_concurrent_sessions=slots, max_batch_size=slots),
                                       engine.num_slots, max_seq_len=engine.max_seq_len)
    outcomes = {s.request_id: Outcome() for s in sessions}
    all_done = threading.Event()

    def on_event(event: SchedulerEvent) -> None:
        if isinstance(event, SessionFailed):
            outcomes[event.request_id].error = event.error
        elif isinstance(event, SessionFinished):
            outcomes[event.request_id].reason = event.reason
            if all(o.reason is not None for o in outcomes.values()):
                all_done.set()

    def on_frames(event: FramesReady) -> None:
        outcomes[event.request_id].frames += event.frames.tolist()

    codec = CodecWorker(SimDecoder(realtime=False), lambda result: None)
    core = EngineCore(scheduler, engine, codec, on_event, on_frames=on_frames, overlap=overlap)
    assert core.overlapped is (overlap and isinstance(engine, PipelinedEngine))
    for s in sessions:
        core.submit(s)
    codec.start()
    core.start()
    try:
        assert all_done.wait(120), {rid: o.reason for rid, o in outcomes.items()}
    finally:
        core.stop()
        codec.stop(5.0)
    return outcomes, core, scheduler
