"""What the TensorRT-LLM backend needs from its environment, checked without importing it.

Two contracts live here, shared by `build_engine.py` (trtllm_build) and the
serving engine (trtllm_engine):

1. The environment: TensorRT-LLM 1.2.x and a CUDA GPU. `tensorrt_llm` cannot
   even be imported without libcuda, and the PyPI package only fetches NVIDIA's
   wheels, so the check never imports it: it asks the package metadata for the
   version and the CUDA driver (libcuda, through ctypes) for the device count.
   Whatever is missing becomes ONE `EngineError` naming it and saying how to
   get it.
2. The engine folder: `manifest.json`, written next to the engine by the build,
   records the build parameters and model shapes; the server reads it to check
   that the engine can hold the configured slots and sequence length before it
   spends a minute loading it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from ..scheduler.step import EngineError

SUPPORTED_SERIES = "1.2"
_SUPPORTED_VERSION = re.compile(r"^1\.2(\.|$)")
INSTALL_HINT = (
    "Install TensorRT-LLM 1.2.x in its own environment on a machine with an NVIDIA GPU and driver "
    "(its torch build differs from this project's): pip install \"tensorrt_llm==1.2.*\" "
    "--extra-index-url https://pypi.nvidia.com, or run inside NVIDIA's NGC container "
    "nvcr.io/nvidia/tensorrt-llm/release:1.2.0; see docs/TENSORRT.md"
)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1


def is_supported_version(version: str) -> bool:
    return bool(_SUPPORTED_VERSION.match(version))


def probe_trtllm_version() -> str | None:
    """Installed tensorrt_llm version, None when the module is absent ('unknown' without metadata)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None
    try:
        return importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def probe_cuda_device_count() -> int:
    """CUDA devices the driver reports (cuInit + cuDeviceGetCount), 0 without a driver.

    Asks libcuda directly: this project's own torch may be a CPU build even on
    a GPU machine, so torch.cuda cannot answer for TensorRT-LLM's environment.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if libcuda.cuInit(0) != 0:
        return 0
    count = ctypes.c_int(0)
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def describe_missing_tensorrt(
    trtllm_version: str | None, cuda_devices: int, *, needed_by: str = "engine.backend=tensorrt"
) -> str | None:
    """The one message for what is missing, or None when the environment is complete."""
    missing: list[str] = []
    if cuda_devices < 1:
        missing.append("a CUDA GPU (the NVIDIA driver reports none to this process)")
    if trtllm_version is None:
        missing.append(f"TensorRT-LLM {SUPPORTED_SERIES}.x (the Python package tensorrt_llm is not installed)")
    elif not is_supported_version(trtllm_version):
        missing.append(f"TensorRT-LLM {SUPPORTED_SERIES}.x (found tensorrt_llm {trtllm_version})")
    if not missing:
        return None
    return f"{needed_by} needs {' and '.join(missing)}. {INSTALL_HINT}"


def check_tensorrt_available(*, needed_by: str = "engine.backend=tensorrt") -> None:
    """Raise EngineError with one clear message unless TensorRT-LLM 1.2.x and a CUDA GPU are there."""
    message = describe_missing_tensorrt(probe_trtllm_version(), probe_cuda_device_count(), needed_by=needed_by)
    if message is not None:
        raise EngineError(message)


# ------------------------------------------------------------------ manifest


def read_manifest(engine_dir: str | Path) -> dict[str, Any]:
    path = Path(engine_dir) / MANIFEST_NAME
    if not path.is_file():
        raise EngineError(
            f"{path} not found: build an engine there first with "
            f"python build_engine.py --config config/model_config.yaml --out {engine_dir} (see docs/TENSORRT.md)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise EngineError(f"{path} is not an orpheus-serve engine manifest of format {MANIFEST_FORMAT}")
    return data


def engine_mismatch(manifest: dict[str, Any], *, num_slots: int, max_seq_len: int) -> str | None:
    """Why an engine cannot serve this config (one line), or None when it can."""
    build = manifest["build"]
    if build["max_batch_size"] < num_slots:
        return (
            f"the engine was built for max_batch_size {build['max_batch_size']} but the config asks for "
            f"{num_slots} concurrent sessions (scheduler.max_concurrent_sessions); rebuild the engine or lower it"
        )
    if build["max_seq_len"] < max_seq_len:
        return (
            f"the engine was built for max_seq_len {build['max_seq_len']} but the config asks for "
            f"{max_seq_len} (engine.max_seq_len); rebuild the engine or lower it"
        )
    return None
