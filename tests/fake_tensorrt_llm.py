"""FakeLLM: a stand-in for the slice of TensorRT-LLM 1.2.x's LLM API that TrtLlmEngine uses.

TensorRT-LLM cannot even be imported without a CUDA GPU, so the adapter's
contract is tested against this fake. It mirrors, by name and behaviour, what
the 1.2.x sources do (llmapi/llm.py, executor/result.py, sampling_params.py):

- `LLM.generate_async(inputs, sampling_params=None, ..., streaming=False)` returns
  a RequestOutput at once. It must be called with an asyncio loop running in the
  calling thread (the real result binds an AsyncQueue to it, `has_event_loop()`);
  here a call from elsewhere raises RuntimeError. It raises ValueError when
  prompt + max_tokens exceed max_seq_len (`BaseLLM._check_arguments`), and
  RuntimeError after shutdown.
- `async for output in request_output` yields the same object after each
  response; `outputs[0].token_ids`, `token_ids_diff`, `finish_reason`
  ('stop' on end_id, 'length' on max_tokens, 'cancelled' after abort);
  `finished`; `abort()`. A per-request error is raised from the iteration.
- In-flight batching: up to `max_batch_size` requests run; the rest wait in a
  first-come queue. `FakeLLMWithPriority` has the later API (PR #12362) whose
  `generate_async` takes `priority` and whose queue serves higher priority first.
- `batched_logits_processor`: called once per iteration for the running
  requests submitted with `apply_batched_logits_processor=True`, with the
  (req_ids, logits, token_ids, stream_ptr, client_ids) arguments of
  `BatchedLogitsProcessor`, token_ids including the prompt.
- Errors (executor/executor.py, executor/proxy.py): a per-request failure is a
  `RequestError` raised from that request's iteration. A fatal one (the worker
  process or a background thread died) goes into `llm._executor._error_queue`
  and is raised, after the executor shuts itself down, by the next submit
  (`_handle_background_error`) or by a result that receives an error response;
  a stream whose worker died otherwise never hears again. `generate_async`
  raises RuntimeError("LLM is shutting down") once `_executor.is_shutdown()`.
  `kill_executor()` does that to the fake.

The runtime advances only when a test calls `iterate()`: one token for every
running request, delivered to the request's loop thread like the real
executor's response thread does.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orpheus_serve.token_format import AUDIO_TOKEN_BASE, CODEBOOK_SIZE, END_OF_SPEECH, TOKENS_PER_FRAME, VOCAB_SIZE


@dataclass(kw_only=True)
class FakeSamplingParams:
    """The fields of tensorrt_llm.SamplingParams (1.2.x) the engine sets, with its validation."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    detokenize: bool = True
    apply_batched_logits_processor: bool = False

    def __post_init__(self) -> None:
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")


class RequestError(RuntimeError):
    """Same name as tensorrt_llm.executor.utils.RequestError (a per-request failure)."""


class FakeRequestError(RequestError):
    """A per-request failure raised by the fake runtime."""


class FakeExecutor:
    """`llm._executor` (GenerationExecutor, 1.2.x): `is_shutdown()` and the `_error_queue` of fatal errors."""

    def __init__(self) -> None:
        self.doing_shutdown = False
        self._error_queue: queue.Queue[BaseException] = queue.Queue()

    def is_shutdown(self) -> bool:
        return self.doing_shutdown

    def handle_background_error(self) -> None:
        """`GenerationExecutor._handle_background_error`: raise the first fatal error, shut down first."""
        if not self._error_queue.empty():
            error = self._error_queue.get()
            self.doing_shutdown = True
            raise error


@dataclass
class FakeCompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


class FakeRequestOutput:
    def __init__(self, llm: FakeLLM, request_id: int, prompt_token_ids: list[int], params: FakeSamplingParams,
                 priority: float) -> None:
        self._loop = asyncio.get_running_loop()  # like has_event_loop(): no loop, no async results
        self._queue: asyncio.Queue[tuple[list[int], str | None] | BaseException] = asyncio.Queue()
        self._llm = llm
        self._done = False
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self.priority = priority
        self.outputs = [FakeCompletionOutput(0)]
        self.abort_calls = 0
        # runtime-side state (guarded by the FakeLLM's lock)
        self.generated: list[int] = []
        self.admitted_at: int | None = None
        self.runtime_done = False

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self.abort_calls += 1
        self._llm._request_abort(self)

    def __aiter__(self) -> FakeRequestOutput:
        return self

    async def __anext__(self) -> FakeRequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        tokens, reason = item
        completion = self.outputs[0]
        completion._last_token_ids_len = len(completion.token_ids)
        completion.token_ids.extend(tokens)
        if reason is not None:
            completion.finish_reason = reason
            self._done = True
        return self

    def _push(self, item: tuple[list[int], str | None] | BaseException) -> None:
        """From the runtime (test) thread to the loop that owns this result."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


def scripted_audio_token(request: FakeRequestOutput, n: int, frames: int) -> int:
    """Token n of a scripted answer: `frames` valid frames, then end_of_speech."""
    if n >= frames * TOKENS_PER_FRAME:
        return END_OF_SPEECH
    code = (n * 37 + request.request_id * 11) % CODEBOOK_SIZE
    return AUDIO_TOKEN_BASE + (n % TOKENS_PER_FRAME) * CODEBOOK_SIZE + code


class FakeLLM:
    """Fake of `tensorrt_llm._tensorrt_engine.LLM` (1.2.x surface: generate_async without priority)."""

    def __init__(
        self,
        *,
        max_batch_size: int = 64,
        max_seq_len: int = 4096,
        frames_per_request: int = 2,
        include_end_token: bool = True,
        batched_logits_processor: Callable[..., None] | None = None,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.frames_per_request = frames_per_request
        self.include_end_token = include_end_token
        self.batched_logits_processor = batched_logits_processor
        self.vocab_size = vocab_size
        self.submitted: list[FakeRequestOutput] = []
        self.refuse_prompts_with: set[int] = set()  # marker token in the prompt -> ValueError at submit
        self.error_after_tokens: dict[int, int] = {}  # marker token -> tokens delivered before a RequestError
        self.processed_by_logits_processor: set[int] = set()
        self.iterations = 0
        self.shutdown_calls = 0
        self.dead = False
        self._waiting: list[FakeRequestOutput] = []
        self._running: list[FakeRequestOutput] = []
        self._aborts: list[FakeRequestOutput] = []
        self._next_id = 1
        self._cond = threading.Condition()
        self._executor = FakeExecutor()

    # ------------------------------------------------------------- API surface

    def generate_async(self, inputs: Sequence[int], sampling_params: FakeSamplingParams | None = None,
                       streaming: bool = False, **kwargs: Any) -> FakeRequestOutput:
        return self._enqueue(inputs, sampling_params, streaming, priority=0.5, **kwargs)

    def shutdown(self) -> None:
        with self._cond:
            self.shutdown_calls += 1
            self._executor.doing_shutdown = True

    def kill_executor(self, error: BaseException, *, tell_streams: bool = False) -> None:
        """The worker process dies with `error`: nothing runs any more. The error waits in the executor's
        error queue for the next submit; with `tell_streams`, every open stream also receives it as an
        error response and raises it (and the executor shuts down), as the result thread does then."""
        with self._cond:
            self.dead = True
            if tell_streams:
                self._executor.doing_shutdown = True
                for request in [*self._running, *self._waiting]:
                    request.runtime_done = True
                    request._push(error)
                self._running.clear()
                self._waiting.clear()
            else:
                self._executor._error_queue.put(error)

    # ------------------------------------------------------------ test control

    def wait_for_submissions(self, count: int, timeout: float = 10.0) -> list[FakeRequestOutput]:
        """Block until `count` requests have been submitted (they arrive on the engine's loop thread)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.submitted) >= count, timeout=timeout):
                raise TimeoutError(f"only {len(self.submitted)} of {count} requests were submitted")
            return list(self.submitted)

    def wait_for_aborts(self, count: int, timeout: float = 10.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: sum(r.abort_calls > 0 for r in self.submitted) >= count,
                                       timeout=timeout):
                raise TimeoutError("abort was not called")

    @property
    def running(self) -> list[FakeRequestOutput]:
        with self._cond:
            return list(self._running)

    @property
    def waiting(self) -> list[FakeRequestOutput]:
        with self._cond:
            return list(self._waiting)

    def iterate(self) -> None:
        """One runtime iteration: settle aborts, admit from the queue, one token per running request."""
        with self._cond:
            if self.dead:
                return  # a dead worker produces nothing
            self.iterations += 1
            for request in self._aborts:
                if not request.runtime_done:
                    request.runtime_done = True
                    request._push(([], "cancelled"))
                    self._forget(request)
            self._aborts.clear()
            while self._waiting and len(self._running) < self.max_batch_size:
                request = self._waiting.pop(0)
                request.admitted_at = self.iterations
                self._running.append(request)
            constrained = [r for r in self._running if r.sampling_params.apply_batched_logits_processor]
            sampled = self._sample_constrained(constrained) if self.batched_logits_processor and constrained else {}
            for request in list(self._running):
                self._advance(request, sampled.get(request.request_id))

    # ------------------------------------------------------------- internals

    def _enqueue(self, inputs: Sequence[int], params: FakeSamplingParams | None, streaming: bool,
                 priority: float, **kwargs: Any) -> FakeRequestOutput:
        if kwargs:
            raise TypeError(f"generate_async() got unexpected keyword arguments {sorted(kwargs)}")
        prompt = list(inputs)
        params = params or FakeSamplingParams()
        with self._cond:
            if self._executor.is_shutdown():
                raise RuntimeError("LLM is shutting down")
            self._executor.handle_background_error()  # submit() raises a pending fatal error
        if not streaming:
            raise ValueError("this fake only streams")
        if any(t in self.refuse_prompts_with for t in prompt):
            raise ValueError("refused by FakeLLM (refuse_prompts_with)")
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise ValueError(
                f"The sum of prompt length ({len(prompt)}) and max_tokens ({params.max_tokens}) should not exceed "
                f"max_seq_len ({self.max_seq_len})"
            )
        with self._cond:
            request = FakeRequestOutput(self, self._next_id, prompt, params, priority)
            self._next_id += 1
            self.submitted.append(request)
            self._waiting.append(request)
            self._sort_waiting()
            self._cond.notify_all()
        return request

    def _sort_waiting(self) -> None:
        """First come, first served (1.2.x: every request has the default priority)."""

    def _request_abort(self, request: FakeRequestOutput) -> None:
        with self._cond:
            self._aborts.append(request)
            self._cond.notify_all()

    def _forget(self, request: FakeRequestOutput) -> None:
        if request in self._running:
            self._running.remove(request)
        if request in self._waiting:
            self._waiting.remove(request)

    def _sample_constrained(self, requests: list[FakeRequestOutput]) -> dict[int, int]:
        """Seeded random logits through the batched logits processor, then argmax."""
        import torch

        logits = []
        for request in requests:
            generator = torch.Generator().manual_seed((request.sampling_params.seed or 0) + len(request.generated))
            logits.append(torch.randn(1, 1, self.vocab_size, generator=generator))
        req_ids = [r.request_id for r in requests]
        token_ids = [[r.prompt_token_ids + r.generated] for r in requests]
        self.batched_logits_processor(req_ids, logits, token_ids, None, req_ids)
        self.processed_by_logits_processor.update(req_ids)
        return {r.request_id: int(t.reshape(-1).argmax()) for r, t in zip(requests, logits, strict=True)}

    def _advance(self, request: FakeRequestOutput, sampled: int | None) -> None:
        marker_errors = [n for t, n in self.error_after_tokens.items() if t in request.prompt_token_ids]
        if marker_errors and len(request.generated) >= marker_errors[0]:
            request.runtime_done = True
            request._push(FakeRequestError(f"request {request.request_id} failed in the fake runtime"))
            self._forget(request)
            return
        n = len(request.generated)
        token = sampled if sampled is not None else scripted_audio_token(request, n, self.frames_per_request)
        request.generated.append(token)
        params = request.sampling_params
        if token == params.end_id:
            request.runtime_done = True
            request._push(([token] if self.include_end_token else [], "stop"))
            self._forget(request)
        elif len(request.generated) >= params.max_tokens:
            request.runtime_done = True
            request._push(([token], "length"))
            self._forget(request)
        else:
            request._push(([token], None))


class FakeLLMWithPriority(FakeLLM):
    """The LLM API after 1.2 (PR #12362): `generate_async(..., priority=)` and a priority-ordered queue."""

    def generate_async(self, inputs: Sequence[int], sampling_params: FakeSamplingParams | None = None,
                       streaming: bool = False, priority: float = 0.5, **kwargs: Any) -> FakeRequestOutput:
        if not 0.0 <= priority <= 1.0:
            raise ValueError(f"priority must be in [0, 1], got {priority}")
        return self._enqueue(inputs, sampling_params, streaming, priority=priority, **kwargs)

    def _sort_waiting(self) -> None:
        self._waiting.sort(key=lambda r: -r.priority)  # stable: first come first among equals
