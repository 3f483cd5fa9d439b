"""The replay calibrated against its card (replay/profile.py, replay/calibration.py, docs/PERFORMANCE.md "Replay
calibration against the H200"): the engine step's interpreter time read from the serve stage when the folder has
it (the core's launch phase, else its CPU per step), the estimate otherwise, each input labelled measured or
estimated; a replay through a path the card never ran labelled modelled, not measured; the card's serve stage
read back as the replay's workload and compared level by level."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from orpheus_serve.benchmarking.cli import Bench, build_parser
from orpheus_serve.replay import UNMEASURED_LABEL, format_inputs, load_profile
from orpheus_serve.replay.calibration import card_serve_workload, codec_totals, compare_level
from orpheus_serve.replay.profile import DEFAULT_ENGINE_LAUNCH_MS, DEFAULT_ENGINE_LAUNCH_PER_ROW_MS

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "docs" / "gpu-results" / "2026-11-28-h200"


def folder_with(tmp_path: Path, serve: dict[str, Any] | None, codec: dict[str, Any] | None = None) -> Path:
    """The H200's engine and codec results, with this serve.json (none if None) and codec.json (the H200's if
    None)."""
    folder = tmp_path / "card"
    folder.mkdir()
    shutil.copy(H200 / "engine.json", folder / "engine.json")
    if codec is None:
        shutil.copy(H200 / "codec.json", folder / "codec.json")
    else:
        (folder / "codec.json").write_text(json.dumps(codec))
    if serve is not None:
        (folder / "serve.json").write_text(json.dumps(serve))
    return folder


def h200_serve() -> dict[str, Any]:
    return json.loads((H200 / "serve.json").read_text())


# ------------------------------------------------------------------ the engine step's interpreter time


def test_the_h200_engine_launch_is_its_cores_cpu_per_step_less_the_codecs_at_most_the_loop() -> None:
    serve = h200_serve()
    profile = load_profile(H200)
    # Per level: the core's CPU per step (us a token x tokens a step), less the codec's host time a step
    # (3.85 ms a pass x 4,841 passes over 41,794 steps), at most the loop period; the median of the levels.
    codec_per_step = 3.851 * 4841 / 41794
    holds = sorted(min(r["core_cpu_us_per_token"] / 1000 * r["tokens_per_s"] * r["wall_seconds"] / r["steps"]
                       - codec_per_step, r["loop_ms_per_step"]) for r in serve["rows"])
    assert profile.engine_launch_ms == pytest.approx(holds[len(holds) // 2], abs=1e-3)
    # On the H200 the core burned more CPU than its loop period at every level: the loop period bounds it.
    assert 6.0 <= profile.engine_launch_ms <= 7.6, profile.engine_launch_ms
    assert "core_cpu_us_per_token" in profile.measured["engine.launch"]
    assert "engine.launch" not in profile.estimated
    # What no card measured stays estimated, and says so.
    assert profile.engine_launch_per_row_ms == DEFAULT_ENGINE_LAUNCH_PER_ROW_MS
    assert set(profile.estimated) >= {"engine.launch_per_row", "engine.prefill", "codec.launch"}
    assert set(profile.measured) >= {"engine.step", "codec.pass", "contention"}


def test_the_cores_measured_launch_phase_is_taken_where_the_kit_recorded_it(tmp_path: Path) -> None:
    serve = h200_serve()
    for row, launch_p50 in zip(serve["rows"], (1.2, 1.6, 1.4, 9.0, 0.9), strict=True):
        row["core_host"] = {"window_steps": 500, "step_ms": {"launch": {"p50": launch_p50, "p90": 2.0, "mean": 1.5}}}
    profile = load_profile(folder_with(tmp_path, serve))
    assert profile.engine_launch_ms == pytest.approx(1.4)  # the median of the levels, not their CPU per step
    assert "core_host.step_ms.launch.p50" in profile.measured["engine.launch"]


def test_without_the_serve_stage_the_launch_is_the_estimate_and_labelled_so(tmp_path: Path) -> None:
    profile = load_profile(folder_with(tmp_path, None))
    assert profile.engine_launch_ms == DEFAULT_ENGINE_LAUNCH_MS
    assert "engine.launch" in profile.estimated and "engine.launch" not in profile.measured
    # A serve stage that recorded neither the core's launch phase nor its CPU: the estimate too.
    serve = h200_serve()
    for row in serve["rows"]:
        del row["core_cpu_us_per_token"]
    (tmp_path / "card" / "serve.json").write_text(json.dumps(serve))
    profile = load_profile(tmp_path / "card")
    assert profile.engine_launch_ms == DEFAULT_ENGINE_LAUNCH_MS
    assert "engine.launch" in profile.estimated
    assert "engine.launch" in format_inputs(profile.inputs_record(ragged_steps=False)).split("estimated ", 1)[1]


# ------------------------------------------------------------------ paths the card never ran


def test_ragged_codec_steps_the_card_never_ran_make_the_replay_modelled_not_measured(tmp_path: Path) -> None:
    profile = load_profile(H200)  # the first card run timed even steps only
    record = profile.inputs_record(ragged_steps=True)
    assert record["unmeasured_paths"] == ["codec.ragged_steps"] and record["label"] == UNMEASURED_LABEL
    assert UNMEASURED_LABEL.upper() in format_inputs(record)
    even = profile.inputs_record(ragged_steps=False)
    assert even["unmeasured_paths"] == [] and even["label"] is None
    assert UNMEASURED_LABEL.upper() not in format_inputs(even)
    # A codec stage that timed ragged steps (the kit's mixed passes): measured, no label.
    codec = json.loads((H200 / "codec.json").read_text())
    codec["mixed_passes"] = [{"batch": 8, "even_ms": 12.0, "even_host_ms": 9.0, "ragged_ms": 5.0,
                              "ragged_host_ms": 4.0}]
    measured = load_profile(folder_with(tmp_path, h200_serve(), codec)).inputs_record(ragged_steps=True)
    assert measured["unmeasured_paths"] == [] and measured["label"] is None


@pytest.mark.parametrize(("settings", "labelled"), [([], True), (["codec.ragged_steps=false"], False)])
def test_the_benchmarks_replay_header_and_json_carry_the_label(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], settings: list[str], labelled: bool) -> None:
    args = build_parser().parse_args(["--mode", "sim", "--sim-profile", str(H200), "--output",
                                      str(tmp_path / "results.json"), *(a for s in settings for a in ("--set", s))])
    bench = Bench(args, 400)
    inputs = bench.replay_inputs(load_profile(H200), ["engine.backend=sim", "codec.decoder=sim",
                                                      *bench.profile_overrides()])
    header = capsys.readouterr().out
    assert header.startswith("replay of 2026-11-28-h200 (NVIDIA H200)")
    assert ("MODELLED, NOT MEASURED" in header) is labelled
    assert (inputs["unmeasured_paths"] == ["codec.ragged_steps"]) is labelled
    assert "serve.json" in inputs["measured"]["engine.launch"]  # the measured ones name their file and field
    json.dumps(inputs)  # it goes into the result JSON as it is


# ------------------------------------------------------------------ the card's serve stage, replayed


def test_the_cards_serve_stage_reads_back_as_the_replays_workload() -> None:
    workload = card_serve_workload(h200_serve())
    assert workload.levels[:2] == (16, 64) and workload.warmup_concurrency == 4
    assert (workload.requests_per_stream, workload.ramp_s, workload.max_tokens, workload.protocol) == \
        (2, 2.0, 280, "grpc")
    # The card's server settings the sim takes; its model, device and backend it does not.
    assert "scheduler.max_concurrent_sessions=384" in workload.server_overrides
    assert "codec.max_batch=384" in workload.server_overrides
    assert not any(o.startswith(("engine.model_path", "engine.device", "engine.backend", "codec.device"))
                   for o in workload.server_overrides)
    # The run's codec inside the server: 100.5 s over 4,841 passes of 17,324 frames.
    assert workload.card_codec == {"ms_per_pass": pytest.approx(20.767, abs=1e-3),
                                   "frames_per_pass": pytest.approx(3.58), "passes": 4841}
    assert workload.card_rows[64]["admitted_peak"] == 8
    # Tokens a step and the core's CPU a step, from the kit's own fields: 2.19 tokens and 8.6 ms at 16 streams.
    same = {e["quantity"]: e for e in compare_level(workload.card_rows[16], workload.card_rows[16],
                                                     card_codec=None, replay_codec=None)}
    assert same["tokens_per_step"]["card"] == pytest.approx(2.188, abs=1e-3)
    assert same["core_cpu_ms_per_step"]["card"] == pytest.approx(8.593, abs=1e-3)
    assert same["core_cpu_ms_per_step"]["ratio"] == 1.0


def test_a_level_is_compared_quantity_by_quantity_within_2x() -> None:
    card = {"admitted_peak": 8, "concurrent_peak": 9, "realtime_of_started": 0.85, "loop_ms_per_step": 6.0}
    replay = {"admitted_peak": 28, "concurrent_peak": 18, "realtime_of_started": 1.0, "loop_ms_per_step": 3.0,
              "admission_inputs": {"samples": 9, "numbers": {  # runner.summarize_admission_inputs
                  "codec_pass_ms_p50": {"min": 8.0, "median": 10.0, "max": 30.0},
                  "codec_frames_per_pass": {"min": 2.0, "median": 4.0, "max": 9.0}}}}
    entries = {e["quantity"]: e for e in compare_level(
        card, replay, card_codec={"ms_per_pass": 20.0, "frames_per_pass": 8.0}, replay_codec=None)}
    assert (entries["admitted_peak"]["ratio"], entries["admitted_peak"]["within_2x"]) == (3.5, False)
    assert (entries["concurrent_peak"]["ratio"], entries["concurrent_peak"]["within_2x"]) == (2.0, True)
    assert entries["loop_ms_per_step"]["within_2x"] is True  # 0.5: the edge counts
    # The replay's level medians against the card's run totals, and each side says where it came from.
    assert (entries["codec_ms_per_pass"]["ratio"], entries["codec_frames_per_pass"]["ratio"]) == (0.5, 0.5)
    assert entries["codec_ms_per_pass"]["from"] == "card: the run's codec counters; replay: admission_inputs, the level's median"
    # Nothing recorded on one side: no ratio, no verdict.
    missing = {e["quantity"]: e for e in compare_level(card, {}, card_codec=None, replay_codec=None)}
    assert missing["codec_ms_per_pass"]["ratio"] is None and missing["admitted_peak"]["within_2x"] is None
    # Counters read before and after a level: only that level's passes.
    assert codec_totals({"passes": 30, "decode_s": 0.5, "frames_decoded": 100},
                        {"passes": 10, "decode_s": 0.3, "frames_decoded": 20}) == \
        {"ms_per_pass": 10.0, "frames_per_pass": 4.0, "passes": 20}
