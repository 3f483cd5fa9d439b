"""Where a decode step's time goes: a torch.profiler trace of a few steps, summarised.

`profile_steps(step, steps=...)` runs `step()` that many times under `torch.profiler` (CUDA
activity on a GPU, CPU activity otherwise), each inside a `record_function(STEP_LABEL)` range,
and returns `StepProfile.as_dict()`:

- `kernels_per_step`: device kernels (and copies / fills) a step runs. On CUDA the kernels of a
  replayed graph are counted one by one, as the card runs them. On a CPU, the outermost operators
  (aten ops called by no other op: `aten::linear`, not the `aten::mm` inside it) stand for kernels.
- `top_kernels`: name, share of the busy time (summed durations of all kernels), ms and calls per step.
- `idle_share`: the part of a step's wall time (its `record_function` range on the host, which ends
  when the step's tokens are back) during which no kernel ran: launch gaps, host work between
  kernels, the wait for the host copy. 1 - (union of kernel intervals) / (step wall time).

The step must finish its device work before it returns (TorchEngine.step does: it waits for its
tokens), so each kernel falls inside the host range of the step that launched it; a kernel that does
not (a clock skew, work left running) is counted in `unassigned_kernels`, not in any step.

A profile that recorded no kernel at all is no measurement (CUPTI has been seen to record nothing in a
profiler session that follows a CUDA graph capture): `as_dict` then says `status: failed` with the
reason, and its kernel figures are None, never a zero taken for a number.

Engine and codec. In the server the codec decodes on its own thread and, on CUDA, its own stream, while
the engine core's loop is profiled (`ArmedStepProfiler`): its kernels overlap the engine's steps. Kernels
are attributed by where they came from (`split_by_origin`): on a CPU, an operator belongs to the engine
when it ran on the thread of the step ranges; on CUDA, a kernel belongs to the engine when it ran on a
stream that the step thread's own operators launched kernels on (a replayed graph's kernels run on the
engine's stream too, and so are the engine's). Everything else is the codec's (`codec_kernels`: its
kernels per step, its busy time and its top kernels), never counted in `kernels_per_step`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STEP_LABEL = "orpheus_step"
TOP_KERNELS = 12
NAME_CHARS = 160  # templated CUDA kernel names run to kilobytes; the head names them
DEFAULT_ARMED_STEPS = 50  # ArmedStepProfiler: steps profiled when the arm file names no count


@dataclass(frozen=True, slots=True)
class Interval:
    """One kernel (or one step's host range), times in microseconds."""

    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return max(0.0, self.end_us - self.start_us)


@dataclass(slots=True)
class StepProfile:
    activity: str  # cuda | cpu
    steps: int
    step_ms: float  # mean wall time of a profiled step
    busy_ms_per_step: float  # union of kernel intervals per step
    kernels_per_step: float
    idle_share: float
    top_kernels: list[dict[str, Any]] = field(default_factory=list)
    unassigned_kernels: int = 0

    @property
    def recorded_kernels(self) -> bool:
        return self.kernels_per_step > 0 or self.unassigned_kernels > 0

    def as_dict(self) -> dict[str, Any]:
        """The summary; with no kernel recorded, `status: failed` and the reason instead of kernel figures."""
        if not self.recorded_kernels:
            return {"status": "failed",
                    "reason": f"no kernels recorded in {self.steps} profiled steps ({self.activity} activity): "
                              "the profiler saw the steps but none of their work",
                    "activity": self.activity, "steps": self.steps, "step_ms": round(self.step_ms, 4),
                    "busy_ms_per_step": None, "kernels_per_step": None, "idle_share": None, "top_kernels": [],
                    "unassigned_kernels": 0}
        return {"status": "measured", "activity": self.activity, "steps": self.steps,
                "step_ms": round(self.step_ms, 4), "busy_ms_per_step": round(self.busy_ms_per_step, 4),
                "kernels_per_step": round(self.kernels_per_step, 1), "idle_share": round(self.idle_share, 4),
                "top_kernels": self.top_kernels, "unassigned_kernels": self.unassigned_kernels}


def union_us(intervals: Iterable[Interval]) -> float:
    """Total time covered by at least one interval (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for iv in sorted(intervals, key=lambda i: i.start_us):
        if iv.start_us >= end:
            total += iv.duration_us
            end = iv.end_us
        elif iv.end_us > end:
            total += iv.end_us - end
            end = iv.end_us
    return total


def summarize(kernels: list[Interval], steps: list[Interval], *, activity: str,
              top: int = TOP_KERNELS) -> StepProfile:
    """Assign each kernel to the step whose range holds its start, then count, rank and measure idleness."""
    if not steps:
        raise ValueError("no profiled step")
    steps = sorted(steps, key=lambda s: s.start_us)
    per_step: list[list[Interval]] = [[] for _ in steps]
    unassigned = 0
    for kernel in kernels:
        index = next((i for i, s in enumerate(steps) if s.start_us <= kernel.start_us <= s.end_us), None)
        if index is None:
            unassigned += 1
        else:
            per_step[index].append(kernel)
    n = len(steps)
    wall_us = sum(s.duration_us for s in steps)
    busy_us = sum(union_us(ks) for ks in per_step)
    totals: dict[str, list[float]] = {}
    for ks in per_step:
        for k in ks:
            entry = totals.setdefault(k.name[:NAME_CHARS], [0.0, 0])
            entry[0] += k.duration_us
            entry[1] += 1
    summed = sum(t for t, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return StepProfile(
        activity=activity, steps=n, step_ms=wall_us / n / 1e3, busy_ms_per_step=busy_us / n / 1e3,
        kernels_per_step=sum(len(ks) for ks in per_step) / n,
        idle_share=max(0.0, 1.0 - busy_us / wall_us) if wall_us > 0 else 0.0,
        top_kernels=[{"name": name, "share": round(t / summed, 4), "ms_per_step": round(t / n / 1e3, 4),
                      "calls_per_step": round(c / n, 2)} for name, (t, c) in ranked],
        unassigned_kernels=unassigned)


@dataclass(slots=True)
class TraceSplit:
    """A trace's kernels by origin (module docstring), and the steps' host ranges."""

    engine: list[Interval]
    codec: list[Interval]
    steps: list[Interval]
    attribution: str  # thread (CPU), stream (CUDA), or none: every kernel counted as the engine's


def split_by_origin(events: Iterable[Any], activity: str) -> TraceSplit:
    """Kernels (CUDA: device kernels, copies, fills; CPU: outermost operators) split into the engine's and the
    codec's, from a profiler's FunctionEvents (module docstring). On CUDA without a stream to go by (no step
    thread operator launched a kernel, or this torch gives kernels no stream), every kernel is the engine's."""
    from torch.autograd import DeviceType

    events = list(events)
    steps = [Interval(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events
             if e.name == STEP_LABEL and e.device_type == DeviceType.CPU]
    step_threads = {e.thread for e in events if e.name == STEP_LABEL and e.device_type == DeviceType.CPU}
    engine: list[Interval] = []
    codec: list[Interval] = []
    if activity != "cuda":
        for evt in events:
            if evt.device_type != DeviceType.CPU or _annotation(evt) \
                    or any(not _annotation(a) for a in _ancestors(evt)):
                continue
            iv = Interval(evt.name, float(evt.time_range.start), float(evt.time_range.end))
            (engine if evt.thread in step_threads else codec).append(iv)
        return TraceSplit(engine, codec, steps, "thread")
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not _annotation(e) and e.name != STEP_LABEL]
    # The thread of the operator each kernel was launched for: kernels link to it by its correlation id.
    launcher_thread = {e.id: e.thread for e in events if e.device_type == DeviceType.CPU and not _annotation(e)}
    engine_streams = {getattr(k, "device_resource_id", None) for k in kernels
                      if launcher_thread.get(getattr(k, "linked_correlation_id", 0)) in step_threads}
    engine_streams.discard(None)
    for k in kernels:
        iv = Interval(k.name, float(k.time_range.start), float(k.time_range.end))
        on_engine = not engine_streams or getattr(k, "device_resource_id", None) in engine_streams
        (engine if on_engine else codec).append(iv)
    return TraceSplit(engine, codec, steps, "stream" if engine_streams else "none")


def _intervals(events: Any, activity: str) -> tuple[list[Interval], list[Interval]]:
    """(the engine's kernels, step ranges) from a profiler's FunctionEvents (`split_by_origin`)."""
    split = split_by_origin(events, activity)
    return split.engine, split.steps


def codec_summary(split: TraceSplit, *, top: int = TOP_KERNELS) -> dict[str, Any]:
    """The codec's kernels that ran inside the profiled steps' ranges: per step, busy time, the top ones."""
    profile = summarize(split.codec, split.steps, activity="codec", top=top)
    return {"kernels_per_step": round(profile.kernels_per_step, 1),
            "busy_ms_per_step": round(profile.busy_ms_per_step, 4), "top_kernels": profile.top_kernels,
            "outside_steps": profile.unassigned_kernels}


def _annotation(evt: Any) -> bool:
    """A `record_function` range (the step label, user ranges) or a Python frame: not an operator."""
    return bool(evt.name == STEP_LABEL or getattr(evt, "is_user_annotation", False)
                or getattr(evt, "is_python_function", False))


def _ancestors(evt: Any) -> Iterable[Any]:
    parent = evt.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def profile_steps(step: Callable[[], object], *, steps: int, device: torch.device | str,
                  top: int = TOP_KERNELS) -> StepProfile:
    """Run `step()` `steps` times under torch.profiler (CUDA activity when `device` is a GPU) and
    summarise (module docstring). The caller warms the step up first: a first call's allocations and
    autotuning are not what a serving step costs."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activity = "cuda" if torch.device(device).type == "cuda" else "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if activity == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_LABEL):
                step()
    kernels, ranges = _intervals(prof.events(), activity)
    return summarize(kernels, ranges, activity=activity, top=top)


class ArmedStepProfiler:
    """The engine core's profile on request (`engine.profile_dir`): a tool (the GPU kit's serve stage) writes
    "STEPS [MIN_ROWS]" into `DIR/arm`; from the first step with at least MIN_ROWS decode rows (default 1) the
    engine-core loop profiles STEPS loop iterations (plan, launch, read-back: with overlap, the device work
    of one step runs during the next iteration), then writes `DIR/profile.json` (StepProfile.as_dict of the
    engine's kernels, the mean decode rows per step, and the codec's kernels apart under `codec_kernels`)
    with an atomic rename and deletes the request. Used by one thread only
    (the engine-core loop). Checking for the file costs one stat call per step."""

    def __init__(self, folder: str | Path, device: torch.device | str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device)
        self._profiler: Any = None
        self._left = 0
        self._rows: list[int] = []

    @property
    def arm_path(self) -> Path:
        return self.folder / "arm"

    @property
    def result_path(self) -> Path:
        return self.folder / "profile.json"

    @contextmanager
    def around_step(self, decode_rows: int) -> Iterator[None]:
        """Wrap one loop iteration carrying `decode_rows` decode rows."""
        if self._profiler is None and self.arm_path.exists():
            steps, min_rows = _request(self.arm_path.read_text())
            if decode_rows >= min_rows:
                self._start(steps)
        if self._profiler is None:
            yield
            return
        from torch.profiler import record_function

        with record_function(STEP_LABEL):
            yield
        self._rows.append(decode_rows)
        self._left -= 1
        if self._left <= 0:
            self._finish()

    def _start(self, steps: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.arm_path.unlink(missing_ok=True)
        self._left = steps
        self._rows = []
        cuda = self.device.type == "cuda"
        self._profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self._profiler.start()

    def _finish(self) -> None:
        prof, self._profiler = self._profiler, None
        prof.stop()
        activity = "cuda" if self.device.type == "cuda" else "cpu"
        split = split_by_origin(prof.events(), activity)
        summary = summarize(split.engine, split.steps, activity=activity).as_dict()
        summary["decode_rows_mean"] = round(sum(self._rows) / max(1, len(self._rows)), 1)
        # The codec's kernels, apart: they overlap the steps but are not the engine's (module docstring).
        summary["codec_kernels"] = codec_summary(split)
        summary["kernel_attribution"] = split.attribution
        scratch = self.result_path.with_name("profile.json.tmp")
        scratch.write_text(json.dumps(summary, indent=2))
        scratch.replace(self.result_path)


def _request(text: str) -> tuple[int, int]:
    """"STEPS [MIN_ROWS]" -> (steps, min_rows); what is missing or not a positive number takes its default."""
    words = text.split()
    numbers = [int(w) if w.isdigit() and int(w) > 0 else 0 for w in words[:2]]
    steps = numbers[0] if numbers and numbers[0] else DEFAULT_ARMED_STEPS
    min_rows = numbers[1] if len(numbers) > 1 and numbers[1] else 1
    return steps, min_rows
