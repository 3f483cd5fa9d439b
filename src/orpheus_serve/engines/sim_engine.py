"""A TokenEngine with no model: valid Orpheus audio token streams and a cost model for time (ARCHITECTURE §6).

It lets the scheduler, the service and the gateways run at GPU-scale
concurrency on a CPU. It does what a slot-batched engine does with a plan
(release, chunked prefill, one decode step over the chosen slots) and checks
the plan the same way a real engine would: a chunk out of order, a decode of
an empty slot, a context past `max_seq_len` or sampling parameters it cannot
take (`step.sampling_problem`) fail that slot only. What can raise
(a slot number outside the engine, making a new session's generator) happens
before anything changes, so a step that raises leaves every session as it was.

Tokens: position p of a session's audio stream gets a code drawn for slot
p % 7 (so every id is in range, code 0 included), from a generator seeded by
`sampling.seed` or, without one, by the request id, so a run reproduces
whatever shares the batch. The stream ends with end_of_speech at a frame
boundary after `cost.end_after_frames` frames if set, else after a
pseudo-random count between half and all of the frames max_tokens allows.

Time: step_ms = step_base_ms + step_per_seq_ms · decoded sessions
+ step_per_ctx_token_ms · their total context + prefill_per_token_ms ·
prefill tokens. With `cost.realtime` that time passes on a modelled device
that runs one step at a time: `launch` (engines/base.PipelinedEngine) queues
the step behind the one still running and returns, and `collect` sleeps until
the step's modelled end, so host work done between the two overlaps the
modelled GPU time as it would on a GPU; `step` is both at once. Otherwise the
time is only reported in `StepOutput.elapsed_s`, and a virtual clock advances
through `clock_advance`.

With a `ModelledCard` (replay/: a measured card, `engine.sim.profile`) the step's time is the card's
instead of the formula: `launch` spends the card's launch time on the interpreter, then queues the step
on the card's device timeline, which it shares with the sim codec; `collect` sleeps to the step's end,
contention with codec passes included.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..config import Config, SimConfig
from ..replay import ModelledCard
from ..replay.card import StepTiming
from ..scheduler.step import EngineError, PrefillChunk, SamplingParams, StepOutput, StepPlan, sampling_problem
from ..token_format import CODEBOOK_SIZE, END_OF_SPEECH, TOKENS_PER_FRAME, VOCAB_SIZE, code_to_token
from .base import MemoryReport


def h100_cost_model(*, realtime: bool = False, end_after_frames: int | None = None) -> SimConfig:
    """Step latency of Orpheus 3B (Llama-3.2-3B: 28 layers, 8 KV heads of 128, bf16) on one H100.

    A decode step is memory-bound: it streams the 6.4 GB of weights (~2.3 ms at
    the ~2.8 TB/s an H100 SXM sustains) plus launch, sampling over the 157k
    vocabulary and framework overhead, which is where a real server lands at
    ~9-10 ms for small batches (step_base_ms). Each extra sequence adds a little
    compute and per-sequence sampling (step_per_seq_ms: 0.12 ms, so batch 64 is
    ~17 ms). Attention reads the KV cache: 28 layers × 2 × 8 × 128 × 2 bytes =
    112 KiB per context token, ~40 ns at 2.8 TB/s (step_per_ctx_token_ms).
    Prefill is compute-bound: 2 × 3.2 G FLOP per token at a few hundred
    TFLOP/s effective plus attention, ~0.02 ms per prompt token."""
    return SimConfig(
        step_base_ms=9.0,
        step_per_seq_ms=0.12,
        step_per_ctx_token_ms=0.00004,
        prefill_per_token_ms=0.02,
        end_after_frames=end_after_frames,
        realtime=realtime,
    )


def _seed_for(sampling: SamplingParams, request_id: str) -> int:
    if sampling.seed is not None:
        return sampling.seed
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class SimStepHandle:
    output: StepOutput
    done_at: float | None  # perf_counter time the modelled device finishes the step (realtime), else None
    timing: StepTiming | None = None  # the step on a modelled card (its end known at collect)


@dataclass(slots=True)
class _SlotState:
    request_id: str
    sampling: SamplingParams
    prompt_len: int
    rng: np.random.Generator
    end_frame: int  # end_of_speech comes at audio position end_frame * 7
    prefilled: int = 0
    generated: int = 0  # ids produced, end_of_speech included
    ended: bool = False
    _frame: np.ndarray | None = None  # codes of the frame being emitted

    @property
    def context(self) -> int:
        return self.prefilled + self.generated

    def next_token(self) -> int:
        position = self.generated  # every generated id so far was an audio token
        self.generated += 1
        if position % TOKENS_PER_FRAME == 0:
            if position // TOKENS_PER_FRAME >= self.end_frame:
                self.ended = True
                return END_OF_SPEECH
            self._frame = self.rng.integers(0, CODEBOOK_SIZE, size=TOKENS_PER_FRAME)
        assert self._frame is not None
        return code_to_token(int(self._frame[position % TOKENS_PER_FRAME]), position)


class SimEngine:
    """Slot-batched cost-model engine; see the module docstring."""

    def __init__(
        self,
        num_slots: int,
        max_seq_len: int,
        cost: SimConfig,
        *,
        clock_advance: Callable[[float], None] | None = None,
        card: ModelledCard | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.cost = cost
        self._clock_advance = clock_advance
        self.card = card if cost.realtime else None  # a card's time is real time only
        self._load = (0, 0, 0)  # the last _run's decoded rows, their context, prefill tokens
        self._slots: dict[int, _SlotState] = {}
        self._closed = False
        self.steps = 0
        self.busy_s = 0.0  # modelled engine time so far
        self._device_free_at = 0.0  # perf_counter time the modelled device finishes what it was given

    @classmethod
    def from_config(cls, config: Config, *, clock_advance: Callable[[float], None] | None = None,
                    card: ModelledCard | None = None) -> SimEngine:
        return cls(
            config.scheduler.max_concurrent_sessions,
            config.engine.max_seq_len,
            config.engine.sim,
            clock_advance=clock_advance,
            card=card,
        )

    def step(self, plan: StepPlan) -> StepOutput:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> SimStepHandle:
        """Run the plan's bookkeeping now; its modelled time starts when the device is free (the time spent
        making the tokens here counts as part of it, as the GPU makes them on a GPU)."""
        called = time.perf_counter()
        out = self._run(plan)
        if self.card is not None:
            batch, context, prefill = self._load
            if not batch and not prefill:
                return SimStepHandle(out, None)
            timing = self.card.launch_step(batch, context / batch if batch else 0.0, prefill)
            return SimStepHandle(out, None, timing)
        if self.cost.realtime:
            start = max(called, self._device_free_at)
            self._device_free_at = start + out.elapsed_s
            return SimStepHandle(out, self._device_free_at)
        if self._clock_advance is not None:
            self._clock_advance(out.elapsed_s)
        return SimStepHandle(out, None)

    def collect(self, handle: SimStepHandle) -> StepOutput:
        if handle.timing is not None:
            assert self.card is not None
            done_at = self.card.step_done_at(handle.timing)
            remaining = done_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            handle.output.elapsed_s = done_at - handle.timing.start
            self.busy_s += handle.output.elapsed_s
            return handle.output
        if handle.done_at is not None:
            remaining = handle.done_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        return handle.output

    def _run(self, plan: StepPlan) -> StepOutput:
        if self._closed:
            raise EngineError("sim engine is closed")
        out = StepOutput()
        for slot in (*plan.release, *(c.slot for c in plan.prefill), *plan.decode):
            self._check_slot(slot)
        # Everything that can raise comes before anything changes (see the module docstring).
        new_sessions = {c.slot: self._new_session(c) for c in plan.prefill if c.start == 0}
        for slot in plan.release:
            self._slots.pop(slot, None)

        prefill_tokens = 0
        for chunk in plan.prefill:
            prefill_tokens += self._prefill(chunk, out, new_sessions.get(chunk.slot))

        batch = 0
        context = 0
        for slot in plan.decode:
            state = self._slots.get(slot)
            if slot in out.failed:
                continue
            if state is None or state.prefilled < state.prompt_len:
                out.failed[slot] = "decode of a slot with no complete prompt"
                continue
            if state.ended:
                # What a model does past its end: it goes on (the engine core launched this step before it read
                # the end back; the scheduler drops the token).
                out.tokens.setdefault(slot, []).append(END_OF_SPEECH)
                continue
            if state.context >= self.max_seq_len:
                out.failed[slot] = f"context of {state.context} tokens is at max_seq_len={self.max_seq_len}"
                continue
            batch += 1
            context += state.context
            out.tokens.setdefault(slot, []).append(state.next_token())

        self._load = (batch, context, prefill_tokens)
        elapsed_ms = 0.0
        if self.card is not None:
            pass  # the card's time, at launch and collect
        elif batch or prefill_tokens:
            elapsed_ms = (
                self.cost.step_base_ms
                + self.cost.step_per_seq_ms * batch
                + self.cost.step_per_ctx_token_ms * context
                + self.cost.prefill_per_token_ms * prefill_tokens
            )
        out.elapsed_s = elapsed_ms / 1000.0
        self.steps += 1
        self.busy_s += out.elapsed_s  # (a card's steps add theirs at collect)
        return out

    def _new_session(self, chunk: PrefillChunk) -> _SlotState | str:
        """The state of a session starting with `chunk`, or why its sampling parameters cannot be taken."""
        sampling = chunk.sampling
        problem = sampling_problem(sampling, VOCAB_SIZE)
        if problem is not None:
            return f"invalid sampling parameters: {problem}"
        # Never more than the context holds (the scheduler ends the session there anyway).
        max_tokens = min(sampling.max_tokens, self.max_seq_len)
        cap_frames = max(1, max_tokens // TOKENS_PER_FRAME)
        rng = np.random.default_rng(_seed_for(sampling, chunk.request_id))
        if self.cost.end_after_frames is not None:
            end_frame = self.cost.end_after_frames
        else:
            # Leave room for end_of_speech within max_tokens where the cap allows it.
            high = max(1, (max_tokens - 1) // TOKENS_PER_FRAME)
            end_frame = int(rng.integers(max(1, (cap_frames + 1) // 2), high + 1))
        return _SlotState(chunk.request_id, sampling, len(chunk.prompt_ids), rng, end_frame)

    def _prefill(self, chunk: PrefillChunk, out: StepOutput, new: _SlotState | str | None) -> int:
        n = len(chunk.prompt_ids)
        if not 0 <= chunk.start < chunk.end <= n:
            out.failed[chunk.slot] = f"bad prefill chunk [{chunk.start}, {chunk.end}) of a {n}-token prompt"
            return 0
        if chunk.start == 0:
            assert new is not None
            if isinstance(new, str):
                self._slots.pop(chunk.slot, None)
                out.failed[chunk.slot] = new
                return 0
            self._slots[chunk.slot] = new
        state = self._slots.get(chunk.slot)
        if state is None or state.request_id != chunk.request_id or state.prefilled != chunk.start:
            out.failed[chunk.slot] = f"prefill chunk [{chunk.start}, {chunk.end}) out of order for {chunk.request_id!r}"
            return 0
        if chunk.end > self.max_seq_len:
            out.failed[chunk.slot] = f"prompt of {n} tokens exceeds max_seq_len={self.max_seq_len}"
            return 0
        state.prefilled = chunk.end
        if chunk.is_last:
            out.tokens.setdefault(chunk.slot, []).append(state.next_token())
        return chunk.end - chunk.start

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise EngineError(f"slot {slot} is outside 0..{self.num_slots - 1}")

    def memory_report(self) -> MemoryReport:
        return MemoryReport(
            device="sim",
            weights_bytes=0,
            kv_cache_bytes=0,
            kv_bytes_per_slot=0,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            free_bytes=None,
        )

    def close(self) -> None:
        self._closed = True
        self._slots.clear()
