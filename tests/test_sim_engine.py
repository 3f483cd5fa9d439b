"""SimEngine: valid, reproducible Orpheus token streams and the step cost model (no torch, no model)."""

from __future__ import annotations

import pytest

from orpheus_serve.config import Config, SimConfig
from orpheus_serve.engines.base import TokenEngine
from orpheus_serve.engines.sim_engine import SimEngine, h100_cost_model
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.token_format import END_OF_SPEECH, FrameParser

COST = SimConfig(
    step_base_ms=9.0,
    step_per_seq_ms=0.5,
    step_per_ctx_token_ms=0.001,
    prefill_per_token_ms=0.02,
    realtime=False,
)


def chunk(slot: int, rid: str, prompt_len: int = 10, start: int = 0, end: int | None = None, **sampling):
    prompt = tuple(range(500, 500 + prompt_len))
    return PrefillChunk(
        slot=slot,
        request_id=rid,
        prompt_ids=prompt,
        start=start,
        end=prompt_len if end is None else end,
        sampling=SamplingParams(**sampling),
    )


def generate(engine: SimEngine, slot: int, first: list[int], limit: int = 10_000) -> list[int]:
    ids = list(first)
    while ids[-1] != END_OF_SPEECH and len(ids) < limit:
        ids += engine.step(StepPlan(decode=[slot])).tokens[slot]
    return ids


def test_tokens_parse_into_whole_frames_and_end_after_the_configured_frames() -> None:
    engine = SimEngine(2, 4096, COST.model_copy(update={"end_after_frames": 12}))
    assert isinstance(engine, TokenEngine)
    out = engine.step(StepPlan(prefill=[chunk(0, "a", seed=3)]))
    ids = generate(engine, 0, out.tokens[0])
    assert len(ids) == 12 * 7 + 1 and ids[-1] == END_OF_SPEECH
    parser = FrameParser()
    frames = parser.feed_many(ids)
    assert frames.shape == (12, 7) and parser.ended and parser.dropped_tokens == 0
    assert frames.min() >= 0 and frames.max() <= 4095


def test_length_is_pseudo_random_within_max_tokens_and_reproducible_per_seed_or_request_id() -> None:
    lengths = set()
    for i in range(8):
        engine = SimEngine(1, 4096, COST)
        out = engine.step(StepPlan(prefill=[chunk(0, f"req-{i}", max_tokens=140)]))
        ids = generate(engine, 0, out.tokens[0])
        assert ids[-1] == END_OF_SPEECH and len(ids) <= 140
        frames = (len(ids) - 1) // 7
        assert 10 <= frames <= 19 and (len(ids) - 1) % 7 == 0
        lengths.add(frames)
    assert len(lengths) > 1

    def alone(rid: str, seed: int | None) -> list[int]:
        engine = SimEngine(1, 4096, COST)
        return generate(engine, 0, engine.step(StepPlan(prefill=[chunk(0, rid, seed=seed)])).tokens[0])

    def in_a_batch(rid: str, seed: int | None) -> list[int]:
        engine = SimEngine(4, 4096, COST)
        out = engine.step(StepPlan(prefill=[chunk(0, "x"), chunk(2, rid, seed=seed), chunk(3, "y", seed=9)]))
        ids = out.tokens[2]
        while ids[-1] != END_OF_SPEECH:
            ids += engine.step(StepPlan(decode=[0, 2, 3][: 1 + len(ids) % 3 + 1])).tokens.get(2, [])
        return ids

    assert alone("r", None) == in_a_batch("r", None)  # seeded by request id, whatever shares the batch
    assert alone("r", 7) == in_a_batch("other", 7)  # an explicit seed wins over the id
    assert alone("r", 7) != alone("r", 8)


def test_step_latency_follows_the_cost_model_and_advances_a_virtual_clock() -> None:
    advanced: list[float] = []
    engine = SimEngine(4, 4096, COST, clock_advance=advanced.append)
    out = engine.step(StepPlan(prefill=[chunk(0, "a", prompt_len=30), chunk(1, "b", prompt_len=20)]))
    assert out.elapsed_s == pytest.approx((9.0 + 0.02 * 50) / 1000)
    out = engine.step(StepPlan(decode=[0, 1]))
    # contexts: 30 prompt + 1 generated, 20 + 1
    assert out.elapsed_s == pytest.approx((9.0 + 0.5 * 2 + 0.001 * (31 + 21)) / 1000)
    assert engine.step(StepPlan(release=[0, 1])).elapsed_s == 0.0  # nothing to compute
    assert advanced == pytest.approx([0.010, 0.010052, 0.0])
    assert engine.busy_s == pytest.approx(0.020052)


def test_realtime_mode_sleeps_for_the_modelled_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import orpheus_serve.engines.sim_engine as sim

    slept: list[float] = []
    monkeypatch.setattr(sim.time, "sleep", slept.append)
    engine = SimEngine(1, 4096, COST.model_copy(update={"realtime": True}))
    t0 = time.perf_counter()
    out = engine.step(StepPlan(prefill=[chunk(0, "a", prompt_len=50)]))
    spent = time.perf_counter() - t0
    assert out.elapsed_s == pytest.approx(0.010)
    # it sleeps what is left of the modelled time after producing the tokens itself
    assert len(slept) == 1 and out.elapsed_s - spent <= slept[0] <= out.elapsed_s


def test_plans_that_break_the_contract_fail_only_their_slot() -> None:
    engine = SimEngine(3, 64, COST.model_copy(update={"end_after_frames": 100}))  # runs into max_seq_len
    out = engine.step(
        StepPlan(
            prefill=[chunk(0, "a", prompt_len=20, end=8), chunk(1, "b", prompt_len=20, start=8, end=20)],
            decode=[2],
        )
    )
    assert set(out.failed) == {1, 2} and "out of order" in out.failed[1] and "no complete prompt" in out.failed[2]
    assert out.tokens == {}
    out = engine.step(StepPlan(prefill=[chunk(0, "a", prompt_len=20, start=8, end=20)]))
    assert list(out.tokens) == [0] and not out.failed
    ids = out.tokens[0]
    while 0 not in out.failed:
        out = engine.step(StepPlan(decode=[0]))
        ids += out.tokens.get(0, [])
    assert "max_seq_len=64" in out.failed[0] and len(ids) == 64 - 20
    with pytest.raises(EngineError, match="outside"):
        engine.step(StepPlan(decode=[3]))


def test_release_reinitialises_and_memory_report_and_close() -> None:
    engine = SimEngine.from_config(Config())
    assert (engine.num_slots, engine.max_seq_len) == (32, 4096)
    report = engine.memory_report()
    assert (report.weights_bytes, report.kv_cache_bytes, report.num_slots) == (0, 0, 32)
    engine.step(StepPlan(prefill=[chunk(0, "a")]))
    out = engine.step(StepPlan(release=[0], decode=[0]))
    assert "no complete prompt" in out.failed[0]
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.step(StepPlan())


def test_h100_preset_is_memory_bound_around_ten_ms() -> None:
    cost = h100_cost_model()
    assert not cost.realtime

    def step_ms(batch: int, ctx: int) -> float:
        return cost.step_base_ms + cost.step_per_seq_ms * batch + cost.step_per_ctx_token_ms * batch * ctx

    assert 9.0 <= step_ms(1, 500) <= 10.0
    assert step_ms(64, 1000) < 2.5 * step_ms(1, 1000)  # batching is nearly free: memory-bound
    # 16 sessions decoded every step stay faster than real time (82 tokens/s = 12.2 ms per token)
    assert step_ms(16, 1000) < 1000 / 82
