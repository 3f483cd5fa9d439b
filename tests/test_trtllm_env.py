"""Selecting the TensorRT-LLM backend: lazy import, one clear message when it cannot run, the manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orpheus_serve.config import load_config
from orpheus_serve.engines import trtllm_env
from orpheus_serve.engines.factory import create_engine
from orpheus_serve.engines.trtllm_env import (
    MANIFEST_FORMAT,
    check_tensorrt_available,
    describe_missing_tensorrt,
    engine_mismatch,
    is_supported_version,
    read_manifest,
)
from orpheus_serve.scheduler.step import EngineError

ROOT = Path(__file__).resolve().parents[1]
ENV_COMPLETE = describe_missing_tensorrt(trtllm_env.probe_trtllm_version(), trtllm_env.probe_cuda_device_count()) is None
needs_incomplete_env = pytest.mark.skipif(ENV_COMPLETE, reason="TensorRT-LLM and a GPU are present here")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize(
    ("version", "ok"),
    [("1.2.0", True), ("1.2.0rc6", True), ("1.2.1.post1", True), ("1.2", True), ("1.1.0", False),
     ("1.20.0", False), ("0.21.0", False), ("unknown", False)],
)
def test_supported_versions(version: str, ok: bool) -> None:
    assert is_supported_version(version) is ok


def test_message_names_everything_missing_in_one_line() -> None:
    both = describe_missing_tensorrt(None, 0)
    assert both is not None and "\n" not in both
    assert "CUDA GPU" in both and "TensorRT-LLM 1.2.x" in both and "not installed" in both
    assert "pypi.nvidia.com" in both and "nvcr.io/nvidia/tensorrt-llm" in both and "docs/TENSORRT.md" in both

    gpu_only = describe_missing_tensorrt(None, 1)
    assert gpu_only is not None and "CUDA GPU" not in gpu_only and "TensorRT-LLM" in gpu_only

    no_gpu = describe_missing_tensorrt("1.2.0", 0)
    assert no_gpu is not None and "CUDA GPU" in no_gpu and "not installed" not in no_gpu

    wrong = describe_missing_tensorrt("1.1.0", 2)
    assert wrong is not None and "found tensorrt_llm 1.1.0" in wrong

    assert describe_missing_tensorrt("1.2.0", 1) is None
    assert describe_missing_tensorrt(None, 0, needed_by="building an engine").startswith("building an engine needs")


def test_check_raises_engine_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtllm_env, "probe_trtllm_version", lambda: None)
    monkeypatch.setattr(trtllm_env, "probe_cuda_device_count", lambda: 0)
    with pytest.raises(EngineError, match=r"needs a CUDA GPU .* and TensorRT-LLM 1\.2\.x"):
        check_tensorrt_available()
    monkeypatch.setattr(trtllm_env, "probe_trtllm_version", lambda: "1.2.0")
    monkeypatch.setattr(trtllm_env, "probe_cuda_device_count", lambda: 1)
    check_tensorrt_available()


@needs_incomplete_env
def test_selecting_tensorrt_here_fails_at_once_with_the_message() -> None:
    config = load_config(overrides=["engine.backend=tensorrt"])
    with pytest.raises(EngineError) as info:
        create_engine(config)
    message = str(info.value)
    assert "TensorRT-LLM" in message and ("CUDA GPU" in message or "tensorrt_llm" in message)


def test_backends_are_imported_only_when_selected(tmp_path: Path) -> None:
    """A `tensorrt_llm` package that explodes on import must never be imported unless selected and usable."""
    poisoned = tmp_path / "tensorrt_llm"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise ImportError('tensorrt_llm was imported')\n")
    code = (
        "import sys\n"
        "import orpheus_serve.engines.factory, orpheus_serve.engines.trtllm_engine, orpheus_serve.engines.trtllm_build\n"
        "from orpheus_serve.config import load_config\n"
        "from orpheus_serve.scheduler.step import EngineError\n"
        "from orpheus_serve.engines import trtllm_env\n"
        "trtllm_env.probe_cuda_device_count = lambda: 0\n"
        "try:\n"
        "    orpheus_serve.engines.factory.create_engine(load_config(overrides=['engine.backend=tensorrt']))\n"
        "except EngineError as exc:\n"
        "    print('refused:', exc)\n"
        "assert 'tensorrt_llm' not in sys.modules, 'imported'\n"
        "assert 'orpheus_serve.engines.torch_engine' not in sys.modules\n"
    )
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "CUDA GPU" in result.stdout


def test_build_engine_help_works_without_a_gpu() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "build_engine.py"), "--help"], env=_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("--config", "--model", "--out", "--dtype"):
        assert flag in result.stdout


@needs_incomplete_env
def test_build_engine_exits_non_zero_with_the_message() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "build_engine.py"), "--config", "config/model_config.yaml"],
                            env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "TensorRT-LLM" in result.stderr and "CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ manifest


def _manifest(**build: int) -> dict:
    return {"format": MANIFEST_FORMAT, "build": {"max_batch_size": 32, "max_seq_len": 4096, **build}}


def test_read_manifest_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"build_engine\.py"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(EngineError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(EngineError, match="format"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest()))
    assert read_manifest(tmp_path)["build"]["max_seq_len"] == 4096


def test_engine_mismatch() -> None:
    assert engine_mismatch(_manifest(), num_slots=32, max_seq_len=4096) is None
    assert engine_mismatch(_manifest(), num_slots=16, max_seq_len=2048) is None
    slots = engine_mismatch(_manifest(), num_slots=64, max_seq_len=4096)
    assert slots is not None and "max_concurrent_sessions" in slots and "rebuild" in slots
    length = engine_mismatch(_manifest(), num_slots=8, max_seq_len=8192)
    assert length is not None and "engine.max_seq_len" in length


# What TensorRT-LLM 1.2.1 pins in its requirements (torch, numpy, transformers), and the versions a resolve of
# `.[tensorrt]` then lands on for the packages both sides name.
TRTLLM_1_2_RESOLVE = {"torch": "2.9.1", "numpy": "1.26.4", "transformers": "4.57.3", "fastapi": "0.121.3",
                      "pydantic": "2.12.5", "huggingface-hub": "0.36.0", "tokenizers": "0.22.1"}


def test_tensorrt_extra_admits_the_versions_tensorrt_llm_pins() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    by_name = {canonicalize_name(r.name): r for r in requirements}
    for name, version in TRTLLM_1_2_RESOLVE.items():
        requirement = by_name.get(canonicalize_name(name))
        if requirement is not None:
            assert requirement.specifier.contains(version, prereleases=True), (
                f"{requirement} excludes {name} {version}, which TensorRT-LLM 1.2 needs: .[tensorrt] cannot resolve")
    assert [str(r) for r in requirements if r.name == "tensorrt-llm"] == [] and any(
        r.startswith("tensorrt-llm") for r in project["optional-dependencies"]["tensorrt"])


def test_setup_script_still_installs_the_tested_torch_first() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pin = setup.index('"torch==2.13.0"')
    assert pin < setup.index("pip install -q -e"), "the exact torch must be installed before the package"
