"""Scheduler tests: a fake clock and StepOutputs built by hand from each plan. No threads, no sleeps."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from orpheus_serve.config import SchedulerConfig
from orpheus_serve.scheduler import (
    FlushPolicy,
    FrameBuffer,
    FramesReady,
    Scheduler,
    SessionFailed,
    SessionFinished,
    SessionRequest,
    SessionState,
)
from orpheus_serve.scheduler.errors import InvalidSessionError, SchedulerFullError
from orpheus_serve.scheduler.step import SamplingParams, StepOutput, StepPlan
from orpheus_serve.token_format import END_OF_SPEECH, code_to_token


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def code_for(request_id: str, position: int) -> int:
    """A deterministic code per (session, audio position), covering 0..4095 (0 included)."""
    return (sum(map(ord, request_id)) * 131 + position * 977) % 4096


def audio_token(request_id: str, position: int) -> int:
    return code_to_token(code_for(request_id, position), position)


def expected_frames(request_id: str, n: int) -> np.ndarray:
    return np.array([[code_for(request_id, 7 * i + k) for k in range(7)] for i in range(n)], dtype=np.int64)


class HandModel:
    """Builds each StepOutput by hand from the plan, as a slot-batched engine would:
    one valid audio token per decoded slot and for each completed prompt; end_of_speech
    after `frames` frames (None: never)."""

    def __init__(self, frames: int | None = None) -> None:
        self.frames = frames
        self.slot_request: dict[int, str] = {}
        self.position: dict[str, int] = {}

    def next_token(self, slot: int) -> int:
        rid = self.slot_request[slot]
        p = self.position.get(rid, 0)
        self.position[rid] = p + 1
        if self.frames is not None and p == 7 * self.frames:
            return END_OF_SPEECH
        return audio_token(rid, p)

    def step(self, plan: StepPlan) -> StepOutput:
        out = StepOutput()
        for slot in plan.release:
            self.slot_request.pop(slot, None)
        for chunk in plan.prefill:
            self.slot_request[chunk.slot] = chunk.request_id
            if chunk.is_last:
                out.tokens[chunk.slot] = [self.next_token(chunk.slot)]
        for slot in plan.decode:
            out.tokens[slot] = [self.next_token(slot)]
        return out


def config(**kw) -> SchedulerConfig:
    base = dict(max_concurrent_sessions=64, max_batch_size=16, prefill_chunk_tokens=256, max_queue=64)
    base.update(kw)
    return SchedulerConfig(**base)


def request(rid: str, clock: FakeClock, prompt_len: int = 10, max_tokens: int = 1400, **kw) -> SessionRequest:
    return SessionRequest(
        request_id=rid,
        prompt_ids=tuple(range(1000, 1000 + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_s=clock(),
        **kw,
    )


def run_step(sched: Scheduler, model: HandModel, clock: FakeClock, dt: float = 0.01):
    plan = sched.schedule()
    out = model.step(plan)
    clock.advance(dt)
    return plan, sched.update(plan, out)


def of_type(events, cls):
    return [e for e in events if isinstance(e, cls)]


# ----------------------------------------------------------------- state machine


def test_session_goes_waiting_prefilling_decoding_finished_and_frees_its_slot() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=4, lookahead_frames=2, clock=clock)
    sched.submit(request("a", clock, prompt_len=12))
    assert sched.session_state("a") is SessionState.WAITING
    assert sched.stats().pending_sessions == 1 and sched.has_work

    plan = sched.schedule()
    assert [(c.slot, c.start, c.end, c.priority) for c in plan.prefill] == [(0, 0, 12, 1.0)]
    assert plan.decode == [] and plan.release == []
    assert sched.session_state("a") is SessionState.PREFILLING
    assert sched.update(plan, StepOutput(tokens={0: [audio_token("a", 0)]})) == []
    assert sched.session_state("a") is SessionState.DECODING

    events: list = []
    position = 1
    for _ in range(3 * 7 - 1):  # up to the first flush: 1 frame + 2 lookahead
        plan = sched.schedule()
        assert plan.decode == [0] and not plan.prefill
        clock.advance(0.01)
        events += sched.update(plan, StepOutput(tokens={0: [audio_token("a", position)]}))
        position += 1
    [first] = events
    assert isinstance(first, FramesReady) and not first.final
    np.testing.assert_array_equal(first.frames, expected_frames("a", 3))

    plan = sched.schedule()
    assert plan.priority == {0: 0.5}  # first audio is out: the TTFB boost ends
    events = sched.update(plan, StepOutput(tokens={0: [END_OF_SPEECH]}))
    final, finished = events
    assert isinstance(final, FramesReady) and final.final and final.num_frames == 0
    assert isinstance(finished, SessionFinished)
    assert (finished.reason, finished.tokens, finished.frames) == ("stop", 22, 3)
    assert finished.queue_s == 0.0 and finished.first_token_s == 0.0
    assert sched.session_state("a") is None

    plan = sched.schedule()
    assert plan.release == [0] and not plan.decode
    assert sched.update(plan, StepOutput()) == []
    assert not sched.has_work
    stats = sched.stats()
    assert (stats.finished, stats.total_sessions, stats.used_slots, stats.free_slots) == (1, 1, 0, 4)
    assert stats.total_tokens == 22


def test_length_cap_ends_with_all_frames_and_drops_ids_past_it() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, clock=clock)
    sched.submit(request("a", clock, max_tokens=21))
    plan = sched.schedule()
    ids = [audio_token("a", p) for p in range(30)]  # an engine streaming past the cap
    events = sched.update(plan, StepOutput(tokens={0: ids}))
    frames = of_type(events, FramesReady)
    assert [f.final for f in frames] == [True]
    np.testing.assert_array_equal(frames[0].frames, expected_frames("a", 3))
    [finished] = of_type(events, SessionFinished)
    assert (finished.reason, finished.tokens, finished.frames) == ("length", 21, 3)


def test_engine_failure_protocol_error_and_engine_finish() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=3, clock=clock)
    for rid in "abc":
        sched.submit(request(rid, clock))
    plan = sched.schedule()
    assert [c.slot for c in plan.prefill] == [0, 1, 2]
    out = StepOutput(
        tokens={1: [audio_token("b", 0), audio_token("b", 0)], 2: [audio_token("c", p) for p in range(10)]},
        failed={0: "CUDA error: device-side assert"},
        finished={2: "stop"},
    )
    events = sched.update(plan, out)
    assert [type(e).__name__ for e in events] == [
        "SessionFailed",
        "SessionFinished",
        "SessionFailed",
        "SessionFinished",
        "FramesReady",
        "FramesReady",
        "SessionFinished",
    ]
    assert events[0] == SessionFailed("a", "engine error: CUDA error: device-side assert")
    assert events[1].reason == "error"
    assert events[2].request_id == "b" and "protocol error" in events[2].error  # position 1 got a slot-0 id
    assert events[3].reason == "error"
    assert not events[4].final and events[4].num_frames == 1  # c's first frame (no lookahead here)
    assert events[5].final and events[5].num_frames == 0  # then the engine stopped "c"
    assert (events[6].request_id, events[6].reason, events[6].tokens) == ("c", "stop", 10)
    assert sorted(sched.schedule().release) == [0, 1, 2]
    stats = sched.stats()
    assert (stats.failed, stats.finished) == (2, 1)


def test_context_limit_ends_the_session_with_length_and_an_oversized_prompt_is_refused() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, clock=clock, max_seq_len=50)
    with pytest.raises(InvalidSessionError, match="max_seq_len=50"):
        sched.submit(request("big", clock, prompt_len=45))
    sched.submit(request("a", clock, prompt_len=20))  # asks for more than the 30 tokens of room
    model = HandModel()
    events: list = []
    while sched.has_work:
        events += run_step(sched, model, clock)[1]
    # A clamped session ends like one that reached max_tokens: a normal "length" finish after its last
    # whole frame (28 of the 30 tokens of room), with every frame handed out.
    assert not of_type(events, SessionFailed)
    [finished] = of_type(events, SessionFinished)
    assert (finished.reason, finished.tokens, finished.frames) == ("length", 28, 4)
    assert sum(e.num_frames for e in of_type(events, FramesReady)) == 4


def test_submit_rejects_duplicate_ids_and_empty_prompts() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=2, clock=clock)
    sched.submit(request("a", clock))
    with pytest.raises(InvalidSessionError, match="already in use"):
        sched.submit(request("a", clock))
    with pytest.raises(InvalidSessionError, match="empty prompt"):
        sched.submit(request("b", clock, prompt_len=0))


# ----------------------------------------------------------------- slots, queue, cancel, timeouts


def test_a_finished_slot_is_released_and_reused_in_the_same_plan() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, clock=clock)
    sched.submit(request("a", clock, max_tokens=7))
    sched.submit(request("b", clock))
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefill] == ["a"]
    events = sched.update(plan, StepOutput(tokens={0: [audio_token("a", p) for p in range(7)]}))
    assert of_type(events, SessionFinished)[0].reason == "length"
    plan = sched.schedule()
    assert plan.release == [0]
    assert [(c.request_id, c.slot, c.start) for c in plan.prefill] == [("b", 0, 0)]


def test_cancel_running_session_frees_its_slot_within_one_step() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, clock=clock)
    model = HandModel()
    sched.submit(request("a", clock))
    sched.submit(request("b", clock))
    for _ in range(5):
        run_step(sched, model, clock)
    plan = sched.schedule()
    assert plan.decode == [0]
    sched.cancel("a")  # the client left while this step runs
    [finished] = sched.drain_events()
    assert (finished.request_id, finished.reason, finished.tokens) == ("a", "cancelled", 5)
    events = sched.update(plan, model.step(plan))  # its token arrives anyway: dropped
    assert events == []
    assert sched.stats().stray_tokens == 1
    plan = sched.schedule()
    assert plan.release == [0]
    assert [(c.request_id, c.slot) for c in plan.prefill] == [("b", 0)]
    sched.cancel("a")  # idempotent
    sched.cancel("nobody")
    assert sched.drain_events() == []
    assert sched.stats().cancelled == 1


def test_cancel_waiting_session_leaves_the_queue() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, clock=clock)
    model = HandModel()
    sched.submit(request("a", clock))
    sched.submit(request("b", clock))
    sched.submit(request("c", clock))
    run_step(sched, model, clock)
    clock.advance(0.5)
    sched.cancel("b")
    [finished] = sched.drain_events()
    assert finished.reason == "cancelled" and finished.first_token_s is None
    assert finished.queue_s == pytest.approx(0.51)
    assert sched.stats().pending_sessions == 1
    sched.cancel("a")
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefill] == ["c"]


def test_queue_bound_32_slots_and_8_waiting_then_immediate_rejection() -> None:
    clock = FakeClock()
    sched = Scheduler(config(max_concurrent_sessions=32, max_queue=8), num_slots=32, clock=clock)
    for i in range(40):
        sched.submit(request(f"r{i}", clock))
    with pytest.raises(SchedulerFullError) as err:
        sched.submit(request("r40", clock))
    message = str(err.value)
    assert "all 32 synthesis slots are in use" in message and "max_queue=8" in message and "retry" in message
    assert err.value.retry_after_s > 0
    assert sched.stats().rejected == 1

    model = HandModel(frames=4)
    finished: list[SessionFinished] = []
    for _ in range(400):
        if not sched.has_work:
            break
        finished += of_type(run_step(sched, model, clock)[1], SessionFinished)
    assert sorted(f.request_id for f in finished) == sorted(f"r{i}" for i in range(40))
    assert {f.reason for f in finished} == {"stop"}
    assert max(f.queue_s for f in finished) > 0  # the last 8 waited for a slot
    sched.submit(request("r40", clock))  # room again


def test_queue_timeout_and_session_timeout() -> None:
    clock = FakeClock()
    sched = Scheduler(config(queue_timeout_s=2.0, session_timeout_s=5.0), num_slots=1, clock=clock)
    model = HandModel()
    sched.submit(request("a", clock))
    sched.submit(request("b", clock))
    run_step(sched, model, clock)
    clock.advance(2.5)
    plan, events = run_step(sched, model, clock)
    assert all(c.request_id != "b" for c in plan.prefill)
    [b_done] = of_type(events, SessionFinished)
    assert (b_done.request_id, b_done.reason, b_done.first_token_s) == ("b", "timeout", None)
    clock.advance(3.0)
    plan = sched.schedule()
    assert plan.release == [0] and plan.decode == []  # timed out in this very schedule()
    [a_done] = sched.drain_events()
    assert (a_done.request_id, a_done.reason) == ("a", "timeout")
    assert sched.stats().timed_out == 2


# ----------------------------------------------------------------- prefill, tokens, flushes


def test_chunked_prefill_respects_the_token_budget_across_sessions() -> None:
    clock = FakeClock()
    sched = Scheduler(config(prefill_chunk_tokens=16), num_slots=4, clock=clock)
    model = HandModel()
    sched.submit(request("a", clock, prompt_len=40))
    sched.submit(request("b", clock, prompt_len=10))
    chunks = []
    for _ in range(4):
        plan, _ = run_step(sched, model, clock)
        assert sum(c.end - c.start for c in plan.prefill) <= 16
        chunks.append([(c.request_id, c.start, c.end) for c in plan.prefill])
        if any(c.request_id == "a" and not c.is_last for c in plan.prefill):
            assert 0 not in plan.decode  # no decode before the prompt is complete
    assert chunks == [
        [("a", 0, 16)],
        [("a", 16, 32)],
        [("a", 32, 40), ("b", 0, 8)],
        [("b", 8, 10)],
    ]
    assert model.position == {"a": 2, "b": 1}  # first tokens come from the last chunks only
    assert sched.stats().prefill_tokens == 50


def test_flush_policy_first_push_waits_for_lookahead_then_thin_buffer_pushes_each_frame() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, lookahead_frames=2, clock=clock)
    model = HandModel(frames=20)
    sched.submit(request("a", clock))
    pushes: list[tuple[int, int, bool]] = []  # (tokens so far, frames, final)
    while sched.has_work:
        _, events = run_step(sched, model, clock, dt=0.0)  # frozen clock: the client buffer never drains
        pushes += [(model.position["a"], e.num_frames, e.final) for e in of_type(events, FramesReady)]
    # first after 21 tokens (1 + 2 lookahead frames); the client then holds one frame (< one regular
    # push of 2 frames), so the next frame goes at once; then every 14 tokens; the rest at the end.
    assert pushes[:4] == [(21, 3, False), (28, 1, False), (42, 2, False), (56, 2, False)]
    assert pushes[-1] == (141, 0, True)
    assert sum(n for _, n, _ in pushes) == 20


def test_pushes_grow_while_the_client_holds_a_deep_buffer() -> None:
    clock = FakeClock()
    # (no client-buffer backpressure: with a frozen clock the client would never play its buffer down)
    sched = Scheduler(config(max_client_buffer_s=1e6), num_slots=1, lookahead_frames=2, clock=clock)
    model = HandModel(frames=60)
    sched.submit(request("a", clock))
    pushes: list[int] = []
    while sched.has_work:
        _, events = run_step(sched, model, clock, dt=0.0)  # frozen clock: the buffer only grows
        pushes += [e.num_frames for e in of_type(events, FramesReady) if not e.final]
    assert sum(pushes) <= 60
    assert max(pushes) == 8  # 4x the regular 2-frame push, no more
    sent = 0
    for n in pushes:  # a push larger than the regular 2 frames only when the client holds twice it
        held = sent - 2  # audible frames before this push: all pushed frames but the decoder's lookahead
        assert n <= 3 or held >= 2 * n, (n, held)
        sent += n
    assert pushes[3:] == sorted(pushes[3:])  # with a frozen clock the buffer only grows, so pushes do too


def test_frames_go_out_exactly_once_in_order_with_several_tokens_per_step() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=2, lookahead_frames=1, clock=clock)
    sched.submit(request("a", clock, max_tokens=700))
    plan = sched.schedule()
    rng = np.random.default_rng(0)
    ids = [audio_token("a", p) for p in range(7 * 30)] + [END_OF_SPEECH, audio_token("a", 0)]
    events: list = []
    pos = 0
    while pos < len(ids) and sched.has_work:
        n = int(rng.integers(1, 12))  # an in-flight batching engine: several ids per step
        events += sched.update(plan, StepOutput(tokens={0: ids[pos : pos + n]}, elapsed_s=0.01))
        pos += n
        clock.advance(float(rng.uniform(0.0, 0.3)))
        plan = sched.schedule()
    pushes = of_type(events, FramesReady)
    assert pushes[0].num_frames >= 2  # 1 frame + 1 lookahead before the first push
    assert [p.final for p in pushes] == [False] * (len(pushes) - 1) + [True]
    np.testing.assert_array_equal(np.concatenate([p.frames for p in pushes]), expected_frames("a", 30))
    [finished] = of_type(events, SessionFinished)
    assert (finished.reason, finished.tokens, finished.frames) == ("stop", 211, 30)


def test_tokens_for_slots_outside_the_plan_and_before_the_last_chunk_are_accepted() -> None:
    clock = FakeClock()
    sched = Scheduler(config(prefill_chunk_tokens=8), num_slots=2, clock=clock)
    sched.submit(request("a", clock, prompt_len=6))
    sched.submit(request("b", clock, prompt_len=20))
    plan = sched.schedule()
    assert [(c.request_id, c.end) for c in plan.prefill] == [("a", 6), ("b", 2)]
    # An engine that schedules itself ran b's whole prompt and streams for both.
    out = StepOutput(tokens={0: [audio_token("a", 0)], 1: [audio_token("b", p) for p in range(3)]})
    sched.update(plan, out)
    assert sched.session_state("b") is SessionState.DECODING
    plan = sched.schedule()
    assert plan.prefill == [] and plan.decode == [0, 1]
    sched.update(plan, StepOutput(tokens={1: [audio_token("b", p) for p in range(3, 21)]}))
    stats = sched.stats()
    assert stats.total_tokens == 22 and stats.total_batches == 2


def test_frame_buffer_regular_pushes_and_final_remainder() -> None:
    buf = FrameBuffer(FlushPolicy(first_frames=3, every_frames=2, lookahead_frames=2))
    frames = expected_frames("x", 8)
    out = []
    for i in range(8):
        buf.add(frames[i : i + 1])
        ready = buf.take_ready()
        if ready is not None:
            out.append(ready)
    assert [len(o) for o in out] == [3, 2, 2]
    out.append(buf.take_final())
    assert [len(o) for o in out] == [3, 2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(out), frames)
    assert buf.take_final().shape == (0, 7)
    assert FlushPolicy.from_config(config(), lookahead_frames=2) == FlushPolicy(3, 2, 2)


# ----------------------------------------------------------------- policies


def test_fair_64_sessions_batch_16_bounded_first_audio_and_no_starvation() -> None:
    clock = FakeClock()
    sched = Scheduler(config(policy="fair"), num_slots=65, lookahead_frames=2, clock=clock)
    model = HandModel()  # utterances longer than the test
    prompt_len = 40
    for i in range(64):
        sched.submit(request(f"s{i}", clock, prompt_len=prompt_len))
    first_audio_step: dict[str, int] = {}
    last_step: dict[str, int] = {}
    all_have_audio_at: int | None = None
    max_gap = 0  # steps between two decodes of a session, at any time
    max_gap_steady = 0  # ... once all 64 have their first audio
    for step in range(1, 301):
        plan, events = run_step(sched, model, clock)
        assert len(plan.decode) <= 16
        for e in of_type(events, FramesReady):
            first_audio_step.setdefault(e.request_id, step)
        for slot in plan.decode:
            rid = model.slot_request[slot]
            if rid in last_step:
                max_gap = max(max_gap, step - last_step[rid])
                if all_have_audio_at is not None and last_step[rid] >= all_have_audio_at:
                    max_gap_steady = max(max_gap_steady, step - last_step[rid])
            last_step[rid] = step
        if all_have_audio_at is None and len(first_audio_step) == 64:
            all_have_audio_at = step
        if step == 150:  # a late arrival into a loaded system
            sched.submit(request("late", clock, prompt_len=prompt_len))
            late_submitted = step
    # 64 at once: admitted at 256 prompt tokens per step, then 20 boosted decode steps each, 16 per step.
    admit_steps = math.ceil(64 * prompt_len / 256)
    bound = admit_steps + math.ceil(64 * 20 / 16) + 1
    assert len(first_audio_step) == 65
    assert max(v for k, v in first_audio_step.items() if k != "late") <= bound
    # The late one: its prefill step, then 20 decode steps straight, ahead of the 64 running.
    assert first_audio_step["late"] - late_submitted == 21
    # While new sessions have the boost the others wait, never longer than the boost phase lasts;
    # after it, round robin steps each of the 65 every ceil(65 / 16) steps, 64 / 15 while "late" boosts.
    assert max_gap <= bound
    assert max_gap_steady <= math.ceil(64 / 15)
    assert all(300 - last < math.ceil(65 / 16) for last in last_step.values())


def test_deadline_ranks_new_then_whole_streams_by_deadline_then_stalled_then_far_ahead() -> None:
    from orpheus_serve.scheduler import DeadlinePolicy, Session

    policy = DeadlinePolicy(yield_s=1.0, stalled_max_wait_s=5.0)
    fp = FlushPolicy(1, 2)
    now = 50.0

    def session(rid: str, order: int, playback_end: float | None, stalls: int = 0) -> Session:
        req = SessionRequest(rid, (1,), SamplingParams(), arrival_s=float(order))
        s = Session(req, order, FrameBuffer(fp), token_limit=100)
        s.playback_end_s = playback_end
        s.first_flush_at = None if playback_end is None else 40.0
        s.stalls = stalls
        return s

    sessions = [
        session("ahead", 1, now + 3.0),
        session("stalled-old", 2, now + 0.2, stalls=1),
        session("stalled-new", 3, now + 0.1, stalls=2),
        session("soon", 4, now + 0.3),
        session("sooner", 5, now + 0.05),
        session("new", 6, None),
        session("starving", 7, now - 6.0, stalls=1),  # dry for longer than stalled_max_wait_s
    ]
    order = [s.request_id for s in policy.select(sessions, 7, now)]
    assert set(order) == {s.request_id for s in sessions}
    ranked = [s.request_id for s in policy.select(sessions, 6, now)]
    assert ranked == ["new", "starving", "sooner", "soon", "stalled-old", "stalled-new"]  # "ahead" yields
    assert [s.request_id for s in policy.select(sessions, 3, now)] == ["new", "starving", "sooner"]


def test_deadline_continuation_chunk_inherits_the_stream_deadline() -> None:
    clock = FakeClock()
    sched = Scheduler(config(policy="deadline", max_batch_size=1), num_slots=2, clock=clock)
    model = HandModel()
    # A continuation whose client still holds 10 s of audio, and a brand-new request.
    sched.submit(request("next-chunk", clock, playback_start_s=clock() - 5.0, audio_before_s=15.0))
    sched.submit(request("new", clock))
    run_step(sched, model, clock)
    decoded = []
    for _ in range(5):
        plan, _ = run_step(sched, model, clock)
        decoded += [model.slot_request[s] for s in plan.decode]
    assert decoded == ["new"] * 5  # the continuation is 10 s ahead: it yields its turn


def test_scheduler_package_imports_no_torch() -> None:
    code = (
        "import sys, orpheus_serve.scheduler, orpheus_serve.request.text; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not [m for m in sys.modules if m.startswith(('orpheus_serve.engines', 'orpheus_serve.codec', "
        "'orpheus_serve.api'))], 'engine, codec or api imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": "src"}, cwd=_root())


def _root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1])


def test_priority_events_and_stats_snapshot() -> None:
    clock = FakeClock()
    sched = Scheduler(config(policy="deadline"), num_slots=2, lookahead_frames=0, clock=clock)
    model = HandModel()
    sched.submit(request("a", clock))
    priorities = []
    for _ in range(12):
        plan, _ = run_step(sched, model, clock)
        priorities.append(plan.priority)
    assert priorities.count({0: 0.5}) == 1  # sent once, the step after the first audio
    stats = sched.stats()
    assert stats.policy == "deadline"
    assert (stats.active_sessions, stats.priority_sessions, stats.max_concurrent) == (1, 0, 2)
    assert stats.total_steps == 12 and stats.total_batches == 11 and stats.mean_batch_size == 1.0
    assert set(stats.as_dict()) >= {"total_sessions", "active_sessions", "pending_sessions", "max_concurrent"}


def test_random_traffic_with_cancels_and_timeouts_keeps_every_invariant() -> None:
    from orpheus_serve.config import SimConfig
    from orpheus_serve.engines.sim_engine import SimEngine

    clock = FakeClock()
    cfg = config(max_batch_size=6, prefill_chunk_tokens=64, max_queue=5, session_timeout_s=2.0, policy="deadline")
    sched = Scheduler(cfg, num_slots=8, lookahead_frames=1, clock=clock)
    engine = SimEngine(8, 4096, SimConfig(realtime=False), clock_advance=clock.advance)
    rng = np.random.default_rng(5)
    submitted: set[str] = set()
    finished: dict[str, SessionFinished] = {}
    frames: dict[str, int] = {}
    finals: set[str] = set()
    for step in range(600):
        if rng.random() < 0.3:
            rid = f"r{step}"
            try:
                sched.submit(request(rid, clock, prompt_len=int(rng.integers(5, 150)), max_tokens=7 * 16))
                submitted.add(rid)
            except SchedulerFullError:
                pass
        if submitted and rng.random() < 0.05:
            sched.cancel(sorted(submitted)[int(rng.integers(len(submitted)))])
        plan = sched.schedule()
        assert not set(plan.decode) & {c.slot for c in plan.prefill}
        assert len(plan.decode) <= 6 and sum(c.end - c.start for c in plan.prefill) <= 64
        out = engine.step(plan)
        assert out.failed == {}, out.failed  # the scheduler never sends the engine an invalid plan
        for e in sched.update(plan, out):
            assert e.request_id in submitted and e.request_id not in finished  # nothing after the end
            if isinstance(e, FramesReady):
                assert e.request_id not in finals
                frames[e.request_id] = frames.get(e.request_id, 0) + e.num_frames
                if e.final:
                    finals.add(e.request_id)
            elif isinstance(e, SessionFinished):
                finished[e.request_id] = e
                assert e.frames == frames.get(e.request_id, 0)
                assert (e.request_id in finals) == (e.reason in ("stop", "length"))
        clock.advance(0.002)
    while sched.has_work:
        for rid in list(submitted - set(finished)):
            sched.cancel(rid)
        plan = sched.schedule()
        for e in sched.update(plan, engine.step(plan)):
            if isinstance(e, SessionFinished):
                finished[e.request_id] = e
    assert set(finished) == submitted
    reasons = {e.reason for e in finished.values()}
    assert {"stop", "cancelled", "timeout"} <= reasons
    stats = sched.stats()
    assert (stats.used_slots, stats.active_sessions, stats.pending_sessions) == (0, 0, 0)
    assert stats.finished + stats.cancelled + stats.timed_out == len(submitted)


# ----------------------------------------------------------------- custom voices (LoRA adapters)


def test_a_session_on_a_new_adapter_waits_for_a_pool_entry_instead_of_failing() -> None:
    """max_adapters distinct adapters run at once; a session on another one stays queued until a session ends
    and the engine has released that session's slot (and with it the adapter's pin), then it starts."""
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=8, clock=clock, max_adapters=2)
    model = HandModel(frames=2)
    for rid, adapter in [("a", "v1"), ("b", "v2"), ("c", "v3"), ("d", "v1"), ("e", None)]:
        sched.submit(request(rid, clock, adapter=adapter))
    plan, _ = run_step(sched, model, clock)
    # v3 waits; a second v1 session and a base-model one do not.
    assert [c.request_id for c in plan.prefill] == ["a", "b", "d", "e"]
    assert sched.session_state("c") is SessionState.WAITING
    ended: list[str] = []
    while "a" not in ended:
        plan, events = run_step(sched, model, clock)
        ended += [e.request_id for e in of_type(events, SessionFinished)]
        if "b" not in ended:
            assert sched.session_state("c") is SessionState.WAITING, ended
    # Every session started together, so all have ended now (v1 twice, v2): c is admitted, but only in a plan
    # after the one that releases their slots.
    assert set(ended) == {"a", "b", "d", "e"}
    plan = sched.schedule()
    assert sorted(plan.release) == [0, 1, 2, 3] and not plan.prefill
    sched.update(plan, model.step(plan))
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefill] == ["c"]
    assert sched.stats().adapter_waits > 0


def test_without_an_adapter_limit_every_session_is_admitted() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=8, clock=clock)
    for rid in "abcd":
        sched.submit(request(rid, clock, adapter=f"voice-{rid}"))
    assert [c.request_id for c in sched.schedule().prefill] == list("abcd")
