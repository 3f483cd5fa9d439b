"""What every stage of the GPU proof kit shares: its shapes (the card's or the dry run's), the StageRun that
writes STAGE.json after every measured piece, the machine's environment, and the random-weight models."""

from __future__ import annotations

import importlib
import json
import os
import platform
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]

# The stages, in the order a card run plans them (README.md): the server first, then the engine's base row in
# the server's own configuration, the GPU tests, the codec, the other engine variants, and the compiled variant
# last (its compilation takes the longest and is worth the least).
STAGES = ("serve", "base", "check", "codec", "engine", "compiled")

_ENGINE_MODULES = ("torch", "safetensors", "triton", "orpheus_serve.weights.tiny",
                   "orpheus_serve.engines.torch_engine", "scripts.bench_engine")

# What each stage imports, checked first (and by tests/test_gpu_kit.py in an environment holding only the
# GPU box's packages plus .whl/): a module missing there fails in seconds, not minutes into a stage.
STAGE_MODULES: dict[str, tuple[str, ...]] = {
    "check": ("pytest", "pytest_timeout", "torch", "scripts.gpu.stages.pytest_progress"),
    "base": _ENGINE_MODULES,
    "engine": (*_ENGINE_MODULES, "orpheus_serve.engines.lora", "scripts.bench_lora"),
    "compiled": _ENGINE_MODULES,
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

# A problem ending in one of these leaves the stage's measured numbers standing: the stage is partial, not failed.
DEADLINE = "(deadline)"
SUBSTEP_FAILED = "(sub-step failed)"


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
    # The engine stages' rows (bench_engine.py --variants): each variant at these batch sizes, KV lengths up to
    # variant_context, graphs on; a profile of each variant's step at profile_batches. The `base` and `compiled`
    # stages take their one variant each; the `engine` stage the rest (or every one, when asked).
    variants: list[str] = field(default_factory=lambda: ["base", "fused", "compiled", "fp8kv", "fp8w", "fused+fp8kv",
                                                         "fused+fp8w"])
    variant_batches: list[int] = field(default_factory=lambda: [1, 128, 256])
    variant_context: int = 1024
    # The attention the engine bench asks for (bench_engine.py --attention): the server's choice on a card; the
    # dry run runs the Triton kernels in Triton's interpreter, so its rows show the card's attention path.
    attention: str = "auto"
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
              serve_levels=[16, 64, 128, 192, 256], serve_requests_per_stream=1, serve_ramp_s=1.0,
              serve_max_tokens=280, serve_max_seq_len=1024)
DRY = Shapes(preset="tiny", device="cpu", dtype="fp32", batches=[1, 2], contexts=[256, 512], steps=2, rounds=1,
             warmup=1, codec_batches=[1, 2], codec_passes=2, overlap_batch=2, overlap_steps=4,
             serve_warmup_concurrency=1, serve_levels=[1, 2], serve_requests_per_stream=1, serve_ramp_s=0.2,
             serve_max_tokens=28, serve_max_seq_len=256, serve_profile_steps=10, memory_plan_seq_lens=[256], lora_batch=2,
             lora_counts=[0, 1, 2], lora_steps=2, lora_rounds=1, lora_reserve_s=20.0, variant_batches=[1, 2],
             variant_context=64, profile_batches=[1, 2], gemm_batches=[1, 2], gemm_min_s=5.0, attention="triton",
             # The named rows; the fused combinations are left to the card (Triton's interpreter is slow).
             variants=["base", "fused", "compiled", "fp8kv", "fp8w"])


class StageKilled(BaseException):
    """SIGTERM reached the stage (run.sh's `timeout` at the stage's deadline). A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way swallows it: it unwinds to the runner,
    which saves what was measured, marked partial."""


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises StageKilled in the main thread, once: a second one during the save is ignored."""
    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise StageKilled(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


class StageRun:
    """One stage: its shapes, folders and deadline, and its STAGE.json, rewritten atomically on save().

    `tag` names the file when one stage runs twice in a call (serve with other server settings: NAME.json);
    the stage inside the file stays the stage's own name."""

    def __init__(self, stage: str, shapes: Shapes, *, results: Path, work: Path, deadline: float,
                 dry_run: bool, tag: str | None = None) -> None:
        self.stage, self.shapes, self.results, self.work = stage, shapes, results, work
        self.deadline, self.dry_run, self.tag = deadline, dry_run, tag
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"stage": stage, "dry_run": dry_run, "ok": False, "complete": False,
                                     "partial": True, "problems": [], "shapes": asdict(shapes)}
        if tag:
            self.data["tag"] = tag
        self.table = ""

    @property
    def path(self) -> Path:
        return self.results / f"{self.tag or self.stage}.json"

    def left(self) -> float:
        """Seconds to this stage's deadline."""
        return self.deadline - time.time()

    def problem(self, text: str) -> None:
        print(f"{self.stage}: PROBLEM: {text}", flush=True)
        self.data["problems"].append(text)

    def save(self) -> None:
        self.data["stage_seconds"] = round(time.monotonic() - self.started, 1)
        self.data["table"] = self.table
        # Until the stage says it finished, what the file holds is what was measured so far.
        self.data["partial"] = not self.data["complete"]
        scratch = self.path.with_name(self.path.name + ".tmp")
        scratch.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        scratch.replace(self.path)  # atomic: a reader, or a kill, never sees half a file

    def run(self, cmd: list[str], *, log_name: str, reserve_s: float = 10.0, env: dict[str, str] | None = None,
            on_progress: Callable[[], None] | None = None,
            poll_s: float = 2.0) -> subprocess.CompletedProcess[str]:
        """`cmd` with what is left of the deadline (less `reserve_s` to write results), output to logs/.

        `on_progress` is called every `poll_s` while it runs, and once more at its end, however it ended: it
        merges what the command has written so far into STAGE.json. At the deadline the command gets SIGTERM
        (a pytest or a bench writes what it has), then SIGKILL 5 s later; exit code 124."""
        timeout = max(5.0, self.left() - reserve_s)
        print("$ " + " ".join(cmd), flush=True)
        log = self.logs / log_name
        ends = time.monotonic() + timeout
        code: int | None = None
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **(env or {})})
            try:
                while code is None:
                    try:
                        code = proc.wait(timeout=max(0.05, min(poll_s, ends - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= ends:
                            _stop(proc)
                            code = 124
                        elif on_progress is not None:
                            on_progress()
            except StageKilled:
                _stop(proc)  # the same SIGTERM reached it (one process group): give it its few seconds
                if on_progress is not None:
                    on_progress()
                raise
        text = log.read_text(errors="replace")
        if code == 124:
            self.problem(f"{log_name.removesuffix('.log')} cut short {DEADLINE}")
        if on_progress is not None:
            on_progress()
        print(text[-3000:], flush=True)
        return subprocess.CompletedProcess(cmd, code, text, "")


def _stop(proc: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def substep_failed(run: StageRun, name: str, text: str) -> dict[str, Any]:
    """A sub-step that failed: recorded, not merged as a number; the main numbers stay good."""
    run.problem(f"{name}: {text} {SUBSTEP_FAILED}")
    return {"status": "failed", "reason": text, "rows": []}


def substep_skipped(run: StageRun, name: str, text: str) -> dict[str, Any]:
    run.problem(f"{name} not measured: {text} {DEADLINE}")
    return {"status": "skipped", "reason": text, "rows": []}


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
                 "pytest", "pytest-timeout", "numpy", "triton"):
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


def python_path_env() -> dict[str, str]:
    """PYTHONPATH for a subprocess that imports the kit's own modules (a pytest plugin): the repository first."""
    current = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), *([current] if current else [])])}
