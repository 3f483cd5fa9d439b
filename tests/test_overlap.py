"""Overlapped steps: the engine core launches step N+1 before it reads step N back (ARCHITECTURE §4).

The engine core, scheduler, engines (the tiny Llama on CPU, the sim engine) and codec worker are the real
ones. What must hold: the same greedy tokens with overlap on and off; a session that ends in step N loses
at most the one token in flight for it, which reaches nobody (not even a session that takes its slot
next); a step that raises at launch fails only its culprit; and the host work of a step runs while the
(modelled) device runs the next one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orpheus_serve.config import SchedulerConfig, SimConfig
from orpheus_serve.core.engine_core import EngineCore
from orpheus_serve.engines.base import TokenEngine
from orpheus_serve.engines.sim_engine import SimEngine
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler import FramesReady, Scheduler, SchedulerEvent, SessionFinished
from orpheus_serve.scheduler.session import SessionRequest
from orpheus_serve.scheduler.step import SamplingParams, StepOutput, StepPlan
from tests.engine_core_support import Outcome, run_core, session_request
from tests.test_engine_faults import poison_torch_decode

SLOTS = 6


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    return None


def torch_engine(tiny_orpheus: Path) -> TorchEngine:
    return TorchEngine(tiny_orpheus, num_slots=SLOTS, max_seq_len=200, device="cpu", dtype="fp32",
                       max_batch_size=4, cuda_graphs=False, seed=0)


def sim_engine(end_after_frames: int | None = 3, **cost: float | bool) -> SimEngine:
    base = dict(step_base_ms=0.0, step_per_seq_ms=0.0, step_per_ctx_token_ms=0.0, prefill_per_token_ms=0.0,
                realtime=False)
    return SimEngine(SLOTS, 512, SimConfig(**{**base, **cost}, end_after_frames=end_after_frames))


def request(rid: str, words: int, max_tokens: int = 70, temperature: float = 0.0) -> SessionRequest:
    return session_request(rid, words, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=7))


def run(engine: TokenEngine, sessions: list[SessionRequest], *, overlap: bool, scheduler: Scheduler | None = None,
        slots: int = SLOTS) -> tuple[dict[str, Outcome], EngineCore, Scheduler]:
    return run_core(engine, sessions, overlap=overlap, scheduler=scheduler, slots=slots)


def mixed_sessions() -> list[SessionRequest]:
    """Prompts of different lengths, and token limits that end them at different steps."""
    return [request("a", 5, 70), request("b", 9, 35), request("c", 3, 105), request("d", 12, 49),
            request("e", 7, 14, temperature=0.8), request("f", 4, 91, temperature=1.0)]


@pytest.mark.parametrize("shape", ["alone", "mixed"])
def test_greedy_and_seeded_tokens_are_the_same_with_overlap_on_and_off(tiny_orpheus: Path, shape: str) -> None:
    sessions = mixed_sessions()
    if shape == "alone":
        for s in sessions[:3]:
            on = run(torch_engine(tiny_orpheus), [s], overlap=True)[0]
            off = run(torch_engine(tiny_orpheus), [s], overlap=False)[0]
            assert on == off and on[s.request_id].frames, s.request_id
        return
    on, core_on, sched_on = run(torch_engine(tiny_orpheus), sessions, overlap=True)
    off, core_off, _ = run(torch_engine(tiny_orpheus), sessions, overlap=False)
    assert on == off
    assert all(o.reason == "length" and len(o.frames) == s.sampling.max_tokens // 7
               for s, o in zip(sessions, on.values(), strict=True))
    # Ends by length are known before the tokens: nothing was planned past them, nothing wasted.
    assert sched_on.stats().stray_tokens == 0
    assert core_on.steps <= core_off.steps + 1


def test_a_session_ending_in_flight_wastes_one_token_and_it_reaches_nobody() -> None:
    """The sim engine ends each session with end_of_speech after 3 frames: a token the scheduler cannot
    foresee, so the step launched after it has one more decode of that session in flight. One slot: every
    next session takes the slot of the one before, right after that discarded token."""
    sessions = [request(f"s{i}", 4 + i, 140) for i in range(4)]
    on, _, scheduler = run(sim_engine(), sessions, overlap=True, slots=1)
    off, _, serial = run(sim_engine(), sessions, overlap=False, slots=1)
    assert on == off
    assert all(o.reason == "stop" and len(o.frames) == 3 for o in on.values())
    # At most one each, dropped (none where the next step was launched without it, e.g. held back by flow control).
    assert 1 <= scheduler.stats().stray_tokens <= len(sessions)
    assert serial.stats().stray_tokens == 0


def test_slot_reuse_with_a_step_in_flight_gives_the_old_token_to_nobody() -> None:
    """Driven by hand in the engine core's order (schedule N+1, launch N+1, then update N): session a ends in
    step N, its slot goes to b in plan N+2, and then step N+1's token for a is read back. It must not reach
    b, whose first token comes from its own prompt."""
    engine = sim_engine(end_after_frames=1)
    scheduler = Scheduler(SchedulerConfig(max_concurrent_sessions=1, max_batch_size=1), 1, max_seq_len=512)
    scheduler.submit(request("a", 4, 140))
    scheduler.submit(request("b", 6, 140))
    frames: dict[str, list] = {"a": [], "b": []}
    ended: list[str] = []
    inflight: tuple[StepPlan, object] | None = None
    plans = []
    for _ in range(40):
        plan = scheduler.schedule()
        plans.append(plan)
        handle = engine.launch(plan) if not plan.empty else None
        if inflight is not None:
            for event in scheduler.update(inflight[0], engine.collect(inflight[1])):
                if isinstance(event, FramesReady):
                    frames[event.request_id] += event.frames.tolist()
                elif isinstance(event, SessionFinished):
                    ended.append(event.request_id)
        inflight = (plan, handle) if handle is not None else None
        if ended == ["a", "b"]:
            break
    assert ended == ["a", "b"]
    # a's end (end_of_speech at position 7) came back after a later decode of a had been launched, and b's
    # prefill went into the same slot while that decode was in flight.
    reuse = next(i for i, p in enumerate(plans) if p.prefill and p.prefill[0].request_id == "b")
    assert plans[reuse].release == [0] and plans[reuse - 1].owners == {0: "a"}
    assert scheduler.stats().stray_tokens == 1  # a's token after end_of_speech (b's is in flight at the end)
    # Each got exactly its own frame, in its own stream: b's is what b gets alone.
    alone = Scheduler(SchedulerConfig(max_concurrent_sessions=1, max_batch_size=1), 1, max_seq_len=512)
    solo, _, _ = run(sim_engine(end_after_frames=1), [request("b", 6, 140)], overlap=False, scheduler=alone, slots=1)
    assert frames["b"] == solo["b"].frames and len(frames["a"]) == 1


def test_a_launch_that_raises_for_one_session_fails_only_it(tiny_orpheus: Path) -> None:
    """The poisoned session's decode raises at launch, after the step has run other passes: the step is run
    again serially after the one in flight is read back, and bisected; the others go on as alone."""
    good = [request("good-a", 5), request("good-b", 7), request("good-c", 9)]
    poisoned = request("poisoned", 6)
    engine = torch_engine(tiny_orpheus)
    poison_torch_decode(engine, poisoned.request_id, after_tokens=14)
    outcomes, core, _ = run(engine, [*good, poisoned], overlap=True)
    failed = outcomes[poisoned.request_id]
    assert failed.reason == "error" and failed.error is not None and "injected decode fault" in failed.error
    assert len(failed.frames) == 2
    assert core.step_errors >= 1 and core.engine_alive
    for s in good:
        alone = run(torch_engine(tiny_orpheus), [s], overlap=False)[0][s.request_id]
        assert outcomes[s.request_id] == alone, s.request_id


class SlowBookkeeping(Scheduler):
    """A scheduler whose bookkeeping of each step output costs `host_s` of wall time (a busy host)."""

    host_s = 0.0

    def update(self, plan: StepPlan, output: StepOutput) -> list[SchedulerEvent]:
        time.sleep(self.host_s)
        return super().update(plan, output)


@pytest.mark.parametrize("overlap", [True, False])
def test_host_work_overlaps_the_modelled_step(overlap: bool) -> None:
    """A modelled 12 ms step and 8 ms of bookkeeping a step: one after the other a loop period is ~20 ms;
    overlapped, ~12 ms (the device is never idle)."""
    step_ms, host_ms = 12.0, 8.0
    engine = sim_engine(end_after_frames=4, step_base_ms=step_ms, realtime=True)
    scheduler = SlowBookkeeping(SchedulerConfig(max_concurrent_sessions=SLOTS, max_batch_size=SLOTS), SLOTS,
                                max_seq_len=512)
    scheduler.host_s = host_ms / 1000
    _, core, _ = run(engine, [request(f"s{i}", 4 + i, 140) for i in range(SLOTS)], overlap=overlap,
                     scheduler=scheduler)
    period_ms = core.loop_s / core.steps * 1000
    engine_ms = core.engine_elapsed_s / core.steps * 1000
    assert engine_ms == pytest.approx(step_ms, rel=0.05)
    if overlap:
        assert period_ms < (step_ms + host_ms) * 0.8, period_ms  # ~12 ms: max(step, host)
    else:
        assert period_ms >= step_ms + host_ms * 0.95, period_ms  # sleeps never end early
