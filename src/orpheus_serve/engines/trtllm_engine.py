"""`TrtLlmEngine`: the TokenEngine seam over TensorRT-LLM 1.2.x (TensorRT backend, FP8 engine).

TensorRT-LLM batches in flight by itself, so this engine does not execute the
scheduler's per-step batch; it maps sessions to runtime requests:

    first PrefillChunk of a slot (start == 0) -> llm.generate_async(prompt ids, streaming=True)
    later chunks of the same prompt           -> ignored (the whole prompt went with the first)
    plan.decode                               -> ignored (every live request decodes every iteration)
    plan.release                              -> RequestOutput.abort(); the slot is forgotten at once
    engine.step()                             -> the token diffs that arrived since the last step

Threads. The LLM API's streaming results are asyncio objects: a RequestOutput
binds to the event loop running when `generate_async` is called
(`executor/result.py`: `has_event_loop()` picks an AsyncQueue), and its
requests and aborts go out over IPC sockets that are not thread-safe. So the
engine owns ONE private event loop on its own thread for its whole life; every
call into the LLM object (submit, abort, shutdown) runs on that loop, and one
pump coroutine per request (`async for output in request_output`) hands diffs
to the engine core thread through a `threading.Condition`. `step()` waits on
that condition, bounded by `step_wait_s`, until at least one diff, finish or
error is there (no sleep-polling), and never waits when nothing is live.

Failures of one request stay with it: sampling parameters the engine cannot
take (`step.sampling_problem`, checked before anything is submitted), a
`ValueError` from `generate_async` (e.g. a prompt too long) or a per-request
`RequestError` from the stream becomes `StepOutput.failed[slot]`; the other
requests go on. Slot numbers are checked before anything changes, so a step
that raises leaves every request as it was.

A dead executor is not a per-request failure. TensorRT-LLM 1.2 reports the
death of its worker process or of its result thread as a "background error":
the exception lands in the executor's `_error_queue` (the MPI future's done
callback, `ManagedThread`), and is raised, with the executor shut down, the
next time a result or a submit looks at it; a stream whose worker died may
otherwise simply never answer again, and `generate_async` refuses with
"LLM is shutting down" once `executor.is_shutdown()`. So the engine reads
those two signals (plain attribute reads, no IPC) at every step, treats any
exception from a stream that is not a `RequestError` as the executor's, and
declares the executor dead when no request has heard anything for
`executor_stall_s` while some are live. From then on every `step()` raises
`ExecutorDeadError` (a `step.EngineDeadError`) with one message naming the
cause: the engine core declares the engine dead at the first such step, fails
every open session with it, turns /ready to 503 `engine_failed` and stops
admitting.

A request the runtime ends itself (end_id, max_tokens, timeout) becomes `StepOutput.finished[slot]` with
the LLM API's reason ('stop', 'length', 'timeout', 'cancelled'). When it stops
on end_id and the runtime left end_of_speech out of the output, it is appended,
so the protocol parser downstream sees the same clean end as with the torch engine.

Sampling (ARCHITECTURE §3): `tensorrt_llm.SamplingParams(end_id=128258, pad_id=128263,
temperature, top_p, top_k, repetition_penalty, seed, max_tokens,
detokenize=False)`. With the TensorRT backend every request is sampled by the
C++ executor's decoder, whose penalty kernel applies repetition_penalty, so
there is nothing more to switch on. The PyTorch backend's default TorchSampler
accepted and ignored it in the 1.x line (only `sampler_type="TRTLLMSampler"`
honoured it there; TensorRT-LLM PR #16485, issue #9442), which is one reason
this backend loads the engine with `tensorrt_llm._tensorrt_engine.LLM`, not
`tensorrt_llm.LLM`.
max_tokens is clamped to max_seq_len - prompt length: the TensorRT backend
rejects requests whose prompt + max_tokens exceed the engine's max_seq_len.
A session without a seed gets a fresh random one (the runtime's default seed is
0 for every request, which would make equal prompts sound identical).

Frame-position constraint (ARCHITECTURE §3): `FramePositionLogitsProcessor`, a
`BatchedLogitsProcessor` (`tensorrt_llm.sampling_params`) passed to the LLM as
`batched_logits_processor` and switched on per request with
`SamplingParams(apply_batched_logits_processor=True)`. The executor calls it
once per iteration for all constrained requests, on the host, with each
request's logits and tokens; it adds a precomputed row of a [7, vocab] 0/-inf
table (the allowed range of slot p % 7, plus end_of_speech on frame boundaries)
to each request's logits on the executor's stream. The table is built on that
stream too (and each call waits on the event recorded after building it), so
the executor's non-blocking stream never reads a table still being filled on
another one. Cost: see docs/TENSORRT.md (measured by
scripts/bench_logits_processor.py). The batched form is used because it travels to the
executor worker once, at start-up; per-request processors are pickled into
every request and must be on the IPC deserialisation allow-list
(`executor/serialization.py`).

Priority. Sessions before first audio come with a higher `PrefillChunk.priority`.
New requests are submitted highest priority first in each step, so the
runtime's first-come queue admits them first; where `generate_async` accepts a
`priority` argument (added to the LLM API after 1.2, PR #12362) it is passed
too. No version of the API changes the priority of a request already enqueued,
so `plan.priority` has nothing to act on here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..scheduler.step import (
    EngineDeadError,
    EngineError,
    PrefillChunk,
    SamplingParams,
    StepOutput,
    StepPlan,
    sampling_problem,
)
from ..token_format import (
    AUDIO_TOKEN_BASE,
    CODEBOOK_SIZE,
    END_OF_SPEECH,
    PAD,
    START_OF_SPEECH,
    TOKENS_PER_FRAME,
    VOCAB_SIZE,
)
from .base import MemoryReport
from .trtllm_env import MANIFEST_NAME, check_tensorrt_available, engine_mismatch, read_manifest
from .vram_budget import ORPHEUS_3B, LlamaDims, kv_bytes_per_slot

if TYPE_CHECKING:
    from ..config import Config

__all__ = [
    "ExecutorDeadError",
    "FramePositionLogitsProcessor",
    "TrtLlmEngine",
    "TrtLlmEngineSettings",
    "check_tensorrt_available",
    "trtllm_sampling_kwargs",
]

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 120.0


class ExecutorDeadError(EngineDeadError):
    """TensorRT-LLM's executor can serve nothing any more (its worker or result thread died, or it shut
    down); every step raises this until the server is restarted."""


def executor_problem(llm: Any) -> str | None:
    """Why the LLM's executor can no longer serve, or None while it can (or the LLM does not say).

    Reads what TensorRT-LLM 1.2's `GenerationExecutor` exposes: `is_shutdown()` (what
    `LLM.generate_async` and `LLM._check_health` consult) and `_error_queue`, where the worker
    process's done-callback and the background threads put the fatal errors that are otherwise
    raised only at the next submit or result. Attribute reads only: safe from any thread.
    """
    executor = getattr(llm, "_executor", "absent")
    if executor == "absent":
        return None  # not an LLM API object (nothing to read)
    if executor is None:
        return "the executor has shut down"
    is_shutdown = getattr(executor, "is_shutdown", None)
    if callable(is_shutdown) and is_shutdown():
        return "the executor has shut down"
    errors = getattr(executor, "_error_queue", None)
    if errors is not None and not errors.empty():
        return "the executor reported a background error (its worker process or result thread failed)"
    return None


def is_request_error(exc: BaseException) -> bool:
    """A per-request failure (TensorRT-LLM's `RequestError`), as opposed to the executor's.

    Matched by class name along the MRO: the class moved between modules across releases
    (`executor.utils`, re-exported by `executor`), and importing tensorrt_llm needs a CUDA driver."""
    return any(cls.__name__ == "RequestError" for cls in type(exc).__mro__)


# --------------------------------------------------------------- sampling


def trtllm_sampling_kwargs(sampling: SamplingParams, *, max_tokens: int, seed: int) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.SamplingParams` for one session (field names of 1.2.x)."""
    kwargs: dict[str, Any] = {
        "end_id": END_OF_SPEECH,  # stop on end_of_speech
        "pad_id": PAD,
        "max_tokens": max_tokens,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": seed,
        "detokenize": False,  # ids only; nothing is ever turned back into text
        "apply_batched_logits_processor": sampling.constrained,
    }
    if sampling.greedy:
        kwargs["top_k"] = 1  # SamplingParams.params_imply_greedy_decoding: top_k == 1
    else:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    return kwargs


# ------------------------------------------------------- frame constraint


def allowed_row(position: int) -> int:
    """Row of the constraint table for audio position `position` (its slot p % 7)."""
    return position % TOKENS_PER_FRAME


def speech_start_index(token_ids: Sequence[int]) -> int:
    """Index of the last start_of_speech in a request's tokens, -1 if there is none.

    The executor hands the processor a request's tokens; whether they include
    the prompt or not, the audio position of the next token is
    len(tokens) - (this index) - 1, since generated tokens never contain
    start_of_speech.
    """
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] == START_OF_SPEECH:
            return i
    return -1


class FramePositionLogitsProcessor:
    """Batched logits processor enforcing ARCHITECTURE §3's frame-position constraint.

    Call signature of `tensorrt_llm.sampling_params.BatchedLogitsProcessor`:
    (req_ids, logits, token_ids, stream_ptr, client_ids), logits modified in
    place. It is pickled into the executor worker at start-up, so it holds only
    plain state until first called; torch is imported on first call (the
    TensorRT-LLM environment always has it).
    """

    # Requests not seen for this many calls are forgotten (they finished or were aborted).
    forget_after_calls = 4096

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._speech_start: dict[int, int] = {}  # runtime request id -> index of its start_of_speech
        self._last_seen: dict[int, int] = {}  # runtime request id -> call count when last seen
        self._calls = 0
        self._tables: dict[tuple[Any, Any, int], Any] = {}  # (device, dtype, vocab) -> [7, vocab] mask
        self._built: dict[tuple[Any, Any, int], Any] = {}  # same key -> CUDA event recorded after the build

    def __getstate__(self) -> dict[str, Any]:
        return {}  # travels to the executor worker empty; tensors are rebuilt there on first use

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._reset()

    def position(self, req_id: int, token_ids: Sequence[int]) -> int:
        """Audio position of the token about to be sampled for `req_id`."""
        start = self._speech_start.get(req_id)
        if start is None:
            # Scanned once per request, on its first call, when the sequence is at its shortest.
            start = self._speech_start[req_id] = speech_start_index(token_ids)
        self._last_seen[req_id] = self._calls
        return len(token_ids) - start - 1

    def table(self, device: Any, dtype: Any, vocab_size: int) -> Any:
        """The [7, vocab] 0/-inf table, built on first use on the current stream.

        On CUDA the caller must make the stream that reads the table wait for it (`__call__`
        does: it builds and reads on the executor's stream, and waits on the event recorded
        after the build, which also covers a later call on another stream)."""
        key = (device, dtype, vocab_size)
        table = self._tables.get(key)
        if table is None:
            import torch

            table = torch.full((TOKENS_PER_FRAME, vocab_size), float("-inf"), dtype=dtype, device=device)
            for row in range(TOKENS_PER_FRAME):
                lo = AUDIO_TOKEN_BASE + row * CODEBOOK_SIZE
                table[row, lo : lo + CODEBOOK_SIZE] = 0.0
            table[0, END_OF_SPEECH] = 0.0  # the stream may end only on a frame boundary
            if table.is_cuda:
                built = torch.cuda.Event()
                built.record()  # on the current stream: the one the table was filled on
                self._built[key] = built
            self._tables[key] = table
        return table

    def _wait_for_table(self, device: Any, dtype: Any, vocab_size: int) -> None:
        built = self._built.get((device, dtype, vocab_size))
        if built is not None:
            import torch

            torch.cuda.current_stream(device).wait_event(built)  # no-op cost once the build has run

    @staticmethod
    def _on_stream(logits: Any, stream_ptr: int | None) -> Any:
        """The executor's stream as the current one (TensorRT backend), else nothing to switch."""
        if logits.is_cuda and stream_ptr is not None:
            import torch

            return torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=logits.device))
        return contextlib.nullcontext()

    def __call__(
        self,
        req_ids: list[int],
        logits: list[Any],
        token_ids: list[list[list[int]]],
        stream_ptr: int | None,
        client_ids: list[int | None],
    ) -> None:
        if not logits:
            return
        self._calls += 1
        first = logits[0]
        # Everything on the executor's stream, the table's build included: the executor's stream is
        # non-blocking, so it would not wait for a build queued on the default stream.
        with self._on_stream(first, stream_ptr):
            table = self.table(first.device, first.dtype, first.shape[-1])
            self._wait_for_table(first.device, first.dtype, first.shape[-1])
            for req_id, req_logits, beams in zip(req_ids, logits, token_ids, strict=True):
                req_logits += table[allowed_row(self.position(req_id, beams[0]))]
        if self._calls % self.forget_after_calls == 0:
            horizon = self._calls - self.forget_after_calls
            for req_id in [r for r, seen in self._last_seen.items() if seen < horizon]:
                del self._last_seen[req_id]
                del self._speech_start[req_id]


# ------------------------------------------------------------------ engine


@dataclass(frozen=True, slots=True)
class TrtLlmEngineSettings:
    engine_dir: str
    num_slots: int
    max_seq_len: int
    kv_cache_free_gpu_memory_fraction: float = 0.85
    step_wait_s: float = 0.05  # longest a step waits for the first new diff
    # Live requests and not one response from any of them for this long: the executor is stuck or
    # its worker died without a word (a 3B decode iteration takes ~10 ms; a long prefill well under 1 s).
    executor_stall_s: float = 60.0


@dataclass(eq=False)
class _LiveRequest:
    """One session's runtime request. `handle` and `cancel_requested` are touched on the loop
    thread only; the rest under the engine's condition lock."""

    slot: int
    request_id: str
    prompt_len: int
    handle: Any = None
    cancel_requested: bool = False
    pending: list[int] = field(default_factory=list)
    last_token: int | None = None
    last_heard: float = field(default_factory=time.monotonic)  # submitted, or last response
    finish_reason: str | None = None
    error: str | None = None

    @property
    def has_news(self) -> bool:
        return bool(self.pending) or self.finish_reason is not None or self.error is not None


def _accepts_keyword(func: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(func).parameters
    return name in params and params[name].kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


class TrtLlmEngine:
    """TokenEngine over a TensorRT-LLM LLM object (real, or a test fake with the same surface)."""

    def __init__(
        self,
        llm: Any,
        *,
        settings: TrtLlmEngineSettings,
        make_sampling_params: Callable[..., Any],
        dims: LlamaDims = ORPHEUS_3B,
        weights_bytes: int = 0,
    ) -> None:
        self.num_slots = settings.num_slots
        self.max_seq_len = settings.max_seq_len
        self._settings = settings
        self._llm = llm
        self._make_sampling_params = make_sampling_params
        self._dims = dims
        self._weights_bytes = weights_bytes
        self._pass_priority = _accepts_keyword(llm.generate_async, "priority")
        self._cond = threading.Condition()
        self._live: dict[int, _LiveRequest] = {}
        self._closed = False
        self._dead: str | None = None  # why the executor can serve nothing any more
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="trtllm-requests", daemon=True)
        self._loop_thread.start()

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        llm: Any | None = None,
        make_sampling_params: Callable[..., Any] | None = None,
    ) -> TrtLlmEngine:
        """Load `engine.tensorrt.engine_dir` (built by build_engine.py), or wrap an injected LLM."""
        trt = config.engine.tensorrt
        settings = TrtLlmEngineSettings(
            engine_dir=trt.engine_dir,
            num_slots=config.scheduler.max_concurrent_sessions,
            max_seq_len=config.engine.max_seq_len,
            kv_cache_free_gpu_memory_fraction=trt.kv_cache_free_gpu_memory_fraction,
        )
        if llm is None:
            check_tensorrt_available()
            manifest = read_manifest(settings.engine_dir)
            problem = engine_mismatch(manifest, num_slots=settings.num_slots, max_seq_len=settings.max_seq_len)
            if problem is not None:
                raise EngineError(f"{settings.engine_dir}: {problem}")
            llm, make_sampling_params = _load_trtllm(settings)
        elif make_sampling_params is None:
            raise ValueError("an injected LLM needs its SamplingParams class as make_sampling_params")
        else:
            has_manifest = (Path(settings.engine_dir) / MANIFEST_NAME).is_file()
            manifest = read_manifest(settings.engine_dir) if has_manifest else None
        dims = LlamaDims(**manifest["model"]) if manifest else ORPHEUS_3B
        weights = int(manifest["engine_bytes"]) if manifest else 0
        return cls(llm, settings=settings, make_sampling_params=make_sampling_params, dims=dims, weights_bytes=weights)

    # ------------------------------------------------------------- TokenEngine

    def step(self, plan: StepPlan) -> StepOutput:
        started = time.perf_counter()
        if self._closed:
            raise EngineError("the TensorRT-LLM engine is closed")
        self._check_executor()
        for slot in (*plan.release, *(c.slot for c in plan.prefill)):
            self._check_slot(slot)  # raises before anything changes
        for slot in plan.release:
            self._release(slot)
        # Only a session's first chunk means anything to a self-batching runtime; highest priority
        # first, so that the runtime's first-come queue admits new sessions (TTFB) first.
        starts = sorted((c for c in plan.prefill if c.start == 0), key=lambda c: -c.priority)
        for chunk in starts:
            self._submit(chunk)
        out = self._collect()
        self._check_executor()  # it may have died while this step waited
        out.elapsed_s = time.perf_counter() - started
        return out

    def memory_report(self) -> MemoryReport:
        per_slot = kv_bytes_per_slot(self._dims, self.max_seq_len)
        return MemoryReport(
            device="cuda (TensorRT-LLM)",
            weights_bytes=self._weights_bytes,
            kv_cache_bytes=per_slot * self.num_slots,
            kv_bytes_per_slot=per_slot,
            num_slots=self.num_slots,
            max_seq_len=self.max_seq_len,
        )

    def close(self) -> None:
        """Abort every live request, shut the LLM down, stop the private loop."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            live = list(self._live.values())
            self._live.clear()
            self._cond.notify_all()
        done = asyncio.run_coroutine_threadsafe(self._shutdown_on_loop(live), self._loop)
        try:
            done.result(timeout=SHUTDOWN_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()
            self._loop.close()

    # -------------------------------------------------------- engine core side

    def _check_executor(self) -> None:
        """Raise ExecutorDeadError once the executor is dead (see the module docstring)."""
        if self._dead is None:
            problem = executor_problem(self._llm)
            if problem is None:
                with self._cond:
                    # The freshest sign of life of any live request (its submit, or its last response):
                    # requests queued behind running ones are silent, the running ones are not.
                    heard = max((r.last_heard for r in self._live.values()), default=None)
                    live = len(self._live)
                silent = 0.0 if heard is None else time.monotonic() - heard
                if silent > self._settings.executor_stall_s:
                    problem = f"no response from the runtime for {silent:.0f} s with {live} requests live"
            if problem is not None:
                self._declare_dead(problem)
        if self._dead is not None:
            raise ExecutorDeadError(f"TensorRT-LLM executor failed, the server needs a restart: {self._dead}")

    def _declare_dead(self, reason: str) -> None:
        with self._cond:
            if self._dead is not None:
                return
            self._dead = reason
            self._cond.notify_all()  # a step waiting for news has none to wait for
        log.critical("TensorRT-LLM executor failed: %s", reason)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.num_slots - 1}")

    def _release(self, slot: int) -> None:
        with self._cond:
            live = self._live.pop(slot, None)
        if live is not None:
            self._loop.call_soon_threadsafe(self._abort_on_loop, live)

    def _submit(self, chunk: PrefillChunk) -> None:
        self._release(chunk.slot)  # start == 0 (re)initialises the slot
        live = _LiveRequest(slot=chunk.slot, request_id=chunk.request_id, prompt_len=len(chunk.prompt_ids))
        with self._cond:
            self._live[chunk.slot] = live
        problem = sampling_problem(chunk.sampling, VOCAB_SIZE)
        if problem is not None:
            self._fail(live, f"invalid sampling parameters: {problem}")
            return
        room = self.max_seq_len - live.prompt_len
        if room < 1:
            self._fail(live, f"prompt of {live.prompt_len} tokens leaves no room under max_seq_len {self.max_seq_len}")
            return
        seed = chunk.sampling.seed if chunk.sampling.seed is not None else secrets.randbits(63)
        kwargs = trtllm_sampling_kwargs(chunk.sampling, max_tokens=min(chunk.sampling.max_tokens, room), seed=seed)
        try:
            params = self._make_sampling_params(**kwargs)
        except ValueError as exc:  # SamplingParams._validate rejects the values
            self._fail(live, f"invalid sampling parameters: {exc}")
            return
        extra = {"priority": chunk.priority} if self._pass_priority else {}
        future = asyncio.run_coroutine_threadsafe(self._stream(live, list(chunk.prompt_ids), params, extra), self._loop)
        future.add_done_callback(_log_unexpected_failure)

    def _collect(self) -> StepOutput:
        out = StepOutput()
        with self._cond:
            if self._live:
                self._cond.wait_for(
                    lambda: self._closed or self._dead is not None or any(r.has_news for r in self._live.values()),
                    timeout=self._settings.step_wait_s,
                )
            for slot, live in list(self._live.items()):
                if live.pending:
                    out.tokens[slot] = live.pending
                    live.pending = []
                if live.error is not None:
                    out.failed[slot] = live.error
                    del self._live[slot]
                elif live.finish_reason is not None:
                    out.finished[slot] = live.finish_reason
                    del self._live[slot]
        return out

    # ------------------------------------------------------------ loop side

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _stream(self, live: _LiveRequest, prompt_ids: list[int], params: Any, extra: dict[str, Any]) -> None:
        if live.cancel_requested:  # released before it was ever submitted
            return
        try:
            handle = self._llm.generate_async(prompt_ids, sampling_params=params, streaming=True, **extra)
        except Exception as exc:
            # A request the runtime refuses (too long, bad values: ValueError) fails alone; anything else
            # while the executor reports itself down (a background error raised at submit, "LLM is shutting
            # down") is the executor's.
            problem = None if isinstance(exc, ValueError | TypeError) else executor_problem(self._llm)
            if problem is not None and not self._closed:
                self._declare_dead(f"{problem}; {type(exc).__name__}: {exc}")
            self._fail(live, exc)
            return
        live.handle = handle
        try:
            async for output in handle:
                completion = output.outputs[0]
                reason = (completion.finish_reason or "stop") if output.finished else None
                self._deliver(live, list(completion.token_ids_diff), reason)
        except Exception as exc:
            # RequestError is this request's; any other exception out of a stream is a background error
            # (the executor raises those, after shutting itself down, through every result that looks).
            if not is_request_error(exc) and not self._closed:
                self._declare_dead(f"{type(exc).__name__}: {exc}")
            self._fail(live, exc)
            if not handle.finished:
                handle.abort()

    def _abort_on_loop(self, live: _LiveRequest) -> None:
        live.cancel_requested = True
        if live.handle is not None and not live.handle.finished:
            live.handle.abort()

    async def _shutdown_on_loop(self, live: list[_LiveRequest]) -> None:
        for request in live:
            self._abort_on_loop(request)
        current = asyncio.current_task()
        pumps = [t for t in asyncio.all_tasks() if t is not current]
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)  # all CancelledError by now
        self._llm.shutdown()

    def _deliver(self, live: _LiveRequest, diff: list[int], reason: str | None) -> None:
        with self._cond:
            live.last_heard = time.monotonic()
            if self._live.get(live.slot) is not live:
                return  # released meanwhile: nobody is waiting for these tokens
            if diff:
                live.pending.extend(diff)
                live.last_token = diff[-1]
            if reason is not None:
                if reason == "stop" and live.last_token != END_OF_SPEECH:
                    # The runtime stopped on end_id without returning it; the parser expects to see it.
                    live.pending.append(END_OF_SPEECH)
                    live.last_token = END_OF_SPEECH
                live.finish_reason = reason
            self._cond.notify_all()

    def _fail(self, live: _LiveRequest, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._cond:
            live.last_heard = time.monotonic()
            if self._live.get(live.slot) is live:
                live.error = message
                self._cond.notify_all()


def _log_unexpected_failure(future: concurrent.futures.Future[None]) -> None:
    """A pump that raised past its own handling (an abort that failed): say so, loudly."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("TensorRT-LLM request pump failed", exc_info=exc)


def _load_trtllm(settings: TrtLlmEngineSettings) -> tuple[Any, Callable[..., Any]]:
    """Open a built engine with the TensorRT backend of the LLM API (1.2.x names)."""
    # `tensorrt_llm._tensorrt_engine.LLM` is the TensorRT-backend class (`llmapi/llm.py: _TrtLLM`);
    # `tensorrt_llm.LLM` is the PyTorch backend in 1.x.
    from tensorrt_llm import SamplingParams as TrtSamplingParams
    from tensorrt_llm._tensorrt_engine import LLM
    from tensorrt_llm.llmapi import KvCacheConfig

    kv_cache = KvCacheConfig(
        free_gpu_memory_fraction=settings.kv_cache_free_gpu_memory_fraction,
        # Slots are pre-allocated (ARCHITECTURE §5): cap the cache at what they can use and leave the
        # rest of the fraction to the codec, which shares this GPU.
        max_tokens=settings.num_slots * settings.max_seq_len,
    )
    try:
        llm = LLM(
            model=settings.engine_dir,
            skip_tokenizer_init=True,  # ids in, ids out; end_id is given per request
            kv_cache_config=kv_cache,
            batched_logits_processor=FramePositionLogitsProcessor(),
        )
    except Exception as exc:
        raise EngineError(f"TensorRT-LLM could not load the engine in {settings.engine_dir}: {exc}") from exc
    return llm, TrtSamplingParams
