"""The step profile the GPU kit records (engines/profiling.py): counting, ranking and idleness from a trace."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from orpheus_serve.engines.profiling import ArmedStepProfiler, Interval, profile_steps, summarize, union_us


def test_busy_time_counts_overlapping_kernels_once() -> None:
    kernels = [Interval("a", 0, 10), Interval("b", 5, 15), Interval("c", 20, 25), Interval("d", 21, 22)]
    assert union_us(kernels) == 20


def test_summary_assigns_kernels_to_their_step_ranks_them_and_measures_idleness() -> None:
    steps = [Interval("step", 0, 100), Interval("step", 200, 300)]
    kernels = [Interval("gemm", 10, 50), Interval("norm", 50, 60),  # step 1: busy 50 of 100
               Interval("gemm", 210, 270), Interval("norm", 260, 280),  # step 2: busy 70 (overlap counted once)
               Interval("stray", 150, 160)]  # between steps: in none
    p = summarize(kernels, steps, activity="cuda")
    assert p.steps == 2 and p.kernels_per_step == 2 and p.unassigned_kernels == 1
    assert p.step_ms == pytest.approx(0.1) and p.busy_ms_per_step == pytest.approx(0.06)
    assert p.idle_share == pytest.approx(1 - 120 / 200)
    assert [k["name"] for k in p.top_kernels] == ["gemm", "norm"]
    assert p.top_kernels[0]["share"] == pytest.approx(100 / 130, abs=1e-4)
    assert p.top_kernels[0]["calls_per_step"] == 1 and p.top_kernels[1]["ms_per_step"] == pytest.approx(0.015)


def test_a_real_cpu_trace_counts_the_operators_of_each_step_and_the_host_gap() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def step() -> None:
        torch.mm(a, b).relu_()
        time.sleep(0.01)  # host time with no operator running: idle

    p = profile_steps(step, steps=3, device="cpu").as_dict()
    assert p["activity"] == "cpu" and p["steps"] == 3 and p["unassigned_kernels"] == 0
    assert p["kernels_per_step"] >= 2  # at least the product and the relu, as leaf operators
    names = {k["name"] for k in p["top_kernels"]}
    assert "aten::mm" in names and "aten::relu_" in names
    idle_ms = p["idle_share"] * p["step_ms"]
    assert p["step_ms"] >= 10 and 9 <= idle_ms < p["step_ms"]  # the sleep is idle, the operators are not


def test_an_armed_profiler_waits_for_the_batch_then_profiles_the_steps_asked(tmp_path: Path) -> None:
    profiler = ArmedStepProfiler(tmp_path / "profile", "cpu")
    a = torch.randn(32, 32)

    def loop(rows: list[int]) -> None:
        for n in rows:
            with profiler.around_step(n):
                for _ in range(n):
                    torch.mm(a, a)

    loop([3, 3])
    assert not profiler.result_path.exists()  # nothing asked: nothing recorded
    profiler.arm_path.write_text("4 3")
    loop([1, 2, 2])  # below 3 decode rows: still waiting
    assert profiler.arm_path.exists() and not profiler.result_path.exists()
    loop([3, 5, 1, 4, 7, 7])  # the 4 steps from the first with 3 rows: 3, 5, 1, 4
    assert not profiler.arm_path.exists()
    p = json.loads(profiler.result_path.read_text())
    assert p["steps"] == 4 and p["decode_rows_mean"] == pytest.approx(13 / 4, abs=0.06) and p["activity"] == "cpu"
    assert p["kernels_per_step"] == pytest.approx(13 / 4, abs=0.06)  # one aten::mm per decode row, as counted
    assert p["top_kernels"][0]["name"] == "aten::mm"
