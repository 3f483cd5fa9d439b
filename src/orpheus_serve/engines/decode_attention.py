"""Decode attention straight from the slot cache: split-K flash decoding in Triton.

One decode step has B rows, each one new query token of one session, attending over its own
slot of the cache `[num_slots, Hkv, max_seq_len, D]` up to its own length. The SDPA path
(llama.py) gathers every row's slot up to the longest length in the batch and masks; this
kernel reads each row's rows in place instead (ARCHITECTURE §6):

- `_split_kernel`, grid (B, Hkv, num_splits): program (b, h, s) takes slot `slots[b]`, KV head
  h, and the s-th of `num_splits` equal pieces of `[0, lengths[b])` (rounded up to BLOCK_N).
  It loads the G = H / Hkv query heads that share KV head h (GQA: one K/V read serves the
  whole group, padded to BLOCK_G rows for `tl.dot`), streams its piece in BLOCK_N-row blocks
  with an online softmax (running max and sum in fp32, exp2 domain), and writes its
  normalised partial output and log-sum-exp to an fp32 workspace. A piece past the row's
  length writes lse = -inf.
- `_combine_kernel`, grid (B, H): merges the splits' partials, weighting each by
  exp2(lse_s - max lse): the exact softmax over the whole row.

Capture-safe for CUDA graphs: slots and lengths are device tensors read inside the kernels,
nothing is synchronised with the host, and every shape (grid, workspace) depends only on B,
the head counts, D and `num_splits`, which `choose_num_splits` derives from the batch, the
heads and max_seq_len, never from the lengths. So one graph per padded batch size serves every
context length.

FP8 (e4m3) caches hold `x / scale` with one static scale per (layer, KV head) (see `fp8.py`).
A per-head scale is constant along the row, so the kernel never multiplies it into the cache
values: K's scale joins the softmax scale of the scores, V's multiplies the partial output
once.

Precision: loads are converted to fp32 (exact from e4m3, bf16 and fp16) and both products run
as fp32 tensor-core dots: IEEE for an fp32 model, TF32 otherwise. TF32 keeps 11 significant
bits, so bf16/fp16/fp8 operands pass unrounded and only the probabilities of the P.V product
are rounded (to 2^-11, finer than the bf16 rounding of P in the usual flash kernels). The
kernel is memory-bound, so TF32's lower throughput against bf16 costs nothing measurable;
it also keeps the kernel off bf16 dots, which Triton's CPU interpreter computes wrongly.

New K/V are written by `KVCache.write` (llama.py: an index_put scatter, quantising for an FP8
cache) before the kernel runs, so the row attends over its own new token. Under TRITON_INTERPRET=1 (set
before this module is imported) the kernels run on CPU tensors: that is how CI tests them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 32  # cache rows per inner iteration
MIN_DOT = 16  # tl.dot's smallest M, N and K on GPUs
TARGET_PROGRAMS = 1024  # split programs to aim for: several waves on a 132-SM H100
PIPELINE_STAGES = 3  # blocks of K/V in flight in the pipelined loop (decode_attention(pipelined=True))
BLOCK_BYTES = BLOCK_N * 2  # bytes per cache row element-block of the pipelined loop: BLOCK_N rows of 16-bit values


def block_rows(cache_dtype: torch.dtype) -> int:
    """Cache rows per block in the pipelined loop: BLOCK_N for 16-bit caches, twice that for FP8 (the same
    bytes per block; halving the bytes per row then halves the loads, not their size), half for fp32."""
    itemsize = torch.empty((), dtype=cache_dtype).element_size()
    return max(MIN_DOT, BLOCK_BYTES // itemsize)


@triton.jit
def _split_kernel(Q, K, V, Slots, Lengths, KScale, VScale, OutPartial, LsePartial,
                  qk_scale_log2,
                  stride_qb, stride_qh,
                  stride_cs, stride_ch, stride_cn,
                  stride_ob, stride_oh, stride_os,
                  stride_lb, stride_lh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr,
                  PRECISION: tl.constexpr, PIPELINED: tl.constexpr, STAGES: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(Slots + b).to(tl.int64)
    length = tl.load(Lengths + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK) * BLOCK
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    score_scale = qk_scale_log2
    if HAS_SCALE:
        score_scale = score_scale * tl.load(KScale + kv_head)

    base = slot * stride_cs + kv_head * stride_ch
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if PIPELINED:
        # A for loop: Triton's software pipeliner (num_stages) prefetches the next blocks of K and V while this
        # one is computed. It pipelines scf.for loops only, never the while loop below.
        for n0 in tl.range(start, end, BLOCK, num_stages=STAGES):
            m_i, l_i, acc = _attend_block(q, K, V, base, n0, end, offs_n, offs_d, d_mask, stride_cn, score_scale,
                                          m_i, l_i, acc, PRECISION)
    else:
        # A while loop, not range(start, end): Triton's interpreter cannot take a loaded scalar as a range
        # bound under NumPy 2.4 (its __index__ converts a 1-element array), and the kernel must run there in CI.
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_block(q, K, V, base, n0, end, offs_n, offs_d, d_mask, stride_cn, score_scale,
                                          m_i, l_i, acc, PRECISION)
            n0 += BLOCK

    filled = l_i > 0
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    if HAS_SCALE:
        out = out * tl.load(VScale + kv_head)
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    out_ptrs = OutPartial + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LsePartial + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _attend_block(q, K, V, base, n0, end, offs_n, offs_d, d_mask, stride_cn, score_scale, m_i, l_i, acc,
                  PRECISION: tl.constexpr):
    """One BLOCK of cache rows n0.. (those before `end`) folded into the online softmax (m_i, l_i, acc)."""
    n = n0 + offs_n
    n_mask = n < end
    offsets = base + n[:, None].to(tl.int64) * stride_cn + offs_d[None, :]
    load_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + offsets, mask=load_mask, other=0.0).to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale  # [BLOCK_G, BLOCK], log2 units
    scores = tl.where(n_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + offsets, mask=load_mask, other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even. bf16 is rounded by hand: Triton's CPU interpreter truncates
    in its own fp32 -> bf16 cast (GPUs round), which would double the kernel's error there."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _combine_kernel(OutPartial, LsePartial, Out,
                    stride_ob, stride_oh, stride_os,
                    stride_lb, stride_lh,
                    stride_yb, stride_yh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(LsePartial + b * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)  # finite: split 0 always holds the row's first token
    weights = tl.exp2(lse - top)
    partial = tl.load(OutPartial + b * stride_ob + head * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(Out + b * stride_yb + head * stride_yh + offs_d, _round_to(out, Out.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int) -> int:
    """Splits per (row, KV head): enough programs to fill the GPU at small batch, never more splits than
    BLOCK_N blocks in max_seq_len. A power of two that depends only on the shapes (capture-safe)."""
    wanted = max(1, TARGET_PROGRAMS // max(1, batch * kv_heads))
    most = max(1, triton.cdiv(max_seq_len, BLOCK_N))
    return min(triton.next_power_of_2(wanted), triton.next_power_of_2(most) if most > 1 else 1, 64)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, *,
                     sm_scale: float | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     num_splits: int | None = None, pipelined: bool = False) -> Tensor:
    """Attention of one query token per row over its own slot.

    q [B, H, D]; k_cache, v_cache [num_slots, Hkv, max_seq_len, D] (fp32, fp16, bf16 or float8_e4m3fn,
    head_dim contiguous); slots, lengths [B] integer device tensors: row b attends over
    cache[slots[b], :, :lengths[b]] (lengths >= 1). k_scale, v_scale [Hkv] fp32: what an FP8 cache's
    values are multiplied by to dequantise. Returns [B, H, D] in q's dtype.

    `pipelined` (engine.fused; on a GPU only, Triton's interpreter runs the plain loop): the block loop as a
    for loop that Triton software-pipelines (STAGES blocks of K/V in flight), with blocks of
    `block_rows(cache dtype)` rows, so an FP8 cache moves as many bytes per block as a bf16 one.

    Under torch.compile the launch is the opaque custom op `orpheus_serve::decode_attention` (see
    `_decode_attention_op`): the split count is chosen inside it from the concrete batch, so the compiled
    graph never sees it and one graph with a dynamic batch serves every batch size.
    """
    _batch, H, D = q.shape
    _num_slots, Hkv, _max_seq_len, Dc = k_cache.shape
    if Dc != D or v_cache.shape != k_cache.shape or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the caches must share a layout with a contiguous head dimension, and q's last dim too")
    if (k_scale is not None) != (v_scale is not None):
        raise ValueError("k_scale and v_scale come together")
    if k_cache.dtype == torch.float8_e4m3fn and k_scale is None:
        raise ValueError("an FP8 cache needs k_scale and v_scale")
    if torch.compiler.is_compiling():
        return _decode_attention_op(q, k_cache, v_cache, slots, lengths, k_scale, v_scale, sm_scale, num_splits,
                                    pipelined)
    return _launch(q, k_cache, v_cache, slots, lengths, k_scale, v_scale, sm_scale, num_splits, pipelined)


def _launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, k_scale: Tensor | None,
            v_scale: Tensor | None, sm_scale: float | None, num_splits: int | None, pipelined: bool) -> Tensor:
    """The two kernels, on concrete shapes: the split count is a compile-time constant of each (NUM_SPLITS), so
    the combine loop and the split programs' ranges are fixed per (batch, heads, max_seq_len)."""
    B, H, D = q.shape
    _num_slots, Hkv, max_seq_len, _ = k_cache.shape
    has_scale = k_scale is not None
    group = H // Hkv
    splits = num_splits or choose_num_splits(B, Hkv, max_seq_len)
    block_d = max(MIN_DOT, triton.next_power_of_2(D))
    block_g = max(MIN_DOT, triton.next_power_of_2(group))
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out_partial = torch.empty((B, H, splits, D), dtype=torch.float32, device=q.device)
    lse_partial = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
    dummy = lse_partial  # never read when there are no scales
    _split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, slots, lengths,
        k_scale if has_scale else dummy, v_scale if has_scale else dummy,
        out_partial, lse_partial,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1),
        GROUP=group, HEAD_DIM=D, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK=block_rows(k_cache.dtype) if pipelined else BLOCK_N, NUM_SPLITS=splits,
        HAS_SCALE=has_scale, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PIPELINED=pipelined and q.is_cuda, STAGES=PIPELINE_STAGES,
    )
    out = torch.empty_like(q)
    _combine_kernel[(B, H)](
        out_partial, lse_partial, out,
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
    )
    return out


# Registered once per process, on import: a torch.library op is global by nature (its name is the dispatcher's
# key). The schema is written out so that it reads the same on every torch release the project runs on.
@torch.library.custom_op(
    "orpheus_serve::decode_attention", mutates_args=(),
    schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, Tensor? k_scale, "
           "Tensor? v_scale, float? sm_scale, int? num_splits, bool pipelined) -> Tensor")
def _decode_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor,
                         k_scale: Tensor | None, v_scale: Tensor | None, sm_scale: float | None,
                         num_splits: int | None, pipelined: bool) -> Tensor:
    """The compiled decode's boundary around the kernels. Dynamo would otherwise trace `_launch`: the split
    count, a function of the batch size, becomes a guard and a constexpr, and every padded batch size (times
    LoRA on and off) compiles the whole decode pass again, past dynamo's recompile limit of 8. Inside the op
    the batch is concrete; outside, the graph holds one call whose output is shaped like q."""
    return _launch(q, k_cache, v_cache, slots, lengths, k_scale, v_scale, sm_scale, num_splits, pipelined)


@_decode_attention_op.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, k_scale: Tensor | None,
      v_scale: Tensor | None, sm_scale: float | None, num_splits: int | None, pipelined: bool) -> Tensor:
    return torch.empty_like(q)
