"""GPU memory budget of one Orpheus server process: weights, KV cache, codec, runtime.

Pure arithmetic on model dimensions, no torch and no GPU. `build_engine.py`
checks free GPU memory against it before a build, the TensorRT-LLM engine
reports it in `memory_report()`, and the table in `docs/TENSORRT.md` is
printed by `python -m orpheus_serve.engines.vram_budget`; a test checks that
the documented table is exactly what this code prints, so the two cannot drift.

The parts:

- weights: the 28 decoder layers at the build dtype (FP8: one byte per weight;
  the per-tensor scales are negligible). TensorRT-LLM keeps the token embedding
  and the output projection (lm_head) in 16 bit under FP8 (ModelOpt's FP8
  config excludes `*lm_head*`, and the embedding is a lookup, not a GEMM), and
  the engine stores lm_head as its own tensor even where the checkpoint ties it
  to the embedding, so both are counted. With Orpheus' 156,940-token vocabulary
  they are 0.96 GB each: the "3.2 B params x 1 byte" shorthand undercounts.
- KV cache per slot: 2 (K and V) x layers x kv_heads x head_dim x max_seq_len
  x 2 bytes (FP16 KV; ARCHITECTURE §6 keeps the cache unquantised).
- codec: SNAC weights in FP16 (19.8 M parameters, ARCHITECTURE §4) plus the
  activations of one batched decode (estimate: 3 live tensors of the last,
  64-channel stage at 24 kHz for every window in the batch).
- runtime activations (estimate): one context pass of `max_num_tokens` tokens
  through the widest projections (QKV, attention out, gate+up) in FP16, plus the
  FP32 logits of a full batch.
- fixed: CUDA context, cuBLAS and TensorRT workspaces (1 GiB, an estimate).

The estimates are sized from the shapes above, not measured; the table says so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

GIB = 1024**3
WeightDtype = Literal["fp8", "fp16", "bf16"]
BYTES_PER_WEIGHT: dict[str, float] = {"fp8": 1.0, "fp16": 2.0, "bf16": 2.0}
KV_BYTES_PER_ELEMENT = 2  # FP16 KV cache
SNAC_PARAMS = 19_800_000  # ARCHITECTURE §4
SNAC_LAST_STAGE_CHANNELS = 64  # decoder_dim 1024 halved at each of the 4 upsampling stages
SNAC_SAMPLES_PER_FRAME = 2048
SNAC_LIVE_TENSORS = 3
FIXED_RUNTIME_BYTES = 1 * GIB  # CUDA context + cuBLAS/TensorRT workspaces (estimate)


@dataclass(frozen=True, slots=True)
class LlamaDims:
    """The shapes of a Llama-architecture decoder that decide its memory."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaDims:
        """From a Hugging Face `config.json` of a Llama model."""
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def as_dict(self) -> dict[str, int | bool]:
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the GEMMs of one decoder layer (what FP8 quantises)."""
        q_and_o = 2 * self.hidden_size * self.num_attention_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + mlp

    @property
    def layer_norm_params(self) -> int:
        return 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Unique parameters of the checkpoint (a tied lm_head counted once)."""
        layers = self.num_layers * (self.layer_matmul_params + self.layer_norm_params)
        heads = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return layers + heads + self.hidden_size  # + final norm


# Llama-3.2-3B as fine-tuned into Orpheus (canopylabs/orpheus-3b-0.1-ft config.json).
ORPHEUS_3B = LlamaDims(
    hidden_size=3072,
    num_layers=28,
    num_attention_heads=24,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=8192,
    vocab_size=156940,
    tie_word_embeddings=True,
)


@dataclass(frozen=True, slots=True)
class WeightBytes:
    layers: int
    embedding: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.lm_head


def weight_bytes(dims: LlamaDims, dtype: WeightDtype) -> WeightBytes:
    """Bytes of the engine's weights for a build dtype (see the module docstring)."""
    if dtype not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown weight dtype {dtype!r}; expected one of {sorted(BYTES_PER_WEIGHT)}")
    matmul = int(dims.num_layers * dims.layer_matmul_params * BYTES_PER_WEIGHT[dtype])
    norms = (dims.num_layers * dims.layer_norm_params + dims.hidden_size) * 2
    embedding = dims.embedding_params * 2
    return WeightBytes(layers=matmul + norms, embedding=embedding, lm_head=embedding)


def kv_bytes_per_token(dims: LlamaDims, bytes_per_element: int = KV_BYTES_PER_ELEMENT) -> int:
    return 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * bytes_per_element


def kv_bytes_per_slot(dims: LlamaDims, max_seq_len: int, bytes_per_element: int = KV_BYTES_PER_ELEMENT) -> int:
    """2 x layers x kv_heads x head_dim x max_seq_len x bytes: one session's full-length cache."""
    return kv_bytes_per_token(dims, bytes_per_element) * max_seq_len


def snac_bytes(batch_windows: int, window_frames: int) -> int:
    """SNAC FP16 weights + activations of one batched decode (estimate)."""
    weights = SNAC_PARAMS * 2
    samples = batch_windows * window_frames * SNAC_SAMPLES_PER_FRAME
    activations = samples * SNAC_LAST_STAGE_CHANNELS * SNAC_LIVE_TENSORS * 2
    return weights + activations


SNAC_STATE_PER_SESSION = 119_232  # elements of the stateful decoder's per-session layer state (codec/stateful.py)
SNAC_GRAPH_STEP_FRAMES = 4  # the widest step the stateful decoder's CUDA graphs capture (step_frames 1, 2, 4)


def snac_graph_pool_bytes(max_batch: int) -> int:
    """FP16 memory the stateful decoder's CUDA graphs hold beyond `snac_bytes` (estimate): the shared pool, sized
    by the widest capture (max_batch rows of 4 frames: captures run largest first and reuse the pool), each
    graph's output (buckets 1, 2, 4, ... max_batch sum to under 2·max_batch rows; frames 1 + 2 + 4; with and
    without edge masks), and the fixed state buffer a step gathers into."""
    activations = max_batch * SNAC_GRAPH_STEP_FRAMES * SNAC_SAMPLES_PER_FRAME * SNAC_LAST_STAGE_CHANNELS \
        * SNAC_LIVE_TENSORS * 2
    outputs = 2 * (2 * max_batch) * (1 + 2 + 4) * SNAC_SAMPLES_PER_FRAME * 2
    state = (max_batch + 1) * SNAC_STATE_PER_SESSION * 2
    return activations + outputs + state


def runtime_activation_bytes(dims: LlamaDims, max_num_tokens: int, max_batch_size: int) -> int:
    """One context pass of max_num_tokens in FP16 + FP32 logits of a full batch (estimate)."""
    widest = 4 * dims.hidden_size + 2 * dims.intermediate_size
    return max_num_tokens * widest * 2 + max_batch_size * dims.vocab_size * 4


@dataclass(frozen=True, slots=True)
class VramBudget:
    gpu_name: str
    gpu_bytes: int
    dtype: WeightDtype
    weights: WeightBytes
    kv_per_slot: int
    num_slots: int
    snac: int
    activations: int
    fixed: int

    @property
    def kv_total(self) -> int:
        return self.kv_per_slot * self.num_slots

    @property
    def total(self) -> int:
        return self.weights.total + self.kv_total + self.snac + self.activations + self.fixed

    @property
    def headroom(self) -> int:
        return self.gpu_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def max_slots(self) -> int:
        """Sessions at full max_seq_len that fit beside everything else."""
        rest = self.gpu_bytes - (self.weights.total + self.snac + self.activations + self.fixed)
        return max(0, rest // self.kv_per_slot)


def plan_vram(
    *,
    gpu_name: str,
    gpu_bytes: int,
    dims: LlamaDims = ORPHEUS_3B,
    dtype: WeightDtype = "fp8",
    num_slots: int = 32,
    max_seq_len: int = 4096,
    max_num_tokens: int = 8192,
    codec_batch_windows: int = 64,
    codec_window_frames: int = 6,
) -> VramBudget:
    return VramBudget(
        gpu_name=gpu_name,
        gpu_bytes=gpu_bytes,
        dtype=dtype,
        weights=weight_bytes(dims, dtype),
        kv_per_slot=kv_bytes_per_slot(dims, max_seq_len),
        num_slots=num_slots,
        snac=snac_bytes(codec_batch_windows, codec_window_frames),
        activations=runtime_activation_bytes(dims, max_num_tokens, num_slots),
        fixed=FIXED_RUNTIME_BYTES,
    )


# FP8 tensor cores arrive with Ada (8.9) and Hopper (9.0); Ampere (A100, 8.0) has none.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def supports_fp8(compute_capability: tuple[int, int]) -> bool:
    return tuple(compute_capability) >= FP8_MIN_COMPUTE_CAPABILITY


@dataclass(frozen=True, slots=True)
class ReferenceGpu:
    name: str
    memory_bytes: int  # nominal; the driver reserves a little of it
    compute_capability: tuple[int, int]

    @property
    def build_dtype(self) -> WeightDtype:
        """What build_engine.py builds for it: FP8 where the GPU has FP8 tensor cores, else BF16."""
        return "fp8" if supports_fp8(self.compute_capability) else "bf16"


REFERENCE_GPUS: tuple[ReferenceGpu, ...] = (
    ReferenceGpu("RTX 4090 (24 GB)", 24 * GIB, (8, 9)),
    ReferenceGpu("A100 (40 GB)", 40 * GIB, (8, 0)),
    ReferenceGpu("A100 (80 GB)", 80 * GIB, (8, 0)),
    ReferenceGpu("H100 (80 GB)", 80 * GIB, (9, 0)),
)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def budget_table_markdown(budgets: Sequence[VramBudget]) -> str:
    """The VRAM table of docs/TENSORRT.md, in GiB."""
    lines = [
        "| GPU | memory | weights | KV / slot | KV x slots | SNAC | activations | fixed | total | headroom | slots that fit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in budgets:
        lines.append(
            f"| {b.gpu_name} | {_gib(b.gpu_bytes)} | {_gib(b.weights.total)} {b.dtype.upper()} | {_gib(b.kv_per_slot)} | "
            f"{_gib(b.kv_total)} ({b.num_slots}) | {_gib(b.snac)} | {_gib(b.activations)} | {_gib(b.fixed)} | "
            f"{_gib(b.total)} | {_gib(b.headroom)} | {b.max_slots} |"
        )
    return "\n".join(lines)


def reference_table(*, num_slots: int = 32, max_seq_len: int = 4096, max_num_tokens: int = 8192) -> str:
    """The docs table: each reference GPU with the dtype build_engine.py would build for it."""
    return budget_table_markdown(
        [
            plan_vram(
                gpu_name=gpu.name,
                gpu_bytes=gpu.memory_bytes,
                dtype=gpu.build_dtype,
                num_slots=num_slots,
                max_seq_len=max_seq_len,
                max_num_tokens=max_num_tokens,
            )
            for gpu in REFERENCE_GPUS
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the VRAM budget table (GiB) for Orpheus 3B on reference GPUs.")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    print(reference_table(num_slots=args.slots, max_seq_len=args.max_seq_len, max_num_tokens=args.max_num_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
