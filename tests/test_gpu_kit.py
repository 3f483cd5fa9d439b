"""The GPU proof kit (scripts/gpu) before it meets a GPU box: the gate a run there must pass here first.

The box is bare: Python 3.12 with its image's packages (scripts/gpu/box-packages.txt) and no network,
so whatever else a stage imports must travel as wheels (.whl/, from scripts/gpu/prepare.sh). The box
is simulated (scripts/gpu/bare_box.py): a virtual environment holding only the box's packages found
here, plus the pinned wheels installed as run.sh installs them. In it, every module the stages import
must import and the check stage's GPU tests must be collected; without one needed wheel (pyzmq) it
must fail. The wheels are downloaded for this interpreter's Python (same pins as the box's); the tests
skip, saying why, where they cannot be.

The full dry run of every stage in the simulated box (tiny models on the CPU, a few minutes) is
marked `gpukit`: `pytest -m gpukit tests/test_gpu_kit.py` (or ORPHEUS_GPUKIT=1) runs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orpheus_serve.benchmarking.runner import ADMISSION_NUMBERS, summarize_admission_inputs  # noqa: E402
from scripts.gpu import bare_box, kit, report  # noqa: E402

STAGES = ("check", "engine", "codec", "serve")
PREPARE = ROOT / "scripts" / "gpu" / "prepare.sh"
REPORT = [sys.executable, str(ROOT / "scripts" / "gpu" / "report.py")]


def prepare_pins() -> dict[str, str]:
    text = PREPARE.read_text()
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^\s+([A-Za-z0-9_.-]+)==(\S+)\s*$", text, re.M)}


# ----------------------------------------------------------------- the simulated bare box


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """prepare.sh's wheels for this interpreter's Python (the box's set, same pins)."""
    dest = tmp_path_factory.mktemp("wheels")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(["bash", str(PREPARE)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WHL_DIR": str(dest), "WHL_PYTHON": version, "PYTHON": sys.executable})
    if proc.returncode != 0:
        pytest.skip(f"the kit's wheels cannot be prepared here (no package index?): {proc.stderr.strip()[-300:]}")
    return dest


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, wheels: Path) -> tuple[Path, Path]:
    """(python, wheels site) of the simulated bare box."""
    dest = tmp_path_factory.mktemp("bare-box")
    python = bare_box.make_bare_box(dest / "venv", wheels=wheels)
    return python, dest / "venv" / "wheels-site"


def box_run(python: Path, site: Path | None, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=bare_box.box_env(site))


def test_the_bare_box_holds_only_the_box_packages(box: tuple[Path, Path]) -> None:
    python, _ = box
    # The project's own dependencies that the box lacks are not there without the wheels...
    for module in ("fastapi", "zmq", "snac", "riva.client"):
        proc = box_run(python, None, "-c", f"import {module}")
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, module
    # ...while the box's own are.
    assert box_run(python, None, "-c", "import torch, numpy, yaml, httpx, safetensors").returncode == 0


def test_every_stage_module_imports_and_gpu_tests_collect_on_the_bare_box(box: tuple[Path, Path]) -> None:
    python, site = box
    proc = box_run(python, site, "scripts/gpu/kit.py", "imports", *STAGES)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = re.search(r"(\d+)/\d+ tests collected|(\d+) tests collected", proc.stdout)
    assert collected and int(collected.group(1) or collected.group(2)) > 0, proc.stdout[-2000:]


def test_the_bare_box_fails_without_a_needed_wheel(box: tuple[Path, Path], wheels: Path, tmp_path: Path) -> None:
    python, _ = box
    without = [w for w in sorted(wheels.glob("*.whl")) if not w.name.startswith("pyzmq-")]
    assert len(without) == len(list(wheels.glob("*.whl"))) - 1
    bare_box.install_wheels(python, without, tmp_path / "site")
    proc = box_run(python, tmp_path / "site", "scripts/gpu/kit.py", "imports", "serve")
    assert proc.returncode == 1
    assert "cannot import zmq: ModuleNotFoundError" in proc.stderr


# ----------------------------------------------------------------- pins, verdicts, report


def test_prepare_pins_every_wheel_at_a_version_the_project_accepts() -> None:
    from packaging.requirements import Requirement

    pins = prepare_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    checked = 0
    for req in requirements:
        name = bare_box.normalize(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {req}"
            checked += 1
    assert checked >= 10
    assert pins["protobuf"].startswith("6.")  # the stubs' gencode; 7 must not reach the box
    for needed in ("pyzmq", "msgpack", "pytest", "pluggy", "iniconfig", "pygments", "pytest-timeout",
                   "nvidia-riva-client", "grpcio-health-checking"):
        assert needed in pins, needed
    assert "av" not in pins  # the stages stream PCM: PyAV need not travel


def test_check_fails_unless_a_gpu_test_passed() -> None:
    # On a GPU box every GPU test skipping (pytest exits 0) means CUDA was not seen: a failure.
    assert kit.check_verdict({"passed": 0, "failed": 0, "skipped": 18}, 0, dry_run=False)
    assert kit.check_verdict({"passed": 3, "failed": 1, "skipped": 0}, 1, dry_run=False)
    assert kit.check_verdict({"passed": 0, "failed": 0, "skipped": 0}, 5, dry_run=False)
    assert kit.check_verdict({"passed": 0, "failed": 0, "skipped": 0}, 5, dry_run=True)
    assert kit.check_verdict({"passed": 12, "failed": 0, "skipped": 6}, 0, dry_run=False) == []
    assert kit.check_verdict({"passed": 0, "failed": 0, "skipped": 18}, 0, dry_run=True) == []


def test_check_runs_the_gpu_marked_test_files() -> None:
    files = kit.gpu_test_files()
    assert {"tests/test_torch_engine.py", "tests/test_codec_stateful.py", "tests/test_engine_sdpa.py"} <= set(files)
    assert "tests/test_gpu_kit.py" not in files  # `gpukit` is not `gpu`


def test_gpu_readings_tolerate_not_available_and_keep_zeros() -> None:
    assert kit.parse_smi_numbers("37, 1234") == (37.0, 1234.0)
    assert kit.parse_smi_numbers("[N/A], 1234") is None
    summary = kit.summarize_gpu_samples([(0.0, 100.0), (80.0, 200.0)], not_available=1)
    assert summary["util_mean_pct"] == 40.0 and summary["util_zero_samples"] == 1 and summary["not_available"] == 1


def test_realtime_held_needs_full_length_streams() -> None:
    row = {"concurrency": 8, "requests": 16, "succeeded": 16, "underrun_streams": 0, "ttfb_p95_ms": 120.0,
           "short_streams": 0}
    assert kit.realtime_held([row], 150) == 8 and kit.realtime_held([row], 100) is None
    assert kit.realtime_held([{**row, "short_streams": 1}], 150) is None


def performance_doc(path: Path) -> None:
    """docs/PERFORMANCE.md without its GPU section, at `path`: the record a report is merged into."""
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    if report.BEGIN in text:
        head, rest = text.split(report.BEGIN, 1)
        text = head.rstrip() + "\n" + rest.split(report.END, 1)[1]
    path.write_text(text)


def stage_json(stage: str, **changes: object) -> dict[str, object]:
    data: dict[str, object] = {
        "stage": stage, "dry_run": False, "ok": True, "complete": True, "problems": [], "stage_seconds": 12.5,
        "env": {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
                "date_utc": "2026-12-01 10:00"},
        "table": f"| {stage} | value |\n|---|---|\n| x | 1 |"}
    data.update(changes)
    return data


def write_results(folder: Path, *stages: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for data in stages:
        (folder / f"{data['stage']}.json").write_text(json.dumps(data))
    return folder


def test_report_records_failed_and_empty_stages_and_refuses_only_dry_runs(tmp_path: Path) -> None:
    doc = tmp_path / "PERFORMANCE.md"
    performance_doc(doc)
    original = doc.read_text()
    failed = stage_json("check", ok=False, problems=["3 GPU test(s) failed", "pytest exited 1"])
    empty = stage_json("serve", ok=False, table="", problems=["stage raised: boom"])
    results = write_results(tmp_path / "r", stage_json("codec"), failed, empty)
    args = [str(results), "--doc", str(doc), "--raw-root", str(tmp_path / "raw")]
    subprocess.run([*REPORT, *args], check=True, capture_output=True)
    merged = doc.read_text()
    assert "| check | NVIDIA H100 80GB HBM3 | 2026-12-01 10:00 | **FAILED** | 3 GPU test(s) failed; pytest exited 1 |" \
        in merged
    assert "| serve | NVIDIA H100 80GB HBM3 | 2026-12-01 10:00 | **FAILED** | stage raised: boom; the stage measured " \
           "nothing |" in merged
    assert "| codec | NVIDIA H100 80GB HBM3 | 2026-12-01 10:00 | ok | - |" in merged
    assert "FAILED: 3 GPU test(s) failed; pytest exited 1" in merged and "| check | value |" in merged  # its table
    assert "**FAILED**: nothing was measured." in merged

    # Dry-run numbers say nothing about a GPU: refused, nothing written.
    doc.write_text(original)
    dry = write_results(tmp_path / "dry", stage_json("codec"), stage_json("engine", dry_run=True))
    proc = subprocess.run([*REPORT, str(dry), "--doc", str(doc), "--raw-root", str(tmp_path / "raw-dry")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "refused" in proc.stderr and "dry run" in proc.stderr
    assert doc.read_text() == original and not (tmp_path / "raw-dry").exists()


def test_report_ingests_the_h200_run_with_its_failed_serve_stage_and_its_edits(tmp_path: Path) -> None:
    """The first card run as it came back (docs/gpu-results/2026-11-28-h200): serve and check failed, both are
    in the section with their problems and numbers; the run's local edits are named; every file is kept."""
    run = ROOT / "docs" / "gpu-results" / "2026-11-28-h200"
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text("# Performance\n")
    subprocess.run([*REPORT, str(run), "--doc", str(doc), "--raw-root", str(tmp_path / "raw"), "--note",
                    "serve levels up to 384"], check=True, capture_output=True)
    merged = doc.read_text()
    assert "| serve | NVIDIA H200 | 2026-11-28 21:44 | **FAILED** | levels [320, 384] not measured (deadline); " \
           "requests failed at concurrency [64, 128, 192, 256] |" in merged
    assert "| check | NVIDIA H200 | 2026-11-28 21:54 | **FAILED** | 3 GPU test(s) failed; pytest exited 1 |" in merged
    assert "| 256 | 512 | 131 | 23,759 | 30,286 | 0.73 | 84 | 3.413-3.413 | 6.91 | 567.24 | 17 | 3 | 0.20 | 66.90 |" \
        in merged  # a failed stage's numbers stay, with admitted peak and the capacity estimate
    assert "4,841 passes decoded 17,324 frames in 100.5 s, 20.8 ms per pass of 3.6 frames" in merged
    assert ("Run `2026-11-28-h200`: serve levels up to 384. It ran with local edits to the kit, "
            "`docs/gpu-results/2026-11-28-h200/kit-edits.diff` (`scripts/gpu/kit.py`, "
            "`src/orpheus_serve/engines/torch_engine.py`).") in merged
    assert "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130 (CUDA 13.0)" in merged
    assert sorted(p.name for p in (tmp_path / "raw" / "2026-11-28-h200").iterdir()) == sorted(
        p.name for p in run.iterdir())


def test_the_admission_inputs_are_summarized_whichever_fields_the_server_reports() -> None:
    before = [{"capacity_streams": 3, "engine_margin": 0.5, "admission_open": False}]  # a server without the new fields
    summary = summarize_admission_inputs(before)
    assert summary["samples"] == 1 and summary["limit_reasons"] is None
    assert summary["numbers"]["capacity_streams"] == {"min": 3, "median": 3, "max": 3}
    assert summary["numbers"]["lead_p5_s"] is None and summary["numbers"]["codec_pass_ms_p99"] is None
    after = [{"capacity_streams": c, "limit_reason": r, "lead_p5_s": lead, "playing_streams": None}
             for c, r, lead in ((10, "lead", 0.8), (40, "model", 1.2), (20, "lead", 1.0), (None, "slots", None))]
    summary = summarize_admission_inputs(after)
    assert summary["numbers"]["capacity_streams"] == {"min": 10, "median": 20, "max": 40}
    assert summary["numbers"]["lead_p5_s"] == {"min": 0.8, "median": 1.0, "max": 1.2}
    assert summary["numbers"]["playing_streams"] is None
    assert summary["limit_reasons"] == {"lead": 2, "model": 1, "slots": 1}
    assert set(summary["numbers"]) == set(ADMISSION_NUMBERS)
    assert summarize_admission_inputs([])["samples"] == 0


def serve_row(concurrency: int, **changes: object) -> dict[str, object]:
    row: dict[str, object] = {
        "concurrency": concurrency, "requests": concurrency, "succeeded": concurrency, "ttfb_p50_ms": 90.0,
        "ttfb_p95_ms": 140.0, "realtime_of_started": 1.0, "underrun_events": 0, "underrun_streams": 0,
        "stream_audio_s_min": 3.413, "stream_audio_s_max": 3.413, "audio_seconds_per_second": 10.0,
        "tokens_per_s": 800.0, "admitted_peak": concurrency, "capacity_at_saturation": None,
        "server_cpu_s_per_audio_s": 0.2, "gpu": {"util_mean_pct": 80.0}, "errors": 0, "short_streams": 0}
    row.update(changes)
    return row


def test_the_serve_tables_show_the_admission_inputs_and_the_level_with_admission_fixed() -> None:
    inputs = summarize_admission_inputs([{"capacity_streams": 120, "limit_reason": "lead", "lead_p5_s": 1.5,
                                              "loop_period_ms_p50": 12.0, "loop_period_ms_p99": 19.0}] * 3)
    data = {"rows": [serve_row(16, admission_inputs=inputs)], "realtime_held": {"150": 16, "300": 16},
            "admission_fixed": serve_row(16, admission="slots", admission_inputs=summarize_admission_inputs(
                [{"limit_reason": "slots"}])),
            "max_tokens": 280, "expected_stream_audio_s": 3.413, "shapes": dataclasses.asdict(kit.REAL)}
    table = report.render_serve(data)
    assert "| 16 | 16 | 16 | 90.00 | 140.00 |" in table and "| 16 (admission slots) | 16 | 16 |" in table
    assert "| 16 | 3 | lead 3 | 120 | - | - | - | - | 12.00 / 19.00 | - / - | - | 1.50 | - |" in table
    assert "| 16 (admission slots) | 1 | slots 1 | - |" in table
    assert "real-time streams at p95 TTFB < 150 ms: **16**" in table and "1 per stream" in table


def test_the_serve_stage_covers_16_to_384_and_fits_the_first_call() -> None:
    """The first call (540 s with a ~30 s machine start: `run.sh --budget 500 serve`) holds the warm-up, every
    level and the level with admission fixed, each at its worst, on the H200's measured start-up times."""
    from orpheus_serve.config import SchedulerConfig

    shapes = kit.REAL
    assert shapes.serve_levels[0] == 16 and shapes.serve_levels[-1] == 384
    worst = kit.serve_level_worst_s(shapes, kit.expected_audio_s(shapes.serve_max_tokens),
                                    SchedulerConfig().queue_timeout_s)
    wheels_s, model_s, server_start_s, archive_s = 2, 8, 30, 10
    planned = wheels_s + model_s + server_start_s + worst * (1 + len(shapes.serve_levels)) + server_start_s + worst
    assert planned <= 500 - archive_s, planned
    readme = (ROOT / "scripts" / "gpu" / "README.md").read_text()
    assert "bash scripts/gpu/run.sh --budget 500 serve" in readme
    assert "bash scripts/gpu/run.sh --budget 245 check codec engine" in readme


def test_report_merges_stages_and_keeps_the_raw_json(tmp_path: Path) -> None:
    doc = tmp_path / "PERFORMANCE.md"
    performance_doc(doc)
    original = doc.read_text()
    first = write_results(tmp_path / "call1", stage_json("engine"), stage_json("serve"))
    args = ["--doc", str(doc), "--raw-root", str(tmp_path / "raw")]
    subprocess.run([*REPORT, str(first), *args], check=True, capture_output=True)
    merged = doc.read_text()
    assert merged.startswith(original.rstrip())  # the record above stays as it was
    assert merged.count("<!-- gpu-kit:begin -->") == 1
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130 (CUDA 13.0), 2026-12-01 10:00" in merged
    raw = tmp_path / "raw" / "2026-12-01-h100-80gb-hbm3"
    assert json.loads((raw / "serve.json").read_text())["stage"] == "serve"

    # The second call's stages join the first's; a partial stage is merged, marked as such.
    second = write_results(tmp_path / "call2", stage_json("check"),
                           stage_json("codec", complete=False, problems=["overlap not measured (deadline)"]))
    subprocess.run([*REPORT, str(second), *args], check=True, capture_output=True)
    again = doc.read_text()
    assert all(f"<!-- gpu-kit:stage {s} -->" in again for s in STAGES)
    assert again.index("stage check") < again.index("stage engine") < again.index("stage codec") < again.index(
        "stage serve")
    assert "PARTIAL: overlap not measured (deadline)" in again
    assert sorted(p.name for p in raw.iterdir()) == [f"{s}.json" for s in sorted(STAGES)]


# ----------------------------------------------------------------- the engine stage's sub-steps


def engine_run(tmp_path: Path, *, left_s: float, **shapes: object) -> kit.StageRun:
    """An engine stage run on the dry shapes, its main bench already measured, `left_s` to its deadline."""
    import dataclasses
    import time

    run = kit.StageRun("engine", dataclasses.replace(kit.DRY, **shapes), results=tmp_path / "out",
                       work=tmp_path / "work", deadline=time.time() + left_s, dry_run=True)
    row = {"variant": "base", "kv_len_first": 250, "kv_len_last": 255, "graphs": True, "constrained": True,
           "batch": 2, "step_ms": 1.0, "tokens_per_s": 2000.0, "x_batch_1": 1.8, "build_s": 0.5}
    bench = {"rows": [row], "complete": True, "skipped": [{"variant": "compiled", "reason": "no compile option"}]}
    run.data.update(bench=bench, slots_that_fit=[], sdpa=["cpu"], complete=True,
                    variants=kit.variant_rows(run.shapes, bench))
    return run


def test_engine_sub_steps_short_of_time_are_skipped_and_said_so(tmp_path: Path) -> None:
    run = engine_run(tmp_path, left_s=5)
    llama = tmp_path / "no-model"  # nothing may start: the time check comes first
    run.data["lora"] = kit._engine_lora(run, llama)
    run.data["gemm"] = kit._engine_gemm_shapes(run, llama)
    run.data["variants"] = kit.variant_rows(run.shapes, run.data["bench"], run.data["lora"])
    kit.render_engine(run)
    assert run.data["lora"] == {"status": "skipped", "reason": "5 s left, 20 s needed", "rows": []}
    assert run.data["gemm"]["status"] == "skipped" and not run.data["gemm"]["rows"]
    assert all(p.endswith("(deadline)") for p in run.data["problems"]) and len(run.data["problems"]) == 2
    assert "**SKIPPED**: 5 s left, 20 s needed" in run.table and "| distinct adapters |" not in run.table
    assert "| base | 250-255 | - | 1.00 |" in run.table  # the measured variant's numbers stay
    # Every named variant has its row: measured, or skipped with its reason, never a number.
    by_name = {v["variant"]: v for v in run.data["variants"]}
    assert list(by_name) == [*run.shapes.variants, "lora0", "lora1", "lora2"]
    assert by_name["compiled"] == {"variant": "compiled", "status": "skipped", "reason": "no compile option"}
    assert by_name["fused"]["status"] == "skipped" and "step_ms" not in by_name["fused"]
    assert by_name["lora2"] == {"variant": "lora2", "status": "skipped", "reason": "5 s left, 20 s needed"}
    assert "| compiled | **SKIPPED**: no compile option |" in run.table


def test_a_failed_engine_sub_step_is_reported_not_merged_as_a_number(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = engine_run(tmp_path, left_s=300)

    def failing(cmd: list[str], *, log_name: str, **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "Traceback ...\nRuntimeError: CUDA out of memory", "")

    monkeypatch.setattr(run, "run", failing)
    run.data["lora"] = kit._engine_lora(run, tmp_path / "model")
    run.data["gemm"] = kit._engine_gemm_shapes(run, tmp_path / "model")
    kit.render_engine(run)
    assert run.data["lora"]["status"] == "failed" and "out of memory" in run.data["lora"]["reason"]
    assert run.data["gemm"]["status"] == "failed" and "gemm" not in run.data["gemm"]
    assert all(p.endswith("(sub-step failed)") for p in run.data["problems"])
    assert run.table.count("**FAILED**") == 2 and "| distinct adapters |" not in run.table

    # The report merges the stage (its main numbers stand), marked partial with what failed.
    run.data.update(ok=True, complete=False, env=stage_json("engine")["env"])
    run.save()
    doc = tmp_path / "PERFORMANCE.md"
    performance_doc(doc)
    subprocess.run([*REPORT, str(run.results), "--doc", str(doc), "--raw-root", str(tmp_path / "raw"),
                    "--allow-dry-run"], check=True, capture_output=True)
    merged = doc.read_text()
    assert "PARTIAL: LoRA adapters in a batch of 2: bench_lora.py exited 1" in merged
    assert "**FAILED**: bench_lora.py exited 1" in merged


@pytest.mark.gpukit  # about half a minute: the engine stage alone, tiny shapes on the CPU
def test_the_engine_stage_measures_adapters_and_variants(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "KIT_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    env.pop("KIT_WHEELS", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "--budget", "300", "--dry-run", "engine"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    engine = json.loads((out / "engine.json").read_text())
    assert engine["ok"] and engine["complete"] and not engine["problems"]
    lora = engine["lora"]
    assert lora["status"] == "measured" and [r["adapters"] for r in lora["rows"]] == [0, 1, 2]
    assert all(r["batch"] == 2 and r["rank"] == 16 and r["tokens_per_s"] > 0 for r in lora["rows"])
    check_engine_variants_and_profile(engine)

    doc = tmp_path / "PERFORMANCE.md"
    performance_doc(doc)
    subprocess.run([*REPORT, str(out), "--doc", str(doc), "--raw-root", str(tmp_path / "raw"), "--allow-dry-run"],
                   check=True, capture_output=True)
    merged = doc.read_text()
    assert "LoRA adapters in a batch of 2 (rows lora0/lora8/lora32; rank 16" in merged
    assert "| lora2 | 2 |" in merged and "| fp8kv | 58-63 |" in merged
    assert "Top kernels at batch 1:" in merged and "| batch | activity | steps |" in merged


def check_engine_variants_and_profile(engine: dict[str, object]) -> None:
    """The dry run's engine.json: a row per named variant (measured, or skipped with its reason), a profile per
    profiled batch, the GEMM shapes."""
    variants = {v["variant"]: v for v in engine["variants"]}  # type: ignore[union-attr]
    assert list(variants) == [*kit.DRY.variants, "lora0", "lora1", "lora2"]
    for name, row in variants.items():
        if row["status"] == "measured":
            assert all(float(v) > 0 for v in row["tokens_per_s"].values()), name
            if not name.startswith("lora"):
                assert set(row["step_ms"]) == {"1", "2"} and row["build_s"] >= 0, name
        else:
            assert row["status"] in ("skipped", "failed") and row["reason"] and "step_ms" not in row, name
    assert all(variants[v]["status"] == "measured" for v in ("base", "fused", "fp8kv", "fp8w"))
    profile = engine["profile"]
    assert profile["variant"] == "base" and [p["batch"] for p in profile["batches"]] == [1, 2]  # type: ignore[index]
    for p in profile["batches"]:  # type: ignore[index]
        assert p["activity"] == "cpu" and p["kernels_per_step"] > 0 and 0 <= p["idle_share"] < 1
        assert p["top_kernels"] and abs(sum(k["share"] for k in p["top_kernels"]) - 1) < 0.5
    gemm = engine["gemm"]
    assert gemm["status"] == "measured" and {r["gemm"] for r in gemm["rows"]} == {"qkv", "o", "gate_up", "down"}


def test_run_sh_rejects_unknown_stages_and_bad_budgets() -> None:
    for args in (["bogus"], ["--budget", "soon", "check"], []):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), *args, "--dry-run"], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 2 and "usage" in proc.stderr, args


def test_plots_are_skipped_without_matplotlib(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if not installed
        "from pathlib import Path\n"
        "from orpheus_serve.benchmarking.plots import plot_results\n"
        "rows = [{'concurrency': c} for c in (1, 2)]\n"
        f"print(plot_results({{'scaling': {{'rows': rows}}}}, Path({str(tmp_path / 'r')!r})))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]" and "matplotlib is not installed" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_in_process_server_needs_no_zeromq() -> None:
    """Only a server whose engine core runs apart imports core.mp_client (and zmq, msgpack)."""
    code = ("import sys; sys.modules['zmq'] = None; sys.modules['msgpack'] = None\n"  # as if not installed
            "import orpheus_serve.api.server, orpheus_serve.api.launch, orpheus_serve.service.build\n"
            "import orpheus_serve.service.service\n"
            "print(sorted(m for m in sys.modules if m.startswith('orpheus_serve.') and m.endswith(\n"
            "    ('mp_client', 'process_group', 'core.process', 'core.wire', 'core.transport', 'core.supervisor'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"})
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]


# ----------------------------------------------------------------- the full dry run (marked gpukit)


@pytest.mark.gpukit
@pytest.mark.timeout(900)
def test_every_stage_runs_end_to_end_on_the_bare_box(box: tuple[Path, Path], wheels: Path, tmp_path: Path) -> None:
    python, _ = box
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**bare_box.box_env(None), "OUT": str(out), "KIT_WORK": str(work), "PYTHON": str(python),
           "KIT_WHEELS": str(wheels), "KIT_SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "--budget", "800", "--dry-run", "all"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([*(f"{s}.json" for s in STAGES), "logs-check-engine-codec-serve.tar.gz"])  # at most 8 files come back
    datas = {s: json.loads((out / f"{s}.json").read_text()) for s in STAGES}
    for stage, data in datas.items():
        assert data["stage"] == stage and data["dry_run"] is True and data["ok"] is True, data["problems"]
        assert data["complete"] is True and data["table"].startswith("| ")
    listing = subprocess.run(["tar", "-tzf", str(out / "logs-check-engine-codec-serve.tar.gz")], capture_output=True, text=True).stdout
    assert "logs/serve-server.log" in listing and "logs/check-pytest.log" in listing

    check = datas["check"]["pytest"]
    assert check["failed"] == 0 and check["skipped"] > 0 and "tests/test_torch_engine.py" in check["files"]

    engine = datas["engine"]
    rows = engine["bench"]["rows"]
    assert {(r["context"], r["graphs"], r["constrained"]) for r in rows} == {(64, False, True)}  # no graphs on a CPU
    assert [r["adapters"] for r in engine["lora"]["rows"]] == [0, 1, 2]
    check_engine_variants_and_profile(engine)
    # Every step of a context's measurement attends within the graph bucket that ends at the context.
    assert all(r["context"] // 2 < r["kv_len_first"] <= r["kv_len_last"] <= r["context"] for r in rows)
    assert engine["slots_that_fit"][0]["max_slots"] > 0

    codec = datas["codec"]
    assert [r["batch"] for r in codec["rows"]] == [1, 2]
    # Graphs on and off side by side (on a CPU the static steps run eagerly where the graphs would replay),
    # with the host time of a pass for both.
    assert codec["graph_path"] == "static-eager" and codec["graph_capture"]["graphs"] == 0
    for row in codec["rows"]:
        assert min(row["pass_ms_median"], row["dynamic_pass_ms_median"], row["host_ms_median"],
                   row["dynamic_host_ms_median"]) > 0
    overlap = codec["overlap"]
    assert overlap["steps_short"] == 0 and overlap["steps_checked"] == 3 * overlap["engine_steps"]

    serve = datas["serve"]
    assert "server.engine_process=true" in serve["overrides"] and serve["warmup"]["succeeded"] > 0
    # The engine core (its own process) profiled its steps in one more round at the highest level.
    profile = serve["profile"]
    assert profile["status"] == "measured" and profile["concurrency"] == 2
    assert profile["batches"][0]["steps"] == kit.DRY.serve_profile_steps and profile["batches"][0]["kernels_per_step"] > 0
    assert [r["concurrency"] for r in serve["rows"]] == [1, 2]
    for row in serve["rows"]:
        assert row["succeeded"] == row["requests"] and row["errors"] == 0 and row["short_streams"] == 0
        for length in (row["stream_audio_s_min"], row["stream_audio_s_max"]):  # every utterance at full length
            assert length == pytest.approx(serve["expected_stream_audio_s"], abs=0.01)
        assert row["server_cpu_s_per_audio_s"] > 0
        assert set(row["admission_inputs"]["numbers"]) == set(ADMISSION_NUMBERS)
    fixed = serve["admission_fixed"]  # the top level again, on a server with admission fixed at the slots
    assert fixed["admission"] == "slots" and fixed["concurrency"] == 2 and fixed["succeeded"] == fixed["requests"] == 2
    assert "(admission slots)" in serve["table"]

    doc = tmp_path / "PERFORMANCE.md"
    performance_doc(doc)
    merge = [*REPORT, str(out), "--doc", str(doc), "--raw-root", str(tmp_path / "raw")]
    refused = subprocess.run(merge, capture_output=True, text=True)
    assert refused.returncode != 0 and "dry run" in refused.stderr
    subprocess.run([*merge, "--allow-dry-run"], check=True, capture_output=True)
    assert "DRY RUN" in doc.read_text() and "real-time streams at p95 TTFB < 150 ms" in doc.read_text()
    assert "Profile of the serve stage's steps" in doc.read_text()
    assert "LoRA adapters in a batch of 2" in doc.read_text() and "| fp8w | " in doc.read_text()


@pytest.mark.gpukit  # about a minute: with the full dry run, outside the CI lane
def test_a_stage_past_its_deadline_is_killed_with_its_whole_process_group(tmp_path: Path) -> None:
    """A stage that cannot stop by itself (here: frozen once its server and engine core are up) is ended
    at the call's deadline with everything it started: nothing is left holding the card."""
    import signal
    import time

    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "KIT_WORK": str(work), "PYTHON": sys.executable}
    env.pop("KIT_WHEELS", None)
    started = time.monotonic()
    call = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "--budget", "60", "--dry-run", "serve"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The stage's own process, then its group once the server's engine core has joined it.
        group: set[int] = set()
        while time.monotonic() - started < 45 and call.poll() is None:
            # The stage's python itself, not `timeout` (whose command line holds the same words).
            pattern = "^" + re.escape(f"{sys.executable} scripts/gpu/kit.py serve --results {out}")
            stage = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
            pids = [int(p) for p in stage.stdout.split()]
            if pids:
                pgid = os.getpgid(pids[0])
                group = {int(p) for p in subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True,
                                                        text=True).stdout.split()}
                if len(group) >= 3:  # the stage, production_server.py and its engine-core process
                    os.kill(pids[0], signal.SIGSTOP)  # the stage can no longer stop anything itself
                    break
            time.sleep(0.5)  # polling a process table: there is nothing to wait on
        assert len(group) >= 3, "the server and its engine core did not start in time"
        output, _ = call.communicate(timeout=90)
    finally:
        if call.poll() is None:
            call.kill()
    assert call.returncode == 1, output
    assert "=== serve done" in output and ("(exit 124)" in output or "(exit 137)" in output), output[-2000:]
    deadline = time.monotonic() + 20
    while (alive := [p for p in group if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]) and (
            time.monotonic() < deadline):
        time.sleep(0.5)
    assert not alive, f"left running: {alive}"
    saved = json.loads((out / "serve.json").read_text())  # what the stage had written stays readable
    assert saved["stage"] == "serve" and saved["ok"] is False
    assert (out / "logs-serve.tar.gz").exists()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (FileNotFoundError, IndexError):
        return "Z"
