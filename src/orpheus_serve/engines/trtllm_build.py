"""Build a TensorRT-LLM engine from a local Orpheus checkpoint: `python build_engine.py ...`.

    python build_engine.py --config config/model_config.yaml [--model models/orpheus]
                           [--out engines/NAME] [--dtype fp8|fp16|bf16]

What a build does, in order:

1. Checks, before anything slow: TensorRT-LLM 1.2.x installed and importable
   and a CUDA GPU present (`trtllm_env.check_tensorrt_available`); the
   checkpoint folder complete; compute capability >= 8.9 for FP8 (Ada, Hopper;
   an A100 is 8.0 and builds bf16); free GPU memory and free disk against the
   estimate of `estimate_build_requirements`. Each failure is one line saying
   what to do.
2. Calibration data: a small built-in set of texts, each formatted as a real
   Orpheus prompt with `protocol.build_prompt_ids` and the checkpoint's own
   tokenizer (`tokenizers`), written as a local dataset folder (`train.jsonl`,
   a `text` column) because that is what TensorRT-LLM's calibration loader
   (`quantization/quantize_by_modelopt.py: get_calib_dataloader`) reads from a
   path. Each text is checked to re-tokenise to exactly its prompt ids; the
   loader's own tokenizer call adds one BOS in front.
3. The build, with the LLM API's TensorRT backend (1.2.x names):
   `tensorrt_llm._tensorrt_engine.LLM(model=..., dtype=..., build_config=BuildConfig(
   max_batch_size, max_seq_len, max_num_tokens), quant_config=QuantConfig(quant_algo=
   QuantAlgo.FP8), calib_config=CalibConfig(...), kv_cache_config=KvCacheConfig(
   free_gpu_memory_fraction=0.05, max_tokens=max_seq_len))` then `llm.save(out)`. FP8 means
   FP8 weights and activations with a 16-bit (FP16) KV cache: no
   `kv_cache_quant_algo` (ARCHITECTURE §6). The LLM API starts a runtime on the
   engine it has just built before `save` can run, and by default that runtime's
   KV cache claims 90% of the free GPU memory; the build needs no cache, so it
   gets one sequence's worth (`BUILD_KV_CACHE_FRACTION` caps it further).
4. `manifest.json` next to the engine: TensorRT-LLM version, GPU name and
   compute capability, build parameters, model shapes, engine size, and the
   sha256 of every checkpoint file. The server reads it back (`trtllm_env`).

Sizes from config: max_seq_len = engine.max_seq_len, max_num_tokens =
engine.tensorrt.max_num_tokens, max_batch_size = scheduler.max_concurrent_sessions:
the runtime batches every live request each iteration, so it must hold as many
as there are slots (scheduler.max_batch_size caps a step of the slot-batched
engines only).

Everything here but `probe_gpu` and `run_build` is pure and tested on CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from ..config import Config, ConfigError, load_config
from ..scheduler.step import EngineError
from ..token_format import PROMPT_SUFFIX, START_OF_HUMAN, VOICES, build_prompt_ids
from .trtllm_env import MANIFEST_FORMAT, MANIFEST_NAME, check_tensorrt_available, probe_trtllm_version
from .vram_budget import (
    FP8_MIN_COMPUTE_CAPABILITY,
    GIB,
    LlamaDims,
    supports_fp8,
    weight_bytes,
)

BuildDtype = Literal["fp8", "fp16", "bf16"]
# Activation (and so KV cache) dtype of each build: FP8 keeps a 16-bit FP16 KV cache.
ACTIVATION_DTYPE: dict[str, str] = {"fp8": "float16", "fp16": "float16", "bf16": "bfloat16"}
CALIBRATION_DATASET_DIR = "orpheus-calibration"
HASH_CHUNK_BYTES = 8 * 1024 * 1024
# Peak GPU use beyond the 16-bit weights during calibration / engine build (activations,
# TensorRT tactic workspace): an estimate.
BUILD_GPU_HEADROOM_BYTES = 2 * GIB
DISK_MARGIN_BYTES = 1 * GIB

# Speech-like lines of different lengths and registers, with numbers, questions and the
# emotion tags the released model honours; one prompt each, voices cycled.
CALIBRATION_TEXTS: tuple[str, ...] = (
    "Hello there, how are you doing today?",
    "I'm doing well, thank you for asking. <laugh> It has been a long week.",
    "The quick brown fox jumps over the lazy dog.",
    "Your order number is 4 8 1 5, and it should arrive on Tuesday, March 3rd.",
    "Wait, what did you just say? <gasp> That can't be right.",
    "Please hold the line while I transfer you to the next available representative.",
    "Streaming speech synthesis turns text into audio while the text is still being read.",
    "Honestly, I don't know. <sigh> Let me think about it for a second.",
    "The meeting has been moved to half past two in the afternoon.",
    "Turn left at the second traffic light, then continue for about three hundred meters.",
    "That's the funniest thing I've heard all day. <chuckle>",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Sorry, I have a bit of a cold today. <sniffle> <cough> Where were we?",
    "The total comes to twenty-four dollars and ninety-nine cents, including tax.",
    "Ugh, Monday mornings. <groan> I need another coffee.",
    "Good night, sleep well, and I'll see you tomorrow. <yawn>",
    "Could you spell that for me? Was it B as in bravo or D as in delta?",
    "Temperatures will reach a high of 31 degrees, with a chance of thunderstorms late tonight.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat.",
    "Are you sure? Because if you're sure, then I'm sure too.",
    "The flight from Chicago is delayed by forty-five minutes; we apologize for the inconvenience.",
    "Mm, that sounds delicious. What's in it?",
    "To reset your password, open settings, choose security, and follow the instructions on screen.",
    "Well, well, well. Look who finally decided to show up.",
)


CLI_DESCRIPTION = """\
Build a TensorRT-LLM 1.2.x engine from a local Orpheus checkpoint: FP8 weights with an FP16
KV cache by default (compute capability >= 8.9), calibrated on built-in Orpheus prompts, sized
from the config (max_batch_size = scheduler.max_concurrent_sessions, max_seq_len =
engine.max_seq_len, max_num_tokens = engine.tensorrt.max_num_tokens). Writes manifest.json
next to the engine. Needs TensorRT-LLM and a CUDA GPU; see docs/TENSORRT.md.
"""


class BuildError(RuntimeError):
    """A build cannot start or did not complete; the message says what to do."""


# ---------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class BuildSettings:
    model_dir: Path
    out_dir: Path
    dtype: BuildDtype
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    tokenizer_path: Path
    calib_max_seq_length: int = 512

    @property
    def workspace_dir(self) -> Path:
        """Where the LLM API puts its temporary checkpoint and engine: beside the output."""
        return self.out_dir.parent

    @classmethod
    def from_config(
        cls, config: Config, *, model_dir: str | None = None, out_dir: str | None = None, dtype: BuildDtype = "fp8"
    ) -> BuildSettings:
        model = Path(model_dir or config.engine.model_path)
        tokenizer = Path(config.engine.tokenizer_path) if config.engine.tokenizer_path else model
        return cls(
            model_dir=model,
            out_dir=Path(out_dir or config.engine.tensorrt.engine_dir),
            dtype=dtype,
            max_batch_size=max(config.scheduler.max_batch_size, config.scheduler.max_concurrent_sessions),
            max_seq_len=config.engine.max_seq_len,
            max_num_tokens=config.engine.tensorrt.max_num_tokens,
            tokenizer_path=tokenizer,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "quant_algo": "FP8" if self.dtype == "fp8" else None,
            "kv_cache_quant_algo": None,
            "activation_dtype": ACTIVATION_DTYPE[self.dtype],
            "kv_cache_dtype": ACTIVATION_DTYPE[self.dtype],
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "max_num_tokens": self.max_num_tokens,
        }


# ------------------------------------------------------------- calibration


@dataclass(frozen=True, slots=True)
class CalibrationRecord:
    text: str  # what goes into the dataset; re-tokenises to `prompt_ids`
    prompt_ids: tuple[int, ...]


def calibration_prompt_ids(tokenizer: Any, texts: Sequence[str] = CALIBRATION_TEXTS) -> list[list[int]]:
    """Orpheus prompt ids for each built-in text, voices cycled."""
    return [build_prompt_ids(tokenizer, VOICES[i % len(VOICES)], text) for i, text in enumerate(texts)]


def calibration_records(tokenizer: Any, texts: Sequence[str] = CALIBRATION_TEXTS) -> list[CalibrationRecord]:
    """Prompts as dataset text that the checkpoint's tokenizer turns back into the same ids.

    `tokenizer` is a `tokenizers.Tokenizer` (decode/encode with special tokens kept).
    """
    records = []
    for ids in calibration_prompt_ids(tokenizer, texts):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        again = tokenizer.encode(text, add_special_tokens=False).ids
        if list(again) != ids:
            raise BuildError(
                "the checkpoint's tokenizer does not round-trip an Orpheus prompt "
                f"(ids {ids[:8]}... became {list(again)[:8]}...); is tokenizer.json the Orpheus one?"
            )
        if ids[0] != START_OF_HUMAN or tuple(ids[-len(PROMPT_SUFFIX) :]) != PROMPT_SUFFIX:
            raise BuildError(f"calibration prompt is not an Orpheus prompt: {ids[:4]}...{ids[-4:]}")
        records.append(CalibrationRecord(text=text, prompt_ids=tuple(ids)))
    return records


def write_calibration_dataset(folder: Path, records: Iterable[CalibrationRecord]) -> Path:
    """A local dataset folder TensorRT-LLM's calibration reads: split `train`, column `text`."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": r.text}, ensure_ascii=False) for r in records]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise BuildError(f"{file} not found: the checkpoint folder needs tokenizer.json (scripts/download_models.py)")
    return Tokenizer.from_file(str(file))


# ---------------------------------------------------------------- checkpoint


@dataclass(frozen=True, slots=True)
class CheckpointDigest:
    files: dict[str, str]  # relative path -> sha256
    sha256: str  # over the sorted (path, sha256) pairs
    total_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.total_bytes, "files": dict(self.files)}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """Regular files of a checkpoint folder, sorted; hidden paths (hub caches, .git) excluded."""
    return sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)
    )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_digest(model_dir: Path) -> CheckpointDigest:
    files = {p.relative_to(model_dir).as_posix(): sha256_file(p) for p in checkpoint_files(model_dir)}
    combined = hashlib.sha256()
    for name in sorted(files):
        combined.update(f"{name}\0{files[name]}\n".encode())
    total = sum(p.stat().st_size for p in checkpoint_files(model_dir))
    return CheckpointDigest(files=files, sha256=combined.hexdigest(), total_bytes=total)


def read_model_dims(model_dir: Path) -> LlamaDims:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise BuildError(
            f"{config_file} not found: download the checkpoint with python scripts/download_models.py "
            "or pass --model FOLDER"
        )
    return LlamaDims.from_hf_config(json.loads(config_file.read_text()))


def checkpoint_problems(model_dir: Path) -> list[str]:
    if not model_dir.is_dir():
        return [f"{model_dir} does not exist: download it with python scripts/download_models.py or pass --model"]
    problems = []
    if not (model_dir / "config.json").is_file():
        problems.append(f"{model_dir}/config.json is missing")
    if not any(model_dir.glob("*.safetensors")):
        problems.append(f"{model_dir} has no *.safetensors weights")
    return problems


# ---------------------------------------------------------------- preflight


@dataclass(frozen=True, slots=True)
class GpuInfo:
    name: str
    compute_capability: tuple[int, int]
    free_bytes: int
    total_bytes: int

    @property
    def compute_capability_str(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


@dataclass(frozen=True, slots=True)
class DiskSpace:
    path: Path
    device: int  # st_dev: two paths on one filesystem share their free space
    free_bytes: int


@dataclass(frozen=True, slots=True)
class BuildRequirements:
    gpu_bytes: int  # peak: the 16-bit checkpoint on the GPU (calibration / conversion) + headroom
    engine_bytes: int
    workspace_disk_bytes: int  # the LLM API's temporary quantised checkpoint + engine
    output_disk_bytes: int


def estimate_build_requirements(dims: LlamaDims, dtype: BuildDtype, checkpoint_bytes: int) -> BuildRequirements:
    engine = weight_bytes(dims, dtype).total
    sixteen_bit = weight_bytes(dims, "bf16").total
    intermediate = 2 if dtype == "fp8" else 1  # FP8 writes a quantised checkpoint before the engine
    return BuildRequirements(
        gpu_bytes=max(checkpoint_bytes, sixteen_bit) + BUILD_GPU_HEADROOM_BYTES,
        engine_bytes=engine,
        workspace_disk_bytes=intermediate * engine + DISK_MARGIN_BYTES,
        output_disk_bytes=engine,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def preflight_problems(
    *,
    dtype: BuildDtype,
    gpu: GpuInfo,
    requirements: BuildRequirements,
    workspace: DiskSpace,
    output: DiskSpace,
) -> list[str]:
    """Every reason the build would fail for lack of hardware, one line each."""
    problems = []
    if dtype == "fp8" and not supports_fp8(gpu.compute_capability):
        need = f"{FP8_MIN_COMPUTE_CAPABILITY[0]}.{FP8_MIN_COMPUTE_CAPABILITY[1]}"
        problems.append(
            f"FP8 needs compute capability >= {need} (Ada or Hopper, e.g. RTX 4090, L40S, H100); "
            f"{gpu.name} is {gpu.compute_capability_str}: build with --dtype bf16 (or fp16) instead"
        )
    if gpu.free_bytes < requirements.gpu_bytes:
        problems.append(
            f"the build needs about {_gib(requirements.gpu_bytes)} of GPU memory; {gpu.name} has "
            f"{_gib(gpu.free_bytes)} free: stop other processes on the GPU (see nvidia-smi)"
        )
    if workspace.device == output.device:
        need = requirements.workspace_disk_bytes + requirements.output_disk_bytes
        if workspace.free_bytes < need:
            problems.append(
                f"the build needs about {_gib(need)} of disk under {output.path}; {_gib(workspace.free_bytes)} free"
            )
    else:
        for space, need in ((workspace, requirements.workspace_disk_bytes), (output, requirements.output_disk_bytes)):
            if space.free_bytes < need:
                problems.append(
                    f"the build needs about {_gib(need)} of disk under {space.path}; {_gib(space.free_bytes)} free"
                )
    return problems


def disk_space(path: Path) -> DiskSpace:
    """Free space of the filesystem that holds `path` (its nearest existing ancestor)."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return DiskSpace(path=path, device=os.stat(probe).st_dev, free_bytes=shutil.disk_usage(probe).free)


# ---------------------------------------------------------------- manifest


def engine_size_bytes(out_dir: Path) -> int:
    return sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def build_manifest(
    *,
    settings: BuildSettings,
    tensorrt_llm_version: str,
    gpu: GpuInfo,
    dims: LlamaDims,
    checkpoint: CheckpointDigest,
    engine_bytes: int,
    calibration_prompts: int,
    created_at: datetime,
) -> dict[str, Any]:
    build = settings.as_dict()
    build["calibration"] = (
        {"prompts": calibration_prompts, "max_seq_length": settings.calib_max_seq_length}
        if settings.dtype == "fp8"
        else None
    )
    return {
        "format": MANIFEST_FORMAT,
        "created_at": created_at.astimezone(timezone.utc).isoformat(timespec="seconds"),
        "tensorrt_llm_version": tensorrt_llm_version,
        "gpu": {
            "name": gpu.name,
            "compute_capability": gpu.compute_capability_str,
            "memory_bytes": gpu.total_bytes,
        },
        "build": build,
        "model": dims.as_dict(),
        "engine_bytes": engine_bytes,
        "checkpoint": {"path": str(settings.model_dir), **checkpoint.as_dict()},
    }


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> Path:
    path = out_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


# ------------------------------------------------------------ GPU-side parts


def probe_gpu() -> GpuInfo:
    """The current CUDA device, through the TensorRT-LLM environment's (CUDA) torch."""
    import torch

    if not torch.cuda.is_available():
        raise BuildError("torch in this environment sees no CUDA GPU; run the build in TensorRT-LLM's environment")
    index = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    major, minor = torch.cuda.get_device_capability(index)
    return GpuInfo(
        name=torch.cuda.get_device_name(index), compute_capability=(major, minor), free_bytes=free, total_bytes=total
    )


# Share of free GPU memory the runtime the LLM API starts after a build may take for its KV cache (the
# 1.2.x default is 0.9). Nothing runs on it before `save`, so the least it accepts is plenty.
BUILD_KV_CACHE_FRACTION = 0.05


def run_build(settings: BuildSettings, calibration_dir: Path | None, calibration_prompts: int) -> None:
    """Quantise (FP8) or convert (16-bit), build and save the engine with TensorRT-LLM's LLM API."""
    from tensorrt_llm._tensorrt_engine import LLM
    from tensorrt_llm.llmapi import BuildConfig, CalibConfig, KvCacheConfig, QuantAlgo, QuantConfig

    build_config = BuildConfig(
        max_batch_size=settings.max_batch_size,
        max_seq_len=settings.max_seq_len,
        max_num_tokens=settings.max_num_tokens,
    )
    extra: dict[str, Any] = {}
    if settings.dtype == "fp8":
        # FP8 weights + activations; no kv_cache_quant_algo, so the KV cache stays FP16.
        extra["quant_config"] = QuantConfig(quant_algo=QuantAlgo.FP8)
        extra["calib_config"] = CalibConfig(
            calib_dataset=str(calibration_dir),
            calib_batches=calibration_prompts,
            calib_batch_size=1,
            calib_max_seq_length=settings.calib_max_seq_length,
        )
    settings.workspace_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(
        model=str(settings.model_dir),
        dtype=ACTIVATION_DTYPE[settings.dtype],
        build_config=build_config,
        workspace=str(settings.workspace_dir),
        # The constructor starts a runtime on the new engine: keep its KV cache to one sequence so the
        # build does not hold most of the GPU (or fail next to a running server) just to save.
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=BUILD_KV_CACHE_FRACTION,
                                      max_tokens=settings.max_seq_len),
        **extra,
    )
    try:
        llm.save(str(settings.out_dir))
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------- CLI


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="config/model_config.yaml", help="config file (sizes, engine dir, model path)")
    ap.add_argument("--model", default=None, help="local Hugging Face checkpoint folder (default: engine.model_path)")
    ap.add_argument("--out", default=None, help="engine output folder (default: engine.tensorrt.engine_dir)")
    ap.add_argument(
        "--dtype",
        choices=("fp8", "fp16", "bf16"),
        default="fp8",
        help="fp8: FP8 weights with an FP16 KV cache (compute capability >= 8.9); fp16/bf16: unquantised",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override, as for the server (repeatable)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="build_engine.py", description=CLI_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config, overrides=args.overrides)
        settings = BuildSettings.from_config(config, model_dir=args.model, out_dir=args.out, dtype=args.dtype)
        check_tensorrt_available(needed_by="building an engine")
        _check_importable()
        problems = checkpoint_problems(settings.model_dir)
        if problems:
            raise BuildError("; ".join(problems))
        dims = read_model_dims(settings.model_dir)
        gpu = probe_gpu()
        checkpoint_bytes = sum(p.stat().st_size for p in checkpoint_files(settings.model_dir))
        requirements = estimate_build_requirements(dims, settings.dtype, checkpoint_bytes)
        problems = preflight_problems(
            dtype=settings.dtype,
            gpu=gpu,
            requirements=requirements,
            workspace=disk_space(settings.workspace_dir),
            output=disk_space(settings.out_dir),
        )
        if problems:
            raise BuildError("\n  ".join(["the build cannot start:", *problems]))
    except (ConfigError, EngineError, BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    print(f"checkpoint {settings.model_dir}: hashing {checkpoint_bytes / GIB:.1f} GiB", flush=True)
    digest = checkpoint_digest(settings.model_dir)
    records = calibration_records(load_tokenizer(settings.tokenizer_path)) if settings.dtype == "fp8" else []
    calibration_dir = (
        write_calibration_dataset(settings.workspace_dir / CALIBRATION_DATASET_DIR, records) if records else None
    )
    print(
        f"building {settings.dtype} engine for {gpu.name} (compute {gpu.compute_capability_str}): "
        f"max_batch_size {settings.max_batch_size}, max_seq_len {settings.max_seq_len}, "
        f"max_num_tokens {settings.max_num_tokens} -> {settings.out_dir}",
        flush=True,
    )
    try:
        run_build(settings, calibration_dir, len(records))
    finally:
        if calibration_dir is not None:
            shutil.rmtree(calibration_dir)
    manifest = build_manifest(
        settings=settings,
        tensorrt_llm_version=probe_trtllm_version() or "unknown",
        gpu=gpu,
        dims=dims,
        checkpoint=digest,
        engine_bytes=engine_size_bytes(settings.out_dir),
        calibration_prompts=len(records),
        created_at=datetime.now(timezone.utc),
    )
    path = write_manifest(settings.out_dir, manifest)
    print(f"engine written to {settings.out_dir} ({manifest['engine_bytes'] / GIB:.2f} GiB); manifest {path}")
    return 0


def _check_importable() -> None:
    """Installed is not enough: the wheel must load against this machine's CUDA and driver."""
    try:
        import tensorrt_llm  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        raise EngineError(f"TensorRT-LLM is installed but does not import here: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
