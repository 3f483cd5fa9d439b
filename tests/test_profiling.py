"""The step profile the GPU kit records (engines/profiling.py): counting, ranking and idleness from a trace."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from orpheus_serve.engines.profiling import (
    STEP_LABEL,
    ArmedStepProfiler,
    Interval,
    profile_steps,
    split_by_origin,
    summarize,
    union_us,
)


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


def test_a_profile_that_recorded_no_kernel_is_a_failed_entry_not_a_number() -> None:
    """Steps that ran but whose work the profiler did not see: status failed with the reason, and no kernel
    figure (0 kernels, 100 % idle) that a table would print as a measurement."""
    p = profile_steps(lambda: time.sleep(0.001), steps=3, device="cpu").as_dict()
    assert p["status"] == "failed" and p["reason"].startswith("no kernels recorded in 3 profiled steps")
    assert p["kernels_per_step"] is None and p["idle_share"] is None and p["top_kernels"] == []
    assert p["steps"] == 3 and p["step_ms"] > 0  # the shape otherwise kept
    measured = summarize([Interval("gemm", 10, 50)], [Interval("step", 0, 100)], activity="cuda").as_dict()
    assert measured["status"] == "measured" and measured["kernels_per_step"] == 1


def test_the_armed_profile_counts_the_codec_threads_operators_apart(tmp_path: Path) -> None:
    """The engine-core loop profiled while a codec thread runs its own operators (as the codec worker does):
    the engine's kernels per step are the loop's own (one aten::mm per decode row, whatever the codec does),
    and what the trace holds of the codec thread is under `codec_kernels`, never among the engine's. A CPU
    profile records the profiling thread's operators only (torch's default): then a trace of every thread
    (where this torch can take one) shows the split itself, the convolutions the codec's."""
    from torch.profiler import ProfilerActivity, profile, record_function

    profiler = ArmedStepProfiler(tmp_path / "profile", "cpu")
    a = torch.randn(32, 32)
    signal, weight = torch.randn(1, 8, 256), torch.randn(8, 8, 7)
    stop = threading.Event()
    codec_started = threading.Event()

    def codec() -> None:
        while not stop.is_set():
            torch.nn.functional.conv1d(signal, weight, padding=3)
            codec_started.set()
            time.sleep(0.0005)

    def loop() -> None:
        for n in (2, 3, 2, 1):
            with profiler.around_step(n):
                for _ in range(n):
                    torch.mm(a, a)
                time.sleep(0.005)  # the codec thread runs meanwhile

    worker = threading.Thread(target=codec, name="codec-worker")
    worker.start()
    try:
        assert codec_started.wait(10)
        profiler.arm_path.write_text("4")
        loop()
        p = json.loads(profiler.result_path.read_text())
        all_threads = None
        config_type = torch._C._profiler._ExperimentalConfig
        if "profile_all_threads" in (config_type.__init__.__doc__ or ""):
            with profile(activities=[ProfilerActivity.CPU],
                         experimental_config=config_type(profile_all_threads=True)) as prof:
                for _ in range(3):
                    with record_function(STEP_LABEL):
                        torch.mm(a, a)
                        time.sleep(0.005)
            all_threads = split_by_origin(prof.events(), "cpu")
    finally:
        stop.set()
        worker.join()
    assert p["status"] == "measured" and p["kernel_attribution"] == "thread"
    assert p["kernels_per_step"] == pytest.approx(2.0)  # 8 products over 4 steps: the codec's are not counted
    assert {k["name"] for k in p["top_kernels"]} == {"aten::mm"}
    assert {k["name"] for k in p["codec_kernels"]["top_kernels"]} <= {"aten::conv1d"}
    if all_threads is not None:
        assert {k.name for k in all_threads.engine} == {"aten::mm"} and len(all_threads.engine) == 3
        assert "aten::conv1d" in {k.name for k in all_threads.codec}


@dataclass
class FakeCudaEvent:
    """The fields of a torch.profiler FunctionEvent that the CUDA attribution reads, for a trace no CPU can
    record: a fake standing in for CUDA's kernel events."""

    name: str
    device_type: DeviceType
    thread: int
    start: float
    end: float
    id: int = 0
    linked_correlation_id: int = 0
    device_resource_id: int | None = None
    is_user_annotation: bool = False
    cpu_parent: None = None

    @property
    def time_range(self) -> SimpleNamespace:
        return SimpleNamespace(start=self.start, end=self.end)


def test_cuda_kernels_on_the_engines_stream_are_the_engines_and_the_rest_the_codecs() -> None:
    """A CUDA trace (faked): the step thread's copy launched a kernel on stream 7, so every kernel on stream 7
    is the engine's, replayed graph kernels included (no operator of theirs); the codec thread's kernels on
    stream 9 are the codec's."""
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        FakeCudaEvent(STEP_LABEL, cpu, thread=1, start=0, end=100, is_user_annotation=True),
        FakeCudaEvent("aten::copy_", cpu, thread=1, start=1, end=2, id=11),
        FakeCudaEvent("aten::conv1d", cpu, thread=2, start=3, end=4, id=12),
        FakeCudaEvent("Memcpy HtoD", cuda, thread=0, start=5, end=6, linked_correlation_id=11, device_resource_id=7),
        FakeCudaEvent("gemm (graph)", cuda, thread=0, start=10, end=40, device_resource_id=7),
        FakeCudaEvent("conv (codec)", cuda, thread=0, start=20, end=60, linked_correlation_id=12,
                      device_resource_id=9),
    ]
    split = split_by_origin(events, "cuda")
    assert split.attribution == "stream"
    assert [k.name for k in split.engine] == ["Memcpy HtoD", "gemm (graph)"]
    assert [k.name for k in split.codec] == ["conv (codec)"]
    # No kernel of the step thread's: nothing to tell the streams by, so all are counted, as before.
    unattributed = split_by_origin([e for e in events if e.name != "Memcpy HtoD"], "cuda")
    assert unattributed.attribution == "none" and len(unattributed.engine) == 2 and not unattributed.codec
