"""Memory planner of the torch engine: what a model and a slot count cost, and whether it fits.

The sizes come from the one memory model, `vram_budget.py` (weights, KV cache per
slot), which the TensorRT-LLM engine and its build use as well; this module adds
what only the torch engine allocates and checks the plan against the device.

Everything the torch engine allocates is known before it loads a byte: the weights
(parameter count x dtype size; with FP8 weights the decoder layers' GEMMs at one byte per
weight plus an fp32 scale per output channel), the KV cache (per slot:
2 x layers x kv_heads x head_dim x max_seq_len x the cache dtype's size: 1 for FP8) and a per-slot presence mask
for the repetition penalty (vocab bytes), plus working memory for one decode step (logits
and sampling buffers for max_batch_size rows). On CUDA with decode graphs it also holds one
scratch cache row that the graphs' padding rows write into, and the graphs' shared memory pool
(the activations of the largest captured decode: max_batch_size rows attending over
max_seq_len). When the SNAC decoder runs on the same GPU, its weights and working memory
(`vram_budget.snac_bytes`, plus `snac_graph_pool_bytes` when the stateful decoder replays CUDA
graphs) are reserved too: it is loaded after the engine, and a plan that
took the whole card would leave it nothing. The engine plans first and refuses, with the
numbers, a configuration that cannot fit, instead of failing half-way through start-up or,
worse, at the first busy moment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from orpheus_serve.engines import vram_budget
from orpheus_serve.engines.fp8 import fp8_weight_bytes
from orpheus_serve.engines.llama import LlamaConfig
from orpheus_serve.scheduler.step import EngineError
from orpheus_serve.shapes import padded_sizes

GiB = 1 << 30
GRAPH_KV_BUCKET = 256  # the smallest KV length a decode graph is captured for
MiB = 1 << 20


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_slot(config: LlamaConfig, max_seq_len: int, dtype: torch.dtype) -> int:
    """The memory model's one formula (vram_budget.kv_bytes_per_slot), for a torch dtype."""
    return vram_budget.kv_bytes_per_slot(config.dims, max_seq_len, dtype_bytes(dtype))


def weights_bytes(config: LlamaConfig, dtype: torch.dtype, quantization: str = "none") -> int:
    """The model's parameters in `dtype`; `quantization: fp8`: the layers' GEMMs as Fp8Linear instead."""
    total = config.num_parameters * dtype_bytes(dtype)
    if quantization == "none":
        return total
    if quantization != "fp8":
        raise EngineError(f"unknown quantization {quantization!r}; expected none or fp8")
    c = config
    gemms = [(c.q_size + 2 * c.kv_size, c.dim), (c.dim, c.q_size), (2 * c.intermediate_size, c.dim),
             (c.dim, c.intermediate_size)]
    high = sum(n * k for n, k in gemms) * dtype_bytes(dtype)
    low = sum(fp8_weight_bytes(n, k) for n, k in gemms)
    return total + c.n_layers * (low - high)


def step_workspace_bytes(config: LlamaConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """Working memory of one decode step, generously: fp32 logits plus the sort, softmax and noise
    buffers of unconstrained sampling (~8 vocab-wide 8-byte rows per batch row), and the keys and
    values a layer gathers for the batch at full length, twice over for attention's own buffers."""
    sampling = 8 * max_batch_size * config.vocab_size * 8
    attention = 2 * 2 * max_batch_size * config.n_kv_heads * config.head_dim * max_seq_len * dtype_bytes(dtype)
    return sampling + attention


def graph_pool_bytes(config: LlamaConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """The decode graphs' shared pool, sized by the largest capture (max_batch_size rows at max_seq_len):
    one layer's live activations at a time (residual, norm, q/k/v, the MLP's gate, up and product), the
    attention scores and probabilities in fp32, the keys and values gathered for the batch, and each
    graph's output rows. Captures run largest first and reuse the pool, so one capture's peak bounds it."""
    rows = max_batch_size
    activations = rows * (6 * config.dim + 3 * config.intermediate_size) * dtype_bytes(dtype)
    scores = 2 * rows * config.n_heads * max_seq_len * 4
    gathered = 2 * rows * config.n_kv_heads * config.head_dim * max_seq_len * dtype_bytes(dtype)
    outputs = len(graph_shapes(max_batch_size, max_seq_len)) * rows * config.dim * dtype_bytes(dtype)
    return activations + scores + gathered + outputs


def graph_shapes(max_batch_size: int, max_seq_len: int) -> list[tuple[int, int]]:
    """The (padded batch, KV length bucket) of every decode graph the torch engine captures."""
    return [(b, k) for b in padded_sizes(max_batch_size) for k in padded_sizes(max_seq_len, GRAPH_KV_BUCKET)]


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device now: CUDA free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes_per_slot: int
    presence_bytes_per_slot: int
    workspace_bytes: int
    num_slots: int
    max_seq_len: int
    budget_bytes: int | None  # None: the device's free memory is unknown, nothing is checked
    scratch_slots: int = 0  # cache rows no session owns (1 with decode graphs: the padding rows' writes)
    graph_pool_bytes: int = 0
    codec_bytes: int = 0  # the SNAC decoder, when it shares the device
    lora_pool_bytes: int = 0  # the LoRA adapter pool (engines/lora.py), when custom voices are on
    kv_dtype: str = ""  # the cache's element type as torch names it (float8_e4m3fn, bfloat16, ...)

    @property
    def fixed_bytes(self) -> int:
        """Everything but the sessions' own slots."""
        return (self.weights_bytes + self.workspace_bytes + self.graph_pool_bytes + self.codec_bytes
                + self.lora_pool_bytes + self.kv_bytes_per_slot * self.scratch_slots)

    @property
    def bytes_per_slot(self) -> int:
        return self.kv_bytes_per_slot + self.presence_bytes_per_slot

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_bytes_per_slot * (self.num_slots + self.scratch_slots)

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.bytes_per_slot * self.num_slots

    @property
    def max_slots(self) -> int | None:
        """Slots that fit in the budget next to everything else."""
        if self.budget_bytes is None:
            return None
        return max(0, (self.budget_bytes - self.fixed_bytes) // self.bytes_per_slot)

    @property
    def fits(self) -> bool:
        return self.max_slots is None or self.num_slots <= self.max_slots

    def describe(self) -> str:
        fit = "unknown free memory" if self.max_slots is None else f"{self.max_slots} fit"
        budget = "" if self.budget_bytes is None else f" of a {self.budget_bytes / GiB:.2f} GiB budget"
        extras = "".join(f" + {name} {size / GiB:.2f} GiB" for name, size in (
            ("graph pool", self.graph_pool_bytes), ("SNAC", self.codec_bytes), ("LoRA pool", self.lora_pool_bytes))
            if size)
        scratch = f" (+{self.scratch_slots} scratch)" if self.scratch_slots else ""
        kv = f"KV cache {self.kv_dtype} " if self.kv_dtype else "KV cache "
        return (f"weights {self.weights_bytes / GiB:.2f} GiB + {kv}{self.kv_bytes_per_slot / MiB:.1f} MiB/slot "
                f"(max_seq_len {self.max_seq_len}) x {self.num_slots} slots{scratch}{extras} = "
                f"{self.total_bytes / GiB:.2f} GiB{budget}; {fit}")

    def check(self) -> None:
        """Raise EngineError, with what would fit, when the plan does not."""
        if self.fits:
            return
        assert self.max_slots is not None and self.budget_bytes is not None
        raise EngineError(
            f"not enough memory: {self.num_slots} slots x max_seq_len {self.max_seq_len} need "
            f"{self.total_bytes / GiB:.2f} GiB (weights {self.weights_bytes / GiB:.2f} GiB, KV cache "
            f"{self.kv_cache_bytes / GiB:.2f} GiB) but the budget is {self.budget_bytes / GiB:.2f} GiB; "
            f"at most {self.max_slots} slots fit: lower scheduler.max_concurrent_sessions or engine.max_seq_len"
        )


def plan_memory(config: LlamaConfig, *, num_slots: int, max_seq_len: int, dtype: torch.dtype,
                max_batch_size: int, budget_bytes: int | None, cuda_graphs: bool = False,
                codec_bytes: int = 0, lora_pool_bytes: int = 0, kv_dtype: torch.dtype | None = None,
                quantization: str = "none") -> MemoryPlan:
    """`cuda_graphs`: the engine captures decode graphs (CUDA only); `codec_bytes`: what the SNAC
    decoder will take on the same device (0 when it runs elsewhere); `kv_dtype`: the cache's dtype
    (default `dtype`); `quantization`: none or fp8 (the layers' GEMM weights)."""
    return MemoryPlan(
        weights_bytes=weights_bytes(config, dtype, quantization),
        kv_bytes_per_slot=kv_bytes_per_slot(config, max_seq_len, kv_dtype or dtype),
        presence_bytes_per_slot=config.vocab_size,
        workspace_bytes=step_workspace_bytes(config, max_batch_size, max_seq_len, dtype),
        num_slots=num_slots,
        max_seq_len=max_seq_len,
        budget_bytes=budget_bytes,
        scratch_slots=1 if cuda_graphs else 0,
        graph_pool_bytes=graph_pool_bytes(config, max_batch_size, max_seq_len, dtype) if cuda_graphs else 0,
        codec_bytes=codec_bytes,
        lora_pool_bytes=lora_pool_bytes,
        kv_dtype=str(kv_dtype or dtype).removeprefix("torch."),
    )
