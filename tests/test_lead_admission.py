"""Admission from the playing streams' production and leads (scheduler/leads.py, ARCHITECTURE §5a), on CPU
with hand-driven sessions and a fake clock: streams that keep real time open admission, streams that fall
behind close it or back it off, and a prediction never holds the limit under what is being served well."""

from __future__ import annotations

import itertools
import math

from orpheus_serve.scheduler.flush import FlushPolicy, FrameBuffer
from orpheus_serve.scheduler.leads import GROW_EVERY_S, GROW_FACTOR, TICK_S, WINDOW_S, LeadAdmission
from orpheus_serve.scheduler.session import Session, SessionState
from orpheus_serve.token_format import TOKENS_PER_SECOND_REALTIME
from tests.test_scheduler import FakeClock, request

MARGIN = 0.05


def streams(clock: FakeClock, n: int, *, prefix: str = "s") -> list[Session]:
    """`n` decoding sessions whose first audio went out now, their clients holding 200 ms."""
    policy = FlushPolicy(first_frames=3, every_frames=2)
    out = []
    for i in range(n):
        s = Session(request=request(f"{prefix}{i}", clock, prompt_len=20), order=i, buffer=FrameBuffer(policy),
                    token_limit=100_000)
        s.state = SessionState.DECODING
        s.first_flush_at = clock()
        s.playback_end_s = clock() + 0.2
        out.append(s)
    return out


def play(clock: FakeClock, sessions: list[Session], seconds: float, rate: float | list[float],
         admission: LeadAdmission, *, model_limit: int, slots: int = 512,
         codec_busy: float | None = None) -> list[int]:
    """Advance `seconds` with each session producing `rate` x real time (one rate, or one per session): its
    client's lead moves by rate - 1 per second, capped at 3 s, and a client that runs dry stalls. The limit is
    asked for every 10 ms; returns the limits seen."""
    rates = rate if isinstance(rate, list) else [rate] * len(sessions)
    owed = dict.fromkeys(range(len(sessions)), 0.0)
    seen = []
    dt = 0.01
    for _ in range(round(seconds / dt)):
        clock.advance(dt)
        for i, (s, r) in enumerate(zip(sessions, rates, strict=True)):
            owed[i] += r * TOKENS_PER_SECOND_REALTIME * dt
            whole = int(owed[i])
            s.generated += whole
            owed[i] -= whole
            lead = s.playback_end_s - clock() + r * dt  # audio arrives as fast as it is produced
            if lead <= 0:
                s.stalls += 1
                lead = 0.05
            s.playback_end_s = clock() + min(lead, 3.0)
        seen.append(admission.update(clock(), sessions, demand=len(sessions), model_limit=model_limit, slots=slots,
                                     codec_busy=codec_busy))
    return seen


def controller() -> LeadAdmission:
    return LeadAdmission(margin=MARGIN, max_client_buffer_s=3.0, max_server_buffer_s=2.0)


def test_a_cold_server_follows_the_prediction_until_streams_can_be_read() -> None:
    clock = FakeClock()
    admission = controller()
    assert admission.update(clock(), [], demand=0, model_limit=6, slots=64) == 6
    assert admission.reason == "model"
    young = streams(clock, 6)
    # Streams younger than half a second are not read: the prediction still rules.
    limits = play(clock, young, 0.3, 1.5, admission, model_limit=6)
    assert set(limits) == {6} and admission.reason == "model"


def test_healthy_streams_open_admission_past_a_pessimistic_prediction() -> None:
    # The H200's failure: the cost model predicted 1-3 streams while the card served ten times that. Streams
    # producing 1.8x real time must raise the limit however low the prediction, a step at a time.
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 10)
    limits = play(clock, sessions, 3.0, 1.8, admission, model_limit=1)
    assert admission.reason == "lead"
    # At the first reading the limit jumps to the ten streams keeping real time, then rises past them, at most
    # GROW_FACTOR at a time and at most every GROW_EVERY_S, while they fill it.
    rises = [(a, b) for a, b in itertools.pairwise(limits) if b > a]
    assert rises[0] == (1, 10), rises
    assert len(rises) >= 2 and all(b <= math.ceil(a * GROW_FACTOR) for a, b in rises[1:]), rises
    assert len(rises) <= 3.0 / GROW_EVERY_S + 1
    assert limits[-1] > 10, limits[-1]
    assert min(limits[round(1.0 / 0.01):]) >= 10


def test_the_rise_follows_the_measured_spare_pace() -> None:
    # 20 streams at 1.19x real time with a 5% margin: the engine has room for 20 * 1.19 / 1.05 = 22.7, so the
    # limit rises to 22, neither the one more of a blind step (21) nor a plain GROW_FACTOR rise (25).
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 20)
    admission.update(clock(), sessions, demand=20, model_limit=20, slots=512)
    limits = play(clock, sessions, WINDOW_S + 1.2, 1.19, admission, model_limit=20)
    assert max(limits) == 22 and admission.limit == 22, max(limits)


def test_falling_streams_close_admission_and_back_it_off() -> None:
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 40)
    play(clock, sessions, 1.5, 1.5, admission, model_limit=40)
    high = admission.limit
    assert high is not None and high >= 40
    # The pipeline slows to 0.9x real time. The clients hold almost a second (built at 1.5x): admission
    # holds while that lead lasts the horizon, then backs off below what runs (fewer are admitted as streams
    # end), by about the measured shortfall, once per window.
    limits = play(clock, sessions, 1.0, 0.9, admission, model_limit=500)
    assert min(limits) >= 40, min(limits)  # a lead in hand: not yet
    limits = play(clock, sessions, 5.0, 0.9, admission, model_limit=500)
    assert admission.reason == "lead"
    # By the shortfall (40 * 0.9 / 1.05 = 34.3), not a fixed share (95% would leave 38), and not twice over.
    low = min(limits)
    assert math.floor(40 * 0.9 / (1 + MARGIN)) - 1 <= low <= math.floor(40 * 0.9 / (1 + MARGIN)), limits
    backs = sum(1 for a, b in itertools.pairwise(limits) if b < a)
    assert backs <= 5.0 / WINDOW_S + 1


def test_a_few_slow_streams_hold_admission_without_backing_off() -> None:
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 50)
    play(clock, sessions, 1.0, 1.5, admission, model_limit=50)
    before = admission.limit
    assert before is not None and before >= 50
    # Two streams in fifty fall (4%: past the 3% growth allows, under the 5% of a back-off): nobody more is
    # admitted, nobody is backed off.
    limits = play(clock, sessions, 1.5, [1.5] * 48 + [0.5] * 2, admission, model_limit=500)
    assert admission.last is not None and admission.last.falling == 2
    assert min(limits[round(WINDOW_S / 0.01):]) >= 50
    assert max(limits[round(WINDOW_S / 0.01):]) <= max(before, 50)


def test_clients_with_full_buffers_count_as_keeping_real_time() -> None:
    # Flow control holds back a stream whose client holds max_client_buffer_s: it produces nothing then, and
    # is ahead, not falling.
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 8)
    play(clock, sessions, 1.0, 1.5, admission, model_limit=8)
    for s in sessions:
        s.playback_end_s = clock() + 2.9
    clock.advance(TICK_S)
    admission.update(clock(), sessions, demand=8, model_limit=8, slots=64)
    assert admission.last is not None
    assert admission.last.ahead == 8 and admission.last.falling == 0


def test_a_stall_counts_as_falling() -> None:
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 4)
    play(clock, sessions, 1.0, 2.0, admission, model_limit=4)
    sessions[0].stalls += 1
    clock.advance(TICK_S)
    admission.update(clock(), sessions, demand=4, model_limit=4, slots=64)
    assert admission.last is not None and admission.last.falling == 1


def test_a_full_codec_holds_and_backs_off_admission_whatever_the_engine_produces() -> None:
    # The codec holds a stream back only once its backlog is a second deep; its busy share says so at once.
    # Twenty streams produced at 3x real time (the engine has room for 57): the codec decides.
    for busy, expect in ((0.4, "grow"), (0.9, "hold"), (1.0, "back off")):
        clock = FakeClock()
        admission = controller()
        sessions = streams(clock, 20)
        admission.update(clock(), sessions, demand=20, model_limit=20, slots=512)
        limits = play(clock, sessions, 1.6, 3.0, admission, model_limit=20, codec_busy=busy)
        assert admission.last is not None and admission.last.codec_busy == busy and admission.last.falling == 0
        if expect == "grow":  # towards the codec's spare time, 20 * 0.8 / 0.4 = 40, not the engine's 57
            grown = math.ceil(20 * GROW_FACTOR)  # at most GROW_FACTOR at a time, and 20 fill no more than 20
            assert max(limits) == grown and admission.limit == grown, max(limits)
        elif expect == "hold":
            assert set(limits) == {20}
        else:  # to 20 * 0.8 / 1.0, though every stream keeps real time: a codec past its back-off is over
            # capacity whatever the leads still hide, so the streams keeping real time are no floor
            backed = limits.index(16)
            assert min(limits) == 16 and max(limits[backed:]) == 16, limits


def test_a_full_codec_holds_admission_while_no_stream_is_old_enough_to_read() -> None:
    # A CPU host's short utterances: every stream is younger than MIN_AGE_S for much of its life, so the readings
    # have nobody to read and the prediction rules, while SNAC runs back to back. The codec's busy share is a
    # reading of its own: the prediction may not raise the limit past a busy codec, and a full one backs it off.
    clock = FakeClock()
    admission = controller()
    assert admission.update(clock(), [], demand=0, model_limit=6, slots=64) == 6
    young = streams(clock, 6)
    held = play(clock, young, 0.3, 1.5, admission, model_limit=12, codec_busy=0.9)
    assert set(held) == {6} and admission.reason == "codec" and admission.last.playing == 0
    backed = play(clock, streams(clock, 6, prefix="y"), 0.3, 1.5, admission, model_limit=12, codec_busy=1.0)
    assert min(backed) == math.floor(6 * 0.8 / 1.0) and admission.reason == "codec", backed
    # An idle codec: the prediction rules again.
    assert play(clock, streams(clock, 6, prefix="z"), 0.2, 1.5, admission, model_limit=12, codec_busy=0.3)[-1] == 12


def test_a_stream_with_a_lead_in_hand_may_dip_below_real_time() -> None:
    # Produced at real time exactly, a stream whose client holds a second is not at risk; one holding 200 ms
    # is (a hiccup empties it). At 0.8x real time, one holding 1.5 s still keeps real time over the horizon.
    clock = FakeClock()
    admission = controller()
    sessions = streams(clock, 3)
    sessions[0].playback_end_s = clock() + 1.0
    sessions[2].playback_end_s = clock() + 1.5
    play(clock, sessions, 1.0, [1.0, 1.0, 0.8], admission, model_limit=3)
    assert admission.last is not None
    assert (admission.last.keeping, admission.last.falling) == (2, 1)


def test_refused_requests_are_demand_that_lets_the_limit_grow() -> None:
    # admission: reject turns requests away at the limit, so the admitted streams sit just under it (streams end,
    # refused ones never arrive) and never fill it. The refusals are unmet demand: with streams producing 1.5x
    # real time the limit must still rise; without refusals it stays.
    def limits_after(refusing: bool) -> int:
        clock = FakeClock()
        admission = controller()
        sessions = streams(clock, 30)
        admission.update(clock(), sessions, demand=30, model_limit=31, slots=512)
        play(clock, sessions, WINDOW_S, 1.5, admission, model_limit=31)  # old enough to be read
        refused = 0
        dt = 0.01
        for _ in range(round(2.0 / dt)):
            clock.advance(dt)
            for s in sessions:
                s.generated += round(1.5 * TOKENS_PER_SECOND_REALTIME * dt)
                s.playback_end_s = clock() + 1.0
            refused += refusing
            limit = admission.update(clock(), sessions, demand=len(sessions) - 1, model_limit=31, slots=512,
                                     refused_total=refused)
        return limit

    grown, held = limits_after(refusing=True), limits_after(refusing=False)
    assert held <= 31, held
    assert grown >= math.ceil(31 * GROW_FACTOR), grown


def test_a_cold_server_far_from_every_bound_doubles_its_limit_at_a_time() -> None:
    # A cold server's prediction can be a small fraction of what it carries (the H100 model's sim: 4 of 214).
    # Streams producing 3x real time with an idle codec: the limit may double per rise (slow start) up to what
    # the median producer's spare pace says; near real time (1.5x) it rises GROW_FACTOR at a time.
    def rises(rate: float, codec_busy: float) -> list[tuple[int, int]]:
        clock = FakeClock()
        admission = controller()
        sessions = streams(clock, 4)
        admission.update(clock(), sessions, demand=4, model_limit=4, slots=512)
        limits = []
        for _ in range(4):  # the streams fill the limit each time it rises, as queued requests would
            limits += play(clock, sessions, GROW_EVERY_S + TICK_S, rate, admission, model_limit=4,
                           codec_busy=codec_busy)
            sessions += streams(clock, admission.limit - len(sessions), prefix=f"t{len(sessions)}-")
        return [(a, b) for a, b in itertools.pairwise(limits) if b > a]

    fast = rises(3.0, 0.1)
    assert fast and all(b <= 2 * a for a, b in fast) and any(b > math.ceil(a * GROW_FACTOR) for a, b in fast), fast
    assert fast[-1][1] >= 4 * 2**2, fast
    near = rises(1.5, 0.1)
    assert near and all(b <= math.ceil(a * GROW_FACTOR) for a, b in near), near
    busy_codec = rises(3.0, 0.5)  # the codec past half its hold: no slow start
    assert busy_codec and all(b <= math.ceil(a * GROW_FACTOR) for a, b in busy_codec), busy_codec
