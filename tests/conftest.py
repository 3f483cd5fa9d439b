"""Shared fixtures: the tiny random-weight models, built once per test run in the real on-disk formats."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The GPU kit's full dry run takes minutes: only when asked for, by marker expression or environment.
    if "gpukit" not in (config.option.markexpr or "") and not os.environ.get("ORPHEUS_GPUKIT"):
        skip_kit = pytest.mark.skip(reason="the GPU kit's full dry run: pytest -m gpukit (or ORPHEUS_GPUKIT=1)")
        for item in items:
            if item.get_closest_marker("gpukit") is not None:
                item.add_marker(skip_kit)
    if importlib.util.find_spec("tensorrt_llm") is None:
        skip_trt = pytest.mark.skip(reason="needs TensorRT-LLM 1.2.x (see docs/TENSORRT.md)")
        for item in items:
            if "tensorrt" in item.keywords:
                item.add_marker(skip_trt)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding tiny-orpheus/ and tiny-snac/ (seed 0). Reuses ORPHEUS_TINY_MODELS if set."""
    preset = os.environ.get("ORPHEUS_TINY_MODELS")
    if preset and (Path(preset) / "tiny-orpheus" / "config.json").exists():
        return Path(preset)
    from scripts.make_tiny_models import main as make_tiny_models

    out = tmp_path_factory.mktemp("models")
    assert make_tiny_models(["--out", str(out), "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_orpheus(tiny_models: Path) -> Path:
    return tiny_models / "tiny-orpheus"


@pytest.fixture(scope="session")
def tiny_snac(tiny_models: Path) -> Path:
    return tiny_models / "tiny-snac"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for torch-heavy modules: on the test machine's two shared cores, two
    threads spend most of their time waiting on each other."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
