"""The GPU proof kit (scripts/gpu) runs end to end on a CPU with --dry-run, so it cannot rot.

One dry run of every stage (tiny model, CPU) into a temporary $OUT: each stage leaves one JSON
and one Markdown table, within the at most 8 files a GPU box sends back; report.py merges them
into a copy of docs/PERFORMANCE.md, keeps stages it was not given, and refuses dry-run numbers
unless told otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("check", "engine", "codec", "serve")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-out")
    work = tmp_path_factory.mktemp("gpu-work")
    env = {**os.environ, "OUT": str(out), "KIT_WORK": str(work), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "all", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def test_every_stage_writes_one_json_and_one_table(dry_run: Path) -> None:
    files = sorted(p.name for p in dry_run.iterdir())
    assert files == sorted(f"{s}.{ext}" for s in STAGES for ext in ("json", "md"))
    assert len(files) <= 8  # what a GPU box sends back at most
    for stage in STAGES:
        data = json.loads((dry_run / f"{stage}.json").read_text())
        assert data["stage"] == stage and data["dry_run"] is True
        assert data["env"]["torch"] and data["stage_seconds"] >= 0
        assert (dry_run / f"{stage}.md").read_text().startswith("| ")


def test_stage_contents(dry_run: Path) -> None:
    check = json.loads((dry_run / "check.json").read_text())
    assert check["pytest"]["exit_code"] == 0 and check["pytest"]["failed"] == 0
    assert "tests/test_torch_engine.py" in check["pytest"]["files"]

    engine = json.loads((dry_run / "engine.json").read_text())
    assert engine["exit_code"] == 0
    combos = {(r["context"], r["constrained"], r["batch"]) for r in engine["rows"]}
    assert combos == {(c, k, b) for c in (16, 24) for k in (True, False) for b in (1, 2)}
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in engine["rows"])
    assert {r["graphs"] for r in engine["rows"]} == {False}  # CUDA graphs exist on CUDA only
    assert engine["slots_that_fit"][0]["max_slots"] > 0

    codec = json.loads((dry_run / "codec.json").read_text())
    assert [r["batch"] for r in codec["rows"]] == [1, 2]
    assert all(r["pass_ms_median"] > 0 and r["audio_s_per_gpu_s"] > 0 for r in codec["rows"])
    assert codec["overlap"]["together_s"] > 0

    serve = json.loads((dry_run / "serve.json").read_text())
    assert serve["exit_code"] == 0, serve["error"]
    assert [r["concurrency"] for r in serve["rows"]] == [1, 2]
    assert all(r["succeeded"] == r["requests"] and r["errors"] == 0 for r in serve["rows"])
    assert "Real-time streams at p95 TTFB" in (dry_run / "serve.md").read_text()


def test_report_merges_into_the_performance_record(dry_run: Path, tmp_path: Path) -> None:
    doc = tmp_path / "PERFORMANCE.md"
    shutil.copy(ROOT / "docs" / "PERFORMANCE.md", doc)
    original = doc.read_text()
    report = [sys.executable, str(ROOT / "scripts" / "gpu" / "report.py")]

    refused = subprocess.run([*report, str(dry_run), "--doc", str(doc)], capture_output=True, text=True)
    assert refused.returncode != 0 and "dry run" in refused.stderr and doc.read_text() == original

    subprocess.run([*report, str(dry_run), "--doc", str(doc), "--allow-dry-run"], check=True, capture_output=True)
    merged = doc.read_text()
    assert merged.startswith(original.rstrip())  # the record above stays as it was
    assert merged.count("<!-- gpu-kit:begin -->") == 1 and "DRY RUN" in merged
    for stage in STAGES:
        assert f"<!-- gpu-kit:stage {stage} -->" in merged

    # A later call with one stage replaces that stage and keeps the others.
    partial = tmp_path / "partial"
    partial.mkdir()
    data = json.loads((dry_run / "codec.json").read_text())
    data["env"]["gpu"] = "NVIDIA H100 80GB HBM3"
    (partial / "codec.json").write_text(json.dumps(data))
    (partial / "codec.md").write_text("| batch | ms |\n|---|---|\n| 1 | 0.5 |\n")
    subprocess.run([*report, str(partial), "--doc", str(doc), "--allow-dry-run"], check=True, capture_output=True)
    again = doc.read_text()
    assert again.count("<!-- gpu-kit:begin -->") == 1
    assert "| 1 | 0.5 |" in again and "NVIDIA H100 80GB HBM3" in again
    assert all(f"<!-- gpu-kit:stage {s} -->" in again for s in STAGES)
    assert again.index("stage engine") < again.index("stage codec") < again.index("stage serve")


def test_run_sh_rejects_unknown_stages() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "bogus", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_prepare_names_every_wheel_the_gpu_box_lacks() -> None:
    """What the server imports and the GPU box does not have is pinned in prepare.sh."""
    prepare = (ROOT / "scripts" / "gpu" / "prepare.sh").read_text()
    pinned = {line.strip().split("==")[0] for line in prepare.splitlines() if "==" in line and " " not in line.strip()}
    needed = {"fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn", "websockets", "snac", "grpcio",
              "grpcio-health-checking", "protobuf", "annotated-types", "typing-inspection", "opentelemetry-api"}
    assert needed <= pinned | {"av"}, needed - pinned
    assert "av==" in prepare
