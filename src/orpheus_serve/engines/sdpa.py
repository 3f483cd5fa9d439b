"""Which scaled-dot-product-attention kernels the torch engine lets PyTorch choose from on CUDA.

Left to itself, recent PyTorch may pick cuDNN attention for SDPA with an explicit mask (the engine's
decode and prefill always pass one). cuDNN builds an execution plan per new shape, which costs tens to
hundreds of milliseconds on an eager path that sees a new prompt length or KV length every step.
The engine therefore pins the set (`engine.sdpa_backends`, default memory-efficient then math) around
everything it runs on the GPU, and records which of them serves its attention shape
(`TorchEngine.sdpa_backend`), so a benchmark states the kernel it measured. On CPU PyTorch has
one implementation and nothing is pinned (ARCHITECTURE §6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
DEFAULT_SDPA_BACKENDS = ("efficient", "math")


def sdpa_backends(names: Sequence[str]) -> list[SDPBackend]:
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if unknown or not names:
        raise ValueError(f"SDPA backends {list(names)!r}: expected a non-empty list of {sorted(SDPA_BACKENDS)}")
    return [SDPA_BACKENDS[n] for n in names]


@contextlib.contextmanager
def pinned_sdpa(device: torch.device, backends: Sequence[SDPBackend]) -> Iterator[None]:
    """PyTorch may choose only among `backends` inside (CUDA); nothing changes on other devices."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(list(backends)):
        yield


def serving_backend(names: Sequence[str], *, device: torch.device, dtype: torch.dtype, kv_heads: int,
                    query_rows: int, head_dim: int) -> str:
    """Which backend of `names` serves the engine's attention shape (a block of `query_rows` query rows
    per KV head against a masked KV span): each is tried alone, fused kernels first and math, PyTorch's
    fallback, last; the first that runs is the one PyTorch's dispatcher takes among the allowed set.
    "cpu" on a CPU."""
    if device.type != "cuda":
        return "cpu"
    priority = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH]
    allowed = sdpa_backends(names)
    kv_len = 300  # not a multiple of 8 or a power of two: the awkward case decode meets every step
    q = torch.zeros(2, kv_heads, query_rows, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(2, kv_heads, kv_len, head_dim, device=device, dtype=dtype)
    mask = torch.ones(2, 1, query_rows, kv_len, device=device, dtype=torch.bool)
    by_backend = {b: n for n, b in SDPA_BACKENDS.items()}
    for backend in (b for b in priority if b in allowed):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
        except RuntimeError:  # "No available kernel": this backend does not take the shape; try the next
            continue
        return by_backend[backend]
    raise RuntimeError(f"none of the SDPA backends {list(names)} runs the engine's attention shape on {device}")
