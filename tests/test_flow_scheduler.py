"""Flow control in the scheduler, on CPU with hand-built outputs and a fake clock (ARCHITECTURE §5a):
the capacity measure, capacity-aware admission, backpressure from codec and client, first push
sizing. No threads, no model."""

from __future__ import annotations

import itertools
import math

import pytest

from orpheus_serve.scheduler import FramesReady, Scheduler, SessionState
from orpheus_serve.scheduler.capacity import CapacityModel
from orpheus_serve.scheduler.errors import SchedulerFullError
from orpheus_serve.scheduler.flow import FlowControl
from orpheus_serve.scheduler.flush import FlushPolicy, FrameBuffer
from orpheus_serve.scheduler.session import Session
from orpheus_serve.token_format import FRAME_SECONDS, SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from tests.test_scheduler import FakeClock, HandModel, config, of_type, request

A_MS, B_MS = 4.0, 0.05  # a known engine cost: step_ms = 4 + 0.05 * batch


def realtime_streams(a_ms: float, b_ms: float, headroom: float) -> int:
    """The analytic answer: the most n with 7 * step(n) * (1 + headroom) <= one frame."""
    budget_ms = FRAME_SECONDS * 1000 / TOKENS_PER_FRAME / (1 + headroom)
    return math.floor((budget_ms - a_ms) / b_ms)


def feed_engine(model: CapacityModel, streams: int, clock: FakeClock, seconds: float = 1.0) -> None:
    """Hold `streams` streams for `seconds`, every one decoded each step, at the known cost."""
    end = clock() + seconds
    while clock() < end:
        step_s = (A_MS + B_MS * streams) / 1000
        clock.advance(step_s)
        model.observe_step(streams, streams * 200, 0, step_s, streams=streams, now=clock())


def feed_codec(model: CapacityModel, passes: int = 40) -> None:
    for i in range(passes):  # a fast codec: 1 ms + 0.05 ms per frame, passes of 1..40 frames
        frames = 1 + i % 40
        model.observe_codec_pass(frames, (1.0 + 0.05 * frames) / 1000)


# ------------------------------------------------------------------ the capacity measure


def test_capacity_converges_to_the_analytic_bound_as_load_ramps() -> None:
    clock = FakeClock()
    model = CapacityModel(max_batch=512, max_frames_per_pass=64, headroom=0.15)
    feed_codec(model)
    expected = realtime_streams(A_MS, B_MS, 0.15)
    assert expected == 132
    # Cold: nothing measured, a few streams at most.
    assert model.estimate(mean_context=200, streams=0, limit=512).max_streams == model.probe_min
    allowed = []
    load = 1
    for _ in range(20):  # admission as a server does it: hold what is allowed, measure, allow more
        feed_engine(model, load, clock)
        load = model.estimate(mean_context=200, streams=load, limit=512).max_streams
        allowed.append(load)
    assert allowed == sorted(allowed)  # grows by at most the probe factor per settled load
    assert all(b <= math.floor(a * model.probe_factor) + 1 for a, b in itertools.pairwise(allowed))
    final = model.estimate(mean_context=200, streams=load, limit=512)
    assert abs(final.max_streams - expected) <= 2, (final, expected)
    assert final.engine_streams is not None and abs(final.engine_streams - expected) <= 2


def test_a_slow_codec_bounds_capacity() -> None:
    clock = FakeClock()
    model = CapacityModel(max_batch=512, max_frames_per_pass=64, headroom=0.0)
    for streams in (4, 6, 9, 14, 21, 32, 48, 72, 108):
        feed_engine(model, streams, clock)
    for i in range(40):  # 20 ms per frame, as SNAC on a small CPU: ~50 frames/s, ~4 real-time streams
        frames = 1 + i % 8
        model.observe_codec_pass(frames, 0.020 * frames)
    estimate = model.estimate(mean_context=200, streams=4, limit=512)
    assert estimate.codec_streams == math.floor(50 * FRAME_SECONDS)  # 4
    assert estimate.max_streams == estimate.codec_streams


def _capacity_under_noise(slow_steps: set[int], extra_ms: float) -> int:
    """Capacity measured at 60 to 100 streams with `extra_ms` added to the steps whose index (mod 70) is
    in `slow_steps`: the same total delay per 70 steps, spread or bunched. The margin is the measured one
    (no floor): twice the jitter."""
    clock = FakeClock()
    model = CapacityModel(max_batch=512, max_frames_per_pass=64, margin_floor=0.0)
    feed_codec(model)
    for streams in (4, 6, 9, 14, 21, 32, 48, 72, 100):
        feed_engine(model, streams, clock, seconds=0.6)
    for i in range(2100):  # the load moves between 60 and 100 streams, so the fit keeps its slope
        streams = 100 if i // 70 % 2 else 60
        step_s = (A_MS + B_MS * streams + (extra_ms if i % 70 in slow_steps else 0.0)) / 1000
        clock.advance(step_s)
        model.observe_step(streams, streams * 200, 0, step_s, streams=streams, now=clock())
    estimate = model.estimate(mean_context=200, streams=100, limit=512)
    assert estimate.engine_streams is not None
    return estimate.engine_streams


def test_lone_slow_steps_cost_less_capacity_than_a_run_of_them() -> None:
    """A stream needs 7 steps per frame: one slow step among them is made up by the others, seven in a
    row are not. Admission plans with the jitter of 7-step means, not of single steps."""
    spread = _capacity_under_noise({0, 10, 20, 30, 40, 50, 60}, extra_ms=4.0)  # one in each 7-step frame
    bunched = _capacity_under_noise({0, 1, 2, 3, 4, 5, 6}, extra_ms=4.0)  # all in one frame
    quiet = _capacity_under_noise(set(), extra_ms=0.0)
    assert quiet == realtime_streams(A_MS, B_MS, 0.0)  # 163
    # (Measured: 145 and 124 with a margin of twice the jitter; with single-step jitter both would be lower.)
    assert bunched + 5 <= spread < quiet
    assert spread >= quiet - 24  # the mean delay, 0.4 ms per step, costs 8; twice its spread about as much again


def test_the_admission_margin_follows_the_measured_spread_and_never_goes_under_the_floor() -> None:
    """engine margin = max(floor, 2 * jitter / predicted period), codec margin the same over passes; a fixed
    `headroom` replaces both."""
    def measured(noise_ms: float, codec_noise_ms: float, **kw: float) -> tuple[float, float, int]:
        clock = FakeClock()
        model = CapacityModel(max_batch=512, max_frames_per_pass=64, **kw)
        for i in range(400):
            frames = 1 + i % 40
            model.observe_codec_pass(frames, (1.0 + 0.05 * frames + (codec_noise_ms if i % 2 else 0.0)) / 1000)
        for streams in (4, 6, 9, 14, 21, 32, 48, 72, 100):
            feed_engine(model, streams, clock, seconds=0.6)
        for i in range(2100):  # runs of five frames (35 steps) of slow and fast periods, at 60 and 100 streams
            streams = 100 if i // 70 % 2 else 60
            step_s = (A_MS + B_MS * streams + (noise_ms if i // 35 % 2 else 0.0)) / 1000
            clock.advance(step_s)
            model.observe_step(streams, streams * 200, 0, step_s, streams=streams, now=clock())
        estimate = model.estimate(mean_context=200, streams=100, limit=512)
        assert estimate.engine_margin is not None and estimate.codec_margin is not None
        assert estimate.engine_streams is not None
        return estimate.engine_margin, estimate.codec_margin, estimate.engine_streams

    quiet_engine, quiet_codec, quiet_streams = measured(0.0, 0.0)
    assert (quiet_engine, quiet_codec) == (0.05, 0.05)  # no spread: the floor
    assert quiet_streams == realtime_streams(A_MS, B_MS, 0.05)
    noisy_engine, noisy_codec, noisy_streams = measured(2.0, 1.0)
    # Runs of frames alternate +0 / +2 ms a step around a fit that splits the difference: a jitter of ~1 ms on
    # a ~10 ms predicted period, so a margin near 2 * 1 / 10; passes alternate +-0.5 ms on ~2 ms.
    assert 0.12 < noisy_engine < 0.35, noisy_engine
    assert noisy_codec > 0.2, noisy_codec
    assert noisy_streams < quiet_streams
    assert measured(2.0, 1.0, margin_floor=1.0)[:2] == (1.0, 1.0)  # a floor over the measured margin binds
    assert measured(2.0, 1.0, headroom=0.1)[:2] == (0.1, 0.1)  # a fixed margin replaces the measured one


def test_never_below_one_stream() -> None:
    clock = FakeClock()
    model = CapacityModel(max_batch=16, max_frames_per_pass=64)
    feed_codec(model)
    for _ in range(3):
        end = clock() + 1.0
        while clock() < end:
            clock.advance(0.2)
            model.observe_step(1, 100, 0, 0.2, streams=1, now=clock())  # 200 ms a token: far from real time
    assert model.estimate(mean_context=100, streams=1, limit=16).max_streams == 1


# ------------------------------------------------------------------ admission


def measured_scheduler(clock: FakeClock, capacity_streams: int, **kw) -> Scheduler:
    """A scheduler with delivery feedback whose capacity measure has settled at `capacity_streams`."""
    sched = Scheduler(config(admission_headroom=0.0, **kw), num_slots=64, lookahead_frames=0,
                      clock=clock, delivery_feedback=True)
    budget_ms = FRAME_SECONDS * 1000 / TOKENS_PER_FRAME
    b_ms = (budget_ms - A_MS) / (capacity_streams + 0.5)  # exactly `capacity_streams` fit
    model = sched.capacity_model  # the measure is fed as the engine core would, without a model running
    for streams in (4, 6, 9, 14, 21, 32, 48):
        end = clock() + 1.0
        while clock() < end:
            step_s = (A_MS + b_ms * streams) / 1000
            clock.advance(step_s)
            model.observe_step(streams, 0, 0, step_s, streams=streams, now=clock())
    feed_codec(model)
    return sched


def test_admission_queues_new_sessions_past_measured_capacity() -> None:
    clock = FakeClock()
    sched = measured_scheduler(clock, capacity_streams=6)
    for i in range(10):
        sched.submit(request(f"s{i}", clock))
    sched.schedule()
    stats = sched.stats()
    assert (stats.active_sessions, stats.pending_sessions) == (6, 4)  # slots are free, capacity is not
    flow = sched.flow_stats()
    assert flow.capacity_streams == 6 and not flow.admission_open and flow.admission_waits >= 4
    # A continuation of a stream already playing is not a new stream: it goes in (here while the
    # stream's first chunk still holds its slot; normally that chunk has just finished).
    sched.submit(request("s0-next", clock, playback_start_s=clock(), audio_before_s=1.0))
    sched.schedule()
    assert sched.session_state("s0-next") is SessionState.PREFILLING
    assert sched.stats().active_sessions == 7
    # Streams end: the waiting ones take their places, up to the capacity again.
    sched.cancel("s0")
    sched.cancel("s1")
    sched.schedule()
    assert sched.stats().active_sessions == 6 and sched.stats().pending_sessions == 3


def test_reject_mode_refuses_at_once_with_a_retry_hint() -> None:
    clock = FakeClock()
    sched = measured_scheduler(clock, capacity_streams=6, admission="reject")
    for i in range(6):
        sched.submit(request(f"s{i}", clock))
    sched.schedule()
    with pytest.raises(SchedulerFullError) as refused:
        sched.submit(request("s6", clock))
    assert refused.value.retry_after_s > 0
    assert "capacity" in str(refused.value)
    assert sched.stats().rejected == 1 and sched.stats().pending_sessions == 0
    # The refusal reaches admission as demand it did not meet (tests/test_lead_admission.py: it lets the limit grow).
    assert sched.flow_stats().refused_requests == 1


@pytest.mark.parametrize("admission", ["queue", "reject"])
def test_a_gateway_that_lags_closes_admission_until_it_catches_up(admission: str) -> None:
    """The engine has room, but an API process's event loop runs late: its sockets would get the audio
    late, so no new stream goes in (queued or refused) until it catches up; a silent one is forgotten."""
    clock = FakeClock()
    sched = measured_scheduler(clock, capacity_streams=6, admission=admission, max_gateway_lag_ms=150.0)
    for i in range(2):
        sched.submit(request(f"s{i}", clock))
    sched.schedule()
    sched.note_gateway_lag(0, 0.010)
    sched.note_gateway_lag(1, 0.400)  # the second API process is starved
    flow = sched.flow_stats()
    assert flow.gateway_lag_ms == 400.0 and not flow.admission_open and flow.capacity_streams == 2
    if admission == "reject":
        with pytest.raises(SchedulerFullError):
            sched.submit(request("s2", clock))
    else:
        sched.submit(request("s2", clock))
        sched.schedule()
        assert sched.session_state("s2") is SessionState.WAITING
    # It catches up: admission opens again.
    sched.note_gateway_lag(1, 0.020)
    assert sched.flow_stats().admission_open
    sched.submit(request("s3", clock))
    sched.schedule()
    assert sched.session_state("s3") is SessionState.PREFILLING
    # A report from an API process that has since gone silent stops counting after a while.
    sched.note_gateway_lag(1, 0.900)
    assert not sched.flow_stats().admission_open
    clock.advance(1.0)
    sched.note_gateway_lag(0, 0.010)
    clock.advance(1.5)
    sched.note_gateway_lag(0, 0.010)
    sched.schedule()
    assert sched.flow_stats().admission_open and sched.flow_stats().gateway_lag_ms == 10.0


def _flow_with_sessions(generated: list[int], typical: int) -> tuple[FlowControl, list[Session]]:
    cfg = config()
    policy = FlushPolicy.from_config(cfg)
    flow = FlowControl(cfg, flush_policy=policy, batch_limit=16, num_slots=64, lookahead_samples=0, feedback=True,
                       max_frames_per_pass=64, max_pass_s=None)
    clock = FakeClock()
    done = Session(request=request("done", clock, prompt_len=40), order=0, buffer=FrameBuffer(policy),
                   token_limit=1400, generated=typical)
    flow.finished(done)  # one finished session: streams run `typical` tokens
    sessions = [Session(request=request(f"s{i}", clock, prompt_len=40), order=i + 1, buffer=FrameBuffer(policy),
                        token_limit=1400, generated=g) for i, g in enumerate(generated)]
    return flow, sessions


def test_admission_plans_with_the_context_streams_admitted_together_will_reach() -> None:
    """Ten streams admitted at once all grow to 40 + 330 tokens together: admission plans with that peak.
    Ten of every age (steady state): old ones end as young ones grow, the total never exceeds today's."""
    burst, young = _flow_with_sessions([0] * 10, typical=330)
    assert burst.planning_context(young) == pytest.approx(40 + 330)
    steady, staggered = _flow_with_sessions([33 * i for i in range(10)], typical=330)
    # The peak is 33 tokens on, just before the oldest ends: today's mean (188.5) plus one spacing.
    assert steady.planning_context(staggered) == pytest.approx(40 + 33 * 4.5 + 33)
    # Half young, half near their end: the old ones' last 30 tokens outweigh the young ones' growth.
    mixed, sessions = _flow_with_sessions([0] * 5 + [300] * 5, typical=330)
    assert mixed.planning_context(sessions) == pytest.approx((5 * 70 + 5 * 370) / 10)
    mixed, sessions = _flow_with_sessions([0] * 8 + [300] * 2, typical=330)  # mostly young: their end
    assert mixed.planning_context(sessions) == pytest.approx((8 * 370) / 10)
    # A stream past the typical length is expected to end now, not to grow without bound.
    _, long_ones = _flow_with_sessions([500] * 4, typical=330)
    assert burst.planning_context(long_ones) == pytest.approx(540)


# ------------------------------------------------------------------ backpressure


def run(sched: Scheduler, model: HandModel, clock: FakeClock, dt: float = 0.001):
    plan = sched.schedule()
    out = model.step(plan)
    clock.advance(dt)
    return plan, sched.update(plan, out)


def test_codec_backlog_holds_a_session_back_until_frames_are_decoded() -> None:
    clock = FakeClock()
    sched = Scheduler(config(max_undecoded_frames=4, flush_every_n_tokens=7), num_slots=2, lookahead_frames=0,
                      clock=clock, delivery_feedback=True)
    model = HandModel(frames=None)
    sched.submit(request("a", clock))
    pushed = 0
    decoded_slots: list[int] = []
    for _ in range(200):  # the codec never answers
        plan, events = run(sched, model, clock)
        decoded_slots += plan.decode
        pushed += sum(e.num_frames for e in of_type(events, FramesReady))
    flow = sched.flow_stats()
    assert flow.peak_undecoded_frames == 4 == flow.max_undecoded_frames
    assert flow.paused_codec == 1 and flow.backpressure_skips > 150
    assert model.position["a"] == 4 * TOKENS_PER_FRAME  # not one token more than the bound allows
    # The codec catches up: the session goes on.
    sched.note_decoded("a", pushed, pushed * SAMPLES_PER_FRAME)
    plan, _ = run(sched, model, clock)
    assert plan.decode == [0]


def test_client_buffer_and_slow_reader_hold_a_session_back() -> None:
    clock = FakeClock()
    sched = Scheduler(config(max_client_buffer_s=1.0, max_server_buffer_s=0.5), num_slots=2,
                      lookahead_frames=0, clock=clock, delivery_feedback=True)
    model = HandModel(frames=None)
    sched.submit(request("a", clock))
    run(sched, model, clock)
    # The client took 2 s of audio at once: it holds more than max_client_buffer_s.
    sched.note_decoded("a", 0, 2 * SAMPLE_RATE)
    sched.note_delivered("a", 2 * SAMPLE_RATE)
    plan, _ = run(sched, model, clock)
    assert plan.decode == [] and sched.flow_stats().paused_client_buffer == 1
    clock.advance(1.1)  # it played 1.1 s: 0.9 s left, under the bound
    plan, _ = run(sched, model, clock)
    assert plan.decode == [0]
    # The codec made 1 s of audio its socket has not taken: a slow reader, held back, not counted as demand.
    sched.note_decoded("a", 0, SAMPLE_RATE)
    plan, _ = run(sched, model, clock)
    flow = sched.flow_stats()
    assert plan.decode == [] and flow.paused_server_buffer == 1 and flow.demand_streams == 0
    sched.note_delivered("a", SAMPLE_RATE)
    clock.advance(1.5)
    plan, _ = run(sched, model, clock)
    assert plan.decode == [0]


def test_deadline_follows_delivered_audio_not_generated_frames() -> None:
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=1, lookahead_frames=0, clock=clock, delivery_feedback=True)
    model = HandModel(frames=None)
    sched.submit(request("a", clock))
    for _ in range(60):
        run(sched, model, clock)
    session = sched._admitted["a"]
    assert session.buffer.flushed_frames >= 6
    assert session.playback_end_s is None  # frames went to the codec, but nothing reached the client
    sched.note_delivered("a", SAMPLES_PER_FRAME)
    assert session.playback_end_s == pytest.approx(clock() + FRAME_SECONDS)


# ------------------------------------------------------------------ first push sizing


@pytest.mark.parametrize(("step_ms", "codec_ms", "expected"), [(1.0, 1.0, 3), (10.0, 20.0, 5)])
def test_first_push_covers_the_wait_for_the_next_frame(step_ms: float, codec_ms: float, expected: int) -> None:
    """The stateful decoder's 4757-sample lookahead: 3 frames give 1387 audible samples (58 ms). At 1 ms
    a step that covers the next frame; at 10 ms a step plus 20 ms passes the first push must wait for
    1.5 x (7 x 10 + 2 x 20) ms = 165 ms of audio: ceil((3960 + 4757) / 2048) = 5 frames."""
    clock = FakeClock()
    sched = Scheduler(config(), num_slots=4, lookahead_frames=2, lookahead_samples=4757, clock=clock,
                      delivery_feedback=True)
    for _ in range(20):
        clock.advance(step_ms / 1000)
        sched.capacity_model.observe_step(1, 100, 0, step_ms / 1000, streams=1, now=clock())
        sched.capacity_model.observe_codec_pass(3, codec_ms / 1000)
    model = HandModel(frames=None)
    sched.submit(request("a", clock))
    first = None
    for _ in range(100):
        _, events = run(sched, model, clock)
        pushes = of_type(events, FramesReady)
        if pushes:
            first = pushes[0]
            break
    assert first is not None and first.num_frames == expected
    assert sched.flow_stats().first_push_frames_last == expected
    audible_ms = (expected * SAMPLES_PER_FRAME - 4757) / SAMPLE_RATE * 1000
    assert audible_ms >= 1.5 * (7 * step_ms + 2 * codec_ms) or expected == 3


def test_codec_capacity_counts_the_passes_the_worker_will_really_run() -> None:
    """SNAC on a small CPU: 20 ms a pass plus 19 ms a frame. Passes kept within 100 ms hold 4 frames
    (41.7 frames/s: 3 real-time streams); unbounded 64-frame passes would amortise the 20 ms (4 streams)."""
    short = CapacityModel(max_batch=16, max_frames_per_pass=64, max_pass_s=0.1, headroom=0.0)
    long = CapacityModel(max_batch=16, max_frames_per_pass=64, headroom=0.0)
    for model in (short, long):
        for i in range(40):
            frames = 1 + i % 5
            model.observe_codec_pass(frames, 0.020 + 0.019 * frames)
    assert short.estimate(mean_context=100, streams=1, limit=16).codec_streams == 3
    assert long.estimate(mean_context=100, streams=1, limit=16).codec_streams == 4


def test_a_finished_stream_counts_as_demand_until_the_codec_has_its_last_frames() -> None:
    clock = FakeClock()
    sched = measured_scheduler(clock, capacity_streams=1)
    model = HandModel(frames=3)  # ends after 3 frames
    sched.submit(request("a", clock))
    sched.submit(request("b", clock))
    finished = None
    for _ in range(40):
        _, events = run(sched, model, clock)
        finished = finished or next((e for e in of_type(events, FramesReady) if e.final), None)
        if finished:
            break
    assert finished is not None and sched.stats().active_sessions == 0
    flow = sched.flow_stats()
    assert flow.draining_streams == 1 and flow.demand_streams == 1
    sched.schedule()
    assert sched.session_state("b") is SessionState.WAITING  # the codec is still busy with "a"
    sched.note_decoded("a", 3, 3 * SAMPLES_PER_FRAME, final=True)
    sched.schedule()
    assert sched.session_state("b") is SessionState.PREFILLING
    assert sched.flow_stats().draining_streams == 0


@pytest.mark.parametrize("refusing", [True, False])
def test_refusals_reach_the_playing_streams_admission_as_demand(refusing: bool) -> None:
    """`admission: reject` refuses at the limit, so its streams sit under it (streams end, the refused never
    arrive) and never fill it: the refusals must reach the leads' controller through FlowControl, or a refusing
    server never grows. Streams produce 1.5x real time throughout."""
    from tests.test_lead_admission import streams

    cfg = config(admission="reject")
    flow = FlowControl(cfg, flush_policy=FlushPolicy.from_config(cfg), batch_limit=16, num_slots=64,
                       lookahead_samples=0, feedback=True, max_frames_per_pass=64, max_pass_s=None)
    clock = FakeClock()
    sessions = streams(clock, 30)
    step = 0

    def play(playing: list, seconds: float, refuse: bool) -> list[int]:
        nonlocal step
        limits = []
        for _ in range(round(seconds / 0.01)):
            clock.advance(0.01)
            step += 1
            for s in playing:
                s.generated += round(1.5 * 82.03 * 0.01)
                s.playback_end_s = clock() + 1.0
            if refuse:
                flow.admission_refused()
            limits.append(flow.admission_limit(playing, step, clock()))
        return limits

    risen = max(play(sessions, 1.5, refuse=False))  # 30 streams fill the limit: it rises past them
    assert risen > 30, risen
    after = play(sessions[:29], 2.0, refuse=refusing)  # now under it, with or without refused requests
    assert flow.stats(sessions[:29], clock(), step).refused_requests == (len(after) if refusing else 0)
    if refusing:
        assert max(after) > risen, (risen, max(after))
    else:
        assert max(after) == risen, (risen, max(after))
