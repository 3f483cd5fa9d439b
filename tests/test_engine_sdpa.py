"""The torch engine's attention kernels (engines/sdpa.py) and weights shared between engines run one
after another (the engine benchmark's one load): tiny random-weight models on the CPU, and on CUDA
where there is one."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch

from orpheus_serve import token_format as P
from orpheus_serve.config import EngineConfig
from orpheus_serve.engines.llama import load_transformer
from orpheus_serve.engines.sdpa import pinned_sdpa, sdpa_backends, serving_backend
from orpheus_serve.engines.torch_engine import TorchEngine, resolved_device, same_device
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = (P.START_OF_HUMAN, P.BOS, *range(1000, 1020), *P.PROMPT_SUFFIX)


def tokens_of(engine: TorchEngine, steps: int = 12) -> list[int]:
    """One seeded session's first `steps` decoded tokens."""
    engine.step(StepPlan(prefill=[PrefillChunk(0, "s", PROMPT, 0, len(PROMPT), SamplingParams(seed=7))]))
    out = []
    for _ in range(steps):
        step = engine.step(StepPlan(decode=[0]))
        assert not step.failed
        out += step.tokens[0]
    return out


def test_backend_names_are_checked() -> None:
    assert len(sdpa_backends(["efficient", "math"])) == 2
    for bad in (["efficient", "fastest"], []):
        with pytest.raises(ValueError, match="SDPA backends"):
            sdpa_backends(bad)
    assert EngineConfig().sdpa_backends == ["efficient", "math"]
    with pytest.raises(pydantic.ValidationError):
        EngineConfig(sdpa_backends=["fastest"])
    with pytest.raises(pydantic.ValidationError):
        EngineConfig(sdpa_backends=[])


def test_on_a_cpu_nothing_is_pinned_and_the_engine_says_so(tiny_orpheus: Path) -> None:
    flags = torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    with pinned_sdpa(torch.device("cpu"), sdpa_backends(["math"])):
        assert (torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()) == flags
    engine = TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=128, device="cpu", dtype="fp32", cuda_graphs=False)
    try:
        assert engine.sdpa_backend == "cpu"
    finally:
        engine.close()


def test_engines_sharing_one_load_decode_like_engines_that_load_their_own(tiny_orpheus: Path) -> None:
    def engine(model: torch.nn.Module | None = None) -> TorchEngine:
        return TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=128, device="cpu", dtype="fp32",
                           cuda_graphs=False, model=model)

    own = engine()
    try:
        expected = tokens_of(own)
    finally:
        own.close()
    shared = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
    for _ in range(2):  # one after the other, as the benchmark runs them
        first = engine(shared)
        try:
            assert tokens_of(first) == expected
        finally:
            first.close()
        # The closed engine's KV cache is released, not kept alive by the shared weights.
        assert all(layer.attention.kv_cache is None for layer in shared.layers)
    with pytest.raises(EngineError, match="shared model"):
        TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=128, device="cpu", dtype="bf16", cuda_graphs=False,
                    model=shared)


@pytest.mark.gpu
def test_on_cuda_attention_runs_on_the_pinned_kernels(tiny_orpheus: Path) -> None:
    process_flags = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    engine = TorchEngine(tiny_orpheus, num_slots=4, max_seq_len=512, device="cuda", dtype="bf16", max_batch_size=4)
    try:
        # The default set: memory-efficient attention serves the engine's masked GQA shape on CUDA.
        assert engine.sdpa_backend == "efficient"
        # cuDNN is not among the kernels PyTorch may choose while the engine runs...
        with engine._on_stream():
            assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert len(tokens_of(engine)) == 12
        # ...and the process's own settings are left as they were.
        assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == process_flags
    finally:
        engine.close()
    cfg = engine.config
    assert serving_backend(["math"], device=torch.device("cuda"), dtype=torch.bfloat16, kv_heads=cfg.n_kv_heads,
                           query_rows=cfg.n_heads // cfg.n_kv_heads, head_dim=cfg.head_dim) == "math"


@pytest.mark.gpu
def test_on_cuda_weights_load_straight_to_the_device(tiny_orpheus: Path) -> None:
    model = load_transformer(tiny_orpheus, dtype=torch.bfloat16, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_device_without_an_index_is_the_current_one(tiny_orpheus: Path) -> None:
    """Weights report their device with its index (`cuda:0`), an engine keeps the one it was given (`cuda`):
    the same card. Seen on CPU as `cpu` against `cpu:0`."""
    assert resolved_device(torch.device("cuda"), 0) == torch.device("cuda:0")
    assert resolved_device(torch.device("cuda"), 1) == torch.device("cuda:1")
    assert resolved_device(torch.device("cuda:1"), 0) == torch.device("cuda:1")
    assert same_device(torch.device("cpu"), torch.device("cpu:0"))
    assert not same_device(torch.device("cpu"), torch.device("cuda:0"))
    shared = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
    engine = TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=128, device="cpu:0", dtype="fp32",
                         cuda_graphs=False, model=shared)
    try:
        assert len(tokens_of(engine)) == 12
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_model_on_cuda_0_serves_an_engine_on_cuda(tiny_orpheus: Path) -> None:
    """bench_engine.py's case: weights loaded once on `cuda:0`, engines made on `cuda`."""
    assert same_device(torch.device("cuda"), torch.device(f"cuda:{torch.cuda.current_device()}"))
    shared = load_transformer(tiny_orpheus, dtype=torch.bfloat16, device="cuda:0")
    engine = TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=128, device="cuda", dtype="bf16",
                         cuda_graphs=False, model=shared)
    try:
        assert len(tokens_of(engine)) == 12
    finally:
        engine.close()
