"""The replay of a measured card (replay/, ARCHITECTURE §8): the H200 kit results read into a profile, the
modelled card's time and interpreter use, and the sim engine and codec running on it behind a real server."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from orpheus_serve.codec.base import STATEFUL_STEP_FRAMES, CodecPush, step_schedule
from orpheus_serve.codec.sim import SimDecoder
from orpheus_serve.config import SimConfig
from orpheus_serve.engines.sim_engine import SimEngine
from orpheus_serve.replay import CardProfile, ModelledCard, ProfileError, load_profile
from orpheus_serve.replay.card import StepTiming
from orpheus_serve.replay.profile import StepCurve
from orpheus_serve.scheduler.leads import CODEC_BUSY_HOLD
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "docs" / "gpu-results" / "2026-11-28-h200"


def hand_profile(**kw: float) -> CardProfile:
    """A card with round numbers: steps of 10 ms + 0.1 ms a row, codec passes of 20 ms with 5 ms of launch."""
    values = dict(codec_launch_ms=5.0, engine_launch_ms=0.0, engine_launch_per_row_ms=0.0,
                  engine_slowdown_under_codec=2.0)
    values.update(kw)
    return CardProfile(name="hand", card="hand", variant="hand",
                       steps=StepCurve((100.0,), (((1, 10.0), (101, 20.0)),)),
                       codec_points=((1, 20.0), (100, 20.0)), **values)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the profile


def test_the_h200_results_read_as_the_card_measured_them() -> None:
    profile = load_profile(H200)
    assert profile.card == "NVIDIA H200" and profile.variant == "triton" and profile.name == "2026-11-28-h200"
    # Triton rows near 1,024 tokens: 12.76 ms at 128, 19.97 at 256; batch 1 from x_batch_1 (5.23 ms).
    assert profile.step_ms(128, 1000) == pytest.approx(12.758)
    assert profile.step_ms(256, 1000) == pytest.approx(19.974)
    assert profile.step_ms(1, 1000) == pytest.approx(5.23, abs=0.01)
    assert profile.step_ms(64, 1000) == pytest.approx(5.23 + 63 / 127 * (12.758 - 5.23), abs=0.01)
    # Measured near 1,024 tokens only: every shorter context is charged that (never flattering).
    assert profile.step_ms(64, 200) == profile.step_ms(64, 1000)
    # Past the largest batch: the last segment's slope.
    assert profile.step_ms(384, 1000) == pytest.approx(19.974 + 128 * (19.974 - 12.758) / 128)
    # Prefill costs as many more rows.
    assert profile.step_ms(10, 500, prefill_tokens=40) == pytest.approx(profile.step_ms(50, 500))
    # Codec passes by frames (2 per session in the kit): 4.41 ms for 2, 5.29 for 64, 32.38 for 512.
    assert profile.codec_pass_ms(2) == pytest.approx(4.409)
    assert profile.codec_pass_ms(64) == pytest.approx(5.292)
    assert profile.codec_pass_ms(1) == pytest.approx(4.409)  # flat below the smallest pass
    assert profile.codec_launch_ms == pytest.approx(3.851)  # the launch-bound floor
    # Contention: 2.766 s together, 2.612 s codec and 0.557 s engine alone: 0.154 s charged to 0.557 s of steps.
    assert profile.engine_slowdown_under_codec == pytest.approx(1 + (2.766 - 2.612) / 0.557)


def test_the_h200_bound_is_what_its_engine_carries() -> None:
    profile = load_profile(H200)
    # About 120 streams by the engine's step alone (README): a step of n rows at most 12.19 ms.
    bound = profile.realtime_bound(mean_kv_len=200, max_frames_per_pass=64)
    assert 105 <= bound <= 120, bound
    # Prefill is work: a prompt of 40 tokens per 343-token utterance costs about 12% more rows.
    with_prefill = profile.realtime_bound(mean_kv_len=200, max_frames_per_pass=64, prefill_share=40 / 343)
    assert with_prefill < bound
    assert with_prefill == pytest.approx(bound / (1 + 40 / 343), rel=0.08)


def test_another_variant_and_bad_folders(tmp_path: Path) -> None:
    assert load_profile(H200, variant="sdpa").step_ms(256, 1000) == pytest.approx(68.03)
    with pytest.raises(ProfileError, match="no graph-replayed decode steps"):
        load_profile(H200, variant="nonesuch")
    with pytest.raises(ProfileError, match=r"engine\.json is missing"):
        load_profile(tmp_path)
    (tmp_path / "engine.json").write_text((H200 / "engine.json").read_text())
    (tmp_path / "codec.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ProfileError, match="no measured codec passes"):
        load_profile(tmp_path)


# ------------------------------------------------------------------ the modelled card


@pytest.fixture
def long_switch_interval():
    """The interpreter hands the GIL over only when its holder waits (no forced switch for a second): which
    thread holds it becomes exact, whatever the machine's load."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    yield
    sys.setswitchinterval(previous)


def blocked_while(work: Callable[[], object]) -> float:
    """Seconds this thread waits for the interpreter once `work` has started on another thread."""
    started = threading.Event()

    def run() -> None:
        started.set()
        work()

    thread = threading.Thread(target=run)
    t0 = time.perf_counter()
    thread.start()
    started.wait()  # the other thread runs `work` now; this one needs the interpreter back to go on
    blocked = time.perf_counter() - t0
    thread.join()
    return blocked


def test_launch_work_holds_the_interpreter_and_device_time_does_not(long_switch_interval: None) -> None:
    # A 20 ms codec pass that is all launch keeps every other thread of the process out for 20 ms; one with
    # 5 ms of launch lets them in after 5 (the rest is a wait on the device): the engine-core loop beside the
    # codec worker, in one process.
    assert blocked_while(lambda: ModelledCard.hold_interpreter(0.05)) >= 0.045
    all_launch = blocked_while(lambda: ModelledCard(hand_profile(codec_launch_ms=20.0)).codec_pass(8))
    some_launch = blocked_while(lambda: ModelledCard(hand_profile(codec_launch_ms=5.0)).codec_pass(8))
    assert all_launch >= 0.018
    assert some_launch < 0.6 * all_launch, (some_launch, all_launch)


def test_an_engine_step_that_shares_the_device_with_a_codec_pass_is_slowed() -> None:
    card = ModelledCard(hand_profile(engine_slowdown_under_codec=1.5))
    alone = card.launch_step(1, 100, 0)
    assert card.step_done_at(alone) == pytest.approx(alone.start + 0.010)
    began: list[float] = []
    codec = threading.Thread(target=lambda: (began.append(time.perf_counter()), card.codec_pass(8)))
    codec.start()
    codec.join()  # a pass of 20 ms on the device from began[0]
    shared = StepTiming(start=began[0] + 0.005, device_s=0.010)  # all of it beside the pass: half as long again
    assert card.step_done_at(shared) - shared.start == pytest.approx(0.015, abs=2e-4)
    later = StepTiming(start=time.perf_counter() + 1.0, device_s=0.010)  # after the pass: not slowed
    assert card.step_done_at(later) - later.start == pytest.approx(0.010)


def test_the_sim_engine_takes_the_cards_step_time() -> None:
    profile = load_profile(H200)
    engine = SimEngine(8, 2048, SimConfig(realtime=True), card=ModelledCard(profile))
    prompt = tuple(range(1000, 1040))
    for slot in range(8):
        engine.step(StepPlan(prefill=[PrefillChunk(slot, f"r{slot}", prompt, 0, 40, SamplingParams(seed=slot))]))
    started = time.perf_counter()
    out = engine.step(StepPlan(decode=list(range(8))))
    wall = time.perf_counter() - started
    assert len(out.tokens) == 8
    expected = profile.step_ms(8, 41) / 1000
    assert out.elapsed_s == pytest.approx(expected, rel=0.05)
    assert wall >= expected


@pytest.mark.parametrize("ragged", [False, True])
def test_the_sim_codec_takes_the_stateful_decoders_steps(ragged: bool) -> None:
    card = ModelledCard(hand_profile(codec_launch_ms=1.0))
    passes: list[int] = []
    replayed = card.codec_pass
    card.codec_pass = lambda frames: passes.append(frames) or replayed(frames)  # type: ignore[method-assign]
    decoder = SimDecoder(card=card, max_batch=64, ragged=ragged)
    assert decoder.lookahead_frames == 3  # the stateful decoder's, so the first push waits as it does
    frames = np.zeros((4, 7), dtype=np.int64)
    # Four sessions of two frames: one forward step of 8 frames.
    results = decoder.decode([CodecPush(("a", i), frames[:2]) for i in range(4)])
    assert passes == [8] and [r.pcm.size for r in results] == [2 * 2048] * 4
    # One frame and four: even steps of 1 (both), 2 and 1 (the longer alone), as the stateful decoder runs
    # them; ragged, one step of 4 frames for both rows (the shorter one's padding computed too).
    passes.clear()
    decoder.decode([CodecPush(("b", 0), frames[:1]), CodecPush(("b", 1), frames[:4])])
    assert passes == ([8] if ragged else [2, 2, 1])
    planned = step_schedule([1, 4], STATEFUL_STEP_FRAMES, 64, ragged=ragged)
    assert [(s.frames, s.advances) for s in planned] == ([(4, [1, 4])] if ragged else [(1, [1, 1]), (2, [2]), (1, [1])])
    # A final push flushes the lookahead: 2 + 3 frames, in a step of 4 and one of 1 either way.
    passes.clear()
    decoder.decode([CodecPush(("c", 0), frames[:2], final=True)])
    assert passes == [4, 1]


# ------------------------------------------------------------------ behind a real server


def what_sets_the_limit(flow: dict[str, Any]) -> set[str]:
    """The reasons a flow reading allows (scheduler/leads.py): the streams' leads once one was read, else the
    cost model's prediction; the codec's load too while it is busy past CODEC_BUSY_HOLD."""
    reasons = {"lead"} if flow["playing_streams"] else {"model"}
    if (flow["codec_busy"] or 0.0) > CODEC_BUSY_HOLD:
        reasons.add("codec")
    return reasons


def test_a_server_replaying_the_card_serves_and_shows_its_admission_inputs(tiny_orpheus: Path) -> None:
    from gateway_support import sim_config, start_server, stats

    # Streams of 60 frames (420 steps of at least 5 ms): long enough to be read (scheduler/leads.py: a stream
    # is read once it has played MIN_AGE_S), so the limit passes from the model's prediction to the leads.
    server = start_server(sim_config(tiny_orpheus, **{
        "engine.sim.profile": str(H200), "engine.sim.end_after_frames": 60, "sampling.min_tokens": 7}))
    try:
        cold = stats(server)["flow"]
        # Cold: nothing to read, so the cost model's prediction bounds admission.
        assert cold["admission"] == "queue" and cold["playing_streams"] == 0, cold
        assert cold["limit_reason"] == "model", cold

        def speak(i: int) -> tuple[int, str, int]:
            with httpx.Client(timeout=60.0) as http:
                r = http.post(f"{server.base_url}/v1/audio/speech",
                              json={"input": f"Replay number {i} of the card.", "response_format": "pcm"})
                return r.status_code, r.text if r.status_code != 200 else "", len(r.content)

        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(speak, i) for i in range(6)]
            # While they play: once a stream can be read, its reading (not the model) sets the limit.
            read: dict[str, Any] | None = None
            deadline = time.monotonic() + 30.0
            while read is None and time.monotonic() < deadline and not all(f.done() for f in futures):
                flow = stats(server)["flow"]
                if flow["playing_streams"]:
                    read = flow
                time.sleep(0.05)
            results = [f.result() for f in futures]  # a request's failure raises here, in this thread
        for status, text, _ in results:
            assert status == 200, text
        sizes = {size for _, _, size in results}
        assert len(sizes) == 1 and sizes.pop() > 0, results  # each stream its 60 frames' audio, whole
        assert read is not None, "no stream was ever read while six played"
        assert read["limit_reason"] in what_sets_the_limit(read), read  # "lead" (or "codec"), never "model"
        assert read["capacity_streams"] is not None and read["capacity_streams"] >= 1, read
        flow = stats(server)["flow"]
        # What set the limit last agrees with the last reading.
        assert flow["limit_reason"] in what_sets_the_limit(flow), flow
        assert flow["loop_period_ms_p50"] >= 5.0  # the card's step at the smallest batch: 5.2 ms
        assert flow["codec_pass_ms_p50"] >= 3.8  # its stateful decoder's launch-bound pass
        assert flow["codec_frames_per_pass"] > 0
        assert flow["capacity_streams"] >= 1
    finally:
        server.stop()
