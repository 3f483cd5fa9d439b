"""Step types: what the scheduler plans and what an engine returns, and nothing else.

The scheduler and every engine import this module; neither imports the other
(as vLLM keeps its scheduler output types apart from both):

    plan = scheduler.schedule()      # StepPlan: releases, prefill chunks, decode slots
    out = engine.step(plan)          # StepOutput: new token ids per slot
    scheduler.update(plan, out)

Slots are KV-cache rows allocated once at start-up (`num_slots`). A session is
bound to one slot from its first prefill chunk to its release.

The contract, by kind of engine:

- A slot-batched engine (torch, sim) does exactly what the plan says: the
  chunks in `prefill` (the last chunk of a prompt also samples the session's
  first token) and one decode step over the slots in `decode`.
- An engine with its own in-flight batching (TensorRT-LLM) turns the first
  prefill chunk of a session into a streaming request, ignores the choice of
  decode slots (it batches every live request itself) and returns whatever
  token diffs arrived since the last step, possibly several per slot and
  possibly for slots not in `decode`. Schedulers must accept that.

Engines stop nothing on their own except where `finished` says so: ending a
session (end_of_speech, max_tokens, cancel, timeout) is the scheduler's call,
made by listing the slot in `release` of a later plan. A slot in `failed`
failed alone; the other slots of the step are unaffected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Seeds every engine takes: TensorRT-LLM's random_seed is a uint64, and torch and sim use the same range.
SEED_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.6
    top_p: float = 0.8
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.1
    max_tokens: int = 1400  # generated tokens; the scheduler ends the session there
    seed: int | None = None  # same seed -> same tokens, whatever shares the batch
    constrained: bool = True  # ARCHITECTURE §3 frame-position constraint

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_problem(params: SamplingParams, vocab_size: int) -> str | None:
    """What an engine cannot take in `params`, or None.

    Engines check this when a session starts, before they change anything for its slot, and
    report a problem as that slot's failure (`StepOutput.failed`): a value the service would
    have refused (a caller that bypasses it, a bug) fails its own session, never the step."""

    def number(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    def integer(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not (number(params.temperature) and params.temperature >= 0):
        return f"temperature {params.temperature!r} is not a number >= 0"
    if not (number(params.top_p) and 0 < params.top_p <= 1):
        return f"top_p {params.top_p!r} is outside (0, 1]"
    if not (integer(params.top_k) and 0 <= params.top_k <= vocab_size):
        return f"top_k {params.top_k!r} is outside 0..{vocab_size}"
    if not (number(params.repetition_penalty) and params.repetition_penalty > 0):
        return f"repetition_penalty {params.repetition_penalty!r} is not a number > 0"
    if not (integer(params.max_tokens) and params.max_tokens >= 1):
        return f"max_tokens {params.max_tokens!r} is not an integer >= 1"
    if params.seed is not None and not (integer(params.seed) and 0 <= params.seed <= SEED_MAX):
        return f"seed {params.seed!r} is outside 0..2**64-1"
    return None


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt ids[start:end] of the session in `slot`. start == 0 (re)initialises
    the slot's state; end == len(prompt_ids) means the prompt is complete and
    the engine samples the session's first generated token."""

    slot: int
    request_id: str
    prompt_ids: tuple[int, ...]
    start: int
    end: int
    sampling: SamplingParams
    priority: float = 0.5  # 0..1, higher first; used by engines that schedule themselves
    adapter: str | None = None  # LoRA adapter (custom voice) the session runs with; None: the base model

    @property
    def is_last(self) -> bool:
        return self.end == len(self.prompt_ids)


@dataclass(slots=True)
class StepPlan:
    release: list[int] = field(default_factory=list)  # slots to free before anything else
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)  # slots that generate one token this step
    # slot -> new priority, for engines that schedule themselves (e.g. TTFB boost ends)
    priority: dict[int, float] = field(default_factory=dict)
    # decode slot -> the request it was planned for. With a step in flight (ARCHITECTURE §4) a slot can change
    # hands before this plan's output is read: its tokens belong to this request, whoever holds the slot then.
    owners: dict[int, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.release or self.prefill or self.decode)


@dataclass(slots=True)
class StepOutput:
    tokens: dict[int, list[int]] = field(default_factory=dict)  # slot -> new ids, in order
    finished: dict[int, str] = field(default_factory=dict)  # slot -> reason the engine stopped it
    failed: dict[int, str] = field(default_factory=dict)  # slot -> error; other slots unaffected
    elapsed_s: float = 0.0  # engine time for this step (modelled time for the sim engine)


class EngineError(RuntimeError):
    """An engine cannot start or run (missing dependency, bad checkpoint, out of memory)."""


class EngineDeadError(EngineError):
    """The engine knows it can never step again (its runtime died); raised by `step()` from then on.

    Unlike an ordinary exception from a step, which may be one session's fault and is isolated, this
    one is the engine's own verdict: the engine core declares the engine dead at once."""
