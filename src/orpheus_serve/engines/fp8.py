"""FP8 (e4m3) numerics of the torch engine: the KV cache's per-head scales and FP8 linear layers.

e4m3 (`torch.float8_e4m3fn`): 4 exponent bits, 3 mantissa bits, largest finite value 448,
smallest normal 2^-6, subnormals down to 2^-9. Rounding to nearest gives, for a value x stored
as q = round(x / s) with scale s and |x| <= 448 s,

    |x - s q| <= 2^-4 |x|     (normal range, |x| >= 2^-6 s)
    |x - s q| <= 2^-10 s      (subnormal range)

so |x - s q| <= max(2^-4 |x|, 2^-10 s). Values past 448 s saturate to +-448 s (the cast clamps).

KV cache: one static scale per (layer, KV head), `s = KV_HEADROOM x amax / 448`, where amax is
the largest |k| (or |v|) that head produced over a calibration prompt run in the model's own
precision when the cache is set up (llama.py). The headroom keeps later, larger values out of
saturation; in floating point it costs nothing but moving the subnormal threshold down by the
same factor. A static per-head scale needs no per-token scale storage, so an FP8 slot is exactly
1/4 of an fp32 slot, and the decode kernel folds the scales into the softmax scale and the output
(decode_attention.py). docs/ATTENTION.md has the error bound on attention this implies.

Weights (`engine.quantization: fp8`): the decoder layers' four GEMMs (q|k|v, o, gate|up, down)
hold e4m3 weights with one scale per output channel (amax of the row / 448, quantised at load
from the checkpoint), and quantise their input per token at run time (amax of the token's row /
448); `torch._scaled_mm` multiplies the two and applies both scales in its epilogue. Norms, the
embedding and the LM head (the constrained slice the sampler projects onto) stay in the model
dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_HEADROOM = 4.0  # calibrated amax x this maps to 448
RELATIVE_ERROR = 2.0**-4  # e4m3 rounding, normal range
SUBNORMAL_ERROR = 2.0**-10  # e4m3 rounding below 2^-6, in units of the scale
_TINY = 1e-12


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale rounded to e4m3, saturating at +-448 (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def kv_scales(amax: Tensor) -> Tensor:
    """Per-head scales [Hkv] (fp32) from the calibrated per-head amax [Hkv]."""
    return (amax.float() * KV_HEADROOM / FP8_MAX).clamp(min=_TINY)


def rounding_bound(x: Tensor, scale: Tensor) -> Tensor:
    """Elementwise bound on |x - dequantise(quantise(x))| for |x| <= 448 scale (module docstring)."""
    return torch.maximum(x.abs().float() * RELATIVE_ERROR, SUBNORMAL_ERROR * scale.float().expand_as(x))


class Fp8Linear(nn.Module):
    """`x @ weight.T` with an e4m3 weight (per-output-channel scales) and e4m3 activations (per-token
    scales) through `torch._scaled_mm`. The result is in the input's dtype."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)  # [N]
        self.out_features, self.in_features = w.shape
        self.weight_fp8 = nn.Parameter((w / scale[:, None]).to(FP8_DTYPE), requires_grad=False)  # [N, K]
        self.weight_scale = nn.Parameter(scale.view(1, -1).contiguous(), requires_grad=False)  # [1, N]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear takes bias-free layers (Llama has none)")
        return cls(linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_quantized(x, quantize_rows(x.reshape(-1, self.in_features)))

    def forward_quantized(self, x: Tensor, quantized: tuple[Tensor, Tensor]) -> Tensor:
        """The GEMM on x already quantised per row (`quantize_rows`, or fused.py's norms, which quantise
        their output as they write it): x gives only the shape and dtype of the result."""
        x_fp8, x_scale = quantized  # [M, K] e4m3 row-major, [M, 1] fp32
        # Hopper's FP8 GEMM takes A row-major and B column-major: weight_fp8 [N, K] contiguous, transposed
        # as a view.
        y = scaled_mm_rowwise(x_fp8, self.weight_fp8.t(), x_scale, self.weight_scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def scaled_mm_rowwise(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """a [M, K] e4m3 row-major @ b [K, N] e4m3 column-major, times scale_a [M, 1] and scale_b [1, N]: bf16 on
    CUDA (its row-wise scaled GEMM writes bf16 only), fp32 on a CPU. A CPU's `_scaled_mm` takes per-tensor
    scales only in some torch releases (2.11 among them): there the GEMM runs at unit scales and the row and
    channel scales follow, which is the same product."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    unit = scale_a.new_ones(())
    return torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=torch.float32) * scale_a * scale_b


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows [M, K] -> (e4m3 [M, K], scales [M, 1] fp32): one scale per row, amax / 448."""
    scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=_TINY)  # [M, 1]
    return (rows.float() / scale).to(FP8_DTYPE), scale


def fp8_weight_bytes(out_features: int, in_features: int) -> int:
    """An Fp8Linear's bytes: one per weight plus an fp32 scale per output channel."""
    return out_features * in_features + 4 * out_features
