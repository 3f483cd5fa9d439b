"""A session that makes the engine fail fails alone; an engine that fails everything is declared dead.

The engine core, scheduler, engines (the tiny Llama on CPU, the sim engine) and codec worker are
the real ones, wired as the service wires them. Bad values reach the engine by submitting
sessions to the engine core directly, past the service's validation. Where a step must *raise*
for one session (which no known input does any more: the engines refuse bad values per slot), a
real internal of the real engine is made to raise for that session only, mid-step, after the
step has already done work for the others.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from orpheus_serve.codec.sim import SimDecoder
from orpheus_serve.config import SimConfig
from orpheus_serve.core.engine_core import EngineCore
from orpheus_serve.engines import sim_engine
from orpheus_serve.engines.base import TokenEngine
from orpheus_serve.engines.sim_engine import SimEngine
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc
from orpheus_serve.request.types import ModelInfo
from orpheus_serve.scheduler.session import SessionRequest
from orpheus_serve.scheduler.step import EngineDeadError, SamplingParams, StepOutput, StepPlan
from orpheus_serve.service.build import assemble_service, load_tokenizer
from tests.engine_core_support import Outcome, run_core, session_request
from tests.gateway_support import check_openai_error, sim_config, stats

SLOTS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=70)
SIM_COST = SimConfig(step_base_ms=0.0, step_per_seq_ms=0.0, step_per_ctx_token_ms=0.0, prefill_per_token_ms=0.0,
                     realtime=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    return None


def make_engine(kind: str, tiny_orpheus: Path) -> TokenEngine:
    if kind == "torch":
        # Decode batches of 2: a step's decode runs in several passes, so a failure in a later pass
        # comes after earlier passes have already produced tokens (and must be undone).
        return TorchEngine(tiny_orpheus, num_slots=SLOTS, max_seq_len=160, device="cpu", dtype="fp32",
                           max_batch_size=2, cuda_graphs=False, seed=0)
    return SimEngine(SLOTS, 512, SIM_COST)


def session(rid: str, words: int, sampling: SamplingParams = GREEDY) -> SessionRequest:
    return session_request(rid, words, sampling)


def run(engine: TokenEngine, sessions: list[SessionRequest]) -> tuple[dict[str, Outcome], EngineCore]:
    """Every session submitted before the engine core starts, so they share every step; returns when all ended."""
    outcomes, core, _ = run_core(engine, sessions, slots=SLOTS)
    return outcomes, core


def alone(kind: str, tiny_orpheus: Path, s: SessionRequest) -> Outcome:
    outcomes, _ = run(make_engine(kind, tiny_orpheus), [s])
    return outcomes[s.request_id]


def assert_same_as_alone(kind: str, tiny_orpheus: Path, outcomes: dict[str, Outcome], good: list[SessionRequest]):
    for s in good:
        got, ref = outcomes[s.request_id], alone(kind, tiny_orpheus, s)
        assert got.error is None and got.reason in ("stop", "length"), (s.request_id, got)
        assert got.frames, s.request_id
        assert (got.frames, got.reason) == (ref.frames, ref.reason), f"{s.request_id} differs from the same run alone"


@pytest.mark.parametrize("kind", ["torch", "sim"])
def test_out_of_range_sampling_values_fail_only_their_own_session(kind: str, tiny_orpheus: Path) -> None:
    """The values that used to kill a whole step, sent past the service's validation: top_k of 2**63
    (overflowed an int64 tensor), negative and too-large seeds (numpy refused them)."""
    good = [session("good-a", 5), session("good-b", 7), session("good-c", 9)]
    bad = [session("top-k-2**63", 6, SamplingParams(temperature=0.0, top_k=2**63)),
           session("seed-minus-1", 8, SamplingParams(temperature=0.0, seed=-1)),
           session("seed-2**64", 10, SamplingParams(temperature=0.0, seed=2**64))]
    outcomes, core = run(make_engine(kind, tiny_orpheus), [good[0], bad[0], good[1], bad[1], good[2], bad[2]])
    for s, param in zip(bad, ("top_k", "seed", "seed"), strict=True):
        got = outcomes[s.request_id]
        assert got.reason == "error" and got.frames == [], (s.request_id, got)
        assert got.error is not None and "invalid sampling parameters" in got.error and param in got.error
    assert core.step_errors == 0 and core.engine_alive  # refused per slot: no step ever failed
    assert_same_as_alone(kind, tiny_orpheus, outcomes, good)


def poison_torch_prefill(engine: TorchEngine, rid: str) -> None:
    """The session's first prefill raises where the top_k overflow used to: setting up its sampling row."""
    reset = engine._sampling.reset
    sessions = engine._sessions

    def faulty_reset(slot: int, params: SamplingParams, seed: int) -> None:
        session_ = sessions[slot]
        if session_ is not None and session_.request_id == rid:
            raise OverflowError("value cannot be converted to type int64 without overflow")
        reset(slot, params, seed)

    engine._sampling.reset = faulty_reset  # type: ignore[method-assign]


def poison_torch_decode(engine: TorchEngine, rid: str, after_tokens: int) -> None:
    """Every decode pass that holds the session raises once it has generated `after_tokens`."""
    decode = engine.model.decode
    sessions = engine._sessions

    def faulty_decode(tokens: Any, slots: Any, positions: Any, kv_len: int) -> Any:
        for slot in slots.tolist():
            s = sessions[slot]
            if s is not None and s.request_id == rid and s.generated >= after_tokens:
                raise RuntimeError("injected decode fault")
        return decode(tokens, slots, positions, kv_len)

    engine.model.decode = faulty_decode  # type: ignore[method-assign]


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_torch_step_that_raises_for_one_session_fails_only_that_session(where: str, tiny_orpheus: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    good = [session("good-a", 5), session("good-b", 7), session("good-c", 9)]
    poisoned = session("poisoned", 6)
    engine = make_engine("torch", tiny_orpheus)
    assert isinstance(engine, TorchEngine)
    if where == "prefill":
        # Admitted second: the step has prefilled good-a (KV, first token) before it raises.
        poison_torch_prefill(engine, poisoned.request_id)
        order = [good[0], poisoned, good[1], good[2]]
    else:
        # Admitted last: its decode pass is the second of the step, after good-a and good-b's has run.
        poison_torch_decode(engine, poisoned.request_id, after_tokens=14)
        order = [*good, poisoned]
    outcomes, core = run(engine, order)
    failed = outcomes[poisoned.request_id]
    assert failed.reason == "error" and failed.error is not None and "engine error" in failed.error
    assert ("overflow" if where == "prefill" else "injected decode fault") in failed.error
    assert len(failed.frames) == (0 if where == "prefill" else 2)  # the frames it had before the fault
    assert core.step_errors >= 1 and core.engine_alive
    assert_same_as_alone("torch", tiny_orpheus, outcomes, good)


def test_sim_step_that_raises_for_two_sessions_fails_only_those_two(tiny_orpheus: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    good = [session("good-a", 5), session("good-b", 7), session("good-c", 9), session("good-d", 11)]
    poisoned = [session("poisoned-1", 6), session("poisoned-2", 8)]
    seed_for = sim_engine._seed_for

    def faulty_seed_for(sampling: SamplingParams, request_id: str) -> int:
        if request_id.startswith("poisoned"):  # as numpy did for seed=-1
            raise ValueError("expected non-negative integer")
        return seed_for(sampling, request_id)

    monkeypatch.setattr(sim_engine, "_seed_for", faulty_seed_for)
    outcomes, core = run(make_engine("sim", tiny_orpheus), [good[0], poisoned[0], good[1], good[2], poisoned[1],
                                                            good[3]])
    for s in poisoned:
        failed = outcomes[s.request_id]
        assert failed.reason == "error" and failed.error is not None and "non-negative" in failed.error
    # Two sessions failing alone in a step where others ran is two bad requests, not a broken engine.
    assert core.step_errors == 1 and core.engine_alive
    assert_same_as_alone("sim", tiny_orpheus, outcomes, good)


def test_one_bad_session_at_a_time_never_kills_the_engine(tiny_orpheus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session failing alone is a bad request; the engine is dead only when unrelated sessions keep failing."""
    engine = make_engine("sim", tiny_orpheus)
    seed_for = sim_engine._seed_for

    def faulty_seed_for(sampling: SamplingParams, request_id: str) -> int:
        if request_id.startswith("poisoned"):
            raise ValueError("injected fault")
        return seed_for(sampling, request_id)

    monkeypatch.setattr(sim_engine, "_seed_for", faulty_seed_for)
    for i in range(3):  # each alone on an idle engine, with a good session after it
        outcomes, core = run(engine, [session(f"poisoned-{i}", 5)])
        assert outcomes[f"poisoned-{i}"].reason == "error" and core.engine_alive
        outcomes, core = run(engine, [session(f"good-{i}", 5)])
        assert outcomes[f"good-{i}"].reason in ("stop", "length") and core.engine_alive


class SwitchableEngine:
    """A real engine, and a switch that makes every step raise (a lost device, say) from then on."""

    def __init__(self, engine: TokenEngine) -> None:
        self.engine = engine
        self.num_slots = engine.num_slots
        self.max_seq_len = engine.max_seq_len
        self.failing = False
        self.failed_calls = 0

    def step(self, plan: StepPlan) -> StepOutput:
        if self.failing and (plan.prefill or plan.decode):
            self.failed_calls += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.engine.step(plan)

    def memory_report(self) -> Any:
        return self.engine.memory_report()

    def close(self) -> None:
        self.engine.close()


def test_an_engine_that_fails_every_step_turns_ready_to_503_within_one_step(tiny_orpheus: Path) -> None:
    config = sim_config(tiny_orpheus)
    engine = SwitchableEngine(SimEngine.from_config(config))
    info = ModelInfo(id="orpheus-tiny", backend="sim", model_path=str(tiny_orpheus), codec_path="sim", tiny=True)
    service = assemble_service(config, engine=engine, decoder=SimDecoder(), tokenizer=load_tokenizer(tiny_orpheus),
                         model_info=info)
    server = ServerThread(config, service).start()
    base = server.base_url
    try:
        assert httpx.get(f"{base}/ready").json() == {"status": "ready"}
        engine.failing = True

        async def two_requests() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as http:
                return await asyncio.gather(*(http.post(f"{base}/v1/audio/speech",
                                                        json={"input": f"Request {i}.", "response_format": "pcm"})
                                              for i in range(2)))

        for response in asyncio.run(two_requests()):
            check_openai_error(response, 500, "engine_error")
        # Declared dead in the step that failed the second session alone: no waiting, no polling.
        ready = httpx.get(f"{base}/ready")
        assert (ready.status_code, ready.json()) == (503, {"status": "engine_failed"})
        assert 2 <= engine.failed_calls <= 3  # the failed step, then each of its sessions alone (or one per step)
        snapshot = stats(server)["engine"]
        assert snapshot["alive"] is False and "illegal memory access" in snapshot["failure"]

        # Nothing is admitted any more, on any protocol; nothing reaches the engine.
        check_openai_error(httpx.post(f"{base}/v1/audio/speech", json={"input": "Anyone?"}), 503, "unavailable")
        with grpc.insecure_channel(server.grpc_address) as channel, pytest.raises(grpc.RpcError) as rpc:
            list(pb_grpc.SynthesizerStub(channel).Synthesize(pb.SynthesizeRequest(text="Anyone?")))
        assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
        with ws_connect(api_client.stream_url(base)) as ws:
            ws.send('{"text": "Anyone?"}')
            assert json.loads(ws.recv(timeout=30))["error"]["code"] == "unavailable"
        assert engine.failed_calls <= 3
        assert httpx.get(f"{base}/health").status_code == 200  # the process is alive; it needs a restart
    finally:
        server.stop(0)


class DyingEngine(SwitchableEngine):
    """A real engine whose runtime dies, and which says so (`EngineDeadError`, as TensorRT-LLM's does)."""

    def step(self, plan: StepPlan) -> StepOutput:
        if self.failing:
            self.failed_calls += 1
            raise EngineDeadError("executor worker exited with code 134")
        return self.engine.step(plan)


def test_an_engine_that_reports_its_own_death_is_dead_after_one_step(tiny_orpheus: Path) -> None:
    config = sim_config(tiny_orpheus)
    engine = DyingEngine(SimEngine.from_config(config))
    info = ModelInfo(id="orpheus-tiny", backend="sim", model_path=str(tiny_orpheus), codec_path="sim", tiny=True)
    service = assemble_service(config, engine=engine, decoder=SimDecoder(), tokenizer=load_tokenizer(tiny_orpheus),
                               model_info=info)
    server = ServerThread(config, service).start()
    base = server.base_url
    try:
        assert httpx.get(f"{base}/ready").json() == {"status": "ready"}
        engine.failing = True

        response = httpx.post(f"{base}/v1/audio/speech", json={"input": "Request.", "response_format": "pcm"},
                              timeout=30)
        check_openai_error(response, 500, "engine_error")
        assert "code 134" in response.json()["error"]["message"]
        assert engine.failed_calls == 1  # no isolation: the engine said it is dead
        ready = httpx.get(f"{base}/ready")
        assert (ready.status_code, ready.json()) == (503, {"status": "engine_failed"})
        assert "code 134" in stats(server)["engine"]["failure"]
    finally:
        server.stop(0)
