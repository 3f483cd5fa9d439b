#!/usr/bin/env python3
"""GPU proof kit: the stages `scripts/gpu/run.sh` runs, each writing STAGE.json into the results folder.

    python scripts/gpu/kit.py STAGE --results DIR [--work DIR] [--deadline UNIX_TIME] [--dry-run]
    python scripts/gpu/kit.py imports STAGE... [--dry-run]   # only import what the stages import

Stages (ARCHITECTURE §8; the card run is two calls, serve alone, then check, codec and engine: README.md):

- check:  nvidia-smi, the torch and CUDA versions, and `pytest -m gpu` over the test files that
          have GPU tests. Fails unless some GPU test passed: on a GPU box, all of them skipping
          means the box was not used.
- engine: writes an Orpheus-3B-shaped random checkpoint (the exact config of
          canopylabs/orpheus-3b-0.1-ft; weight values do not change speed), then
          `scripts/bench_engine.py --variants` (weights loaded once, straight to the GPU): one engine per
          variant (base: the server's defaults; fused: engine.fused; compiled: engine.compile; fp8kv;
          fp8w; fused+fp8kv; fused+fp8w), decode step ms and tokens/s at batch 1, 128 and 256 with KV
          lengths up to 1,024 (one CUDA-graph bucket), graphs on, the constraint on, each engine's build
          time, and a torch.profiler profile of each one's step at batch 1 and 256 (engine.json
          `profile`). A variant this tree cannot build is a row marked skipped, with the reason. Then the
          memory plan (slots that fit) against the card's free memory, and two sub-steps, each skipped
          (and said so) when too little of the stage's time is left: `scripts/bench_lora.py`, a batch of
          128 sessions with 0, 8 and 32 distinct random PEFT adapters (rows lora0/lora8/lora32; rank 16,
          all seven target modules, CUDA graphs on, pool of 32); `scripts/bench_fp8_gemm.py`, the
          decoder's GEMM shapes in bf16 and FP8. A sub-step that fails is recorded as failed.
- codec:  the stateful SNAC decoder in FP16 on its own CUDA stream: ms per decode pass at each
          batch size with CUDA graphs (`codec.cuda_graphs`, the server's default) and without, side by
          side, and the host (thread CPU) ms of a pass for both; audio seconds decoded per GPU second,
          one 4-frame step against four 1-frame ones, mixed passes as a server makes them (streaming
          pushes, a first push, a final one) in even steps against ragged ones (`codec.ragged_steps`),
          overlap of graph passes with engine decode steps (both at once against each alone; every step
          checked to have decoded every row), and FP16 against FP32 on the same codes (SNR). The dry run
          runs the static path eagerly where the graphs would be.
- serve:  the production shape: production_server.py with the engine core in its own process
          (server.engine_process), torch backend, bf16, CUDA graphs, the codec on its own stream,
          the 3B-shaped model; a warm-up level, then stepped concurrency levels over gRPC with
          arrivals spread over a ramp and fixed-length utterances (the model is random, so
          --max-tokens sets the length; each stream's length is checked). Real-time streams held at
          p95 TTFB under 150 ms and under 300 ms, server CPU per audio second (API and engine-core
          processes), GPU utilisation sampled during the levels only, and the inputs of the admission
          decision (`flow` in GET /v1/stats: capacity and its limit reason, engine and codec bounds,
          margins, loop period, codec pass, lead p5) sampled every 0.5 s per level. Then the top level
          measured runs again on a second server with `scheduler.admission=slots` (admitted while a slot
          is free): the pipeline's own capacity, apart from the admission control's estimate. And one more
          round at the highest level with the engine core profiling 50 of its steps (engine.profile_dir):
          serve.json's `profile`, shaped as engine.json's.

Every stage rewrites its STAGE.json (numbers, a Markdown table, `ok`, `complete`, `problems`) with
an atomic rename after every piece it measures, and stops starting new pieces as its deadline nears:
a stage cut short still leaves what it measured. `--dry-run` runs the same code with tiny shapes on
the CPU (tiny random models), so the kit runs end to end on machines without a GPU. Models and logs
go under --work, outside the results folder (run.sh returns the logs as one archive).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from scripts.gpu.report import markdown_table, render_serve  # noqa: E402

STAGES = ("check", "engine", "codec", "serve")
TTFB_TARGETS_MS = (150.0, 300.0)

# What each stage imports, checked first (and by tests/test_gpu_kit.py in an environment holding only the
# GPU box's packages plus .whl/): a module missing there fails in seconds, not minutes into a stage.
STAGE_MODULES: dict[str, tuple[str, ...]] = {
    "check": ("pytest", "pytest_timeout", "torch"),
    "engine": ("torch", "safetensors", "triton", "orpheus_serve.weights.tiny", "orpheus_serve.engines.torch_engine",
               "orpheus_serve.engines.lora", "scripts.bench_engine", "scripts.bench_lora"),
    "codec": ("torch", "snac", "orpheus_serve.weights.tiny", "orpheus_serve.codec.loader",
              "orpheus_serve.codec.stateful", "orpheus_serve.engines.torch_engine", "scripts.bench_codec_stateful"),
    "serve": ("torch", "snac", "zmq", "msgpack", "grpc", "uvicorn", "fastapi", "orpheus_serve.weights.tiny",
              "production_server", "orpheus_serve.api.server", "orpheus_serve.api.launch",
              "orpheus_serve.service.build", "orpheus_serve.core.mp_client", "orpheus_serve.core.process",
              "orpheus_serve.engines.torch_engine",
              "orpheus_serve.codec.stateful", "orpheus_serve.codec.worker", "orpheus_serve.benchmarking.launch",
              "orpheus_serve.benchmarking.runner", "orpheus_serve.benchmarking.plots",
              "orpheus_serve.client.protocols"),
}


@dataclass(frozen=True)
class Shapes:
    """Everything a stage sizes by: the real run's, or the dry run's tiny ones."""

    preset: str
    device: str
    dtype: str
    batches: list[int]
    contexts: list[int]  # KV lengths the engine bench reaches: each the top of one CUDA-graph bucket
    steps: int
    rounds: int
    warmup: int
    codec_batches: list[int]
    codec_passes: int
    overlap_batch: int
    overlap_steps: int
    serve_warmup_concurrency: int
    serve_levels: list[int]
    serve_requests_per_stream: int  # requests per level = this x concurrency (closed loop)
    serve_ramp_s: float  # a level's first requests arrive spread evenly over this
    serve_max_tokens: int
    serve_max_seq_len: int
    serve_profile_steps: int = 50  # engine-core steps profiled in one more round at the highest serve level
    memory_plan_seq_lens: list[int] = field(default_factory=lambda: [1024, 4096])
    constrained: str = "on"  # the frame-position constraint in the main engine bench: on, off or on,off
    # Engine sub-step: adapters in one batch (bench_lora.py), graphs on.
    lora_batch: int = 128
    lora_counts: list[int] = field(default_factory=lambda: [0, 8, 32])
    lora_rank: int = 16
    lora_steps: int = 8
    lora_rounds: int = 3
    lora_reserve_s: float = 60.0  # kept back from the main bench; the sub-step starts only with this left
    # The engine stage's rows (bench_engine.py --variants): each variant at these batch sizes, KV lengths up to
    # variant_context, graphs on; a profile of each variant's step at profile_batches.
    variants: list[str] = field(default_factory=lambda: ["base", "fused", "compiled", "fp8kv", "fp8w", "fused+fp8kv",
                                                         "fused+fp8w"])
    variant_batches: list[int] = field(default_factory=lambda: [1, 128, 256])
    variant_context: int = 1024
    # The codec stage stops starting batch sizes with less than this left, and measures the overlap with the
    # engine only with more than codec_overlap_min_s left (it builds a 3B engine: ~10 s on an H200).
    codec_batch_min_s: float = 15.0
    codec_overlap_min_s: float = 20.0
    profile_batches: list[int] = field(default_factory=lambda: [1, 256])
    gemm_batches: list[int] = field(default_factory=lambda: [1, 128, 256])  # M of the per-shape GEMM measurement
    gemm_min_s: float = 15.0  # the GEMM sub-step starts only with this left


REAL = Shapes(preset="3b", device="cuda", dtype="bf16", batches=[1, 32, 128, 256], contexts=[256, 1024],
              steps=8, rounds=3, warmup=2, codec_batches=[1, 8, 32, 64, 128, 256], codec_passes=20,
              overlap_batch=64, overlap_steps=64, serve_warmup_concurrency=4,
              serve_levels=[16, 64, 128, 192, 256, 320, 384], serve_requests_per_stream=1, serve_ramp_s=1.0,
              serve_max_tokens=280, serve_max_seq_len=1024)
DRY = Shapes(preset="tiny", device="cpu", dtype="fp32", batches=[1, 2], contexts=[256, 512], steps=2, rounds=1,
             warmup=1, codec_batches=[1, 2], codec_passes=2, overlap_batch=2, overlap_steps=4,
             serve_warmup_concurrency=1, serve_levels=[1, 2], serve_requests_per_stream=1, serve_ramp_s=0.2,
             serve_max_tokens=28, serve_max_seq_len=256, serve_profile_steps=10, memory_plan_seq_lens=[256], lora_batch=2,
             lora_counts=[0, 1, 2], lora_steps=2, lora_rounds=1, lora_reserve_s=20.0, variant_batches=[1, 2],
             variant_context=64, profile_batches=[1, 2], gemm_batches=[1, 2], gemm_min_s=5.0,
             # The named rows; the fused combinations are left to the card (Triton's interpreter is slow).
             variants=["base", "fused", "compiled", "fp8kv", "fp8w"])


# ----------------------------------------------------------------- one stage's run


class StageRun:
    """One stage: its shapes, folders and deadline, and its STAGE.json, rewritten atomically on save()."""

    def __init__(self, stage: str, shapes: Shapes, *, results: Path, work: Path, deadline: float,
                 dry_run: bool) -> None:
        self.stage, self.shapes, self.results, self.work = stage, shapes, results, work
        self.deadline, self.dry_run = deadline, dry_run
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"stage": stage, "dry_run": dry_run, "ok": False, "complete": False,
                                     "problems": [], "shapes": asdict(shapes)}
        self.table = ""

    def left(self) -> float:
        """Seconds to this stage's deadline."""
        return self.deadline - time.time()

    def problem(self, text: str) -> None:
        print(f"{self.stage}: PROBLEM: {text}", flush=True)
        self.data["problems"].append(text)

    def save(self) -> None:
        self.data["stage_seconds"] = round(time.monotonic() - self.started, 1)
        self.data["table"] = self.table
        path = self.results / f"{self.stage}.json"
        scratch = path.with_name(path.name + ".tmp")
        scratch.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        scratch.replace(path)  # atomic: a reader, or a kill, never sees half a file

    def run(self, cmd: list[str], *, log_name: str, reserve_s: float = 10.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`cmd` with what is left of the deadline (less `reserve_s` to write results), output to logs/."""
        timeout = max(5.0, self.left() - reserve_s)
        print("$ " + " ".join(cmd), flush=True)
        log = self.logs / log_name
        with log.open("w") as out:
            try:
                proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                      timeout=timeout, env={**os.environ, **(env or {})})
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = 124
        text = log.read_text(errors="replace")
        if code == 124:
            self.problem(f"{log_name.removesuffix('.log')} cut short (deadline)")
        print(text[-3000:], flush=True)
        return subprocess.CompletedProcess(cmd, code, text, "")


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    multiprocessors=props.multi_processor_count)
    smi = nvidia_smi("name,memory.total,driver_version")
    if smi:
        info["nvidia_smi"] = smi
        info["driver"] = smi[0].split(",")[-1].strip()
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in ("fastapi", "pydantic", "uvicorn", "websockets", "grpcio", "protobuf", "pyzmq", "msgpack", "snac",
                 "pytest", "numpy", "triton"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    info["packages"] = packages
    return info


def nvidia_smi(query: str) -> list[str]:
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []


def machine_label(env: dict[str, Any]) -> str:
    return env.get("gpu") or f"CPU ({env.get('cpu_count')} cores, dry run)"


def import_stage_modules(stage: str) -> list[str]:
    """Import what `stage` imports; the failures, as 'module: error' lines."""
    failures = []
    for name in STAGE_MODULES[stage]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import-time failure is the answer this check gives
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


# ----------------------------------------------------------------- models


def ensure_models(run: StageRun) -> tuple[Path, Path]:
    """(Llama folder, SNAC folder): written once per machine under the work folder."""
    from orpheus_serve.weights.tiny import write_llama, write_snac

    shapes = run.shapes
    models = run.work / "models"
    llama = models / f"orpheus-{shapes.preset}"
    snac = models / "snac-random"
    if not (llama / "model.safetensors").exists():
        import torch

        started = time.perf_counter()
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[shapes.dtype]
        scratch = llama.with_name(llama.name + ".partial")  # a kill mid-write leaves no folder that looks whole
        write_llama(scratch, shapes.preset, seed=0, device=shapes.device, dtype=dtype)
        scratch.replace(llama)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the stage's own engines and subprocesses get the card's memory back
        print(f"wrote {llama} in {time.perf_counter() - started:.1f} s", flush=True)
    if not (snac / "pytorch_model.bin").exists():
        write_snac(snac, seed=0)  # the real snac_24khz architecture, random weights
    return llama, snac


# ----------------------------------------------------------------- check


def check_verdict(counts: dict[str, int], exit_code: int, *, dry_run: bool) -> list[str]:
    """What makes the check stage fail. On a GPU box at least one GPU test must pass: every one skipping
    (pytest then exits 0) means CUDA was not seen. A dry run on a CPU skips them all by design."""
    problems = []
    if counts["failed"]:
        problems.append(f"{counts['failed']} GPU test(s) failed")
    if counts["passed"] + counts["failed"] + counts["skipped"] == 0:
        problems.append("no GPU test was collected")
    elif not dry_run and counts["passed"] == 0:
        problems.append(f"no GPU test passed ({counts['skipped']} skipped): the tests did not see the GPU")
    if exit_code not in (0, 5) or (exit_code == 5 and not problems):
        problems.append(f"pytest exited {exit_code}")
    return problems


def gpu_test_files() -> list[str]:
    """The test files with `gpu`-marked tests (not `gpukit`, the kit's own dry run)."""
    marked = re.compile(r"mark\.gpu\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if marked.search(p.read_text()))


def pytest_command(files: list[str], *extra: str) -> tuple[list[str], dict[str, str]]:
    """`pytest -m gpu` as the check stage runs it. The box's own pytest plugins (benchmark, cov, xdist...)
    are not loaded: only pytest-timeout, which pyproject's `timeout` setting needs."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "pytest_timeout", "-p", "no:cacheprovider",
           *extra, *files]
    return cmd, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def stage_check(run: StageRun) -> None:
    env = run.data["env"]
    files = gpu_test_files()
    junit = run.work / "check-junit.xml"
    junit.unlink(missing_ok=True)
    cmd, extra_env = pytest_command(files, f"--junitxml={junit}")
    proc = run.run(cmd, log_name="check-pytest.log", env=extra_env)
    counts = _junit_counts(junit)
    failures = _junit_failures(junit)
    for text in check_verdict(counts, proc.returncode, dry_run=run.dry_run):
        run.problem(text)
    run.data["pytest"] = {"files": files, "exit_code": proc.returncode, **counts, "failures": failures}
    rows = [["machine", machine_label(env)], ["torch / CUDA / cuDNN", f"{env['torch']} / {env['torch_cuda']} / "
                                                                     f"{env['cudnn']}"]]
    if env.get("nvidia_smi"):
        rows.append(["nvidia-smi (name, MiB, driver)", "; ".join(env["nvidia_smi"])])
    rows.append(["pytest -m gpu", f"{counts['passed']} passed, {counts['failed']} failed, "
                                  f"{counts['skipped']} skipped (exit {proc.returncode})"])
    rows += [[f"failed: {name}", message[:160].replace("\n", " ")] for name, message in failures]
    run.table = markdown_table(["check", "result"], rows)
    run.data["complete"] = proc.returncode != 124


def _junit_counts(path: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not path.exists():
        return counts
    import xml.etree.ElementTree as ET

    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _junit_failures(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    import xml.etree.ElementTree as ET

    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                out.append((f"{case.get('classname')}::{case.get('name')}", child.get("message") or ""))
    return out


# ----------------------------------------------------------------- engine


def stage_engine(run: StageRun) -> None:
    """The variants (Shapes.variants: base, fused, compiled, ...) at batch 1, 128 and 256 near 1,024 tokens,
    each engine's build time and a profile of its step at batch 1 and 256; then the LoRA rows
    (lora0/lora8/lora32) and the FP8 GEMMs per shape. README.md states the call plan."""
    shapes = run.shapes
    llama, _ = ensure_models(run)
    kept = shapes.lora_reserve_s + shapes.gemm_min_s
    bench, code = _engine_bench(run, llama, tag="engine-variants", batches=shapes.variant_batches,
                                contexts=[shapes.variant_context], graphs="on", constrained=shapes.constrained,
                                # The sub-steps' time is kept back (the bench is stopped there if it runs on); no
                                # variant starts in the last 25 s before it: one engine at batch 256 takes about
                                # 20 s to build and measure.
                                deadline=run.deadline - kept - 25, variants=shapes.variants,
                                profile_batches=shapes.profile_batches, reserve_s=kept)
    if code not in (0, 124):
        run.problem(f"bench_engine.py exited {code}")
    for failed in (s for s in bench.get("skipped", []) if s.get("failed")):
        run.problem(f"variant {failed['variant']}: {failed['reason']} (sub-step failed)")
    if not bench.get("complete") and not any(s.get("failed") for s in bench.get("skipped", [])):
        run.problem("not every variant was measured (deadline)")
    from scripts.bench_engine import memory_plan

    # Nothing else holds the card now: the plan is against its real free memory.
    plans = [memory_plan(llama, slots=max(shapes.variant_batches), max_seq_len=n, device=shapes.device,
                         dtype=shapes.dtype) for n in shapes.memory_plan_seq_lens]
    run.data.update(model=llama.name, bench=bench, slots_that_fit=plans, sdpa=sorted(
        {str(r.get("sdpa")) for r in bench["rows"]}), profile=engine_profile(bench))
    if not bench["rows"]:
        run.problem("no engine configuration was measured")
    run.data["complete"] = bool(bench.get("complete")) and code == 0
    run.data["variants"] = variant_rows(shapes, bench)
    render_engine(run)
    run.save()
    run.data["lora"] = _engine_lora(run, llama)
    run.data["variants"] = variant_rows(shapes, bench, run.data["lora"])
    render_engine(run)
    run.save()
    run.data["gemm"] = _engine_gemm_shapes(run, llama)
    render_engine(run)
    run.data["complete"] = run.data["complete"] and all(
        run.data[k].get("status") == "measured" for k in ("lora", "gemm"))


def engine_profile(bench: dict[str, Any], variant: str = "base") -> dict[str, Any]:
    """engine.json's `profile`: the profiled steps of `variant` per batch size (kernels per step, top kernels,
    idle share; engines/profiling.py), and every other variant's under `variants`."""
    profiles = bench.get("profiles", [])
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for p in profiles:
        by_variant.setdefault(p["variant"], []).append(p)
    return {"variant": variant, "batches": by_variant.pop(variant, []), "variants": by_variant}


def variant_rows(shapes: Shapes, bench: dict[str, Any], lora: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per named variant, in the kit's order: measured (step ms and tokens/s per batch size, the
    engine's build time), or skipped / not measured with the reason, never a number."""
    skipped = {s["variant"]: (s["reason"], "failed" if s.get("failed") else "skipped") for s in bench.get("skipped", [])}
    out: list[dict[str, Any]] = []
    for name in shapes.variants:
        rows = [r for r in bench["rows"] if r["variant"] == name]
        if rows:
            out.append({"variant": name, "status": "measured", "build_s": rows[0].get("build_s"),
                        "kv_lens": f"{rows[0]['kv_len_first']}-{rows[0]['kv_len_last']}",
                        "slots_fit": rows[0].get("slots_fit"),
                        "step_ms": {str(r["batch"]): r["step_ms"] for r in rows},
                        "tokens_per_s": {str(r["batch"]): r["tokens_per_s"] for r in rows}})
        else:
            reason, status = skipped.get(name, ("not measured (deadline or a failed run)", "skipped"))
            out.append({"variant": name, "status": status, "reason": reason})
    for count in shapes.lora_counts:
        name = f"lora{count}"
        row = next((r for r in (lora or {}).get("rows", []) if r["adapters"] == count), None)
        if row is not None:
            out.append({"variant": name, "status": "measured", "batch": row["batch"],
                        "step_ms": {str(row["batch"]): row["step_ms"]},
                        "tokens_per_s": {str(row["batch"]): row["tokens_per_s"]}, "vs_base": row.get("vs_base")})
        else:
            out.append({"variant": name, "status": "skipped",
                        "reason": (lora or {}).get("reason") or "LoRA sub-step not run yet"})
    return out


def _engine_bench(run: StageRun, llama: Path, *, tag: str, batches: list[int], contexts: list[int], graphs: str,
                  constrained: str, deadline: float, variants: list[str] | None = None,
                  profile_batches: list[int] | None = None, reserve_s: float = 0.0) -> tuple[dict[str, Any], int]:
    """One `bench_engine.py` run: (its JSON, its exit code)."""
    shapes = run.shapes
    raw = run.work / f"{tag}.json"
    raw.unlink(missing_ok=True)  # never report an earlier run's rows
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--presets", "", "--model", str(llama),
           "--device", shapes.device, "--dtype", shapes.dtype, "--contexts-are-kv-tops",
           "--batches", ",".join(map(str, batches)), "--contexts", ",".join(map(str, contexts)),
           "--graphs", graphs, "--constrained", constrained, "--steps", str(shapes.steps),
           "--rounds", str(shapes.rounds), "--warmup", str(shapes.warmup), "--json", str(raw),
           "--deadline", str(deadline)]
    if variants:
        cmd += ["--variants", ",".join(variants)]
    if profile_batches:
        cmd += ["--profile-batches", ",".join(map(str, profile_batches))]
    if run.dry_run:
        cmd += ["--threads", "1"]
    # Triton on a CPU (the dry run) runs in its interpreter only.
    proc = run.run(cmd, log_name=f"{tag}.log", reserve_s=20 + reserve_s,
                   env={"TRITON_INTERPRET": "1"} if run.dry_run else None)
    bench = json.loads(raw.read_text()) if raw.exists() else {"rows": [], "memory_plans": [], "complete": False,
                                                              "profiles": [], "skipped": []}
    return bench, proc.returncode


def _substep_failed(run: StageRun, name: str, text: str) -> dict[str, Any]:
    """A sub-step that failed: recorded, not merged as a number; the main bench's numbers stay good."""
    run.problem(f"{name}: {text} (sub-step failed)")
    return {"status": "failed", "reason": text, "rows": []}


def _substep_skipped(run: StageRun, name: str, text: str) -> dict[str, Any]:
    run.problem(f"{name} not measured: {text} (deadline)")
    return {"status": "skipped", "reason": text, "rows": []}


def _engine_lora(run: StageRun, llama: Path) -> dict[str, Any]:
    """Decode of one batch with 0, 8 and 32 distinct LoRA adapters (bench_lora.py), graphs on."""
    shapes = run.shapes
    name = f"LoRA adapters in a batch of {shapes.lora_batch}"
    if run.left() < shapes.lora_reserve_s:
        return _substep_skipped(run, name, f"{run.left():.0f} s left, {shapes.lora_reserve_s:.0f} s needed")
    raw = run.work / "engine-lora.json"
    raw.unlink(missing_ok=True)
    # Written once per machine (kept with the models): random, PEFT's format, the project's own writer.
    adapters = run.work / "models" / f"lora-{llama.name}-r{shapes.lora_rank}"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_lora.py"), "--presets", "", "--model", str(llama),
           "--adapters-dir", str(adapters), "--write-adapters", "--device", shapes.device, "--dtype", shapes.dtype,
           "--batch", str(shapes.lora_batch), "--adapters", ",".join(map(str, shapes.lora_counts)),
           "--rank", str(shapes.lora_rank), "--steps", str(shapes.lora_steps), "--rounds", str(shapes.lora_rounds),
           "--graphs", "on", "--json", str(raw)]
    if run.dry_run:
        cmd += ["--threads", "1"]
    proc = run.run(cmd, log_name="engine-lora.log", reserve_s=10)
    if proc.returncode == 124:
        return {"status": "skipped", "reason": "cut short by the stage's deadline", "rows": []}
    if proc.returncode != 0 or not raw.exists():
        return _substep_failed(run, name, f"bench_lora.py exited {proc.returncode}: {proc.stdout[-400:]}")
    data = json.loads(raw.read_text())
    counts = [r["adapters"] for r in data["rows"]]
    if counts != shapes.lora_counts:
        return _substep_failed(run, name, f"measured adapter counts {counts}, expected {shapes.lora_counts}")
    return {"status": "measured", "adapters_dir": str(adapters), **data}


def _engine_gemm_shapes(run: StageRun, llama: Path) -> dict[str, Any]:
    """The decoder's four GEMM shapes in bf16 and FP8 (scripts/bench_fp8_gemm.py) at the variant batch sizes."""
    shapes = run.shapes
    name = "FP8 GEMMs per shape"
    if run.left() < shapes.gemm_min_s:
        return _substep_skipped(run, name, f"{run.left():.0f} s left, {shapes.gemm_min_s:.0f} s needed")
    raw = run.work / "engine-gemm.json"
    raw.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_fp8_gemm.py"), "--model", str(llama), "--device",
           shapes.device, "--batches", ",".join(map(str, shapes.gemm_batches)), "--json", str(raw)]
    if run.dry_run:
        cmd += ["--threads", "1", "--iters", "2"]
    proc = run.run(cmd, log_name="engine-gemm.log", reserve_s=5)
    if proc.returncode == 124:
        return {"status": "skipped", "reason": "cut short by the stage's deadline", "rows": []}
    if proc.returncode != 0 or not raw.exists():
        return _substep_failed(run, name, f"bench_fp8_gemm.py exited {proc.returncode}: {proc.stdout[-400:]}")
    return {"status": "measured", **json.loads(raw.read_text())}


def render_engine(run: StageRun) -> None:
    data = run.data
    shapes = run.shapes
    plans = data["slots_that_fit"]
    batches = [str(b) for b in shapes.variant_batches]
    run.table = markdown_table(
        ["variant", "KV lengths", *(f"batch {b} ms" for b in batches), *(f"batch {b} tok/s" for b in batches),
         "build s", "slots that fit"],
        [[v["variant"], v.get("kv_lens", "-"), *(v["step_ms"].get(b, "-") for b in batches),
          *(v["tokens_per_s"].get(b, "-") for b in batches), v.get("build_s", "-"), v.get("slots_fit", "-")]
         if v["status"] == "measured" else [v["variant"], f"**{v['status'].upper()}**: {v['reason']}",
                                            *(["-"] * (2 * len(batches) + 2))]
         for v in data.get("variants", []) if not v["variant"].startswith("lora")])
    run.table += (f"\n\nDecode step per variant (engine.json `variants`), KV lengths up to {shapes.variant_context:,}, "
                  f"CUDA graphs on where the device has them, constrained; build s: the engine's start (caches, "
                  f"compilation, graphs); the lora rows (a batch of {shapes.lora_batch}) follow.")
    run.table += f"\n\nAttention (SDPA) kernel: {', '.join(data['sdpa']) or '-'}."
    run.table += "\n\nMemory plan (engine planner, 90% of the free memory measured with nothing loaded):\n\n"
    run.table += markdown_table(
        ["slots", "max_seq_len", "free GiB", "weights GiB", "KV MiB / slot", "budget GiB", "slots that fit"],
        [[p["slots"], p["max_seq_len"], p["free_gib_measured"], p["weights_gib"], p["kv_mib_per_slot"],
          p["budget_gib"], p["max_slots"]] for p in plans])
    if lora := data.get("lora"):
        graphs = "on" if any(r.get("graphs") for r in lora["rows"]) else "off"
        run.table += (f"\n\nLoRA adapters in a batch of {shapes.lora_batch} (rows lora0/lora8/lora32; rank "
                      f"{shapes.lora_rank}, q,k,v,o,gate,up,down; CUDA graphs {graphs}; pool of "
                      f"{max(shapes.lora_counts)}; session i uses adapter i mod N):")
        run.table += "\n\n" + (markdown_table(
            ["variant", "distinct adapters", "step ms", "tokens/s", "vs no adapters"],
            [[f"lora{r['adapters']}", r["adapters"], r["step_ms"], r["tokens_per_s"], r["vs_base"]]
             for r in lora["rows"]])
            if lora["status"] == "measured" else f"**{lora['status'].upper()}**: {lora['reason']}")
    if gemm := data.get("gemm"):
        run.table += ("\n\nDecoder GEMMs per shape (`scripts/bench_fp8_gemm.py`): bf16 against FP8 "
                      "`torch._scaled_mm` (row-major A, column-major B), per-row scales and one scale per tensor, "
                      "activation quantisation not included:")
        run.table += "\n\n" + (markdown_table(
            ["GEMM", "M", "N x K", "bf16 us", "fp8 rowwise us", "fp8 tensorwise us", "best / bf16"],
            [[r["gemm"], r["m"], f"{r['n']} x {r['k']}", r["bf16_us"], r["fp8_rowwise_us"],
              r["fp8_tensorwise_us"], r["best_vs_bf16"]] for r in gemm["rows"]])
            if gemm["status"] == "measured" else f"**{gemm['status'].upper()}**: {gemm['reason']}")


# ----------------------------------------------------------------- codec


def _half_precision_snr(snac_dir: Path, device: str, codes: Any) -> dict[str, Any]:
    """The stateful decoder in FP16 against FP32 on the same codes, streamed in pushes of two frames."""
    import numpy as np

    from orpheus_serve.codec.base import CodecPush
    from orpheus_serve.codec.loader import load_snac
    from orpheus_serve.codec.stateful import StatefulDecoder

    def stream(dtype: str) -> Any:
        decoder = StatefulDecoder(load_snac(snac_dir, device=device, dtype=dtype, noise=False))
        pieces = [decoder.decode([CodecPush("snr", codes[i : i + 2], final=i + 2 >= len(codes))])[0].pcm
                  for i in range(0, len(codes), 2)]
        return np.concatenate(pieces).astype(np.float64)

    half_dtype = "fp16" if device.startswith("cuda") else "fp32"  # CPU: no FP16 kernels worth timing
    reference, half = stream("fp32"), stream(half_dtype)
    error = float(np.sum((reference - half) ** 2))
    snr = float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference**2)) / error)
    return {"frames": len(codes), "dtype": half_dtype, "snr_db": round(snr, 1), "expected_min_db": 40}


def stage_codec(run: StageRun) -> None:
    import numpy as np
    import torch

    from orpheus_serve.codec.loader import load_snac
    from orpheus_serve.codec.stateful import StatefulDecoder
    from orpheus_serve.token_format import CODEBOOK_SIZE, FRAME_SECONDS, TOKENS_PER_FRAME
    from scripts.bench_codec_stateful import PUSH_FRAMES, time_mixed_passes, time_passes

    shapes = run.shapes
    llama, snac_dir = ensure_models(run)
    cuda = shapes.device.startswith("cuda")
    codec_dtype = "fp16" if cuda else "fp32"
    model = load_snac(snac_dir, device=shapes.device, dtype=codec_dtype, noise=False)
    stream = torch.cuda.Stream() if cuda else None
    push_frames = PUSH_FRAMES  # the codec worker's steady-state push: every two frames (flush_every_n_tokens 14)
    rng = np.random.default_rng(0)

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, CODEBOOK_SIZE, size=(n, TOKENS_PER_FRAME), dtype=np.int64)

    def on_stream() -> Any:
        import contextlib

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def sync() -> None:
        if stream is not None:
            stream.synchronize()

    def codec_passes(decoder: StatefulDecoder, batch: int, passes: int, tag: str) -> tuple[list[float], list[float]]:
        """(wall, host) seconds per pass for `passes` passes of `batch` sessions, 2 new frames each, on the
        codec's own stream; host = the calling thread's CPU time inside `decode`."""
        with on_stream():
            times = time_passes(decoder, batch, passes, rng, tag, sync)
        return times.wall_s, times.host_s

    rows: list[dict[str, Any]] = []
    # graphs: the server's path on CUDA (codec.cuda_graphs); the dry run runs the same static steps eagerly.
    graph_path = "graphs" if cuda else "static-eager"
    run.data.update(device=shapes.device, dtype=codec_dtype, decoder="stateful", graph_path=graph_path, rows=rows)

    def render() -> None:
        run.table = markdown_table(
            ["batch", f"{graph_path} ms / pass (median)", "p90", "dynamic ms / pass (median)", "p90",
             f"host ms / pass, {graph_path}", "host ms / pass, dynamic", f"audio s per GPU s ({graph_path})"],
            [[r["batch"], r["pass_ms_median"], r["pass_ms_p90"], r["dynamic_pass_ms_median"], r["dynamic_pass_ms_p90"],
              r["host_ms_median"], r["dynamic_host_ms_median"], r["audio_s_per_gpu_s"]] for r in rows])
        if capture := run.data.get("graph_capture"):
            shapes_text = (f"buckets {capture['buckets']}, frames per step {capture['step_frames']}, with and without "
                           "edge masks")
            run.table += (f"\n\n{capture['graphs']} CUDA graphs ({shapes_text}) captured in {capture['seconds']} s"
                          if capture["graphs"] else f"\n\nNo CUDA: the static steps ({shapes_text}) ran eagerly")
            run.table += ("; dynamic = graphs off (eager steps of the exact batch). host = the calling thread's CPU "
                          "time inside a pass.")
        if fidelity := run.data.get("fp16_vs_fp32"):
            run.table += "\n\n" + markdown_table(
                [f"{fidelity['dtype'].upper()} vs FP32 (same codes)", "SNR dB", "expected"],
                [[f"{fidelity['frames']} frames", fidelity["snr_db"], ">= 40"]])
        if per_replay := run.data.get("frames_per_replay"):
            run.table += "\n\n" + markdown_table(
                ["passes of 4 frames per session, batch", "one 4-frame step: ms / pass", "host ms",
                 "four 1-frame steps: ms / pass", "host ms"],
                [[r["batch"], r["steps_1_2_4_ms"], r["steps_1_2_4_host_ms"], r["steps_1_ms"], r["steps_1_host_ms"]]
                 for r in per_replay])
        if mixed := run.data.get("mixed_passes"):
            run.table += "\n\n" + markdown_table(
                ["mixed passes (streaming 2 frames, one first push, one final), batch", "even steps: ms / pass",
                 "host ms", "ragged steps: ms / pass", "host ms"],
                [[r["batch"], r["even_ms"], r["even_host_ms"], r["ragged_ms"], r["ragged_host_ms"]] for r in mixed])
            run.table += ("\n\nEven steps take such a pass in three steps (2, 1, then 1 for the final's flush), ragged "
                          "ones (`codec.ragged_steps`, the server's default on CUDA) in one of 4 frames.")
        if overlap := run.data.get("overlap"):
            run.table += "\n\n" + markdown_table(
                ["overlap at batch", "engine steps", "engine alone s", "codec alone s", "both at once s", "overlap"],
                [[overlap["batch"], overlap["engine_steps"], overlap["engine_alone_s"], overlap["codec_alone_s"],
                  overlap["together_s"], overlap["overlap"]]])
            run.table += ("\n\noverlap = (engine alone + codec alone - both at once) / min(engine alone, codec "
                          f"alone), codec passes on the {graph_path} path: 1 = the shorter one is hidden completely, "
                          "0 = they run one after the other.")

    def median_p90(times: list[float]) -> tuple[float, float]:
        ordered = sorted(times)
        return ordered[len(ordered) // 2], ordered[round(0.9 * (len(ordered) - 1))]

    with torch.inference_mode():
        max_batch = max(shapes.codec_batches)
        dynamic = StatefulDecoder(model, max_batch=max_batch, noise=False)  # graphs off: the eager, unpadded steps
        started = time.perf_counter()
        graphs = StatefulDecoder(model, max_batch=max_batch, noise=False, static=True, cuda_graphs=cuda)
        run.data["graph_capture"] = {"graphs": graphs.graph_count, "buckets": graphs.batch_buckets,
                                     "step_frames": list(graphs.step_frames),
                                     "seconds": round(time.perf_counter() - started, 2)}
        for batch in shapes.codec_batches:
            if run.left() < shapes.codec_batch_min_s:
                run.problem(f"codec batch {batch} and above not measured (deadline)")
                break
            measured: dict[str, tuple[list[float], list[float]]] = {"graphs": ([], []), "dynamic": ([], [])}
            for decoder in (graphs, dynamic):
                codec_passes(decoder, batch, 2, f"warm{batch}")
            for half in range(2):  # interleaved halves: drifting clocks or load hit both paths alike
                for name, decoder in (("graphs", graphs), ("dynamic", dynamic)):
                    wall, host = codec_passes(decoder, batch, max(1, shapes.codec_passes // 2), f"b{batch}h{half}")
                    measured[name][0].extend(wall)
                    measured[name][1].extend(host)
            (median, p90), (dynamic_median, dynamic_p90) = (median_p90(measured[n][0]) for n in ("graphs", "dynamic"))
            host, dynamic_host = (median_p90(measured[n][1])[0] for n in ("graphs", "dynamic"))
            audio_s = batch * push_frames * FRAME_SECONDS
            rows.append({"batch": batch, "frames_per_session": push_frames, "path": graph_path,
                         "pass_ms_median": round(median * 1e3, 3), "pass_ms_p90": round(p90 * 1e3, 3),
                         "host_ms_median": round(host * 1e3, 3), "audio_s_per_gpu_s": round(audio_s / median, 1),
                         "dynamic_pass_ms_median": round(dynamic_median * 1e3, 3),
                         "dynamic_pass_ms_p90": round(dynamic_p90 * 1e3, 3),
                         "dynamic_host_ms_median": round(dynamic_host * 1e3, 3)})
            print(f"codec batch {batch}: {graph_path} {median * 1e3:.2f} ms per pass (host {host * 1e3:.2f}), "
                  f"dynamic {dynamic_median * 1e3:.2f} ms (host {dynamic_host * 1e3:.2f}), "
                  f"{audio_s / median:.1f} audio s per s", flush=True)
            render()
            run.save()
        if run.left() > shapes.codec_overlap_min_s + 30:  # leaves the overlap its time
            # The decoder's choice of one graph per (bucket, frames) against one frame per replay (stateful.py).
            one_frame = StatefulDecoder(model, max_batch=max_batch, noise=False, static=True, cuda_graphs=cuda,
                                        step_frames=(1,))
            per_replay: list[dict[str, Any]] = []
            run.data["frames_per_replay"] = per_replay
            for batch in sorted({shapes.codec_batches[0], min(32, max_batch)}):
                cells: dict[str, float] = {}
                for name, decoder in (("steps_1_2_4", graphs), ("steps_1", one_frame)):
                    with on_stream():
                        time_passes(decoder, batch, 1, rng, f"fw{batch}", sync, push_frames=4)
                        times = time_passes(decoder, batch, max(2, shapes.codec_passes // 2), rng, f"f{batch}",
                                            sync, push_frames=4)
                    cells[f"{name}_ms"] = round(median_p90(times.wall_s)[0] * 1e3, 3)
                    cells[f"{name}_host_ms"] = round(median_p90(times.host_s)[0] * 1e3, 3)
                per_replay.append({"batch": batch, **cells})
            del one_frame
            # A server's passes mix first, streaming and final pushes: even steps against ragged ones (stateful.py).
            ragged = StatefulDecoder(model, max_batch=max_batch, noise=False, static=True, cuda_graphs=cuda,
                                     ragged=True)
            mixed: list[dict[str, Any]] = []
            run.data["mixed_passes"] = mixed
            for batch in sorted({3, max(3, min(32, max_batch))}):
                cells = {}
                for name, decoder in (("even", graphs), ("ragged", ragged)):
                    with on_stream():
                        time_mixed_passes(decoder, batch, 1, rng, f"mw{batch}", sync)
                        times = time_mixed_passes(decoder, batch, max(2, shapes.codec_passes // 2), rng, f"m{batch}",
                                                  sync)
                    cells[f"{name}_ms"] = round(median_p90(times.wall_s)[0] * 1e3, 3)
                    cells[f"{name}_host_ms"] = round(median_p90(times.host_s)[0] * 1e3, 3)
                mixed.append({"batch": batch, **cells})
            del ragged
            render()
            run.save()
        else:
            run.problem("frames per replay and mixed passes not measured (deadline)")
        fidelity = _half_precision_snr(snac_dir, shapes.device, frames(48))
        run.data["fp16_vs_fp32"] = fidelity
        if fidelity["snr_db"] < fidelity["expected_min_db"]:
            run.problem(f"{fidelity['dtype']} vs fp32 SNR {fidelity['snr_db']} dB < {fidelity['expected_min_db']} dB")
        render()
        run.save()
        if run.left() > shapes.codec_overlap_min_s:
            run.data["overlap"] = _codec_engine_overlap(
                run, llama, graphs, lambda *args: codec_passes(*args)[0])
        else:
            run.problem("overlap not measured (deadline)")
    render()
    run.data["complete"] = not run.data["problems"]


def _codec_engine_overlap(run: StageRun, llama: Path, decoder: Any,
                          codec_passes: Callable[..., list[float]]) -> dict[str, Any]:
    """Engine decode steps and codec passes on their own streams, each alone, then both at once."""
    from orpheus_serve import token_format as P
    from orpheus_serve.engines.torch_engine import TorchEngine
    from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan

    shapes = run.shapes
    batch, steps = shapes.overlap_batch, shapes.overlap_steps
    prompt = (P.START_OF_HUMAN, P.BOS, *range(1000, 1032), *P.PROMPT_SUFFIX)
    rounds = 3  # warm-up, engine alone, both at once: every one of them must decode every row
    engine = TorchEngine(llama, num_slots=batch, max_seq_len=len(prompt) + rounds * steps + 16,
                         device=shapes.device, dtype=shapes.dtype, max_batch_size=batch)
    decoded = {"steps": 0, "short": 0}
    try:
        for slot in range(batch):
            out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"o{slot}", prompt, 0, len(prompt),
                                                             SamplingParams(seed=slot))]))
            if out.failed:
                raise RuntimeError(f"overlap prefill failed: {out.failed}")

        def engine_steps() -> None:
            for _ in range(steps):
                out = engine.step(StepPlan(decode=list(range(batch))))  # returns host tokens: the step has finished
                decoded["steps"] += 1
                if out.failed or len(out.tokens) != batch:
                    decoded["short"] += 1

        passes = max(2, steps // 4)

        def codec_work() -> None:
            codec_passes(decoder, batch, passes, "overlap")

        def timed(*work: Callable[[], None]) -> float:
            threads = [threading.Thread(target=w) for w in work]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - started

        engine_steps()  # warm both
        codec_work()
        engine_alone = timed(engine_steps)
        codec_alone = timed(codec_work)
        together = timed(engine_steps, codec_work)
    finally:
        engine.close()
    if decoded["short"]:
        run.problem(f"overlap: {decoded['short']} of {decoded['steps']} engine steps did not decode every row")
    shorter = min(engine_alone, codec_alone)
    overlap = (engine_alone + codec_alone - together) / shorter if shorter > 0 else 0.0
    return {"batch": batch, "engine_steps": steps, "codec_passes": passes, "steps_checked": decoded["steps"],
            "steps_short": decoded["short"], "sdpa": engine.sdpa_backend,
            "engine_alone_s": round(engine_alone, 3), "codec_alone_s": round(codec_alone, 3),
            "together_s": round(together, 3), "overlap": round(overlap, 2)}


# ----------------------------------------------------------------- serve


class GpuSampler:
    """GPU utilisation and memory from nvidia-smi twice a second, kept only inside `window()`s (the
    levels): start-up and idle gaps between levels are not averaged in. Zero readings are kept (an idle
    GPU during a level is a finding); "[N/A]" readings are counted, not parsed."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self._window: list[tuple[float, float]] | None = None
        self._not_available = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self.available = bool(nvidia_smi("utilization.gpu"))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                if self._window is None:
                    continue
            for line in nvidia_smi("utilization.gpu,memory.used")[:1]:
                reading = parse_smi_numbers(line)
                with self._lock:
                    if self._window is None:
                        continue
                    if reading is None:
                        self._not_available += 1
                    else:
                        self._window.append((reading[0], reading[1]))

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @contextmanager
    def window(self) -> Iterator[dict[str, Any]]:
        """Samples taken inside; the dict is filled with their summary on exit."""
        summary: dict[str, Any] = {}
        with self._lock:
            self._window, self._not_available = [], 0
        try:
            yield summary
        finally:
            with self._lock:
                samples, not_available, self._window = self._window or [], self._not_available, None
            summary.update(summarize_gpu_samples(samples, not_available))


def parse_smi_numbers(line: str) -> tuple[float, ...] | None:
    """'37, 1234' -> (37.0, 1234.0); None when any field is '[N/A]' or not a number."""
    try:
        return tuple(float(x) for x in line.split(","))
    except ValueError:
        return None


def summarize_gpu_samples(samples: list[tuple[float, float]], not_available: int = 0) -> dict[str, Any]:
    if not samples:
        return {"samples": 0, "not_available": not_available}
    utils = [u for u, _ in samples]
    return {"samples": len(samples), "not_available": not_available,
            "util_mean_pct": round(sum(utils) / len(utils), 1), "util_max_pct": max(utils),
            "util_zero_samples": sum(u == 0 for u in utils), "memory_used_max_mib": max(m for _, m in samples)}


def realtime_held(rows: list[dict[str, Any]], ttfb_ms: float) -> int | None:
    """Largest concurrency whose p95 TTFB is under `ttfb_ms` with every request served at full length,
    no underrun and no failure."""
    good = [r["concurrency"] for r in rows
            if r["succeeded"] == r["requests"] and r["underrun_streams"] == 0 and not r.get("short_streams")
            and r["ttfb_p95_ms"] is not None and r["ttfb_p95_ms"] < ttfb_ms]
    return max(good) if good else None


def expected_audio_s(max_tokens: int) -> float:
    from orpheus_serve.token_format import FRAME_SECONDS, TOKENS_PER_FRAME

    return (max_tokens // TOKENS_PER_FRAME) * FRAME_SECONDS


def serve_overrides(shapes: Shapes, llama: Path, snac_dir: Path) -> list[str]:
    slots = max(shapes.serve_levels)
    return [
        f"engine.model_path={llama}", f"codec.path={snac_dir}", "engine.backend=torch", "engine.mode=batched",
        f"engine.device={shapes.device}", f"engine.dtype={shapes.dtype}", "engine.cuda_graphs=true",
        f"engine.max_seq_len={shapes.serve_max_seq_len}", f"codec.device={shapes.device}", "codec.decoder=stateful",
        "server.engine_process=true",
        f"scheduler.max_concurrent_sessions={slots}", f"scheduler.max_batch_size={slots}",
        f"codec.max_batch={slots}", f"server.max_connections={2 * slots + 16}",
        f"scheduler.max_queue={4 * slots}", "server.playground=false",
    ]


def serve_level_worst_s(shapes: Shapes, expected_s: float, queue_timeout_s: float) -> float:
    """The longest a level can take: the ramp, a request's whole wait in the queue, then its utterances
    (at most twice real time), and the level's own set-up."""
    return shapes.serve_ramp_s + queue_timeout_s + 2 * expected_s * shapes.serve_requests_per_stream + 5


def stage_serve(run: StageRun) -> None:
    """Warm-up, the levels, then one level on a second server with admission fixed at the slot count (the
    top level measured, one utterance per stream): the levels with the admission control, that one without."""
    from orpheus_serve.benchmarking.launch import LaunchedServer
    from orpheus_serve.benchmarking.runner import LoadSpec, Target, measure
    from orpheus_serve.config import SchedulerConfig

    shapes = run.shapes
    llama, snac_dir = ensure_models(run)
    profile_dir = run.work / "serve-profile"
    overrides = [*serve_overrides(shapes, llama, snac_dir), f"engine.profile_dir={profile_dir}"]
    expected = expected_audio_s(shapes.serve_max_tokens)
    frame_s = expected / max(1, shapes.serve_max_tokens // 7)
    level_worst_s = serve_level_worst_s(shapes, expected, SchedulerConfig().queue_timeout_s)
    rows: list[dict[str, Any]] = []
    run.data.update(overrides=overrides, protocol="grpc", max_tokens=shapes.serve_max_tokens,
                    expected_stream_audio_s=round(expected, 3), ttfb_targets_ms=list(TTFB_TARGETS_MS),
                    warmup=None, rows=rows, realtime_held={}, admission_fixed=None, level_worst_s=level_worst_s)

    def spec(concurrency: int, seed: int, per_stream: int = shapes.serve_requests_per_stream) -> LoadSpec:
        # Short texts only (voice-agent turns, one sentence): one chunk each, so max_tokens fixes every length.
        return LoadSpec(requests=concurrency * per_stream, concurrency=concurrency, protocol="grpc", seed=seed,
                        max_tokens=shapes.serve_max_tokens, ramp_s=shapes.serve_ramp_s, text_mix=(1.0, 0.0, 0.0))

    def level(target: Target, gpu: GpuSampler, load: LoadSpec) -> dict[str, Any]:
        """One level, with GPU use and the admission inputs (`measure`: admission_inputs) sampled while it runs."""
        with gpu.window() as usage:
            row = measure(target, load)
        row["gpu"] = usage
        return row

    def check_lengths(row: dict[str, Any]) -> None:
        shortest = row.get("stream_audio_s_min")
        row["short_streams"] = int(shortest is not None and shortest < expected - frame_s / 2)
        if row["short_streams"]:
            run.problem(f"{row['concurrency']} streams: shortest stream {shortest} s < {expected:.3f} s expected "
                        f"(the model ended an utterance early)")
        longest = row.get("stream_audio_s_max")
        if longest is not None and longest > expected + frame_s / 2:
            run.problem(f"{row['concurrency']} streams: longest stream {longest} s > {expected:.3f} s expected "
                        f"(a text was split into several chunks)")

    def render() -> None:
        run.data["realtime_held"] = {f"{t:g}": realtime_held(rows, t) for t in TTFB_TARGETS_MS}
        run.table = render_serve(run.data)

    started = time.monotonic()
    server = LaunchedServer(overrides, log_path=run.logs / "serve-server.log",
                            ready_timeout_s=max(30.0, run.left() - 60))
    with server, GpuSampler() as gpu:
        run.data["server_start_s"] = round(time.monotonic() - started, 1)
        print(f"server ready in {run.data['server_start_s']} s", flush=True)
        # Kept for the level with admission fixed: a second server start, then one level.
        fixed_reserve_s = run.data["server_start_s"] + level_worst_s
        target = Target(server.url, server.grpc_addr)
        run.data["warmup"] = level(target, gpu, spec(shapes.serve_warmup_concurrency, seed=99))
        run.save()
        for index, concurrency in enumerate(shapes.serve_levels):
            if run.left() < level_worst_s + fixed_reserve_s + 10:
                run.problem(f"levels {shapes.serve_levels[index:]} not measured (deadline)")
                break
            row = level(target, gpu, spec(concurrency, seed=index))
            check_lengths(row)
            rows.append(row)
            print(f"serve {concurrency}: TTFB p95 {row['ttfb_p95_ms']} ms, {row['succeeded']}/{row['requests']} ok, "
                  f"underruns {row['underrun_events']}, GPU {row['gpu'].get('util_mean_pct')}%, admission "
                  f"{row['admission_inputs']['limit_reasons']}", flush=True)
            render()
            run.save()
        if rows:  # only if it and the level with admission fixed both still fit
            run.data["profile"] = serve_profile(run, target, spec(rows[-1]["concurrency"], seed=77), profile_dir,
                                                rows[-1], level_worst_s + fixed_reserve_s)
            run.save()
        stats = target.stats()
        run.data["server_stats_end"] = {k: stats.get(k) for k in ("process", "memory", "engine", "codec") if k in stats}
    if not rows:
        run.problem("no level was measured")
    failed = [r["concurrency"] for r in rows if r["errors"]]
    if failed:
        run.problem(f"requests failed at concurrency {failed}")
    render()
    run.save()
    fixed = _serve_admission_fixed(run, overrides, max((r["concurrency"] for r in rows), default=None),
                                   level, spec, level_worst_s)
    if fixed is not None:
        check_lengths(fixed)
        run.data["admission_fixed"] = fixed
        if fixed["errors"]:
            run.problem(f"requests failed at concurrency {fixed['concurrency']} with admission fixed at the slots")
    render()
    run.data["complete"] = len(rows) == len(shapes.serve_levels) and fixed is not None


def _serve_admission_fixed(run: StageRun, overrides: list[str], concurrency: int | None,
                           level: Callable[..., dict[str, Any]], spec: Callable[..., Any],
                           level_worst_s: float) -> dict[str, Any] | None:
    """The top level measured, one utterance per stream, on a second server with `scheduler.admission=slots`:
    every request is admitted while a slot is free, so what the pipeline carries shows apart from admission."""
    from orpheus_serve.benchmarking.launch import LaunchedServer
    from orpheus_serve.benchmarking.runner import Target

    if concurrency is None:
        run.problem("the level with admission fixed at the slots not measured: no level to repeat")
        return None
    start_s = run.data.get("server_start_s") or 30.0
    if run.left() < start_s + level_worst_s:
        run.problem(f"the level with admission fixed at the slots not measured: {run.left():.0f} s left, "
                    f"{start_s + level_worst_s:.0f} s needed (deadline)")
        return None
    fixed_overrides = [*overrides, "scheduler.admission=slots"]
    started = time.monotonic()
    server = LaunchedServer(fixed_overrides, log_path=run.logs / "serve-slots-server.log",
                            ready_timeout_s=max(30.0, run.left() - level_worst_s))
    with server, GpuSampler() as gpu:
        print(f"server (admission=slots) ready in {time.monotonic() - started:.1f} s", flush=True)
        row = level(Target(server.url, server.grpc_addr), gpu, spec(concurrency, seed=77, per_stream=1))
    row.update(admission="slots", overrides=["scheduler.admission=slots"])
    print(f"serve {concurrency} (admission=slots): TTFB p95 {row['ttfb_p95_ms']} ms, "
          f"{row['succeeded']}/{row['requests']} ok, underruns {row['underrun_events']}", flush=True)
    return row


def serve_profile(run: StageRun, target: Any, load: Any, folder: Path, top: dict[str, Any],
                  estimate_s: float) -> dict[str, Any]:
    """One more round at the serve stage's highest level, `serve_profile_steps` of its engine-core steps
    profiled inside the server (engine.profile_dir, engines/profiling.ArmedStepProfiler): from the first step
    with at least 3/4 of that level's peak of admitted streams. serve.json's `profile`, shaped as engine.json's."""
    from orpheus_serve.benchmarking.runner import measure

    name = "profile of the engine core's steps"
    if run.left() < estimate_s + 20:
        return _substep_skipped(run, name, f"{run.left():.0f} s left, {estimate_s + 20:.0f} s needed")
    result, arm = folder / "profile.json", folder / "arm"
    result.unlink(missing_ok=True)
    min_rows = max(1, int(0.75 * (top.get("admitted_peak") or 1)))
    arm.write_text(f"{run.shapes.serve_profile_steps} {min_rows}")
    measure(target, load)
    arm.unlink(missing_ok=True)  # not taken (too few rows ever): no later profile
    if not result.exists():
        return _substep_failed(run, name, f"the engine core ran fewer than {run.shapes.serve_profile_steps} steps "
                                          f"with {min_rows} or more decode rows")
    summary = json.loads(result.read_text())
    return {"status": "measured", "variant": "serve", "concurrency": load.concurrency,
            "batches": [{"batch": summary["decode_rows_mean"], **summary}]}


STAGE_FUNCS: dict[str, Callable[[StageRun], None]] = {
    "check": stage_check, "engine": stage_engine, "codec": stage_codec, "serve": stage_serve}


# ----------------------------------------------------------------- entry


def run_stage(stage: str, *, results: Path, work: Path, deadline: float, dry_run: bool) -> int:
    shapes = DRY if dry_run else REAL
    run = StageRun(stage, shapes, results=results, work=work, deadline=deadline, dry_run=dry_run)
    missing = import_stage_modules(stage)
    if missing:
        for line in missing:
            run.problem(f"cannot import {line}")
        run.save()
        return 1
    import torch

    if not dry_run and not torch.cuda.is_available():
        run.problem("no CUDA device: run with --dry-run on a machine without a GPU")
        run.save()
        return 2
    if dry_run:
        torch.set_num_threads(1)  # a dry run shares small machines; its numbers mean nothing anyway
    run.data["env"] = environment()
    run.save()
    try:
        STAGE_FUNCS[stage](run)
    except Exception:
        run.problem("stage raised:\n" + traceback.format_exc()[-3000:])
        run.save()
        return 1
    measured = {"check": lambda d: d.get("pytest"), "engine": lambda d: d.get("bench", {}).get("rows"),
                "codec": lambda d: d.get("rows"), "serve": lambda d: d.get("rows")}[stage](run.data)
    # A deadline, or a failed sub-step (recorded as such beside numbers that stand), does not fail the stage.
    run.data["ok"] = bool(measured) and not [p for p in run.data["problems"]
                                             if not p.endswith(("(deadline)", "(sub-step failed)"))]
    run.save()
    print(f"{stage}: {'ok' if run.data['ok'] else 'FAILED'}, wrote {results / (stage + '.json')} "
          f"in {run.data['stage_seconds']} s", flush=True)
    return 0 if run.data["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["imports"]:
        ap = argparse.ArgumentParser(description="import what the stages import (and collect the GPU tests)")
        ap.add_argument("stages", nargs="+", choices=STAGES)
        args = ap.parse_args(argv[1:])
        failures = [line for stage in args.stages for line in import_stage_modules(stage)]
        if "check" in args.stages and not failures:
            cmd, env = pytest_command(gpu_test_files(), "--collect-only")
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
            print(proc.stdout[-2000:] + proc.stderr[-2000:])
            if proc.returncode != 0:
                failures.append(f"pytest --collect-only -m gpu exited {proc.returncode}")
        for line in failures:
            print(f"cannot import {line}", file=sys.stderr)
        print("imports: " + ("FAILED" if failures else "ok") + f" ({', '.join(args.stages)})")
        return 1 if failures else 0

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--results", type=Path, required=True, help="where STAGE.json goes")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("KIT_WORK", "/tmp/orpheus-gpu-kit")),
                    help="models and logs (kept between stages on one machine)")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time the stage must be done by")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args(argv)
    deadline = args.deadline if args.deadline is not None else time.time() + 540
    return run_stage(args.stage, results=args.results, work=args.work, deadline=deadline, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
