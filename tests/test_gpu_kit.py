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
import time
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orpheus_serve.benchmarking.runner import ADMISSION_NUMBERS, summarize_admission_inputs  # noqa: E402
from scripts.gpu import bare_box, report  # noqa: E402
from scripts.gpu.stages import check, common, serve  # noqa: E402
from scripts.gpu.stages import engine as engine_stage  # noqa: E402

STAGES = ("check", "engine", "codec", "serve")  # the four the report tests merge
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
    proc = box_run(python, site, "scripts/gpu/kit.py", "imports", *common.STAGES)
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
    assert check.check_verdict({"passed": 0, "failed": 0, "skipped": 18}, 0, dry_run=False)
    assert check.check_verdict({"passed": 3, "failed": 1, "skipped": 0}, 1, dry_run=False)
    assert check.check_verdict({"passed": 0, "failed": 0, "skipped": 0}, 5, dry_run=False)
    assert check.check_verdict({"passed": 0, "failed": 0, "skipped": 0}, 5, dry_run=True)
    assert check.check_verdict({"passed": 12, "failed": 0, "skipped": 6}, 0, dry_run=False) == []
    assert check.check_verdict({"passed": 0, "failed": 0, "skipped": 18}, 0, dry_run=True) == []


def test_check_runs_the_gpu_marked_test_files() -> None:
    files = check.gpu_test_files()
    assert {"tests/test_torch_engine.py", "tests/test_codec_stateful.py", "tests/test_engine_sdpa.py"} <= set(files)
    assert "tests/test_gpu_kit.py" not in files  # `gpukit` is not `gpu`


def test_gpu_readings_tolerate_not_available_and_keep_zeros() -> None:
    assert serve.parse_smi_numbers("37, 1234") == (37.0, 1234.0)
    assert serve.parse_smi_numbers("[N/A], 1234") is None
    summary = serve.summarize_gpu_samples([(0.0, 100.0), (80.0, 200.0)], not_available=1)
    assert summary["util_mean_pct"] == 40.0 and summary["util_zero_samples"] == 1 and summary["not_available"] == 1


def test_realtime_held_needs_full_length_streams() -> None:
    row = {"concurrency": 8, "requests": 16, "succeeded": 16, "underrun_streams": 0, "ttfb_p95_ms": 120.0,
           "short_streams": 0}
    assert serve.realtime_held([row], 150) == 8 and serve.realtime_held([row], 100) is None
    assert serve.realtime_held([{**row, "short_streams": 1}], 150) is None


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
            "max_tokens": 280, "expected_stream_audio_s": 3.413, "shapes": dataclasses.asdict(common.REAL)}
    table = report.render_serve(data)
    assert "| 16 | 16 | 16 | 90.00 | 140.00 |" in table and "| 16 (admission slots) | 16 | 16 |" in table
    assert "| 16 | 3 | lead 3 | 120 | - | - | - | - | 12.00 / 19.00 | - / - | - | 1.50 | - |" in table
    assert "| 16 (admission slots) | 1 | slots 1 | - |" in table
    assert "real-time streams at p95 TTFB < 150 ms: **16**" in table and "1 per stream" in table


def test_the_serve_stage_covers_16_to_256_and_a_fifteen_minute_loan_gives_it_every_level() -> None:
    """Levels from 16 to 256 streams: past twice what the H200's engine carried (about 120), so the top levels
    are overload. On a 15-minute loan with a 90 s start, the plan gives serve every level, the profile round
    and the row with admission fixed, each at its worst, on the H200's measured start-up times."""
    from orpheus_serve.config import SchedulerConfig
    from scripts.gpu import plan as loan

    shapes = common.REAL
    assert shapes.serve_levels[0] == 16 and shapes.serve_levels[-1] == 256
    assert tuple(shapes.serve_levels) == loan.SERVE_LEVELS
    worst = serve.serve_level_worst_s(shapes, serve.expected_audio_s(shapes.serve_max_tokens),
                                    SchedulerConfig().queue_timeout_s)
    assert worst == pytest.approx(loan.LEVEL_WORST_S, abs=0.01)
    for card in ("h100", "h200"):
        given = {s.name: s.given_s for c in loan.plan_loan(900, card=card, start_s=90).calls for s in c.stages}
        assert given["serve"] == loan.STAGE_COSTS["serve"].planned_s(loan.CARDS[card])


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


def engine_run(tmp_path: Path, *, left_s: float, **shapes: object) -> common.StageRun:
    """An engine stage run on the dry shapes, its main bench already measured, `left_s` to its deadline."""
    import dataclasses
    import time

    run = common.StageRun("engine", dataclasses.replace(common.DRY, **shapes), results=tmp_path / "out",
                       work=tmp_path / "work", deadline=time.time() + left_s, dry_run=True)
    row = {"variant": "base", "kv_len_first": 250, "kv_len_last": 255, "graphs": True, "constrained": True,
           "batch": 2, "step_ms": 1.0, "tokens_per_s": 2000.0, "x_batch_1": 1.8, "build_s": 0.5}
    bench = {"rows": [row], "complete": True, "skipped": [{"variant": "compiled", "reason": "no compile option"}]}
    run.data.update(bench=bench, slots_that_fit=[], sdpa=["cpu"], complete=True,
                    variants=engine_stage.variant_rows(run.shapes.variants, bench, run.shapes, lora=None))
    return run


def test_engine_sub_steps_short_of_time_are_skipped_and_said_so(tmp_path: Path) -> None:
    run = engine_run(tmp_path, left_s=5)
    llama = tmp_path / "no-model"  # nothing may start: the time check comes first
    run.data["lora"] = engine_stage.engine_lora(run, llama)
    run.data["gemm"] = engine_stage.engine_gemm_shapes(run, llama)
    run.data["variants"] = engine_stage.variant_rows(run.shapes.variants, run.data["bench"], run.shapes, run.data["lora"])
    engine_stage.render_engine(run)
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
    run.data["lora"] = engine_stage.engine_lora(run, tmp_path / "model")
    run.data["gemm"] = engine_stage.engine_gemm_shapes(run, tmp_path / "model")
    engine_stage.render_engine(run)
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


def check_engine_variants_and_profile(engine: dict[str, object], *, lora: bool = True) -> None:
    """An engine stage's dry-run JSON (engine, base or compiled): a row per planned variant (measured, or skipped
    or failed with its reason, never a number), the lora rows after them in the engine stage, a profile per
    profiled batch of its first variant, the GEMM shapes in the engine stage."""
    planned = engine["variants_planned"]
    variants = {v["variant"]: v for v in engine["variants"]}  # type: ignore[union-attr]
    assert list(variants) == [*planned, *(["lora0", "lora1", "lora2"] if lora else [])]  # type: ignore[misc]
    for name, row in variants.items():
        if row["status"] == "measured":
            assert all(float(v) > 0 for v in row["tokens_per_s"].values()), name
            if not name.startswith("lora"):
                assert set(row["step_ms"]) == {"1", "2"} and row["build_s"] >= 0, name
                if engine.get("attention_requested"):  # the dry run asks for the Triton kernels (interpreted)
                    assert row["attention"] == "triton", name
                if name == "compiled":  # every measured batch size ran on the compile made at build
                    assert row["compiles"]["at_build"] >= 1 and row["compiles"]["after_warm_up"] == 0, row
        else:
            assert row["status"] in ("skipped", "failed") and row["reason"] and "step_ms" not in row, name
    assert all(variants[v]["status"] == "measured" for v in ("base", "fused", "fp8kv", "fp8w") if v in variants)
    profile = engine["profile"]
    assert profile["variant"] == planned[0] and profile["status"] == "measured"  # type: ignore[index]
    assert [p["batch"] for p in profile["batches"]] == [1, 2] and not profile["failed"]  # type: ignore[index]
    for p in profile["batches"]:  # type: ignore[index]
        assert p["activity"] == "cpu" and p["kernels_per_step"] > 0 and 0 <= p["idle_share"] < 1
        assert p["top_kernels"] and abs(sum(k["share"] for k in p["top_kernels"]) - 1) < 0.5
    if lora:
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


# ----------------------------------------------------------------- stages in the order of their value


def test_the_engine_stages_split_the_variants_and_engine_can_run_them_all() -> None:
    shapes = common.DRY
    assert engine_stage.stage_variants("base", shapes) == ["base"]
    assert engine_stage.stage_variants("compiled", shapes) == ["compiled"]
    assert engine_stage.stage_variants("engine", shapes) == ["fused", "fp8kv", "fp8w"]
    assert engine_stage.stage_variants("engine", shapes, ["all"]) == shapes.variants
    assert engine_stage.stage_variants("engine", shapes, ["fp8w", "base"]) == ["base", "fp8w"]  # the kit's order
    with pytest.raises(ValueError, match="unknown variants"):
        engine_stage.stage_variants("engine", shapes, ["fast"])
    assert common.STAGES == ("serve", "base", "check", "codec", "engine", "compiled")
    assert set(common.STAGE_MODULES) == set(common.STAGES)


def test_each_stage_option_belongs_to_its_stage() -> None:
    from scripts.gpu import kit

    for argv in (["check", "--tag", "again"], ["engine", "--override", "codec.ragged_steps=false"],
                 ["base", "--variants", "all"], ["serve", "--tests", "tests/test_fused.py"],
                 ["serve", "--override", "no-equals-sign"], ["serve", "--tag", "check"]):
        with pytest.raises(SystemExit) as stopped:
            kit.main([*argv, "--results", "/nonexistent", "--dry-run"])
        assert stopped.value.code == 2, argv


# ----------------------------------------------------------------- the check stage's time and order


def test_check_runs_the_riskiest_gpu_test_files_first() -> None:
    files = ["tests/test_codec.py", "tests/test_fused.py", "tests/test_lora.py", "tests/test_zeta.py",
             "tests/test_lora_kernels.py", "tests/test_alpha.py"]
    durations = {"tests/test_zeta.py::test_a": 1.0, "tests/test_codec.py::test_a": 3.0,
                 "tests/test_codec.py::test_b": 4.0}
    assert check.ordered_test_files(files, durations) == [
        "tests/test_fused.py", "tests/test_lora_kernels.py", "tests/test_lora.py",  # at risk first
        "tests/test_zeta.py", "tests/test_codec.py",  # then the shortest known
        "tests/test_alpha.py"]  # then those never timed
    ordered = check.ordered_test_files(check.gpu_test_files(), check.recorded_durations())
    assert ordered[:2] == ["tests/test_fused.py", "tests/test_lora_kernels.py"]
    assert sorted(ordered) == check.gpu_test_files()


def test_check_counts_tests_not_run_for_lack_of_time_as_the_deadline() -> None:
    stopped = {"passed": 3, "failed": 0, "skipped": 1, "not_run": 5}
    for exit_code in (1, 2, 124):  # session timeout, SIGTERM, the stage's own stop
        problems = check.check_verdict(stopped, exit_code, dry_run=False)
        assert problems == ["5 of 9 GPU test(s) not run: the stage's time ran out (deadline)"], exit_code
    assert "1 GPU test(s) failed" in check.check_verdict({**stopped, "failed": 1}, 1, dry_run=False)
    assert check.check_verdict({**stopped, "not_run": 0}, 1, dry_run=False) == ["pytest exited 1"]
    # Collected but none ran (the time ran out at once) is the deadline too, not "no GPU test was collected".
    assert check.check_verdict({"passed": 0, "failed": 0, "skipped": 0, "not_run": 4}, 2, dry_run=False) == [
        "4 of 4 GPU test(s) not run: the stage's time ran out (deadline)"]


def test_the_progress_file_gives_each_test_one_outcome(tmp_path: Path) -> None:
    lines = [{"collected": ["t.py::a", "t.py::b", "t.py::c", "t.py::d", "t.py::e"]},
             {"nodeid": "t.py::a", "when": "call", "outcome": "passed", "seconds": 1.5, "message": ""},
             {"nodeid": "t.py::a", "when": "teardown", "outcome": "failed", "seconds": 0.5, "message": "leak"},
             {"nodeid": "t.py::b", "when": "setup", "outcome": "skipped", "seconds": 0.0, "message": "no CUDA"},
             {"nodeid": "t.py::c", "when": "call", "outcome": "passed", "seconds": 2.0, "message": ""}]
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"nodeid": "t.py::d", "wh')  # cut
    collected, tests = check.read_progress(progress)
    assert collected == [f"t.py::{n}" for n in "abcde"]
    assert tests == {"t.py::a": {"outcome": "failed", "seconds": 2.0, "message": "leak"},
                     "t.py::b": {"outcome": "skipped", "seconds": 0.0, "message": "no CUDA"},
                     "t.py::c": {"outcome": "passed", "seconds": 2.0, "message": ""}}
    assert check.count_outcomes(collected, tests) == {"passed": 1, "failed": 1, "skipped": 1, "collected": 5,
                                                      "not_run": 2}


SLOW_GPU_TESTS = """
import time

import pytest

gpu = pytest.mark.gpu


@gpu
def test_skips():
    pytest.skip("on purpose")


@gpu
@pytest.mark.parametrize("index", range(30))
def test_slow(index):
    time.sleep(1.0)
"""


def kit_check(tmp_path: Path, tests: Path, *, deadline_s: float) -> subprocess.Popen[str]:
    """`kit.py check --dry-run` over `tests`, in its own process group as run.sh's `timeout` runs it."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "kit.py"), "check", "--dry-run", "--results",
         str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--deadline", str(time.time() + deadline_s),
         "--tests", str(tests)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def check_after_a_cut(tmp_path: Path) -> tuple[dict, dict]:
    data = json.loads((tmp_path / "out" / "check.json").read_text())
    summary = data["pytest"]
    junit = tmp_path / "work" / "logs" / "check-junit.xml"
    assert junit.exists(), "pytest ended without writing its JUnit file"
    assert data["partial"] is True and data["complete"] is False
    assert summary["collected"] == 31 and summary["skipped"] == 1 and summary["failed"] == 0
    assert summary["passed"] >= 1 and summary["not_run"] >= 1
    assert summary["passed"] + summary["skipped"] + summary["not_run"] == 31
    assert len(summary["not_run_tests"]) == summary["not_run"] and len(summary["durations"]) == 31 - summary["not_run"]
    # What JUnit recorded is what the stage counted (the test still running at a SIGTERM is in neither: JUnit
    # leaves an empty, nameless testcase for it).
    import xml.etree.ElementTree as ET

    cases = [c for c in ET.parse(junit).getroot().iter("testcase") if c.get("name")]
    assert len(cases) == summary["passed"] + summary["skipped"]
    return data, summary


def test_the_check_stage_stopped_by_its_deadline_leaves_its_junit_and_what_ran(tmp_path: Path) -> None:
    tests = tmp_path / "test_slow_gpu.py"
    tests.write_text(SLOW_GPU_TESTS)
    # Room for pytest's start and a few 1 s tests under the session timeout (the deadline less 12 s).
    proc = kit_check(tmp_path, tests, deadline_s=24)
    output, _ = proc.communicate(timeout=60)
    data, summary = check_after_a_cut(tmp_path)
    assert summary["session_timeout_s"] <= 24 - check.SESSION_MARGIN_S
    assert data["ok"] is True, output[-3000:]  # partial, not failed: nothing failed, the time ran out
    assert data["problems"] == [f"{summary['not_run']} of 31 GPU test(s) not run: the stage's time ran out "
                                "(deadline)"]
    assert "session-timeout" in (tmp_path / "work" / "logs" / "check-pytest.log").read_text()
    assert "| pytest -m gpu | " in data["table"] and "not run:" in data["table"]


def test_the_check_stage_killed_mid_run_keeps_what_ran(tmp_path: Path) -> None:
    """SIGTERM to the stage's process group (run.sh's `timeout`) while pytest runs: pytest ends its session
    and writes its JUnit file; the stage saves the tests that ran, marked partial, before the KILL would come."""
    import signal

    tests = tmp_path / "test_slow_gpu.py"
    tests.write_text(SLOW_GPU_TESTS)
    proc = kit_check(tmp_path, tests, deadline_s=300)
    progress = tmp_path / "work" / "check-progress.jsonl"
    started = time.monotonic()
    while time.monotonic() - started < 60 and proc.poll() is None:
        if progress.exists() and len(progress.read_text().splitlines()) >= 4:  # collected, a skip, two passes
            break
        time.sleep(0.2)  # polling a file another process writes: there is nothing to wait on
    os.killpg(proc.pid, signal.SIGTERM)
    killed = time.monotonic()
    output, _ = proc.communicate(timeout=30)
    assert time.monotonic() - killed < 10, "the stage outlived the 10 s before run.sh's KILL"
    data, summary = check_after_a_cut(tmp_path)
    assert data["killed"] and summary["exit_code"] == 124, output[-3000:]
    assert data["ok"] is True and all(p.endswith("(deadline)") for p in data["problems"])


# ----------------------------------------------------------------- nothing measured is lost


def profiled(variant: str, batch: int, kernels: int, **changes: object) -> dict[str, object]:
    entry: dict[str, object] = {"variant": variant, "batch": batch, "activity": "cuda", "steps": 5, "step_ms": 2.0,
                                "busy_ms_per_step": 1.8, "kernels_per_step": kernels, "idle_share": 0.1,
                                "top_kernels": [{"name": "gemm", "share": 1.0, "ms_per_step": 1.8,
                                                 "calls_per_step": kernels}]}
    entry.update(changes)
    return entry


def test_a_profile_without_kernels_is_a_failed_row_not_a_number(tmp_path: Path) -> None:
    bench = {"profiles": [profiled("fused", 1, 0), profiled("fused", 256, 90), profiled("fp8w", 1, 80),
                          profiled("fp8w", 256, 80, status="failed", reason="CUPTI unavailable")]}
    profile = engine_stage.engine_profile(bench, "fused")
    assert [b["batch"] for b in profile["batches"]] == [256] and profile["status"] == "measured"
    assert profile["failed"] == [{"variant": "fused", "batch": 1, "reason": "the profile recorded no kernels"},
                                 {"variant": "fp8w", "batch": 256, "reason": "CUPTI unavailable"}]
    assert [b["batch"] for b in profile["variants"]["fp8w"]] == [1]
    assert engine_stage.engine_profile({"profiles": [profiled("base", 1, 0)]}, "base")["status"] == "failed"
    tables = report.profile_tables(profile, "Profile")
    assert "| 1 (fused) | **FAILED**: the profile recorded no kernels |" in tables
    assert "| 256 (fp8w) | **FAILED**: CUPTI unavailable |" in tables and "| 256 | cuda | 5 |" in tables
    # serve.json's profile as a whole.
    assert report.profile_tables({"status": "failed", "reason": "no kernels", "rows": []}, "Serve") == \
        "Serve: **FAILED**: no kernels"


def test_report_shows_a_killed_stage_as_partial_and_a_tagged_pass_as_its_own_block(tmp_path: Path) -> None:
    doc = tmp_path / "PERFORMANCE.md"
    performance_doc(doc)
    killed = stage_json("base", complete=False, partial=True, killed="SIGTERM: the stage's deadline",
                        problems=["killed before it finished; what it measured until then stands (deadline)"])
    even = stage_json("serve", tag="serve-even", extra_overrides=["codec.ragged_steps=false"],
                      table="| even | value |\n|---|---|\n| x | 2 |")
    results = write_results(tmp_path / "r", stage_json("serve"), killed)
    (results / "serve-even.json").write_text(json.dumps(even))
    (results / "engine-variants.json").write_text(json.dumps({"rows": []}))  # a bench's raw file: not a stage
    subprocess.run([*REPORT, str(results), "--doc", str(doc), "--raw-root", str(tmp_path / "raw")], check=True,
                   capture_output=True)
    merged = doc.read_text()
    assert "| base | NVIDIA H100 80GB HBM3 | 2026-12-01 10:00 | **PARTIAL** | killed before it finished" in merged
    assert "| serve (serve-even) | NVIDIA H100 80GB HBM3 | 2026-12-01 10:00 | ok |" in merged
    assert "server settings added: `codec.ragged_steps=false`" in merged and "| even | value |" in merged
    assert "Raw results: `docs/gpu-results/2026-12-01-h100-80gb-hbm3/serve-even.json`" in merged
    assert merged.index("<!-- gpu-kit:stage base -->") < merged.index("<!-- gpu-kit:stage serve -->") < \
        merged.index("<!-- gpu-kit:stage serve-even -->")
    # Merged again with only the first pass: the tagged pass's block stays.
    subprocess.run([*REPORT, str(write_results(tmp_path / "r2", stage_json("serve"))), "--doc", str(doc),
                    "--raw-root", str(tmp_path / "raw")], check=True, capture_output=True)
    assert doc.read_text().count("<!-- gpu-kit:stage serve-even -->") == 1


def check_stage_rows(stage: str, data: dict) -> None:
    """A stage's rows, however far it got: each one whole, never a half-measured one."""
    if stage == "check":
        summary = data.get("pytest")
        if summary and "collected" in summary:
            ran = summary["passed"] + summary["failed"] + summary["skipped"]
            assert ran + summary["not_run"] == summary["collected"]
    elif stage in ("base", "engine", "compiled"):
        for row in data.get("bench", {}).get("rows", []):
            assert row["variant"] in data["variants_planned"] and row["step_ms"] > 0 and row["tokens_per_s"] > 0
        for row in data.get("variants", []):
            if row["status"] == "measured":
                assert all(v > 0 for v in row["step_ms"].values()), row
            else:
                assert row["status"] in ("skipped", "failed") and row["reason"] and "step_ms" not in row, row
    elif stage == "codec":
        for row in data.get("rows", []):
            assert row["batch"] in common.DRY.codec_batches and row["pass_ms_median"] > 0, row
    elif stage == "serve":
        for row in data.get("rows", []):
            assert row["concurrency"] in common.DRY.serve_levels and 0 <= row["succeeded"] <= row["requests"], row


@pytest.mark.gpukit
@pytest.mark.timeout(1200)
def test_every_stage_cut_at_random_points_leaves_partial_well_formed_rows(tmp_path: Path) -> None:
    """Each stage of the dry run cut at two seeded random points: once as run.sh cuts it (its deadline, then
    SIGTERM to its process group 5 s later), once killed well before the deadline it was given. Its STAGE.json
    is there, parses, says partial unless the stage finished, and holds only whole rows. The serve stage runs
    as the second pass would (a tag, an override)."""
    import random
    import signal

    chance = random.Random(47)
    work = tmp_path / "work"  # the models, written once
    for stage in common.STAGES:
        for cut, killed_early in ((chance.uniform(8, 30), False), (chance.uniform(8, 30), True)):
            out = tmp_path / f"out-{stage}-{cut:.0f}"
            extra = ["--tag", "serve-even", "--override", "codec.ragged_steps=false"] if stage == "serve" else []
            deadline = time.time() + (cut + 300 if killed_early else cut)
            proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "gpu" / "kit.py"), stage, "--dry-run",
                                     "--results", str(out), "--work", str(work), "--deadline", str(deadline), *extra],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=cut if killed_early else cut + 5)
                was_killed = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    output, _ = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    output, _ = proc.communicate()
                was_killed = True
            name = "serve-even" if stage == "serve" else stage
            where = f"{stage} cut at {cut:.1f} s ({'killed' if was_killed else 'stopped itself'}): {output[-2000:]}"
            data = json.loads((out / f"{name}.json").read_text())
            assert sorted(p.name for p in out.iterdir()) == [f"{name}.json"], where
            assert data["stage"] == stage and data["partial"] is (not data["complete"]), where
            if was_killed and killed_early and not data["complete"]:  # its deadline was far: the kill cut it
                assert data["partial"] is True and data.get("killed"), where
            if data.get("killed"):
                assert data["partial"] is True, where
            assert all(isinstance(p, str) for p in data["problems"]), where
            if stage == "serve":
                assert data["tag"] == "serve-even" and data["extra_overrides"] == ["codec.ragged_steps=false"], where
            check_stage_rows(stage, data)


# ----------------------------------------------------------------- the full dry run (marked gpukit)


@pytest.mark.gpukit
@pytest.mark.timeout(1500)
def test_every_stage_runs_end_to_end_on_the_bare_box(box: tuple[Path, Path], wheels: Path, tmp_path: Path) -> None:
    python, _ = box
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**bare_box.box_env(None), "OUT": str(out), "KIT_WORK": str(work), "PYTHON": str(python),
           "KIT_WHEELS": str(wheels), "KIT_SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "--budget", "800", "--dry-run", "all"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    # Every stage `all` names, one JSON each, and one log archive: at most 8 files come back.
    archives = [p.name for p in out.glob("logs-*.tar.gz")]
    ran = sorted(p.stem for p in out.glob("*.json"))
    assert len(archives) == 1 and set(STAGES) <= set(ran) <= set(common.STAGES), (archives, ran)
    assert len(list(out.iterdir())) == len(ran) + 1 <= 8
    datas = {s: json.loads((out / f"{s}.json").read_text()) for s in ran}
    for stage, data in datas.items():
        assert data["stage"] == stage and data["dry_run"] is True and data["ok"] is True, data["problems"]
        assert data["complete"] is True and data["table"].startswith("| ")
    listing = subprocess.run(["tar", "-tzf", str(out / archives[0])], capture_output=True, text=True).stdout
    assert "logs/serve-server.log" in listing and "logs/check-pytest.log" in listing

    check = datas["check"]["pytest"]
    assert check["failed"] == 0 and check["skipped"] > 0 and "tests/test_torch_engine.py" in check["files"]

    engine = datas["engine"]
    rows = engine["bench"]["rows"]
    assert {(r["context"], r["graphs"], r["constrained"]) for r in rows} == {(64, False, True)}  # no graphs on a CPU
    assert [r["adapters"] for r in engine["lora"]["rows"]] == [0, 1, 2]
    check_engine_variants_and_profile(engine)
    # base and compiled are stages of their own: run here as a second call where `all` does not name them.
    missing = [s for s in ("base", "compiled") if s not in datas]
    if missing:
        more = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "--budget", "420", "--dry-run",
                               *missing], cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
        assert more.returncode == 0, more.stdout[-5000:] + more.stderr[-3000:]
        datas.update({s: json.loads((out / f"{s}.json").read_text()) for s in missing})
    for alone in ("base", "compiled"):
        assert datas[alone]["ok"] is True and datas[alone]["variants_planned"] == [alone], datas[alone]["problems"]
        assert "lora" not in datas[alone] and not datas[alone]["slots_that_fit"]
        check_engine_variants_and_profile(datas[alone], lora=False)
    assert not {"base", "compiled"} & set(engine["variants_planned"])  # each measured once
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
    assert profile["batches"][0]["steps"] == common.DRY.serve_profile_steps and profile["batches"][0]["kernels_per_step"] > 0
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
