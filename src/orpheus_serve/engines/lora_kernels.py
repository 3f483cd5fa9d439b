"""Segmented batched LoRA: the rows of one forward pass grouped by adapter, two Triton kernels per linear.

Every target linear of a step adds, per row m with pool entry e = entries[m] (0: no adapter),

    y[m, cols of projection s] += (x[m] @ A[e][:, s·R : (s+1)·R]) @ B[e][:, cols of projection s]

with the pool's A [P, in, S·R] and B [P, R, out] (lora.py: S projections fused in the linear, R the
pool's rank, `scale` folded into B, smaller ranks zero-padded). Gathering every row's A and B into
[M, in, S·R] and [M, R, out] copies (the plain torch path, `lora_reference`) costs as much memory
traffic as the adapters times the rows, whether or not rows share an adapter: on an H200 it halved
the decode throughput of a batch of 128. Here, as in Punica's and S-LoRA's SGMV kernels, the rows are
grouped by adapter and each group reads its adapter's weights once:

- `LoraSegments.from_entries` (plain torch ops, on the device, no host sync): the rows sorted by
  entry (`order`), and a fixed list of tiles, each up to BLOCK_M rows of one entry (entry 0 tiles
  do nothing). The number of tiles depends only on the row count and the pool size, so the grid is
  fixed and a CUDA graph captured once serves any mix of adapters.
- `_shrink_kernel`, grid (tiles, splits): xa = x[rows] @ A[e], split along `in` into a few pieces
  written to an fp32 workspace [splits, M, S·R] (no atomics: the same inputs give the same bits).
- `_expand_kernel`, grid (tiles, column blocks of `out`): sums the pieces and, for each projection
  whose columns the block covers, adds xa[:, s·R : (s+1)·R] @ B[e][:, block] to y in place.
  Rows without an adapter are never touched: their output is the base model's, bit for bit.

Precision: loads are converted to fp32 and the products are fp32 dots (IEEE for an fp32 model,
TF32 otherwise: bf16/fp16 operands pass unrounded), accumulating in fp32; y gets one rounding to its
dtype. Triton's CPU interpreter computes bf16 dots wrongly; fp32 dots keep it exact there.

`lora_reference` is the same math in plain torch (a gather of each row's A and B, batched matmuls):
the capture-safe path without Triton, and what the kernels are tested against (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from orpheus_serve.engines.lora_segments import LoraSegments

SHRINK_TILE = 64 * 64  # elements of A per inner iteration of the shrink (BLOCK_K x the padded S*R)
EXPAND_BLOCK_N = 128  # output columns per expand program
MIN_DOT = 16  # tl.dot's smallest N and K on GPUs
MAX_SPLITS = 8  # pieces the shrink splits `in` into: enough programs for a small batch, a short sum


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_segmented(x: Tensor, y: Tensor, a_all: Tensor, b_all: Tensor, segments: LoraSegments,
                   bounds: Tensor, rank: int) -> Tensor:
    """The kernels' version of `lora_reference` (same arguments; `bounds` [S + 1] int32 on the device,
    `segments` from the same entries): adds into y in place and returns it."""
    m, n_in = x.shape
    n_out = y.shape[1]
    width = a_all.shape[2]  # S * R
    num_slices = bounds.shape[0] - 1
    if x.stride(1) != 1 or y.stride(1) != 1 or a_all.stride(2) != 1 or b_all.stride(2) != 1:
        raise ValueError("x, y and the pool tensors need a contiguous last dimension")
    block_n = max(MIN_DOT, triton.next_power_of_2(width))
    block_k = max(MIN_DOT, SHRINK_TILE // block_n)  # an A tile of at most SHRINK_TILE elements in registers
    k_blocks = triton.cdiv(n_in, block_k)
    splits = min(MAX_SPLITS, k_blocks)
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(n_in, k_per_split)
    # Rows of entry 0 are never written here and never read by the expand.
    xa = torch.empty((splits, m, width), dtype=torch.float32, device=x.device)
    precision = _precision(x.dtype)
    tiles = segments.num_tiles
    _shrink_kernel[(tiles, splits)](
        x, a_all, segments.order, segments.tiles, xa, n_in, width,
        x.stride(0), a_all.stride(0), a_all.stride(1), xa.stride(0), xa.stride(1), tiles,
        BLOCK_M=segments.block_m, BLOCK_K=block_k, BLOCK_N=block_n,
        K_PER_SPLIT=k_per_split, PRECISION=precision,
    )
    _expand_kernel[(tiles, triton.cdiv(n_out, EXPAND_BLOCK_N))](
        xa, b_all, segments.order, segments.tiles, y, bounds, n_out, rank,
        xa.stride(0), xa.stride(1), b_all.stride(0), b_all.stride(1), y.stride(0), tiles,
        NUM_SLICES=num_slices, SPLITS=splits, BLOCK_M=segments.block_m,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)), BLOCK_N=EXPAND_BLOCK_N, PRECISION=precision,
    )
    return y


@triton.jit
def _tile_rows(Order, Tiles, tile, num_tiles, BLOCK_M: tl.constexpr):
    """A tile's rows of the input ([BLOCK_M] int64, from the adapter-sorted order) and which of them are real."""
    start = tl.load(Tiles + num_tiles + tile)
    end = tl.load(Tiles + 2 * num_tiles + tile)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(Order + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def _shrink_kernel(X, A, Order, Tiles, XA, n_in, width,
                   stride_xm, stride_ae, stride_ak, stride_xs, stride_xam, num_tiles,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   K_PER_SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    entry = tl.load(Tiles + tile).to(tl.int64)
    if entry == 0:
        return
    rows, m_mask = _tile_rows(Order, Tiles, tile, num_tiles, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = split * K_PER_SPLIT + k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < n_in
        x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        a = tl.load(A + entry * stride_ae + offs_k[:, None] * stride_ak + offs_n[None, :],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    tl.store(XA + split * stride_xs + rows[:, None] * stride_xam + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])

@triton.jit
def _expand_kernel(XA, B, Order, Tiles, Y, Bounds, n_out, rank,
                   stride_xs, stride_xam, stride_be, stride_bk, stride_ym, num_tiles,
                   NUM_SLICES: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    entry = tl.load(Tiles + tile).to(tl.int64)
    if entry == 0:
        return
    rows, m_mask = _tile_rows(Order, Tiles, tile, num_tiles, BLOCK_M)
    first_col = col_block * BLOCK_N
    offs_n = first_col + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b = tl.load(B + entry * stride_be + offs_r[:, None] * stride_bk + offs_n[None, :],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(Bounds + s)
        hi = tl.load(Bounds + s + 1)
        if (first_col < hi) & (first_col + BLOCK_N > lo):  # this block holds columns of projection s
            xa = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for p in tl.static_range(SPLITS):
                xa += tl.load(XA + p * stride_xs + rows[:, None] * stride_xam + (s * rank + offs_r)[None, :],
                              mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            part = tl.dot(xa, b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            in_slice = (offs_n >= lo) & (offs_n < hi)
            acc += tl.where(in_slice[None, :], part, 0.0)
    y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(Y.dtype.element_ty), mask=y_mask)
