"""Decode a window of frames, computing only the samples that are kept (and what they depend on).

A windowed decoder keeps the middle of each window; the context frames on
either side are there only because the kept samples depend on them. SNAC's
decoder is a chain of layers whose rate grows from 4 latent steps per frame to
2048 samples per frame, and its cost grows with the rate: the first two
latent convs are ~1% of it, the four upsampling blocks ~16%, ~33%, ~33% and
~17% (multiply-adds per frame, `LayerPlan.macs_per_frame`). A kept sample at the output depends on
a bounded span of each layer's input, and that span shrinks, in frames, the
later the layer. So before each top-level layer the activations are cropped,
per window, to the kept range plus the receptive field of the layers still to
come. Every layer is translation-equivariant (stride-1 'same' convs, and
transposed convs whose output shifts by exactly their stride), so a crop only
moves the origin; the zero padding a later conv applies at a crop edge lies
outside the receptive field of every kept sample, so the kept samples are
those of the full window decode (up to float rounding). Where a crop would
reach past the window, it stops at the window's edge, which is exactly where
the full decode pads too.

The effect: context frames cost almost nothing past the first layers, a
window [L | n | R] with L, R >= 2 costs about n + 0.8 frames of full-rate
compute instead of L + n + R, and longer context is nearly free (docs/CODEC.md has the numbers).

Receptive fields and costs are derived from the loaded modules (conv kernels,
dilations, paddings, strides); an unknown layer type raises rather than being
guessed at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d

from ..token_format import SAMPLES_PER_FRAME
from .loader import frames_to_codes

_POINTWISE = (Snake1d, torch.nn.Tanh, torch.nn.Identity)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "_orig_mod", module)  # torch.compile wrapper -> the module itself


def _reach(module: torch.nn.Module, margin_out: int) -> int:
    """Margin (in input samples, each side) of `module`'s input that `margin_out` output samples need."""
    module = _unwrap(module)
    if isinstance(module, torch.nn.ConvTranspose1d):
        (stride,), (kernel,), (padding,) = module.stride, module.kernel_size, module.padding
        # Output u takes inputs i with 0 <= u + padding - i*stride < kernel. Kept ranges start and
        # end on multiples of the stride (frame boundaries), so `margin_out` outputs before the range
        # reach floor((margin + kernel - 1 - padding) / stride) inputs back, and after it
        # floor((margin - 1 + padding) / stride) + 1 inputs on.
        before = (margin_out + kernel - 1 - padding) // stride
        after = (margin_out - 1 + padding) // stride + 1
        return max(before, after, 0)
    if isinstance(module, torch.nn.Conv1d):
        (stride,), (kernel,), (dilation,) = module.stride, module.kernel_size, module.dilation
        (padding,) = module.padding if isinstance(module.padding, tuple) else (0,)
        if stride != 1 or isinstance(module.padding, str):
            raise ValueError(f"cannot crop through {module}: only stride-1 convs with numeric padding")
        return margin_out + max(padding, (kernel - 1) * dilation - padding)
    if isinstance(module, ResidualUnit | DecoderBlock):
        return _reach(module.block, margin_out)  # a residual's skip path is pointwise
    if isinstance(module, torch.nn.Sequential):
        for child in reversed(module):
            margin_out = _reach(child, margin_out)
        return margin_out
    if isinstance(module, (*_POINTWISE, NoiseBlock)):  # noise: x + randn * (1x1 conv of x), on or off
        return margin_out
    raise ValueError(f"cannot derive the receptive field of {type(module).__name__}")


def _upsampling(module: torch.nn.Module) -> int:
    module = _unwrap(module)
    if isinstance(module, torch.nn.ConvTranspose1d):
        return module.stride[0]
    return math.prod(_upsampling(c) for c in module.children()) if any(True for _ in module.children()) else 1


def _macs(module: torch.nn.Module, rate: int) -> tuple[float, int]:
    """(multiply-adds per frame, output rate) of `module` fed at `rate` samples per frame."""
    module = _unwrap(module)
    if isinstance(module, torch.nn.ConvTranspose1d):
        (kernel,) = module.kernel_size
        per_input = module.in_channels * module.out_channels // module.groups * kernel
        return float(per_input * rate), rate * module.stride[0]
    if isinstance(module, torch.nn.Conv1d):
        (kernel,) = module.kernel_size
        return float(module.out_channels * module.in_channels // module.groups * kernel * rate), rate
    total = 0.0
    for child in module.children():
        macs, rate = _macs(child, rate)
        total += macs
    return total, rate


@dataclass(frozen=True, slots=True)
class LayerPlan:
    layer: torch.nn.Module
    rate: int  # input samples per frame
    upsampling: int  # output rate / input rate
    margin: int  # input samples needed on each side of the kept range by this and all later layers
    macs_per_frame: float  # this layer's compute for one frame of audio


class CroppedDecoder:
    """SNAC decode of windows that computes only each window's kept frames (see module doc)."""

    def __init__(self, model: SNAC) -> None:
        self.model = model
        layers = list(_unwrap(model.decoder).model)
        latent_rate = SAMPLES_PER_FRAME // math.prod(_upsampling(layer) for layer in layers)
        rates = [latent_rate]
        for layer in layers:
            rates.append(rates[-1] * _upsampling(layer))
        if rates[-1] != SAMPLES_PER_FRAME:
            raise ValueError(f"decoder does not produce {SAMPLES_PER_FRAME} samples per frame")
        margins = [0] * (len(layers) + 1)
        for i in range(len(layers) - 1, -1, -1):
            margins[i] = _reach(layers[i], margins[i + 1])
        self.layers = [
            LayerPlan(layer, rates[i], rates[i + 1] // rates[i], margins[i], _macs(layer, rates[i])[0])
            for i, layer in enumerate(layers)
        ]
        total = sum(p.macs_per_frame for p in self.layers)
        self._shares = [p.macs_per_frame / total for p in self.layers]

    def cost_frames(self, length: int, keep: int) -> float:
        """Relative cost of one window of `length` frames keeping `keep`, in full-decode frames."""
        return sum(
            share * min(length, keep + 2 * p.margin / p.rate) for share, p in zip(self._shares, self.layers, strict=True)
        )

    @torch.inference_mode()
    def decode(
        self, frames: torch.Tensor, keep_start: torch.Tensor, keep_start_host: np.ndarray, keep: int
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Decode windows [B, T, 7] (int64, on the model's device) of which row b keeps frames from
        keep_start[b] (given on the device and on the host, [B] int64), `keep` frames at most.

        Returns (audio [B, W], origin [B] on the host): row b's sample at window position x
        (frame * 2048 + offset) is audio[b, x - origin[b]], for every x in its kept range.
        Crop positions are computed on both sides so the host never waits for the device."""
        batch, length, _ = frames.shape
        h = self.model.quantizer.from_codes(frames_to_codes(frames))  # [B, C, T * latent_rate]
        # Window position of each row's h[:, :, 0], tracked identically on host and device.
        origin_host = np.zeros(batch, dtype=np.int64)
        origin = torch.zeros(batch, dtype=torch.int64, device=frames.device)
        for p in self.layers:
            full = length * p.rate
            width = min(full, keep * p.rate + 2 * p.margin)
            if width < h.shape[-1]:
                start_host = np.clip(keep_start_host * p.rate - p.margin, 0, full - width)
                start = (keep_start * p.rate - p.margin).clamp(min=0, max=full - width)  # [B]
                shift = start_host - origin_host
                if (shift == shift[0]).all():  # the same crop for every row: a view
                    h = h[:, :, int(shift[0]) : int(shift[0]) + width]
                else:
                    index = (start - origin)[:, None, None] + torch.arange(width, device=h.device)  # [B, 1, W]
                    h = torch.gather(h, 2, index.expand(-1, h.shape[1], -1))
                origin_host, origin = start_host, start
            h = p.layer(h)  # [B, C', width * upsampling]
            origin_host, origin = origin_host * p.upsampling, origin * p.upsampling
        return h[:, 0, :], origin_host
