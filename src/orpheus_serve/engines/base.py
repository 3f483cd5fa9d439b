"""`TokenEngine`: the interface every token engine implements, and `PipelinedEngine`, the split step.

The step types it takes and returns (`StepPlan`, `StepOutput`, `PrefillChunk`,
`SamplingParams`) and their contract live in `orpheus_serve.scheduler.step`, which the
scheduler imports too; this module adds what only engines and their callers
need: the engine protocol and its memory report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..scheduler.step import StepOutput, StepPlan


@dataclass(frozen=True, slots=True)
class MemoryReport:
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_slot: int
    num_slots: int
    max_seq_len: int
    free_bytes: int | None = None  # device memory left after allocation, where known
    kv_cache_dtype: str | None = None  # the cache's element type (float8_e4m3fn, bfloat16, ...), where known
    compile_s: float | None = None  # start-up time spent compiling the decode pass (engine.compile), where it ran
    graph_capture_s: float | None = None  # start-up time spent capturing decode CUDA graphs, where captured


@runtime_checkable
class TokenEngine(Protocol):
    num_slots: int
    max_seq_len: int

    def step(self, plan: StepPlan) -> StepOutput:
        """Apply one plan; blocking; called from the engine core thread only."""
        ...

    def memory_report(self) -> MemoryReport: ...

    def close(self) -> None: ...


@runtime_checkable
class PipelinedEngine(TokenEngine, Protocol):
    """An engine whose step comes in two halves, so that the engine core can plan and launch step N+1 before it
    reads step N back (ARCHITECTURE §4, "Overlapped steps"):

        handle = engine.launch(plan)     # queues the step on the device and returns
        output = engine.collect(handle)  # waits until its tokens are on the host

    `step(plan)` is `collect(launch(plan))`. The contract:

    - Plans run in launch order. A plan may decode a session whose previous token (or whose first, from its
      prompt's last chunk) is still in flight: the engine feeds it from the device, never from the host.
    - Everything a plan can be refused for (a bad slot, a context past `max_seq_len`, bad sampling) is found at
      launch. A launch that raises changes no session, as a step that raises does, and nothing is in flight.
    - `collect` takes handles in launch order, each once. It raises only if the device failed, and then the
      engine is dead (`EngineDeadError`).
    - On a CPU both halves may run in `launch`; `collect` then only hands the output over.
    """

    def launch(self, plan: StepPlan) -> Any:
        """Queue `plan`; returns a handle for `collect` before the step's tokens are on the host."""
        ...

    def collect(self, handle: Any) -> StepOutput:
        """The output of a launched step, once its tokens are on the host."""
        ...
