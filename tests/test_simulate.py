"""The virtual-clock policy simulation: client playback model, and deadline vs fair where it matters."""

from __future__ import annotations

import pytest

from orpheus_serve.benchmarking.simulate import (
    SimulationSetup,
    StreamResult,
    Workload,
    compare_policies,
    format_table,
    realtime_capacity,
    simulate,
)
from orpheus_serve.config import SchedulerConfig
from orpheus_serve.engines.sim_engine import h100_cost_model
from orpheus_serve.token_format import FRAME_SECONDS


def setup(slots: int = 64, batch: int = 16) -> SimulationSetup:
    return SimulationSetup(
        scheduler=SchedulerConfig(
            max_concurrent_sessions=slots, max_batch_size=batch, max_queue=1000, queue_timeout_s=600.0
        ),
        num_slots=slots,
        cost=h100_cost_model(),
        lookahead_frames=2,
        codec_latency_s=0.010,
    )


def test_client_playback_model_counts_underruns_and_stall_time() -> None:
    s = StreamResult("x", arrival_s=1.0)
    s.receive(1.25, 1)  # first audio: one frame
    assert s.ttfb_s == pytest.approx(0.25)
    s.receive(1.25 + 0.8 * FRAME_SECONDS, 3)  # in time: buffer had 0.2 frames left
    s.receive(1.25 + 3 * FRAME_SECONDS, 3)  # nothing new
    assert s.underruns == 0
    s.receive(1.25 + 3.5 * FRAME_SECONDS, 4)  # ran dry at 3 frames, audio came 0.5 frame late
    assert s.underruns == 1 and s.stall_s == pytest.approx(0.5 * FRAME_SECONDS)
    s.receive(1.25 + 4.5 * FRAME_SECONDS, 5)  # playback resumed at the late arrival: exactly in time
    s.finish_reason = "stop"
    assert s.underruns == 1 and not s.real_time
    assert s.audio_s == pytest.approx(5 * FRAME_SECONDS)


def test_light_load_every_stream_is_real_time_under_both_policies() -> None:
    results = compare_policies(setup(), Workload(sessions=8, arrival_window_s=2.0, seed=1))
    for r in results:
        assert r.completed == 8 and r.real_time_streams == 8 and r.underruns == 0
        assert r.ttfb_percentile(100) < 0.3  # 1 prefill + 20 boosted decode steps at ~10 ms
    assert realtime_capacity(h100_cost_model(), 16, 1000) > 16


def test_simulation_reproduces() -> None:
    a = simulate(setup(), Workload(sessions=6, arrival_window_s=1.0, seed=3))
    b = simulate(setup(), Workload(sessions=6, arrival_window_s=1.0, seed=3))
    assert [(s.ttfb_s, s.audio_s, s.underruns) for s in a.streams] == [
        (s.ttfb_s, s.audio_s, s.underruns) for s in b.streams
    ]
    assert "real-time" in format_table([a])


@pytest.mark.parametrize("window_s", [2.0, 15.0])
def test_deadline_keeps_more_streams_real_time_than_fair_at_64_sessions(window_s: float) -> None:
    # 64 slots, batch 16: about 17 voices of real-time capacity. 64 sessions at once (2 s) is a
    # hard overload; spread over 15 s the load swings around the capacity.
    fair, deadline = compare_policies(setup(), Workload(sessions=64, arrival_window_s=window_s, seed=1))
    assert fair.completed == deadline.completed == 64
    assert deadline.real_time_streams > fair.real_time_streams
    assert deadline.underrun_streams <= fair.underrun_streams
    assert deadline.underruns <= fair.underruns
