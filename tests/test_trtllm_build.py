"""The pure parts of build_engine.py: settings, calibration prompts, checkpoint hash, checks, manifest."""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from orpheus_serve.config import load_config
from orpheus_serve.engines.trtllm_build import (
    CALIBRATION_TEXTS,
    BuildError,
    BuildSettings,
    DiskSpace,
    GpuInfo,
    build_manifest,
    calibration_records,
    checkpoint_digest,
    checkpoint_problems,
    disk_space,
    estimate_build_requirements,
    main,
    preflight_problems,
    read_model_dims,
    sha256_file,
    write_calibration_dataset,
    write_manifest,
)
from orpheus_serve.engines.trtllm_env import engine_mismatch, read_manifest
from orpheus_serve.engines.vram_budget import GIB, ORPHEUS_3B
from orpheus_serve.token_format import BOS, PROMPT_SUFFIX, START_OF_HUMAN, VOICES, build_prompt_ids
from orpheus_serve.weights.tiny import write_tokenizer

H100 = GpuInfo("NVIDIA H100 80GB HBM3", (9, 0), free_bytes=78 * GIB, total_bytes=80 * GIB)
A100 = GpuInfo("NVIDIA A100-SXM4-80GB", (8, 0), free_bytes=78 * GIB, total_bytes=80 * GIB)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_settings_from_config() -> None:
    config = load_config(overrides=["scheduler.max_concurrent_sessions=24", "scheduler.max_batch_size=8",
                                    "engine.max_seq_len=3072", "engine.tensorrt.max_num_tokens=4096"])
    s = BuildSettings.from_config(config)
    assert s.max_batch_size == 24  # every live session is in the runtime's batch
    assert (s.max_seq_len, s.max_num_tokens) == (3072, 4096)
    assert s.model_dir == Path("models/orpheus") and s.out_dir == Path("engines/orpheus-fp8")
    assert s.tokenizer_path == s.model_dir and s.dtype == "fp8"
    assert s.workspace_dir == Path("engines")
    other = BuildSettings.from_config(config, model_dir="m", out_dir="engines/x", dtype="bf16")
    assert (other.model_dir, other.out_dir, other.dtype) == (Path("m"), Path("engines/x"), "bf16")
    assert other.as_dict()["activation_dtype"] == "bfloat16"
    fp8 = s.as_dict()
    assert fp8["quant_algo"] == "FP8" and fp8["kv_cache_quant_algo"] is None and fp8["kv_cache_dtype"] == "float16"


# -------------------------------------------------------------- calibration


def test_calibration_records_are_orpheus_prompts_that_round_trip(tokenizer: Tokenizer) -> None:
    records = calibration_records(tokenizer)
    assert len(records) == len(CALIBRATION_TEXTS) >= 16
    for i, record in enumerate(records):
        ids = list(record.prompt_ids)
        assert ids == build_prompt_ids(tokenizer, VOICES[i % len(VOICES)], CALIBRATION_TEXTS[i])
        assert ids[:2] == [START_OF_HUMAN, BOS] and tuple(ids[-4:]) == PROMPT_SUFFIX
        assert tokenizer.encode(record.text, add_special_tokens=False).ids == ids
    assert "tara: Hello there" in records[0].text
    assert {r.text.split(":")[0].split(">")[-1] for r in records} == set(VOICES)  # every voice is calibrated


def test_calibration_rejects_a_tokenizer_that_does_not_round_trip(tokenizer: Tokenizer) -> None:
    class Lossy:
        def encode(self, text: str, add_special_tokens: bool = True):
            return tokenizer.encode(text.upper(), add_special_tokens=add_special_tokens)

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    with pytest.raises(BuildError, match="round-trip"):
        calibration_records(Lossy(), ["hello"])


def test_calibration_dataset_layout(tmp_path: Path, tokenizer: Tokenizer) -> None:
    records = calibration_records(tokenizer, CALIBRATION_TEXTS[:3])
    folder = write_calibration_dataset(tmp_path / "calib", records)
    lines = (folder / "train.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in lines] == [r.text for r in records]


# ---------------------------------------------------------------- checkpoint


def test_checkpoint_digest(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "config.json").write_text('{"a": 1}')
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 1000)
    (ckpt / "sub" / "extra.txt").write_text("x")
    (ckpt / ".cache" / "huggingface").mkdir(parents=True)
    (ckpt / ".cache" / "huggingface" / "meta").write_text("download bookkeeping")

    digest = checkpoint_digest(ckpt)
    assert sorted(digest.files) == ["config.json", "model.safetensors", "sub/extra.txt"]
    assert digest.files["model.safetensors"] == hashlib.sha256(b"\x00" * 1000).hexdigest()
    assert digest.total_bytes == len('{"a": 1}') + 1000 + 1
    assert sha256_file(ckpt / "config.json") == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert checkpoint_digest(ckpt).sha256 == digest.sha256  # deterministic

    (ckpt / ".cache" / "huggingface" / "meta").write_text("changed")
    assert checkpoint_digest(ckpt).sha256 == digest.sha256  # hidden files do not count
    (ckpt / "config.json").write_text('{"a": 2}')
    assert checkpoint_digest(ckpt).sha256 != digest.sha256


def test_checkpoint_problems(tmp_path: Path, tiny_orpheus: Path) -> None:
    assert "does not exist" in checkpoint_problems(tmp_path / "nope")[0]
    tmp_path.joinpath("config.json").write_text("{}")
    assert any("safetensors" in p for p in checkpoint_problems(tmp_path))
    assert checkpoint_problems(tiny_orpheus) == []
    assert read_model_dims(tiny_orpheus).vocab_size == 156940
    with pytest.raises(BuildError, match=r"download_models\.py"):
        read_model_dims(tmp_path / "nope")


# ----------------------------------------------------------------- preflight


def _space(path: str, device: int, free_gib: float) -> DiskSpace:
    return DiskSpace(Path(path), device, int(free_gib * GIB))


def test_requirements_estimate() -> None:
    checkpoint = int(6.6e9)
    fp8 = estimate_build_requirements(ORPHEUS_3B, "fp8", checkpoint)
    bf16 = estimate_build_requirements(ORPHEUS_3B, "bf16", checkpoint)
    assert fp8.engine_bytes < bf16.engine_bytes
    assert fp8.gpu_bytes >= checkpoint  # calibration holds the 16-bit model on the GPU
    assert fp8.workspace_disk_bytes > 2 * fp8.engine_bytes  # quantised checkpoint + engine + margin
    assert fp8.output_disk_bytes == fp8.engine_bytes


def test_preflight_passes_on_a_big_hopper() -> None:
    req = estimate_build_requirements(ORPHEUS_3B, "fp8", int(6.6e9))
    assert preflight_problems(dtype="fp8", gpu=H100, requirements=req, workspace=_space("engines", 1, 500),
                              output=_space("engines/x", 1, 500)) == []


def test_preflight_stops_fp8_below_compute_8_9() -> None:
    req = estimate_build_requirements(ORPHEUS_3B, "fp8", int(6.6e9))
    problems = preflight_problems(dtype="fp8", gpu=A100, requirements=req, workspace=_space("e", 1, 500),
                                  output=_space("e/x", 1, 500))
    assert len(problems) == 1
    assert ">= 8.9" in problems[0] and "8.0" in problems[0] and "--dtype bf16" in problems[0]
    bf16 = estimate_build_requirements(ORPHEUS_3B, "bf16", int(6.6e9))
    assert preflight_problems(dtype="bf16", gpu=A100, requirements=bf16, workspace=_space("e", 1, 500),
                              output=_space("e/x", 1, 500)) == []


def test_preflight_checks_gpu_memory_and_disk() -> None:
    req = estimate_build_requirements(ORPHEUS_3B, "fp8", int(6.6e9))
    busy = GpuInfo("NVIDIA GeForce RTX 4090", (8, 9), free_bytes=3 * GIB, total_bytes=24 * GIB)
    problems = preflight_problems(dtype="fp8", gpu=busy, requirements=req, workspace=_space("e", 1, 5),
                                  output=_space("e/x", 1, 5))
    assert len(problems) == 2
    assert "GPU memory" in problems[0] and "RTX 4090" in problems[0] and "nvidia-smi" in problems[0]
    assert "disk" in problems[1]
    # separate filesystems are checked separately
    split = preflight_problems(dtype="fp8", gpu=H100, requirements=req, workspace=_space("/tmp/w", 1, 500),
                               output=_space("/data/x", 2, 1))
    assert len(split) == 1 and "/data/x" in split[0]


def test_disk_space_of_a_path_not_yet_created(tmp_path: Path) -> None:
    space = disk_space(tmp_path / "a" / "b")
    assert space.free_bytes > 0 and space.path == tmp_path / "a" / "b"
    assert space.device == disk_space(tmp_path).device


# ------------------------------------------------------------------ manifest


def test_manifest_contents_and_round_trip(tmp_path: Path) -> None:
    config = load_config(overrides=["scheduler.max_concurrent_sessions=32", "engine.max_seq_len=4096"])
    settings = BuildSettings.from_config(config, out_dir=str(tmp_path))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    digest = checkpoint_digest(ckpt)
    manifest = build_manifest(settings=settings, tensorrt_llm_version="1.2.0", gpu=H100, dims=ORPHEUS_3B,
                              checkpoint=digest, engine_bytes=4_700_000_000, calibration_prompts=24,
                              created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    assert manifest["tensorrt_llm_version"] == "1.2.0"
    assert manifest["gpu"] == {"name": H100.name, "compute_capability": "9.0", "memory_bytes": 80 * GIB}
    assert manifest["build"]["max_batch_size"] == 32 and manifest["build"]["max_seq_len"] == 4096
    assert manifest["build"]["max_num_tokens"] == 8192
    assert manifest["build"]["calibration"] == {"prompts": 24, "max_seq_length": 512}
    assert manifest["checkpoint"]["sha256"] == digest.sha256
    assert manifest["checkpoint"]["files"] == {"config.json": hashlib.sha256(b"{}").hexdigest()}
    assert manifest["created_at"] == "2026-01-02T03:04:05+00:00"
    assert manifest["model"]["num_kv_heads"] == 8

    write_manifest(tmp_path, manifest)
    again = read_manifest(tmp_path)
    assert again == json.loads(json.dumps(manifest))
    assert engine_mismatch(again, num_slots=32, max_seq_len=4096) is None


def test_main_reports_config_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "config/model_config.yaml", "--set", "scheduler.nope=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config error: scheduler.nope") and err.count("\n") == 1


# --------------------------------------------------------- the build call


def test_build_runtime_claims_a_small_kv_cache_and_saves_before_shutdown(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """The LLM API starts a runtime after building; its KV cache must not take 90% of the GPU (issue: e)."""
    import types

    from orpheus_serve.engines.trtllm_build import BUILD_KV_CACHE_FRACTION, run_build

    calls: list[tuple[str, Any]] = []

    class Recorder:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

    class FakeBuildLLM:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(("init", kwargs))

        def save(self, path: str) -> None:
            calls.append(("save", path))

        def shutdown(self) -> None:
            calls.append(("shutdown", None))

    engine_module = types.ModuleType("tensorrt_llm._tensorrt_engine")
    engine_module.LLM = FakeBuildLLM
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    for name in ("BuildConfig", "CalibConfig", "KvCacheConfig", "QuantConfig"):
        setattr(llmapi, name, type(name, (Recorder,), {}))
    llmapi.QuantAlgo = types.SimpleNamespace(FP8="FP8")
    package = types.ModuleType("tensorrt_llm")
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm._tensorrt_engine", engine_module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)

    config = load_config(overrides=["scheduler.max_concurrent_sessions=32", "engine.max_seq_len=4096"])
    settings = BuildSettings.from_config(config, model_dir=str(tmp_path / "m"), out_dir=str(tmp_path / "e" / "x"),
                                         dtype="fp16")
    run_build(settings, None, 0)

    assert [c[0] for c in calls] == ["init", "save", "shutdown"]
    kv = calls[0][1]["kv_cache_config"].kwargs
    assert kv["free_gpu_memory_fraction"] == BUILD_KV_CACHE_FRACTION <= 0.1
    assert kv["max_tokens"] == 4096  # one sequence, not slots x max_seq_len
    assert calls[1][1] == str(tmp_path / "e" / "x")
