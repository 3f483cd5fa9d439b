"""TensorRT-LLM on a real GPU: build engines from the tiny checkpoint and stream through TrtLlmEngine.

Skipped unless TensorRT-LLM 1.2.x and a CUDA GPU are present (conftest). Run in
TensorRT-LLM's environment: `python -m pytest -q -m tensorrt tests/test_trtllm_gpu.py`.
The tiny random-weight model has the real vocabulary, so the frame-position
logits processor is the only thing that makes its output parse as audio frames.
It is the `tiny-trt` preset: head size 64, since TensorRT-LLM's attention
plugin accepts head sizes 32..256 only (the suite's usual tiny model has 16).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from orpheus_serve.config import DEFAULT_CONFIG_PATH, load_config
from orpheus_serve.engines.trtllm_build import main as build_main
from orpheus_serve.engines.trtllm_engine import TrtLlmEngine
from orpheus_serve.engines.vram_budget import supports_fp8
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.token_format import FrameParser, build_prompt_ids
from orpheus_serve.weights.tiny import write_tiny_models

TRT_PRESET = "tiny-trt"

pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu, pytest.mark.slow]

SIZES = [
    "scheduler.max_concurrent_sessions=4",
    "scheduler.max_batch_size=4",
    "engine.max_seq_len=256",
    "engine.tensorrt.max_num_tokens=512",
]


def _build(tiny_orpheus: Path, out: Path, dtype: str) -> None:
    args = ["--config", str(DEFAULT_CONFIG_PATH), "--model", str(tiny_orpheus), "--out", str(out), "--dtype", dtype]
    for item in SIZES:
        args += ["--set", item]
    assert build_main(args) == 0


@pytest.fixture(scope="module")
def tiny_orpheus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a head size TensorRT-LLM accepts (overrides the suite's head-size-16 one)."""
    return write_tiny_models(tmp_path_factory.mktemp("models"), preset=TRT_PRESET, snac=False)


@pytest.fixture(scope="module")
def fp16_engine_dir(tiny_orpheus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "tiny-fp16"
    _build(tiny_orpheus, out, "fp16")
    return out


@pytest.fixture
def engine(fp16_engine_dir: Path) -> Iterator[TrtLlmEngine]:
    config = load_config(overrides=[*SIZES, "engine.backend=tensorrt", f"engine.tensorrt.engine_dir={fp16_engine_dir}"])
    engine = TrtLlmEngine.from_config(config)
    yield engine
    engine.close()


def _prompt(tiny_orpheus: Path, text: str) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_orpheus / "tokenizer.json"))
    return tuple(build_prompt_ids(tokenizer, "tara", text))


def _drain(engine: TrtLlmEngine, slots: set[int], max_steps: int = 2000) -> tuple[dict[int, list[int]], dict, dict]:
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    failed: dict[int, str] = {}
    for _ in range(max_steps):
        out = engine.step(StepPlan())
        for slot, ids in out.tokens.items():
            tokens.setdefault(slot, []).extend(ids)
        finished.update(out.finished)
        failed.update(out.failed)
        if slots <= finished.keys() | failed.keys():
            return tokens, finished, failed
    raise AssertionError(f"sessions {slots} did not end: {finished=} {failed=}")


def test_manifest_records_the_build(fp16_engine_dir: Path, tiny_orpheus: Path) -> None:
    manifest = json.loads((fp16_engine_dir / "manifest.json").read_text())
    assert manifest["tensorrt_llm_version"].startswith("1.2")
    assert manifest["build"]["dtype"] == "fp16" and manifest["build"]["max_batch_size"] == 4
    assert manifest["engine_bytes"] > 0
    assert set(manifest["checkpoint"]["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_streams_constrained_audio_frames_and_cancels(engine: TrtLlmEngine, tiny_orpheus: Path) -> None:
    sampling = SamplingParams(max_tokens=49, seed=1)
    plan = StepPlan(prefill=[
        PrefillChunk(slot=s, request_id=f"r{s}", prompt_ids=_prompt(tiny_orpheus, f"Sentence number {s}."),
                     start=0, end=len(_prompt(tiny_orpheus, f"Sentence number {s}.")), sampling=sampling,
                     priority=0.9)
        for s in (0, 1, 2)
    ])
    first = engine.step(plan)
    assert first.failed == {}
    tokens, finished, failed = _drain_with_cancel(engine, cancel_slot=2)
    assert failed == {}
    for slot in (0, 1):
        assert finished[slot] in ("stop", "length")
        parser = FrameParser()
        parser.feed_many(tokens[slot])  # every token inside its slot's range: the constraint held
        assert parser.position >= 7
    assert 2 not in finished


def _drain_with_cancel(engine: TrtLlmEngine, cancel_slot: int) -> tuple[dict[int, list[int]], dict, dict]:
    tokens: dict[int, list[int]] = {}
    while len(tokens.get(cancel_slot, [])) < 3:
        out = engine.step(StepPlan())
        for slot, ids in out.tokens.items():
            tokens.setdefault(slot, []).extend(ids)
    engine.step(StepPlan(release=[cancel_slot]))
    rest, finished, failed = _drain(engine, {0, 1})
    for slot, ids in rest.items():
        tokens.setdefault(slot, []).extend(ids)
    return tokens, finished, failed


def test_fp8_build(tiny_orpheus: Path, tmp_path: Path) -> None:
    import torch

    if not supports_fp8(torch.cuda.get_device_capability()):
        pytest.skip("FP8 needs compute capability >= 8.9")
    out = tmp_path / "tiny-fp8"
    _build(tiny_orpheus, out, "fp8")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["build"]["quant_algo"] == "FP8" and manifest["build"]["kv_cache_quant_algo"] is None
    assert manifest["build"]["calibration"]["prompts"] >= 16
