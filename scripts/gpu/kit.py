#!/usr/bin/env python3
"""GPU proof kit: the stages `scripts/gpu/run.sh` runs, each writing STAGE.json and STAGE.md.

    python scripts/gpu/kit.py STAGE --results DIR [--work DIR] [--dry-run]

Stages (each well under ten minutes on one H100):

- check:  nvidia-smi, the torch and CUDA versions, and `pytest -m gpu` over the test files that
          have GPU tests (CUDA-graph decode against eager, the codec stream, FP16 SNAC, the
          memory planner on the card).
- engine: writes an Orpheus-3B-shaped random checkpoint (the exact config of
          canopylabs/orpheus-3b-0.1-ft; weight values do not change speed) on the GPU, then
          `scripts/bench_engine.py`: decode step ms and tokens/s per batch size, at two
          contexts, CUDA graphs on and off, the constraint on and off, and the memory plan.
- codec:  the stateful SNAC decoder in FP16 on its own CUDA stream: ms per decode pass at each
          batch size, audio seconds decoded per GPU second, and overlap with engine decode
          steps (both at once against each alone).
- serve:  the real server (torch backend, bf16, CUDA graphs, codec on its stream) with the 3B-shaped
          model, and `benchmark.py --mode scaling` over gRPC with fixed-length utterances (the
          model is random, so --max-tokens sets the length): real-time streams at p95 TTFB under
          150 ms, GPU utilisation, server CPU per audio second.

`--dry-run` runs the same code with tiny shapes on the CPU (the tiny random models), so the kit
is exercised by the test suite on machines without a GPU. Models and scratch files go under
--work (outside the results folder: only the JSON and Markdown files come back from a GPU box).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

STAGES = ("check", "engine", "codec", "serve")
TTFB_TARGET_MS = 150.0


@dataclass(frozen=True)
class Shapes:
    """Everything a stage sizes by: the real run's, or the dry run's tiny ones."""

    preset: str
    device: str
    dtype: str
    batches: list[int]
    contexts: list[int]
    steps: int
    rounds: int
    warmup: int
    codec_batches: list[int]
    codec_passes: int
    overlap_batch: int
    overlap_steps: int
    serve_concurrent: int
    serve_max_tokens: int
    serve_requests: int | None  # None: the benchmark's default (2 x concurrency per level)
    serve_max_seq_len: int
    memory_plan_seq_lens: list[int] = field(default_factory=lambda: [1024, 4096])


REAL = Shapes(preset="3b", device="cuda", dtype="bf16", batches=[1, 8, 32, 64, 128, 256], contexts=[256, 1024],
              steps=8, rounds=3, warmup=2, codec_batches=[1, 8, 32, 64, 128, 256], codec_passes=20,
              overlap_batch=64, overlap_steps=64, serve_concurrent=256, serve_max_tokens=280, serve_requests=None,
              serve_max_seq_len=1024)
DRY = Shapes(preset="tiny", device="cpu", dtype="fp32", batches=[1, 2], contexts=[16, 24], steps=2, rounds=1,
             warmup=1, codec_batches=[1, 2], codec_passes=2, overlap_batch=2, overlap_steps=4,
             serve_concurrent=2, serve_max_tokens=28, serve_requests=2, serve_max_seq_len=256,
             memory_plan_seq_lens=[256])


# ----------------------------------------------------------------- output


def write_stage(results: Path, stage: str, data: dict[str, Any], table: str) -> None:
    """STAGE.json (everything measured) and STAGE.md (the table the report shows)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stage}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (results / f"{stage}.md").write_text(table.rstrip() + "\n")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# A GPU box gives one command ten minutes: a stage's subprocess gets what is left of this budget, so
# that a slow run still ends with its JSON and table written (marked as cut short).
STAGE_BUDGET_S = float(os.environ.get("KIT_STAGE_BUDGET_S", "560"))
_STAGE_STARTED = time.monotonic()


def budget_left(reserve_s: float = 20.0) -> float:
    return max(30.0, STAGE_BUDGET_S - (time.monotonic() - _STAGE_STARTED) - reserve_s)


def run(cmd: list[str], *, timeout_s: float, log: Path | None = None, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    print("$ " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(timeout_s, budget_left()),
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")

        proc = subprocess.CompletedProcess(cmd, 124, text(exc.stdout), text(exc.stderr) + "\n(cut short: stage budget)")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-4000:] + proc.stderr[-2000:], flush=True)
    return proc


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    multiprocessors=props.multi_processor_count)
    smi = _nvidia_smi("name,memory.total,driver_version")
    if smi:
        info["nvidia_smi"] = smi
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in ("fastapi", "pydantic", "uvicorn", "websockets", "grpcio", "protobuf", "snac", "av", "transformers"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    info["packages"] = packages
    return info


def _nvidia_smi(query: str) -> list[str]:
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []


def machine_label(env: dict[str, Any]) -> str:
    return env.get("gpu") or f"CPU ({env.get('cpu_count')} cores, dry run)"


# ----------------------------------------------------------------- models


def ensure_models(work: Path, shapes: Shapes) -> tuple[Path, Path]:
    """(Llama folder, SNAC folder): written once per machine under `work`."""
    from orpheus_serve.weights.tiny import write_llama, write_snac

    models = work / "models"
    llama = models / f"orpheus-{shapes.preset}"
    snac = models / "snac-random"
    if not (llama / "model.safetensors").exists():
        import torch

        started = time.perf_counter()
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[shapes.dtype]
        write_llama(llama, shapes.preset, seed=0, device=shapes.device, dtype=dtype)
        print(f"wrote {llama} in {time.perf_counter() - started:.1f} s", flush=True)
    if not (snac / "pytorch_model.bin").exists():
        write_snac(snac, seed=0)  # the real snac_24khz architecture, random weights
    return llama, snac


# ----------------------------------------------------------------- stages


def stage_check(shapes: Shapes, work: Path, dry_run: bool) -> tuple[dict[str, Any], str]:
    env = environment()
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    junit = work / "check-junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *files]
    proc = run(cmd, timeout_s=480, log=work / "check-pytest.log")
    counts = _junit_counts(junit)
    failures = _junit_failures(junit)
    data = {"stage": "check", "dry_run": dry_run, "env": env, "pytest": {
        "files": files, "exit_code": proc.returncode, **counts, "failures": failures}}
    rows = [["machine", machine_label(env)], ["torch / CUDA", f"{env['torch']} / {env['torch_cuda']}"]]
    if env.get("nvidia_smi"):
        rows.append(["nvidia-smi", "; ".join(env["nvidia_smi"])])
    rows.append(["pytest -m gpu", f"{counts['passed']} passed, {counts['failed']} failed, "
                                  f"{counts['skipped']} skipped (exit {proc.returncode})"])
    rows += [[f"failed: {name}", message[:160].replace("|", "/").replace("\n", " ")] for name, message in failures]
    return data, markdown_table(["check", "result"], rows)


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


def stage_engine(shapes: Shapes, work: Path, dry_run: bool) -> tuple[dict[str, Any], str]:
    env = environment()
    llama, _ = ensure_models(work, shapes)
    raw = work / "engine-bench.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--presets", "", "--model", str(llama),
           "--device", shapes.device, "--dtype", shapes.dtype,
           "--batches", ",".join(map(str, shapes.batches)), "--contexts", ",".join(map(str, shapes.contexts)),
           "--graphs", "on,off", "--constrained", "on,off", "--steps", str(shapes.steps),
           "--rounds", str(shapes.rounds), "--warmup", str(shapes.warmup), "--json", str(raw)]
    raw.unlink(missing_ok=True)  # never report an earlier run's rows
    proc = run(cmd, timeout_s=540, log=work / "engine-bench.log")
    # bench_engine.py rewrites its JSON after every configuration: a run cut short keeps what it measured.
    bench = json.loads(raw.read_text()) if raw.exists() else {"rows": [], "memory_plans": []}
    from scripts.bench_engine import memory_plan

    plans = [memory_plan(llama, slots=max(shapes.batches), max_seq_len=n, device=shapes.device, dtype=shapes.dtype)
             for n in shapes.memory_plan_seq_lens]
    data = {"stage": "engine", "dry_run": dry_run, "env": env, "model": llama.name, "exit_code": proc.returncode,
            "error": None if proc.returncode == 0 else proc.stderr[-3000:], **bench, "slots_that_fit": plans}
    rows = [[r["context"], r["graphs"], r["constrained"], r["batch"], r["step_ms"], r["tokens_per_s"],
             r["x_batch_1"]] for r in bench["rows"]]
    table = markdown_table(["context", "CUDA graphs", "constrained", "batch", "step ms", "tokens/s", "x batch 1"],
                           rows)
    plan_rows = [[p["max_seq_len"], p["weights_gib"], p["kv_mib_per_slot"], p["budget_gib"], p["max_slots"]]
                 for p in plans]
    table += "\n\nMemory plan (engine planner, 90% of free memory):\n\n" + markdown_table(
        ["max_seq_len", "weights GiB", "KV MiB / slot", "budget GiB", "slots that fit"], plan_rows)
    if proc.returncode != 0:
        cut = " (cut short by the stage's time budget: the rows above are what it measured)" if (
            proc.returncode == 124) else ""
        table += f"\n\nbench_engine.py failed (exit {proc.returncode}){cut}; see engine.json"
    return data, table


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

    reference, half = stream("fp32"), stream("fp16")
    error = float(np.sum((reference - half) ** 2))
    snr = float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference**2)) / error)
    return {"frames": len(codes), "snr_db": round(snr, 1), "expected_min_db": 40}


def stage_codec(shapes: Shapes, work: Path, dry_run: bool) -> tuple[dict[str, Any], str]:
    import numpy as np
    import torch

    from orpheus_serve.codec.base import CodecPush
    from orpheus_serve.codec.loader import load_snac
    from orpheus_serve.codec.stateful import StatefulDecoder
    from orpheus_serve.token_format import CODEBOOK_SIZE, FRAME_SECONDS, TOKENS_PER_FRAME

    env = environment()
    llama, snac_dir = ensure_models(work, shapes)
    cuda = shapes.device.startswith("cuda")
    codec_dtype = "fp16" if cuda else "fp32"
    model = load_snac(snac_dir, device=shapes.device, dtype=codec_dtype, noise=False)
    stream = torch.cuda.Stream() if cuda else None
    push_frames = 2  # the codec worker's steady-state push: every two frames (flush_every_n_tokens 14)
    rng = np.random.default_rng(0)

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, CODEBOOK_SIZE, size=(n, TOKENS_PER_FRAME), dtype=np.int64)

    def on_stream() -> Any:
        import contextlib

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def sync() -> None:
        if stream is not None:
            stream.synchronize()

    def codec_passes(decoder: StatefulDecoder, batch: int, passes: int, tag: str) -> list[float]:
        """Per-pass seconds for `passes` passes of `batch` sessions, 2 new frames each."""
        with on_stream():
            decoder.decode([CodecPush((tag, b), frames(3)) for b in range(batch)])  # past first audio
            sync()
            times = []
            for _ in range(passes):
                pushes = [CodecPush((tag, b), frames(push_frames)) for b in range(batch)]
                started = time.perf_counter()
                decoder.decode(pushes)  # returns host PCM: the pass has finished
                sync()
                times.append(time.perf_counter() - started)
            for b in range(batch):
                decoder.close((tag, b))
        return times

    rows = []
    with torch.inference_mode():
        decoder = StatefulDecoder(model, max_batch=max(shapes.codec_batches), noise=False)
        for batch in shapes.codec_batches:
            codec_passes(decoder, batch, 2, f"warm{batch}")
            times = sorted(codec_passes(decoder, batch, shapes.codec_passes, f"b{batch}"))
            median = times[len(times) // 2]
            audio_s = batch * push_frames * FRAME_SECONDS
            rows.append({"batch": batch, "frames_per_session": push_frames, "pass_ms_median": round(median * 1e3, 3),
                         "pass_ms_p90": round(times[round(0.9 * (len(times) - 1))] * 1e3, 3),
                         "audio_s_per_gpu_s": round(audio_s / median, 1)})
            print(f"codec batch {batch}: {median * 1e3:.2f} ms per pass, {audio_s / median:.1f} audio s per s",
                  flush=True)
        overlap = _codec_engine_overlap(shapes, llama, decoder, codec_passes)
        fidelity = _half_precision_snr(snac_dir, shapes.device, frames(48))
        print(f"codec FP16 vs FP32 on the same codes: SNR {fidelity['snr_db']} dB", flush=True)
    data = {"stage": "codec", "dry_run": dry_run, "env": env, "device": shapes.device, "dtype": codec_dtype,
            "decoder": "stateful", "rows": rows, "overlap": overlap, "fp16_vs_fp32": fidelity}
    table = markdown_table(["batch", "ms / pass (median)", "ms / pass (p90)", "audio s per GPU s"],
                           [[r["batch"], r["pass_ms_median"], r["pass_ms_p90"], r["audio_s_per_gpu_s"]] for r in rows])
    table += "\n\n" + markdown_table(["FP16 vs FP32 (same codes)", "SNR dB", "expected"],
                                     [[f"{fidelity['frames']} frames", fidelity["snr_db"], ">= 40"]])
    table += "\n\n" + markdown_table(
        ["overlap at batch", "engine alone s", "codec alone s", "both at once s", "overlap"],
        [[overlap["batch"], overlap["engine_alone_s"], overlap["codec_alone_s"], overlap["together_s"],
          overlap["overlap"]]])
    table += ("\n\noverlap = (engine alone + codec alone - both at once) / min(engine alone, codec alone): "
              "1 = the shorter one is hidden completely, 0 = they run one after the other.")
    return data, table


def _codec_engine_overlap(shapes: Shapes, llama: Path, decoder: Any,
                          codec_passes: Callable[..., list[float]]) -> dict[str, Any]:
    """Engine decode steps and codec passes on their own streams, each alone, then both at once."""
    from orpheus_serve import token_format as P
    from orpheus_serve.engines.torch_engine import TorchEngine
    from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan

    batch = shapes.overlap_batch
    engine = TorchEngine(llama, num_slots=batch, max_seq_len=64 + 2 * shapes.overlap_steps + 16,
                         device=shapes.device, dtype=shapes.dtype, max_batch_size=batch)
    try:
        for slot in range(batch):
            prompt = (P.START_OF_HUMAN, P.BOS, *range(1000, 1032), *P.PROMPT_SUFFIX)
            engine.step(StepPlan(prefill=[PrefillChunk(slot, f"o{slot}", prompt, 0, len(prompt),
                                                       SamplingParams(seed=slot))]))

        def engine_steps() -> None:
            for _ in range(shapes.overlap_steps):
                engine.step(StepPlan(decode=list(range(batch))))  # returns host tokens: the step has finished

        passes = max(2, shapes.overlap_steps // 4)

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
    shorter = min(engine_alone, codec_alone)
    overlap = (engine_alone + codec_alone - together) / shorter if shorter > 0 else 0.0
    return {"batch": batch, "engine_steps": shapes.overlap_steps, "codec_passes": passes,
            "engine_alone_s": round(engine_alone, 3), "codec_alone_s": round(codec_alone, 3),
            "together_s": round(together, 3), "overlap": round(overlap, 2)}


class GpuSampler:
    """GPU utilisation and memory from nvidia-smi, once a second, while a benchmark runs."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []  # (util %, memory used MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for line in _nvidia_smi("utilization.gpu,memory.used")[:1]:
                util, mem = (float(x) for x in line.split(","))
                self.samples.append((util, mem))

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"samples": 0}
        busy = [u for u, _ in self.samples if u > 0] or [0.0]
        return {"samples": len(self.samples), "util_mean_pct": round(sum(busy) / len(busy), 1),
                "util_max_pct": max(u for u, _ in self.samples),
                "memory_used_max_mib": max(m for _, m in self.samples)}


def stage_serve(shapes: Shapes, work: Path, dry_run: bool) -> tuple[dict[str, Any], str]:
    env = environment()
    llama, snac_dir = ensure_models(work, shapes)
    out_dir = work / "serve"
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "results.json"
    slots = shapes.serve_concurrent
    overrides = [
        f"engine.model_path={llama}", f"codec.path={snac_dir}", "engine.backend=torch", "engine.mode=batched",
        f"engine.device={shapes.device}", f"engine.dtype={shapes.dtype}", "engine.cuda_graphs=true",
        f"engine.max_seq_len={shapes.serve_max_seq_len}", f"codec.device={shapes.device}", "codec.decoder=stateful",
        f"scheduler.max_concurrent_sessions={slots}", f"scheduler.max_batch_size={slots}",
        f"codec.max_batch={slots}", f"server.max_connections={2 * slots + 16}",
        f"scheduler.max_queue={4 * slots}", "server.playground=false",
    ]
    cmd = [sys.executable, str(ROOT / "benchmark.py"), "--mode", "scaling", "--protocol", "grpc",
           "--concurrent", str(slots), "--max-tokens", str(shapes.serve_max_tokens),
           "--ttfb-target-ms", str(TTFB_TARGET_MS), "--output", str(raw), "--no-progress"]
    if shapes.serve_requests:
        cmd += ["--requests", str(shapes.serve_requests)]
    for item in overrides:
        cmd += ["--set", item]
    raw.unlink(missing_ok=True)
    with GpuSampler() as sampler:
        proc = run(cmd, timeout_s=560, log=out_dir / "benchmark.log")
    results = json.loads(raw.read_text()) if raw.exists() else {}
    scaling = results.get("scaling", {})
    rows = scaling.get("rows", [])
    server_logs = sorted(out_dir.glob("server_*.log"))
    data = {"stage": "serve", "dry_run": dry_run, "env": env, "exit_code": proc.returncode,
            "overrides": overrides, "max_tokens": shapes.serve_max_tokens, "ttfb_target_ms": TTFB_TARGET_MS,
            "max_realtime_concurrency": scaling.get("max_realtime_concurrency"), "gpu": sampler.summary(),
            "rows": rows,
            "error": None if proc.returncode == 0 else (proc.stderr[-2000:] + "\n" + "".join(
                p.read_text()[-2000:] for p in server_logs))}
    table = markdown_table(
        ["concurrent", "requests", "ok", "TTFB p50 ms", "TTFB p95 ms", "real-time of started", "underruns",
         "audio s / s", "tokens/s", "server CPU s / audio s"],
        [[r["concurrency"], r["requests"], r["succeeded"], r["ttfb_p50_ms"], r["ttfb_p95_ms"],
          r["realtime_of_started"], r["underrun_events"], r["audio_seconds_per_second"], r["tokens_per_s"],
          r["server_cpu_s_per_audio_s"]] for r in rows])
    held = scaling.get("max_realtime_concurrency")
    gpu = sampler.summary()
    table += (f"\n\nReal-time streams at p95 TTFB < {TTFB_TARGET_MS:g} ms: **{held if held is not None else 'none'}** "
              f"(gRPC, {shapes.serve_max_tokens}-token utterances)")
    if gpu.get("samples"):
        table += (f"; GPU utilisation mean {gpu['util_mean_pct']}% (busy samples), peak {gpu['util_max_pct']}%, "
                  f"memory peak {gpu['memory_used_max_mib']:.0f} MiB")
    if proc.returncode != 0:
        table += f"\n\nbenchmark.py failed (exit {proc.returncode}); see serve.json"
    return data, table


STAGE_FUNCS = {"check": stage_check, "engine": stage_engine, "codec": stage_codec, "serve": stage_serve}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--results", type=Path, required=True, help="where STAGE.json and STAGE.md go")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("KIT_WORK", "/tmp/orpheus-gpu-kit")),
                    help="models and scratch files (kept between stages on one machine)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args(argv)

    shapes = DRY if args.dry_run else REAL
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on a machine without a GPU", file=sys.stderr)
            return 2
    else:
        import torch

        torch.set_num_threads(1)  # a dry run shares small machines; its numbers mean nothing anyway
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data, table = STAGE_FUNCS[args.stage](shapes, args.work, args.dry_run)
    data["shapes"] = asdict(shapes)
    data["stage_seconds"] = round(time.perf_counter() - started, 1)
    write_stage(args.results, args.stage, data, table)
    print(f"{args.stage}: wrote {args.results / (args.stage + '.json')} and .md in {data['stage_seconds']} s")
    failed = data.get("exit_code", data.get("pytest", {}).get("exit_code", 0))
    return 0 if failed in (0, 5) else 1  # 5: pytest found nothing to run (no GPU tests selected)


if __name__ == "__main__":
    sys.exit(main())
