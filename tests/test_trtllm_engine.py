"""Contract tests of TrtLlmEngine against FakeLLM (the TensorRT-LLM 1.2.x API surface it uses).

Streaming diffs, end-of-speech handling, cancel mid-stream, one request's error
not touching the others, priority, sampling parameters, the frame-position
logits processor in the loop, the bounded wait of step(), and close().
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

import pytest
import torch
from fake_tensorrt_llm import (
    FakeExecutor,
    FakeLLM,
    FakeLLMWithPriority,
    FakeRequestError,
    FakeSamplingParams,
    scripted_audio_token,
)

from orpheus_serve.config import load_config
from orpheus_serve.engines.base import TokenEngine
from orpheus_serve.engines.trtllm_build import BuildSettings, CheckpointDigest, GpuInfo, build_manifest, write_manifest
from orpheus_serve.engines.trtllm_engine import (
    ExecutorDeadError,
    FramePositionLogitsProcessor,
    TrtLlmEngine,
    TrtLlmEngineSettings,
    executor_problem,
    is_request_error,
    speech_start_index,
    trtllm_sampling_kwargs,
)
from orpheus_serve.engines.vram_budget import ORPHEUS_3B, LlamaDims, kv_bytes_per_slot
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.token_format import (
    AUDIO_TOKEN_BASE,
    BOS,
    CODEBOOK_SIZE,
    END_OF_SPEECH,
    PAD,
    PROMPT_SUFFIX,
    START_OF_HUMAN,
    VOCAB_SIZE,
    FrameParser,
)

STEP_WAIT_S = 0.2


def prompt(marker: int, length: int = 12) -> tuple[int, ...]:
    """An Orpheus-shaped prompt whose text part starts with `marker` (to address it in the fake)."""
    body = [marker + i for i in range(length - 2 - len(PROMPT_SUFFIX))]
    return (START_OF_HUMAN, BOS, *body, *PROMPT_SUFFIX)


def chunk(slot: int, ids: tuple[int, ...], *, start: int = 0, end: int | None = None, priority: float = 0.5,
          sampling: SamplingParams | None = None) -> PrefillChunk:
    return PrefillChunk(slot=slot, request_id=f"req-{slot}-{ids[2]}", prompt_ids=ids, start=start,
                        end=len(ids) if end is None else end, sampling=sampling or SamplingParams(), priority=priority)


@dataclass
class Collected:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    def add(self, out) -> None:
        for slot, ids in out.tokens.items():
            self.tokens.setdefault(slot, []).extend(ids)
        for slot, why in out.finished.items():
            assert slot not in self.finished, f"slot {slot} reported finished twice"
            self.finished[slot] = why
        for slot, why in out.failed.items():
            assert slot not in self.failed, f"slot {slot} reported failed twice"
            self.failed[slot] = why


def run_until(engine: TrtLlmEngine, fake: FakeLLM, done: Callable[[Collected], bool], *, iterate: bool = True,
              collected: Collected | None = None, max_steps: int = 300) -> Collected:
    """Advance the fake runtime and step the engine until `done` holds (bounded)."""
    c = collected if collected is not None else Collected()
    if done(c):
        return c
    for _ in range(max_steps):
        if iterate:
            fake.iterate()
        c.add(engine.step(StepPlan()))
        if done(c):
            return c
    raise AssertionError(f"condition not reached after {max_steps} steps: {c}")


@pytest.fixture
def engines() -> Iterator[Callable[..., TrtLlmEngine]]:
    made: list[TrtLlmEngine] = []

    def make(fake: FakeLLM, *, num_slots: int = 4, max_seq_len: int = 4096,
             step_wait_s: float = STEP_WAIT_S) -> TrtLlmEngine:
        settings = TrtLlmEngineSettings(engine_dir="unused", num_slots=num_slots, max_seq_len=max_seq_len,
                                        step_wait_s=step_wait_s)
        engine = TrtLlmEngine(fake, settings=settings, make_sampling_params=FakeSamplingParams)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_is_a_token_engine(engines) -> None:
    assert isinstance(engines(FakeLLM()), TokenEngine)


# ---------------------------------------------------------------- streaming


def test_streams_token_diffs_until_end_of_speech(engines) -> None:
    fake = FakeLLM(frames_per_request=2)
    engine = engines(fake)
    ids = prompt(1000)
    engine.step(StepPlan(prefill=[chunk(0, ids)], decode=[0]))
    (request,) = fake.wait_for_submissions(1)

    c = run_until(engine, fake, lambda c: 0 in c.finished)

    expected = [scripted_audio_token(request, n, 2) for n in range(2 * 7)] + [END_OF_SPEECH]
    assert c.tokens[0] == expected
    assert c.finished == {0: "stop"}
    assert c.failed == {}
    assert request.prompt_token_ids == list(ids)  # ids in, never a string
    parser = FrameParser()
    assert parser.feed_many(c.tokens[0]).shape == (2, 7)
    assert parser.ended and parser.dropped_tokens == 0
    # finished means forgotten: later steps say nothing more about slot 0
    again = engine.step(StepPlan())
    assert again.tokens == {} and again.finished == {}


def test_several_tokens_per_slot_accumulate_between_steps(engines) -> None:
    fake = FakeLLM(frames_per_request=3)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    fake.wait_for_submissions(1)
    for _ in range(5):
        fake.iterate()
    c = run_until(engine, fake, lambda c: len(c.tokens.get(0, [])) >= 5, iterate=False)
    assert len(c.tokens[0]) == 5  # five runtime iterations, five tokens, however many steps


def test_end_of_speech_appended_when_runtime_omits_it(engines) -> None:
    fake = FakeLLM(frames_per_request=1, include_end_token=False)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    fake.wait_for_submissions(1)
    c = run_until(engine, fake, lambda c: 0 in c.finished)
    assert c.tokens[0][-1] == END_OF_SPEECH and c.tokens[0].count(END_OF_SPEECH) == 1
    assert len(c.tokens[0]) == 8
    assert c.finished[0] == "stop"


def test_length_finish_is_reported(engines) -> None:
    fake = FakeLLM(frames_per_request=10)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000), sampling=SamplingParams(max_tokens=9))]))
    fake.wait_for_submissions(1)
    c = run_until(engine, fake, lambda c: 0 in c.finished)
    assert c.finished[0] == "length"
    assert len(c.tokens[0]) == 9 and END_OF_SPEECH not in c.tokens[0]


def test_later_prefill_chunks_and_decode_slots_are_ignored(engines) -> None:
    fake = FakeLLM(frames_per_request=1)
    engine = engines(fake)
    ids = prompt(1000, length=20)
    engine.step(StepPlan(prefill=[chunk(0, ids, start=0, end=8)]))
    engine.step(StepPlan(prefill=[chunk(0, ids, start=8, end=16)], decode=[0, 1, 2]))
    engine.step(StepPlan(prefill=[chunk(0, ids, start=16)], decode=[0]))
    fake.wait_for_submissions(1)
    run_until(engine, fake, lambda c: 0 in c.finished)
    assert len(fake.submitted) == 1
    assert fake.submitted[0].prompt_token_ids == list(ids)  # the whole prompt, with the first chunk


def test_two_sessions_stream_independently(engines) -> None:
    fake = FakeLLM(frames_per_request=2)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000)), chunk(3, prompt(2000))]))
    first, second = fake.wait_for_submissions(2)
    c = run_until(engine, fake, lambda c: {0, 3} <= c.finished.keys())
    by_marker = {r.prompt_token_ids[2]: r for r in (first, second)}
    for slot, marker in ((0, 1000), (3, 2000)):
        assert c.tokens[slot] == [*by_marker[marker].generated]
    assert c.tokens[0] != c.tokens[3]  # each slot got its own request's tokens


# ------------------------------------------------------------------ sampling


def test_sampling_parameters_reach_the_runtime(engines) -> None:
    fake = FakeLLM()
    engine = engines(fake, max_seq_len=4096)
    ids = prompt(1000)
    engine.step(StepPlan(prefill=[chunk(0, ids), chunk(1, prompt(2000), sampling=SamplingParams(seed=7))]))
    requests = {r.prompt_token_ids[2]: r for r in fake.wait_for_submissions(2)}
    params = requests[1000].sampling_params
    assert params.end_id == END_OF_SPEECH == 128258
    assert params.pad_id == PAD
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.8, 0)
    assert params.repetition_penalty == 1.1
    assert params.detokenize is False
    assert params.apply_batched_logits_processor is True
    assert params.max_tokens == 1400
    assert params.seed is not None  # drawn per session: the runtime default would be 0 for everyone
    assert requests[2000].sampling_params.seed == 7


def test_unseeded_sessions_get_different_seeds(engines) -> None:
    fake = FakeLLM()
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000)), chunk(1, prompt(1000))]))
    a, b = fake.wait_for_submissions(2)
    assert a.sampling_params.seed != b.sampling_params.seed


def test_max_tokens_clamped_to_the_room_left_under_max_seq_len(engines) -> None:
    fake = FakeLLM(max_seq_len=40)
    engine = engines(fake, max_seq_len=40)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000, length=12))]))
    (request,) = fake.wait_for_submissions(1)
    assert request.sampling_params.max_tokens == 28


def test_prompt_without_room_fails_only_that_slot(engines) -> None:
    fake = FakeLLM(frames_per_request=1, max_seq_len=20)
    engine = engines(fake, max_seq_len=20)
    out = engine.step(StepPlan(prefill=[chunk(0, prompt(1000, length=20)), chunk(1, prompt(2000, length=10))]))
    assert "max_seq_len 20" in out.failed[0]
    (request,) = fake.wait_for_submissions(1)  # only the one that fits reached the runtime
    assert request.prompt_token_ids[2] == 2000
    c = run_until(engine, fake, lambda c: 1 in c.finished)
    assert c.finished == {1: "stop"} and 0 not in c.tokens


def test_sampling_kwargs_mapping() -> None:
    kw = trtllm_sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.3,
                                               constrained=False), max_tokens=100, seed=3)
    assert kw == {"end_id": END_OF_SPEECH, "pad_id": PAD, "max_tokens": 100, "repetition_penalty": 1.3, "seed": 3,
                  "detokenize": False, "apply_batched_logits_processor": False, "temperature": 0.7, "top_p": 0.9,
                  "top_k": 40}
    greedy = trtllm_sampling_kwargs(SamplingParams(temperature=0.0), max_tokens=5, seed=1)
    assert greedy["top_k"] == 1 and "temperature" not in greedy and "top_p" not in greedy
    FakeSamplingParams(**kw)  # every name is a SamplingParams field


def test_invalid_sampling_fails_only_that_slot(engines) -> None:
    fake = FakeLLM(frames_per_request=1)
    engine = engines(fake)
    bad = SamplingParams(top_p=1.5)
    out = engine.step(StepPlan(prefill=[chunk(0, prompt(1000), sampling=bad), chunk(1, prompt(2000))]))
    assert "top_p" in out.failed[0]
    fake.wait_for_submissions(1)
    c = run_until(engine, fake, lambda c: 1 in c.finished)
    assert c.finished == {1: "stop"}


# -------------------------------------------------------------------- cancel


def test_cancel_mid_stream_aborts_and_frees_the_runtime_slot(engines) -> None:
    fake = FakeLLM(frames_per_request=50, max_batch_size=2)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000)), chunk(1, prompt(2000)), chunk(2, prompt(3000))]))
    fake.wait_for_submissions(3)
    c = run_until(engine, fake, lambda c: len(c.tokens.get(0, [])) >= 3 and len(c.tokens.get(1, [])) >= 3)
    assert 2 not in c.tokens  # waiting: the runtime batch holds two
    cancelled = next(r for r in fake.submitted if r.prompt_token_ids[2] == 1000)

    out = engine.step(StepPlan(release=[0]))
    fake.wait_for_aborts(1)
    assert cancelled.abort_calls == 1
    after = Collected()
    after.add(out)
    run_until(engine, fake, lambda c: len(c.tokens.get(2, [])) >= 3, collected=after)

    assert 0 not in after.tokens and 0 not in after.finished and 0 not in after.failed
    assert cancelled.outputs[0].finish_reason == "cancelled"  # the runtime ended it
    assert len(after.tokens[1]) >= 3  # the neighbour never stopped
    assert cancelled not in fake.running


def test_release_and_reuse_of_a_slot_in_one_plan(engines) -> None:
    fake = FakeLLM(frames_per_request=50)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    fake.wait_for_submissions(1)
    run_until(engine, fake, lambda c: len(c.tokens.get(0, [])) >= 2)
    fake.iterate()  # a token of the old request is in flight when the slot changes hands

    out = engine.step(StepPlan(release=[0], prefill=[chunk(0, prompt(2000))]))
    old, new = fake.wait_for_submissions(2)
    c = Collected()
    c.add(out)
    run_until(engine, fake, lambda c: len(c.tokens.get(0, [])) >= 4, collected=c)
    assert c.tokens[0] == new.generated[: len(c.tokens[0])]  # nothing of the old request leaks in
    assert old.abort_calls == 1


def test_release_of_an_unknown_or_finished_slot_is_harmless(engines) -> None:
    fake = FakeLLM(frames_per_request=1)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    fake.wait_for_submissions(1)
    run_until(engine, fake, lambda c: 0 in c.finished)
    engine.step(StepPlan(release=[0, 2]))
    assert fake.submitted[0].abort_calls == 0


def test_slot_out_of_range_is_a_programming_error(engines) -> None:
    engine = engines(FakeLLM(), num_slots=2)
    with pytest.raises(ValueError, match="slot 2"):
        engine.step(StepPlan(prefill=[chunk(2, prompt(1000))]))


# -------------------------------------------------------------------- errors


def test_error_on_one_request_does_not_affect_others(engines) -> None:
    fake = FakeLLM(frames_per_request=2)
    fake.error_after_tokens[1000] = 3
    fake.refuse_prompts_with.add(3000)
    engine = engines(fake)
    c = Collected()
    c.add(engine.step(StepPlan(prefill=[chunk(0, prompt(1000)), chunk(1, prompt(2000)), chunk(2, prompt(3000))])))
    fake.wait_for_submissions(2)

    run_until(engine, fake, lambda c: {0, 2} <= c.failed.keys() and 1 in c.finished, collected=c)

    assert "FakeRequestError" in c.failed[0]
    assert len(c.tokens[0]) == 3  # what arrived before the error is still delivered
    assert "ValueError" in c.failed[2] and 2 not in c.tokens
    assert c.finished == {1: "stop"}
    healthy = next(r for r in fake.submitted if r.prompt_token_ids[2] == 2000)
    assert c.tokens[1] == healthy.generated and len(c.tokens[1]) == 15
    # the slots of failed sessions are free for new ones
    engine.step(StepPlan(release=[0, 2], prefill=[chunk(0, prompt(4000))]))
    fake.wait_for_submissions(3)
    assert run_until(engine, fake, lambda c: 0 in c.finished).finished == {0: "stop"}


def test_runtime_shut_down_is_a_dead_engine(engines) -> None:
    fake = FakeLLM()
    engine = engines(fake)
    fake.shutdown()
    for _ in range(2):  # every step from then on, with one message
        with pytest.raises(ExecutorDeadError, match="executor has shut down"):
            engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    assert fake.submitted == []


# ------------------------------------------------------------ dead executor


def start_two(engine: TrtLlmEngine, fake: FakeLLM) -> Collected:
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000)), chunk(1, prompt(2000))]))
    fake.wait_for_submissions(2)
    return run_until(engine, fake, lambda c: all(len(c.tokens.get(s, [])) >= 2 for s in (0, 1)))


def test_worker_death_reported_only_in_the_error_queue_is_detected(engines) -> None:
    """The worker process died: its streams go silent; the error waits in the executor's queue."""
    fake = FakeLLM(frames_per_request=20)
    engine = engines(fake)
    start_two(engine, fake)
    fake.kill_executor(RuntimeError("Executor worker died: CUDA error: an illegal memory access"))
    with pytest.raises(ExecutorDeadError, match="background error") as dead:
        engine.step(StepPlan(decode=[0, 1]))
    assert "restart" in str(dead.value)
    with pytest.raises(ExecutorDeadError):  # and on every later step, releases included
        engine.step(StepPlan(release=[0]))
    assert not fake._executor._error_queue.empty()  # only looked at: the runtime's own handler raises it


def test_background_error_raised_through_the_streams_is_the_executors(engines) -> None:
    fake = FakeLLM(frames_per_request=20)
    engine = engines(fake)
    start_two(engine, fake)
    fake.kill_executor(RuntimeError("proxy_dispatch_result_thread: ZMQ socket closed"), tell_streams=True)
    fake._executor = FakeExecutor()  # so that only the streams can tell (the real one says it shut down too)
    with pytest.raises(ExecutorDeadError, match="ZMQ socket closed"):
        for _ in range(50):  # the pumps hear it on the loop thread; a step or two later at most
            engine.step(StepPlan(decode=[0, 1]))


def test_fatal_error_at_submit_is_the_executors(engines) -> None:
    """The error lands between a step's check and the submit, which raises it with the executor shut down."""
    fake = FakeLLM()
    engine = engines(fake)

    def dies_at_submit(*args: object, **kwargs: object) -> None:
        fake._executor.doing_shutdown = True  # _handle_background_error shuts down, then raises
        raise RuntimeError("MPI worker exited with code 134")

    fake.generate_async = dies_at_submit
    with pytest.raises(ExecutorDeadError, match="code 134"):
        engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
        for _ in range(50):
            engine.step(StepPlan())


def test_a_refused_request_does_not_kill_the_executor(engines) -> None:
    fake = FakeLLM()
    fake.refuse_prompts_with.add(1000)
    engine = engines(fake)
    c = Collected()
    c.add(engine.step(StepPlan(prefill=[chunk(0, prompt(1000))])))
    run_until(engine, fake, lambda c: 0 in c.failed, iterate=False, collected=c)
    assert "ValueError" in c.failed[0]
    engine.step(StepPlan(prefill=[chunk(1, prompt(2000))]))  # and the next one is served
    fake.wait_for_submissions(1)


def test_a_runtime_that_stops_answering_is_declared_dead(engines) -> None:
    fake = FakeLLM()
    settings = TrtLlmEngineSettings(engine_dir="unused", num_slots=4, max_seq_len=4096, step_wait_s=0.05,
                                    executor_stall_s=0.3)
    engine = TrtLlmEngine(fake, settings=settings, make_sampling_params=FakeSamplingParams)
    try:
        engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
        fake.wait_for_submissions(1)
        deadline = time.monotonic() + 5
        with pytest.raises(ExecutorDeadError, match="no response from the runtime"):
            while time.monotonic() < deadline:
                engine.step(StepPlan(decode=[0]))  # the fake never iterates: not one token comes
    finally:
        engine.close()


def test_an_idle_engine_is_not_a_stalled_one(engines) -> None:
    fake = FakeLLM(frames_per_request=1)
    settings = TrtLlmEngineSettings(engine_dir="unused", num_slots=4, max_seq_len=4096, step_wait_s=0.05,
                                    executor_stall_s=0.2)
    engine = TrtLlmEngine(fake, settings=settings, make_sampling_params=FakeSamplingParams)
    try:
        time.sleep(0.3)  # idle longer than the stall limit, then a request: its clock starts at its submit
        engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
        fake.wait_for_submissions(1)
        assert run_until(engine, fake, lambda c: 0 in c.finished).finished == {0: "stop"}
    finally:
        engine.close()


def test_request_errors_are_told_from_executor_errors() -> None:
    assert is_request_error(FakeRequestError("bad request"))
    assert not is_request_error(RuntimeError("worker died"))
    assert executor_problem(object()) is None  # not an LLM API object: nothing to read
    fake = FakeLLM()
    assert executor_problem(fake) is None
    fake._executor._error_queue.put(RuntimeError("x"))
    assert "background error" in (executor_problem(fake) or "")


def test_dead_executor_fails_every_open_session_and_stops_admission() -> None:
    """With the real engine core: one clear error for every open stream, the engine declared dead (so /ready
    answers 503 engine_failed), and no new session admitted."""
    from orpheus_serve.codec.sim import SimDecoder
    from orpheus_serve.codec.worker import CodecWorker
    from orpheus_serve.config import SchedulerConfig
    from orpheus_serve.core.engine_core import EngineCore
    from orpheus_serve.request.errors import ServiceUnavailableError
    from orpheus_serve.scheduler import Scheduler, SchedulerEvent, SessionFailed, SessionFinished
    from orpheus_serve.scheduler.session import SessionRequest

    fake = FakeLLM(frames_per_request=200)
    settings = TrtLlmEngineSettings(engine_dir="unused", num_slots=4, max_seq_len=4096, step_wait_s=0.02)
    engine = TrtLlmEngine(fake, settings=settings, make_sampling_params=FakeSamplingParams)
    scheduler = Scheduler(SchedulerConfig(max_concurrent_sessions=4, max_batch_size=4), 4, max_seq_len=4096)
    errors: dict[str, str] = {}
    tokens: dict[str, int] = {}
    ended = threading.Event()

    def on_event(event: SchedulerEvent) -> None:
        if isinstance(event, SessionFailed):
            errors[event.request_id] = event.error
        elif isinstance(event, SessionFinished) and event.reason not in ("stop", "length"):
            errors.setdefault(event.request_id, event.reason)
        if len(errors) == 3:
            ended.set()

    codec = CodecWorker(SimDecoder(realtime=False), lambda result: None)
    core = EngineCore(scheduler, engine, codec, on_event,
                      on_frames=lambda e: tokens.__setitem__(e.request_id, tokens.get(e.request_id, 0) + 1))
    stop = threading.Event()

    def runtime() -> None:  # the runtime iterates on its own, like the executor's loop
        while not stop.is_set():
            fake.iterate()
            time.sleep(0.005)

    spinner = threading.Thread(target=runtime, daemon=True)
    for i in range(3):
        core.submit(SessionRequest(request_id=f"s{i}", prompt_ids=prompt(1000 * (i + 1)),
                                   sampling=SamplingParams(max_tokens=1400), arrival_s=time.monotonic()))
    codec.start()
    core.start()
    spinner.start()
    try:
        deadline = time.monotonic() + 20
        while len(tokens) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tokens) == 3, "every session streamed frames before the failure"
        fake.kill_executor(RuntimeError("Executor worker died: CUDA error: an illegal memory access"))
        assert ended.wait(20), errors
        assert set(errors) == {"s0", "s1", "s2"}
        assert all("TensorRT-LLM executor failed" in e for e in errors.values()), errors
        assert not core.engine_alive and "background error" in (core.engine_failure or "")
        with pytest.raises(ServiceUnavailableError):
            core.submit(SessionRequest(request_id="late", prompt_ids=prompt(5000), sampling=SamplingParams(),
                                       arrival_s=time.monotonic()))
    finally:
        stop.set()
        spinner.join()
        core.stop()
        codec.stop(5.0)
        engine.close()


# ------------------------------------------------------------------ priority


def test_new_sessions_are_submitted_highest_priority_first(engines) -> None:
    fake = FakeLLM(frames_per_request=1, max_batch_size=1)  # 1.2.x: no priority argument, first come first served
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000), priority=0.2), chunk(1, prompt(2000), priority=0.9),
                                  chunk(2, prompt(3000), priority=0.5)]))
    submitted = fake.wait_for_submissions(3)
    assert [r.prompt_token_ids[2] for r in submitted] == [2000, 3000, 1000]
    assert all(r.priority == 0.5 for r in submitted)  # nothing passed where the API takes nothing
    fake.iterate()
    c = run_until(engine, fake, lambda c: bool(c.tokens), iterate=False)
    assert list(c.tokens) == [1]  # the runtime admitted the high-priority session first


def test_priority_is_passed_where_the_api_accepts_it(engines) -> None:
    fake = FakeLLMWithPriority(frames_per_request=1, max_batch_size=1)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000), priority=0.5)]))
    fake.wait_for_submissions(1)
    c = run_until(engine, fake, lambda c: bool(c.tokens))  # slot 0 holds the only runtime batch place
    engine.step(StepPlan(prefill=[chunk(1, prompt(2000), priority=0.2)]))
    engine.step(StepPlan(prefill=[chunk(2, prompt(3000), priority=0.9)]))
    fake.wait_for_submissions(3)
    assert {r.prompt_token_ids[2]: r.priority for r in fake.submitted} == {1000: 0.5, 2000: 0.2, 3000: 0.9}

    c = run_until(engine, fake, lambda c: 0 in c.finished and (1 in c.tokens or 2 in c.tokens), collected=c)
    assert 2 in c.tokens and 1 not in c.tokens  # submitted later, admitted first


def test_plan_priority_updates_are_accepted(engines) -> None:
    fake = FakeLLM(frames_per_request=1)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000), priority=0.9)]))
    fake.wait_for_submissions(1)
    out = engine.step(StepPlan(priority={0: 0.5}))
    assert out.failed == {}


# ------------------------------------------------------- frame constraint


def test_constrained_sessions_go_through_the_logits_processor(engines) -> None:
    fake = FakeLLM(batched_logits_processor=FramePositionLogitsProcessor(), frames_per_request=3)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[
        chunk(0, prompt(1000), sampling=SamplingParams(max_tokens=21, seed=11)),
        chunk(1, prompt(2000), sampling=SamplingParams(constrained=False)),
    ]))
    fake.wait_for_submissions(2)
    c = run_until(engine, fake, lambda c: {0, 1} <= c.finished.keys())

    constrained = next(r for r in fake.submitted if r.prompt_token_ids[2] == 1000)
    free = next(r for r in fake.submitted if r.prompt_token_ids[2] == 2000)
    assert constrained.request_id in fake.processed_by_logits_processor
    assert free.request_id not in fake.processed_by_logits_processor
    assert c.finished[0] == "length" and len(c.tokens[0]) == 21
    frames = FrameParser().feed_many(c.tokens[0])  # raises on any token outside its slot's range
    assert frames.shape == (3, 7)


def test_processor_table_allows_exactly_one_codebook_per_position() -> None:
    processor = FramePositionLogitsProcessor()
    table = processor.table(torch.device("cpu"), torch.float32, VOCAB_SIZE)
    for row in range(7):
        allowed = torch.isfinite(table[row]).nonzero().flatten().tolist()
        lo = AUDIO_TOKEN_BASE + row * CODEBOOK_SIZE
        expected = list(range(lo, lo + CODEBOOK_SIZE)) + ([END_OF_SPEECH] if row == 0 else [])
        assert sorted(allowed) == sorted(expected)


def test_processor_masks_each_request_at_its_own_position() -> None:
    processor = FramePositionLogitsProcessor()
    p = list(prompt(1000))
    at_0 = p
    at_3 = p + [AUDIO_TOKEN_BASE + i * CODEBOOK_SIZE for i in range(3)]
    at_7 = p + [AUDIO_TOKEN_BASE + (i % 7) * CODEBOOK_SIZE for i in range(7)]
    logits = [torch.zeros(1, 1, VOCAB_SIZE) for _ in range(3)]
    processor([5, 6, 7], logits, [[at_0], [at_3], [at_7]], None, [None, None, None])
    for tensor, row in zip(logits, (0, 3, 0), strict=True):
        allowed = torch.isfinite(tensor.reshape(-1)).nonzero().flatten().tolist()
        lo = AUDIO_TOKEN_BASE + row * CODEBOOK_SIZE
        assert sorted(allowed) == [*([END_OF_SPEECH] if row == 0 else []), *range(lo, lo + CODEBOOK_SIZE)]
    # one token later the position moved on, without rescanning the prompt
    again = [torch.zeros(1, 1, VOCAB_SIZE)]
    processor([6], again, [[[*at_3, AUDIO_TOKEN_BASE + 3 * CODEBOOK_SIZE]]], None, [None])
    allowed = torch.isfinite(again[0].reshape(-1)).nonzero().flatten()
    assert allowed.min().item() == AUDIO_TOKEN_BASE + 4 * CODEBOOK_SIZE


def test_processor_position_without_prompt_and_forgetting() -> None:
    assert speech_start_index([1, 2, 3]) == -1
    assert speech_start_index([*list(prompt(1000)), AUDIO_TOKEN_BASE]) == len(prompt(1000)) - 1
    processor = FramePositionLogitsProcessor()
    assert processor.position(1, [AUDIO_TOKEN_BASE] * 5) == 5  # tokens without the prompt: all are audio
    processor.forget_after_calls = 2
    for _ in range(6):
        processor([9], [torch.zeros(1, 1, VOCAB_SIZE)], [[list(prompt(1000))]], None, [None])
    assert 1 not in processor._speech_start and 9 in processor._speech_start


def test_processor_builds_its_table_on_the_stream_it_reads_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's stream is non-blocking: a table built on the default stream could be read unfinished."""
    streams: list[int | None] = []

    @contextlib.contextmanager
    def on_stream(logits: torch.Tensor, stream_ptr: int | None) -> Iterator[None]:
        streams.append(stream_ptr)
        try:
            yield
        finally:
            streams.pop()

    built_on: list[list[int | None]] = []
    build = FramePositionLogitsProcessor.table

    def recording_table(self: FramePositionLogitsProcessor, *args: object) -> torch.Tensor:
        built_on.append(list(streams))
        return build(self, *args)

    monkeypatch.setattr(FramePositionLogitsProcessor, "_on_stream", staticmethod(on_stream))
    monkeypatch.setattr(FramePositionLogitsProcessor, "table", recording_table)
    processor = FramePositionLogitsProcessor()
    logits = [torch.zeros(1, 1, VOCAB_SIZE)]
    processor([1], logits, [[list(prompt(1000))]], 0xBEEF, [None])
    assert built_on == [[0xBEEF]]  # built inside the executor's stream, not before switching to it
    assert torch.isfinite(logits[0]).sum().item() == CODEBOOK_SIZE + 1


@pytest.mark.gpu
def test_processor_on_a_non_blocking_side_stream_masks_like_on_the_cpu() -> None:
    """What TensorRT-LLM does: logits on CUDA, the executor's own non-blocking stream passed as stream_ptr,
    the default stream busy with other work."""
    requests = 16
    histories = [[list(prompt(1000)) + [AUDIO_TOKEN_BASE] * n] for n in range(requests)]
    generator = torch.Generator().manual_seed(0)
    host = [torch.randn(1, 1, VOCAB_SIZE, generator=generator) for _ in range(requests)]
    expected = [t.clone() for t in host]
    FramePositionLogitsProcessor()(list(range(requests)), expected, histories, None, [None] * requests)

    side = torch.cuda.Stream()  # non-blocking with respect to the default stream, like the executor's
    device_logits = [t.cuda() for t in host]
    side.wait_stream(torch.cuda.current_stream())  # the logits were written on the default stream
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        busy = busy @ busy  # default-stream work the side stream must not wait for, nor race with
    processor = FramePositionLogitsProcessor()
    for _ in range(3):  # the first call builds the table on the side stream, later ones reuse it
        logits = [t.clone() for t in device_logits]
        side.wait_stream(torch.cuda.current_stream())
        processor(list(range(requests)), logits, histories, side.cuda_stream, [None] * requests)
        side.synchronize()
        for got, want in zip(logits, expected, strict=True):
            assert torch.equal(got.cpu(), want)


def test_processor_pickles_without_its_caches() -> None:
    processor = FramePositionLogitsProcessor()
    processor([1], [torch.zeros(1, 1, VOCAB_SIZE)], [[list(prompt(1000))]], None, [None])
    clone = pickle.loads(pickle.dumps(processor))
    assert clone._speech_start == {} and clone._tables == {}
    out = [torch.zeros(1, 1, VOCAB_SIZE)]
    clone([1], out, [[list(prompt(1000))]], None, [None])
    assert torch.isfinite(out[0]).sum().item() == CODEBOOK_SIZE + 1


# ---------------------------------------------------------------- waiting


def test_step_without_live_requests_does_not_wait(engines) -> None:
    engine = engines(FakeLLM(), step_wait_s=30.0)
    started = time.perf_counter()
    out = engine.step(StepPlan())
    assert time.perf_counter() - started < 5.0
    assert out.tokens == {} and out.elapsed_s < 5.0


def test_step_wait_is_bounded_when_nothing_arrives(engines) -> None:
    fake = FakeLLM()
    engine = engines(fake, step_wait_s=0.1)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    fake.wait_for_submissions(1)
    started = time.perf_counter()
    out = engine.step(StepPlan())  # live, but the runtime does not move
    waited = time.perf_counter() - started
    assert out.tokens == {} and out.finished == {}
    assert 0.09 <= waited < 10.0


def test_step_wakes_as_soon_as_a_diff_arrives(engines) -> None:
    fake = FakeLLM()
    engine = engines(fake, step_wait_s=60.0)

    def runtime() -> None:
        fake.wait_for_submissions(1)
        fake.iterate()

    thread = threading.Thread(target=runtime)
    thread.start()
    started = time.perf_counter()
    out = engine.step(StepPlan(prefill=[chunk(0, prompt(1000))]))
    thread.join()
    assert len(out.tokens[0]) == 1
    assert time.perf_counter() - started < 30.0  # woken by the diff, not by the 60 s bound


# ------------------------------------------------------------------ close


def test_close_aborts_live_requests_and_shuts_the_runtime_down(engines) -> None:
    fake = FakeLLM(frames_per_request=50)
    engine = engines(fake)
    engine.step(StepPlan(prefill=[chunk(0, prompt(1000)), chunk(1, prompt(2000))]))
    fake.wait_for_submissions(2)
    run_until(engine, fake, lambda c: len(c.tokens) == 2)
    engine.close()
    assert all(r.abort_calls == 1 for r in fake.submitted)
    assert fake.shutdown_calls == 1
    assert not engine._loop_thread.is_alive()
    with pytest.raises(EngineError, match="closed"):
        engine.step(StepPlan())
    engine.close()  # idempotent
    assert fake.shutdown_calls == 1


# ------------------------------------------------------------ from_config


def test_from_config_reads_slots_and_lengths(tmp_path) -> None:
    config = load_config(overrides={"scheduler.max_concurrent_sessions": 8, "scheduler.max_batch_size": 8,
                                    "engine.max_seq_len": 2048, "engine.backend": "tensorrt",
                                    "engine.tensorrt.engine_dir": str(tmp_path / "none")})
    fake = FakeLLM()
    engine = TrtLlmEngine.from_config(config, llm=fake, make_sampling_params=FakeSamplingParams)
    try:
        assert (engine.num_slots, engine.max_seq_len) == (8, 2048)
        report = engine.memory_report()
        assert report.kv_bytes_per_slot == kv_bytes_per_slot(ORPHEUS_3B, 2048)
        assert report.kv_cache_bytes == 8 * report.kv_bytes_per_slot
    finally:
        engine.close()
    with pytest.raises(ValueError, match="SamplingParams"):
        TrtLlmEngine.from_config(config, llm=fake)


def test_from_config_takes_model_shapes_from_the_manifest(tmp_path) -> None:
    dims = LlamaDims(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=192, vocab_size=VOCAB_SIZE, tie_word_embeddings=True)
    config = load_config(overrides={"engine.tensorrt.engine_dir": str(tmp_path), "engine.max_seq_len": 1024})
    settings = BuildSettings.from_config(config, out_dir=str(tmp_path), dtype="fp16")
    manifest = build_manifest(settings=settings, tensorrt_llm_version="1.2.0", dims=dims,
                              gpu=GpuInfo("NVIDIA H100", (9, 0), 70 << 30, 80 << 30),
                              checkpoint=CheckpointDigest(files={}, sha256="0" * 64, total_bytes=0),
                              engine_bytes=123456, calibration_prompts=0, created_at=datetime.now())
    write_manifest(tmp_path, manifest)
    engine = TrtLlmEngine.from_config(config, llm=FakeLLM(), make_sampling_params=FakeSamplingParams)
    try:
        report = engine.memory_report()
        assert report.weights_bytes == 123456
        assert report.kv_bytes_per_slot == 2 * 2 * 2 * 16 * 1024 * 2
    finally:
        engine.close()
