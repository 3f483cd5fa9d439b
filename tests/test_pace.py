"""The machine pace (tests/pace.py) and the container drain's stream sizing (scripts/container_check.py): windows
and stream lengths that follow the machine's measured speed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from scripts import container_check
from tests import pace as pace_module
from tests.pace import MAX_SLOWNESS, REFERENCE_ROUND_S, STEPS, TOO_SLOW, MachinePace

ROOT = Path(__file__).resolve().parents[1]


def test_a_window_stretches_by_the_slowness_and_never_shrinks(pace: MachinePace) -> None:
    assert MachinePace(slowness=3.0, measured_round_s=3 * REFERENCE_ROUND_S).window(2.0) == 6.0
    assert MachinePace(slowness=MAX_SLOWNESS, measured_round_s=1.0).window(1.0) == MAX_SLOWNESS  # the cap holds
    # This module's own measurement (each module that waits on time measures afresh).
    assert pace.slowness >= 1.0 and pace.measured_round_s > 0
    assert pace.slowness == pytest.approx(max(1.0, pace.measured_round_s / REFERENCE_ROUND_S))
    if pace.slowness <= MAX_SLOWNESS:
        assert pace.window(1.0) >= 1.0


@pytest.mark.parametrize("slowness", [MAX_SLOWNESS + 0.01, 10.0, 100.0])
def test_above_the_cap_a_window_fails_the_check_instead_of_widening(slowness: float) -> None:
    # A cap of a few times the reference: past it a "within a second" window would hold nearly anything.
    assert 1.0 < MAX_SLOWNESS <= 4.0
    too_slow = MachinePace(slowness=slowness, measured_round_s=slowness * REFERENCE_ROUND_S)
    with pytest.raises(pytest.fail.Exception, match=TOO_SLOW):
        too_slow.window(1.0)
    with pytest.raises(pytest.fail.Exception, match=TOO_SLOW):
        too_slow.stretch()
    assert TOO_SLOW == "machine too slow for timing checks"


def _fake_calibrations(monkeypatch: pytest.MonkeyPatch, slownesses: list[float]) -> list[float]:
    left = list(slownesses)
    monkeypatch.setattr(pace_module, "calibrate",
                        lambda: MachinePace(slowness=(s := left.pop(0)), measured_round_s=s * REFERENCE_ROUND_S))
    return left


def test_one_slow_calibration_is_measured_again_and_the_second_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    left = _fake_calibrations(monkeypatch, [1.3, 9.0])
    assert pace_module.measure().slowness == 1.3 and left == [9.0]  # under the cap: measured once
    left = _fake_calibrations(monkeypatch, [9.0, 1.5, 9.0])
    assert pace_module.measure().slowness == 1.5 and left == [9.0]  # a spike: the second measurement stands
    _fake_calibrations(monkeypatch, [9.0, 7.0])
    still_slow = pace_module.measure()  # slow twice: only once more, and the checks fail
    assert still_slow.slowness == 7.0
    with pytest.raises(pytest.fail.Exception, match=TOO_SLOW):
        still_slow.window(1.0)


def test_the_calibration_runs_without_the_code_under_test() -> None:
    # In a fresh interpreter where orpheus_serve cannot be imported at all: the pace must not measure the code
    # whose slowdowns its windows are there to catch.
    script = ("import sys\n"
              "sys.modules['orpheus_serve'] = None  # any import of it now raises\n"
              "from tests.pace import calibrate\n"
              "measured = calibrate(rounds=1)\n"
              "assert measured.measured_round_s > 0, measured\n"
              "assert not [m for m in sys.modules if m.startswith('orpheus_serve.')], sorted(sys.modules)\n"
              "print('calibrated', measured.measured_round_s)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "calibrated" in done.stdout, done.stderr[-3000:]


class _OpNames(TorchDispatchMode):
    """Records the aten ops a block of torch code runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_the_workload_is_matmul_and_softmax_work_that_scales_with_its_size() -> None:
    def flops(outputs: int) -> int:
        projection, hidden = pace_module.workload(outputs)
        with FlopCounterMode(display=False) as counter:
            pace_module.workload_round(projection, hidden)
        return counter.get_total_flops()

    small = flops(4096)
    assert small >= 2 * STEPS * 2 * pace_module.SESSIONS * pace_module.HIDDEN * 4096  # two matmuls a step
    assert flops(4 * 4096) == 4 * small  # the matmul work grows with the size, step for step

    projection, hidden = pace_module.workload(4096)
    with _OpNames() as recorded:
        pace_module.workload_round(projection, hidden)
    assert recorded.ops["mm"] == 2 * STEPS and recorded.ops["_softmax"] == STEPS, recorded.ops

    # And the time follows the work: the best of three rounds at four times the size takes well over twice as
    # long (a round's own overhead is a few ops a step; the best of three rides out a busy moment).
    def best_s(outputs: int) -> float:
        projection, hidden = pace_module.workload(outputs)
        pace_module.workload_round(projection, hidden)
        return min(pace_module.workload_round(projection, hidden) for _ in range(3))

    previous = torch.get_num_threads()
    torch.set_num_threads(pace_module.THREADS)
    try:
        assert best_s(4 * 8192) > 2 * best_s(8192)
    finally:
        torch.set_num_threads(previous)


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
