"""Fused Triton kernels of the decoder layer (`engine.fused`): fewer, larger kernels per step.

Unfused, a layer runs for its norms, residual adds, rotary embedding, cache write and SwiGLU about a
dozen small elementwise kernels besides its GEMMs and attention; at decode batch sizes each is a
launch and a round trip through memory for a few kilobytes. Here (q|k|v and gate|up are single GEMMs
already, llama.py):

- `add_rms_norm(delta, residual, weight)`: residual + delta (the layer's previous sub-block output),
  then RMSNorm of the sum, in one pass; returns the new residual stream and the normalised input of
  the next GEMM. With `fp8=True` it also writes that input quantised to e4m3 with one scale per row
  (amax / 448), the form `Fp8Linear` multiplies, so FP8 GEMMs need no separate quantisation pass.
- `silu_mul(gate_up)`: SiLU(gate) * up from the gate|up GEMM's output, optionally also in e4m3 per row.
- `rope_cache_write(qkv, cos, sin, cache, slots, positions)`: rotary embedding of q and k and the
  write of k and v into the slot cache (quantised for an FP8 cache), straight from the q|k|v GEMM's
  output; returns the rotated q.

Numerics follow the unfused path step by step: fp32 arithmetic, rounding to the model dtype where it
rounds (the residual sum, the normalised value before the norm weight, the rotated q/k, SiLU(gate)),
so the two differ only by the order of the fp32 sum of squares and by fused multiply-adds: the last
bit of an fp32 model, at most one rounding step of a bf16 one (tests/test_fused.py states the tolerance).

Roundings are done by hand before the casts, so the casts are exact on the GPU and in Triton's CPU
interpreter alike: e4m3 by `_round_e4m3` (round to nearest even on the e4m3 grid of the value's binade;
the interpreter's own float-to-e4m3 cast rounds wrongly where the mantissa carries into the exponent),
bf16 by decode_attention's `_round_to` (the interpreter truncates fp32 to bf16).

All three are capture-safe (no host sync; slots and positions are read on the device) and run under
TRITON_INTERPRET=1 on CPU tensors, which is how the tests check them against the unfused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from orpheus_serve.engines.decode_attention import _round_to
from orpheus_serve.engines.fp8 import FP8_DTYPE


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest even on the e4m3 grid: 3 mantissa bits, subnormal step 2^-9."""
    biased = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.maximum(biased, 127 - 6)  # below 2^-6 the grid is the subnormal one, 2^-9
    quantum = ((biased - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
    return ((v / quantum + magic) - magic) * quantum


@triton.jit
def _add_rms_norm_kernel(Delta, Residual, Weight, ResidualOut, Out, OutFp8, OutScale, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(Residual + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(Delta + row * N + offs, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + d, ResidualOut.dtype.element_ty)  # the residual stream, rounded as `x + delta` rounds
        tl.store(ResidualOut + row * N + offs, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / N
    normed = _round_to(x * tl.math.rsqrt(mean_square + eps), Out.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(w * normed, Out.dtype.element_ty)
    tl.store(Out + row * N + offs, y, mask=mask)
    if FP8:
        _store_fp8_row(y.to(tl.float32), mask, OutFp8 + row * N + offs, OutScale + row)


@triton.jit
def _store_fp8_row(y, mask, Dest, Scale):
    """One row quantised to e4m3 with its own scale (amax / 448, at least 1e-12), as fp8.Fp8Linear does."""
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0) / 448.0, 1e-12)
    tl.store(Dest, _round_e4m3(y / scale).to(Dest.dtype.element_ty), mask=mask)
    tl.store(Scale, scale)


@triton.jit
def _silu_mul_kernel(GateUp, Out, OutFp8, OutScale, N: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(GateUp + row * 2 * N + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * 2 * N + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = _round_to(gate / (1.0 + tl.exp(-gate)), Out.dtype.element_ty).to(tl.float32)  # F.silu rounds to the dtype
    y = _round_to(silu * up, Out.dtype.element_ty)
    tl.store(Out + row * N + offs, y, mask=mask)
    if FP8:
        _store_fp8_row(y.to(tl.float32), mask, OutFp8 + row * N + offs, OutScale + row)


@triton.jit
def _rope_cache_write_kernel(QKV, Cos, Sin, QOut, KCache, VCache, Slots, Positions, KScale, VScale,
                             T, stride_qkv_row, stride_cs, stride_ch, stride_cn,
                             H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr):
    """Program (token, head): head < H rotates query head `head` into QOut; head >= H rotates key head
    head - H and writes it and the matching value head into the cache at (slot, head - H, position)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF)
    c = tl.load(Cos + token * HALF + offs)
    s = tl.load(Sin + token * HALF + offs)
    base = QKV + token * stride_qkv_row
    D = 2 * HALF  # the head dim (constexpr, as HALF is)
    if head < H:
        x1 = tl.load(base + head * D + offs).to(tl.float32)
        x2 = tl.load(base + head * D + HALF + offs).to(tl.float32)
        out = QOut + (token * H + head) * D
        tl.store(out + offs, _round_to(x1 * c - x2 * s, QOut.dtype.element_ty))
        tl.store(out + HALF + offs, _round_to(x2 * c + x1 * s, QOut.dtype.element_ty))
    else:
        kv = head - H
        k_base = base + (H + kv) * D
        v_base = base + (H + HKV + kv) * D
        k1 = tl.load(k_base + offs).to(tl.float32)
        k2 = tl.load(k_base + HALF + offs).to(tl.float32)
        # Rounded to the model dtype first, as the unfused path stores the rotated k before caching it.
        r1 = _round_to(k1 * c - k2 * s, QOut.dtype.element_ty).to(tl.float32)
        r2 = _round_to(k2 * c + k1 * s, QOut.dtype.element_ty).to(tl.float32)
        v1 = tl.load(v_base + offs).to(tl.float32)
        v2 = tl.load(v_base + HALF + offs).to(tl.float32)
        slot = tl.load(Slots + token // T).to(tl.int64)  # offsets past 2^31 in a large cache
        position = tl.load(Positions + token).to(tl.int64)
        dest = slot * stride_cs + kv * stride_ch + position * stride_cn
        if SCALED:
            ks = tl.load(KScale + kv)
            vs = tl.load(VScale + kv)
            r1 = _round_e4m3(tl.minimum(tl.maximum(r1 / ks, -448.0), 448.0))
            r2 = _round_e4m3(tl.minimum(tl.maximum(r2 / ks, -448.0), 448.0))
            v1 = _round_e4m3(tl.minimum(tl.maximum(v1 / vs, -448.0), 448.0))
            v2 = _round_e4m3(tl.minimum(tl.maximum(v2 / vs, -448.0), 448.0))
        tl.store(KCache + dest + offs, _round_to(r1, KCache.dtype.element_ty))
        tl.store(KCache + dest + HALF + offs, _round_to(r2, KCache.dtype.element_ty))
        tl.store(VCache + dest + offs, _round_to(v1, VCache.dtype.element_ty))
        tl.store(VCache + dest + HALF + offs, _round_to(v2, VCache.dtype.element_ty))


def _num_warps(block: int) -> int:
    return 8 if block >= 4096 else 4


def add_rms_norm(delta: Tensor | None, residual: Tensor, weight: Tensor, eps: float, *, fp8: bool = False
                 ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """residual, delta [..., N] (delta None: no add) -> (residual + delta, RMSNorm(residual + delta) * weight,
    with fp8: that output in e4m3 [M, N] and its per-row scales [M, 1] fp32, else None)."""
    n = residual.shape[-1]
    rows = residual.numel() // n
    residual = residual.contiguous()
    new_residual = torch.empty_like(residual) if delta is not None else residual
    out = torch.empty_like(residual)
    out_fp8 = torch.empty((rows, n), dtype=FP8_DTYPE, device=residual.device) if fp8 else out
    scale = torch.empty((rows, 1), dtype=torch.float32, device=residual.device) if fp8 else out
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](delta.contiguous() if delta is not None else residual, residual, weight,
                                  new_residual, out, out_fp8, scale, eps, N=n, BLOCK=block,
                                  HAS_DELTA=delta is not None, FP8=fp8, num_warps=_num_warps(block))
    return new_residual, out, (out_fp8, scale) if fp8 else None


def silu_mul(gate_up: Tensor, *, fp8: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """gate_up [..., 2N] (gate | up) -> (SiLU(gate) * up [..., N], with fp8: it in e4m3 [M, N] and per-row scales)."""
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n)
    gate_up = gate_up.contiguous()
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    out_fp8 = torch.empty((rows, n), dtype=FP8_DTYPE, device=gate_up.device) if fp8 else out
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device) if fp8 else out
    block = triton.next_power_of_2(n)
    _silu_mul_kernel[(rows,)](gate_up, out, out_fp8, scale, N=n, BLOCK=block, FP8=fp8, num_warps=_num_warps(block))
    return out, (out_fp8, scale) if fp8 else None


def rope_cache_write(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                     positions: Tensor, *, n_heads: int, n_kv_heads: int, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None) -> Tensor:
    """qkv [B, T, (H + 2 Hkv) D] (the q|k|v GEMM's output), cos, sin [B, T, D/2] fp32, caches
    [slots, Hkv, S, D], slots [B], positions [B, T] -> rotated q [B, T, H, D]; rotated k and v are
    written into the caches at (slots[b], :, positions[b, t]) (divided by the per-head scales and
    rounded to e4m3 for an FP8 cache)."""
    B, T, width = qkv.shape
    D = width // (n_heads + 2 * n_kv_heads)
    qkv = qkv.contiguous()  # token b * T + t starts at row (b * T + t) * width
    q = torch.empty((B, T, n_heads, D), dtype=qkv.dtype, device=qkv.device)
    scaled = k_scale is not None and v_scale is not None
    _rope_cache_write_kernel[(B * T, n_heads + n_kv_heads)](
        qkv, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache, slots, positions.contiguous(),
        k_scale if scaled else cos, v_scale if scaled else cos,
        T, qkv.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=n_heads, HKV=n_kv_heads, HALF=D // 2, SCALED=scaled, num_warps=1)
    return q
