"""The VRAM budget formulas, and that docs/TENSORRT.md shows exactly what they compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orpheus_serve.engines.vram_budget import (
    GIB,
    ORPHEUS_3B,
    REFERENCE_GPUS,
    LlamaDims,
    kv_bytes_per_slot,
    kv_bytes_per_token,
    plan_vram,
    reference_table,
    supports_fp8,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parents[1]


def test_kv_cache_per_slot_is_the_design_formula() -> None:
    # 2 x layers(28) x kv_heads(8) x head_dim(128) x max_seq_len x 2 bytes
    assert kv_bytes_per_token(ORPHEUS_3B) == 2 * 28 * 8 * 128 * 2 == 114688
    assert kv_bytes_per_slot(ORPHEUS_3B, 4096) == 2 * 28 * 8 * 128 * 4096 * 2 == 448 * 2**20


def test_orpheus_parameter_count() -> None:
    # Llama-3.2-3B is 3.21 B with its 128256-token vocabulary; Orpheus' 156940 tokens add 88 M.
    assert ORPHEUS_3B.total_params == pytest.approx(3.301e9, rel=1e-3)
    per_layer = 2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192
    assert ORPHEUS_3B.layer_matmul_params == per_layer


def test_weight_bytes_by_dtype() -> None:
    fp8 = weight_bytes(ORPHEUS_3B, "fp8")
    bf16 = weight_bytes(ORPHEUS_3B, "bf16")
    assert fp8.embedding == fp8.lm_head == 156940 * 3072 * 2  # kept 16-bit under FP8
    assert bf16.layers - fp8.layers == 28 * ORPHEUS_3B.layer_matmul_params  # one byte per GEMM weight saved
    assert fp8.total == pytest.approx(4.42 * GIB, rel=0.01)
    with pytest.raises(ValueError):
        weight_bytes(ORPHEUS_3B, "int4")  # type: ignore[arg-type]


def test_dims_from_a_hugging_face_config(tiny_orpheus: Path) -> None:
    config = json.loads((tiny_orpheus / "config.json").read_text())
    dims = LlamaDims.from_hf_config(config)
    assert dims.vocab_size == 156940 and dims.tie_word_embeddings
    assert dims.num_kv_heads == config["num_key_value_heads"]
    assert dims.head_dim == config["hidden_size"] // config["num_attention_heads"]
    real = {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 8192, "vocab_size": 156940, "tie_word_embeddings": True}
    assert LlamaDims.from_hf_config(real) == ORPHEUS_3B


def test_budget_arithmetic_and_fit() -> None:
    budget = plan_vram(gpu_name="x", gpu_bytes=24 * GIB, num_slots=32, max_seq_len=4096)
    assert budget.kv_total == 32 * 448 * 2**20
    assert budget.total == budget.weights.total + budget.kv_total + budget.snac + budget.activations + budget.fixed
    assert budget.fits and budget.max_slots >= 32
    small = plan_vram(gpu_name="y", gpu_bytes=12 * GIB, num_slots=32, max_seq_len=4096)
    assert not small.fits and small.max_slots < 32
    assert plan_vram(gpu_name="z", gpu_bytes=4 * GIB).max_slots == 0


def test_fp8_needs_ada_or_hopper() -> None:
    assert supports_fp8((8, 9)) and supports_fp8((9, 0)) and supports_fp8((10, 0))
    assert not supports_fp8((8, 6)) and not supports_fp8((8, 0))
    assert {g.name: g.build_dtype for g in REFERENCE_GPUS}["A100 (80 GB)"] == "bf16"
    assert {g.name: g.build_dtype for g in REFERENCE_GPUS}["H100 (80 GB)"] == "fp8"


def test_docs_table_is_the_computed_one() -> None:
    docs = (ROOT / "docs" / "TENSORRT.md").read_text()
    assert reference_table(num_slots=32, max_seq_len=4096, max_num_tokens=8192) in docs
