"""`TokenEngine`: the interface every token engine implements.

The step types it takes and returns (`StepPlan`, `StepOutput`, `PrefillChunk`,
`SamplingParams`) and their contract live in `orpheus_serve.scheduler.step`, which the
scheduler imports too; this module adds what only engines and their callers
need: the engine protocol and its memory report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class TokenEngine(Protocol):
    num_slots: int
    max_seq_len: int

    def step(self, plan: StepPlan) -> StepOutput:
        """Apply one plan; blocking; called from the engine core thread only."""
        ...

    def memory_report(self) -> MemoryReport: ...

    def close(self) -> None: ...
