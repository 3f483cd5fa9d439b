"""The machine pace (tests/pace.py) and the container drain's stream sizing (scripts/container_check.py): windows
and stream lengths that follow the machine's measured speed."""

from __future__ import annotations

import pytest

from scripts import container_check
from tests.pace import REFERENCE_ROUND_S, MachinePace


def test_a_window_stretches_by_the_slowness_and_never_shrinks(pace: MachinePace) -> None:
    assert MachinePace(slowness=3.0, measured_round_s=3 * REFERENCE_ROUND_S).window(2.0) == 6.0
    # The run's own measurement (once per run, shared with every test that waits on time).
    assert pace.slowness >= 1.0 and pace.measured_round_s > 0
    assert pace.window(1.0) >= 1.0
    assert pace.slowness == pytest.approx(max(1.0, pace.measured_round_s / REFERENCE_ROUND_S))


def _after_signal_s(frames: int, frames_per_s: float, client_buffer_s: float) -> float:
    return max((frames - container_check.SIGNAL_AFTER_FRAMES) / frames_per_s,
               frames * container_check.FRAME_S - client_buffer_s)


@pytest.mark.parametrize("frames_per_s", [200.0, 40.0, 12.0, 7.4, 3.0])
def test_the_drain_streams_fit_half_the_window_at_the_measured_speed(frames_per_s: float) -> None:
    frames = container_check.drain_frames(frames_per_s, grace_s=10.0, client_buffer_s=3.0)
    assert container_check.DRAIN_MIN_FRAMES <= frames <= container_check.DRAIN_MAX_FRAMES
    assert _after_signal_s(frames, frames_per_s, 3.0) <= container_check.DRAIN_BUDGET * 10.0
    if frames < container_check.DRAIN_MAX_FRAMES:  # the longest that fits: one frame more would not
        assert _after_signal_s(frames + 1, frames_per_s, 3.0) > container_check.DRAIN_BUDGET * 10.0


def test_the_drain_streams_shorten_as_the_machine_slows_and_a_too_slow_one_is_named() -> None:
    sizes = [container_check.drain_frames(speed, 10.0, 3.0) for speed in (200.0, 12.0, 7.4, 3.0)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    with pytest.raises(container_check.CheckFailed, match="frames/s per stream"):
        container_check.drain_frames(1.0, 10.0, 3.0)
