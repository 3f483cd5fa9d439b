"""Stateful streaming SNAC decoder: every frame is decoded once, and the audio is exact.

Architecture
------------
SNAC's 24 kHz decoder (no attention) is a chain of layers over time:

    codes ─▶ latent (embedding + 1x1 conv, repeated per codebook stride; 4 samples per frame)
          ─▶ depthwise conv k7 ─▶ 1x1 conv
          ─▶ 4 × DecoderBlock(stride s ∈ 8, 8, 4, 2):
                 Snake ─▶ ConvTranspose(k=2s, stride s, padding ceil(s/2)) ─▶ [Noise]
                 ─▶ 3 × ResidualUnit(x + 1x1(Snake(dilated depthwise conv k7(Snake(x)))), dilation 1, 3, 9)
          ─▶ Snake ─▶ conv k7 ─▶ tanh                       (2048 samples per frame)

Every layer is either pointwise in time (Snake, 1x1 convs, tanh, noise) or a
convolution with a bounded window, so it can run incrementally. Each layer with
a window keeps, per session, just what it still needs:

- a 'same'-padded conv (kernel k, dilation d, padding p = (k-1)d/2) keeps the
  last (k-1)d samples of its input; its output for time t needs input up to
  t + p, so it delays the stream by p samples at its own resolution;
- a transposed conv (stride s, kernel k) keeps the k - s samples of output that
  the next input will still add to (overlap-add tail); the one-shot decode crops
  `padding` samples at its start, so it delays the stream by `padding` output
  samples, and the delay it receives is multiplied by s;
- a residual unit delays its skip path by the delay of its inner conv so the
  two branches stay aligned.

Delays compose into the lookahead: the number of output samples that must
wait for later frames. It is derived from the loaded modules at construction
(never hard-coded). For snac_24khz:

    3·512 (latent conv) + (4 + 39)·64 + (4 + 39)·8 + (2 + 39)·2 + (1 + 39) + 3 = 4757 samples

(39 = 3 + 9 + 27, the residual units' paddings). That is 2.32 frames, so
`lookahead_frames` = 3: a frame's audio is final once 3 more frames are in.
The first samples (1387 of them) come out as soon as 3 frames = 21 tokens are
in, the same first-audio delay as a windowed decoder with 2 frames of
lookahead, and from then on every frame pushed releases exactly 2048 samples.

Edges. The one-shot decode zero-pads the input of every windowed layer at
both ends. Here each session's stream at each layer is shifted by that layer's
delay; samples that lie before time 0 or past the utterance's end are zeroed
right before every windowed layer, which is exactly that zero padding. The
final push runs `lookahead_frames` more frame steps (masked zeros in, real
audio out) to flush the tail, as the one-shot decode ends.

Batching. All per-session state lives in one pool tensor [rows, state_size]
(each layer's slot is a view [rows, C, samples] into it). A forward step takes
the rows of every session that has work, as a [B, state_size] batch (a view
when the rows are contiguous, else gathered and scattered back), and advances
them all by the same number of frames, chosen from a small fixed set
(`step_frames`, default 1, 2, 4). Shapes therefore depend only on (B, frames per
step), which is what CUDA graphs or torch.compile need; sessions join and
leave between steps. Everything runs on the model's device and dtype.

Static steps and CUDA graphs. With `static=True` a step never allocates its
inputs: the rows of a step are padded to a batch bucket (1, 2, 4, ... up to
max_batch, the engine's `padded_sizes` rule), their codes, pool rows and edge
positions go to the device in one copy into a preallocated int64 buffer,
their state is gathered into a preallocated [bucket, state_size] buffer
(padding rows read a pool row that is always zero), the layers run on those
buffers, and only the real rows' state is scattered back. Each (bucket,
frames per step, edge masks or not) shape thus reads and writes fixed
addresses, so with `cuda_graphs=True` (CUDA) the layers of each shape are
captured once at construction, into one shared memory pool, and a step is a
copy, a gather, one replay and a scatter. On a CPU the very same static
path runs eagerly (tests; padding rows cost compute there, so the server
keeps the dynamic path on a CPU).

Frames per step under graphs: one graph per (bucket, frames) for frames in
`step_frames` (1, 2, 4), not one frame per replay. A step's kernel count does
not depend on its frames (a 1-, 2- or 4-frame step dispatches the same ~470
torch operators, as counted with a TorchDispatchMode; `scripts/
bench_codec_stateful.py --passes-only` prints them per pass), and at the small
batches a server runs a step is launch-bound on the GPU (4.4 ms for a pass of
2 frames at batch 1 on an H200, 5.3 ms for 64 frames at batch 32), so four
1-frame replays would cost about four times one 4-frame replay (the kit's
codec stage measures both on a card: `frames_per_replay`). On a CPU, where
compute dominates, the choice matters little and goes either way (host ms per
pass of 4 frames per session, static steps run eagerly, one thread: batch 1,
61 as one 4-frame step against 88 as four 1-frame steps; batch 8, 663 against
557, the narrower steps staying in cache). A 3-frame step is
2 + 1, as on the dynamic path: the step scheduling (`_run`) is shared by both
paths, so both decode the same steps.
Ragged steps (`ragged=True`, the server's choice on CUDA: `codec.ragged_steps`). A call's pushes of
unequal lengths share one step (`base.step_schedule(ragged=True)`): the step takes the smallest size that
holds the longest push, a shorter row gets code-0 padding after its frames, and its per-row advance (a [B]
tensor among the step's inputs, so graphs capture it) says how many frames are real. Every layer is causal
in its stream's own time: its state is the inputs before the step, and output sample t needs inputs up to
t only. So a row's first advance·spf samples at every layer are exactly its real frames' (its audio), and
every history slot, and every residual's pending skip samples, is gathered from the window just before
sample advance·spf instead of taken from its end: the padding reaches neither audio nor state.

Edge masks are a graph variant of their own because they cost a masked copy
of the input of every windowed layer, and only steps that touch an
utterance's first or last frames need them.

Not thread-safe: one codec worker owns an instance.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from snac import SNAC
from snac.attention import LocalMHA
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d
from torch import nn

from orpheus_serve.codec.base import STATEFUL_STEP_FRAMES, CodecPush, CodecResult, step_schedule
from orpheus_serve.codec.transfer import HostTransfer
from orpheus_serve.shapes import padded_sizes
from orpheus_serve.token_format import TOKENS_PER_FRAME, frames_to_snac_codes

from .loader import SeededNoiseBlock, full_fp32_convolutions

# Codebook strides the 7-token Orpheus frame layout is defined for: per frame, 1 + 2 + 4 codes.
_ORPHEUS_VQ_STRIDES = (4, 2, 1)


# ---------------------------------------------------------------------------------------------
# One forward step's view of the per-session state and edge masks.


@dataclass(slots=True)
class _StepContext:
    states: list[torch.Tensor]  # one [B, C, samples] view per state slot, updated in place
    # Per windowed layer: True where the layer's input lies outside the utterance ([B, 1, T]),
    # or None when no row of this step is at an edge.
    outside: list[torch.Tensor] | None
    noise: bool
    generator: torch.Generator | None = None  # the noise's, when seeded
    # Ragged steps: [B] frames each row advances (the rest of its step is padding); None: every row advances
    # the whole step.
    advance: torch.Tensor | None = None

    def zero_outside(self, mask_index: int, x: torch.Tensor) -> torch.Tensor:
        if self.outside is None:
            return x
        return x.masked_fill(self.outside[mask_index], 0.0)

    def window(self, hist: torch.Tensor, x: torch.Tensor, samples_per_frame: int) -> torch.Tensor:
        """[hist, x] along time, and hist <- the samples that precede the next step's input: the input window of
        a conv that needs hist.shape[-1] samples of history. Every layer is causal in the streams' own time
        (module doc), so a row that advances a frames of the step's n has its valid samples first and keeps,
        as history, the window's samples just before its sample a·spf; a full step keeps the last ones."""
        keep = hist.shape[-1]
        if keep == 0:
            return x
        window = torch.cat([hist, x], dim=-1)  # [B, C, keep + T]
        if self.advance is None:
            hist.copy_(window[..., -keep:])
        else:
            start = self.advance * samples_per_frame  # [B]: where each row's next history begins
            index = start[:, None] + torch.arange(keep, device=x.device)  # [B, keep]
            hist.copy_(window.gather(-1, index[:, None, :].expand(-1, window.shape[1], -1)))
        return window


@dataclass(frozen=True, slots=True)
class _EdgeSpec:
    """Where the input stream of one windowed layer stands relative to real time."""

    delay: int  # stream sample index - delay = time of that sample in the one-shot decode
    samples_per_frame: int  # resolution of the stream


class _Op:
    """One decoder layer in streaming form: consumes the new input samples, returns the new output samples."""

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        raise NotImplementedError


@dataclass(eq=False)
class _Snake(_Op):
    alpha: torch.Tensor  # [1, C, 1]
    inv_alpha: torch.Tensor  # [1, C, 1], the same (alpha + 1e-9)^-1 as snac.layers.snake

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        # x + (1/alpha)·sin²(alpha·x) in one buffer: these maps are the widest tensors of the step.
        y = torch.mul(x, self.alpha)
        y.sin_().square_()
        return y.mul_(self.inv_alpha).add_(x)


@dataclass(eq=False)
class _Pointwise(_Op):
    """1x1 conv: no window, no state. A matmul: small 1x1 convs would take a conv path that copies its input."""

    weight: torch.Tensor  # [C_out, C_in]
    bias: torch.Tensor | None  # [C_out, 1]

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        y = torch.matmul(self.weight, x)  # [B, C_out, T]
        return y if self.bias is None else y.add_(self.bias)


@dataclass(eq=False)
class _Tanh(_Op):
    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        return torch.tanh(x)


@dataclass(eq=False)
class _Noise(_Op):
    """snac NoiseBlock: x + N(0, 1)[B, 1, T] * (1x1 conv of x). Pointwise in time, so new samples draw new noise."""

    weight: torch.Tensor  # [C, C, 1]

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        if not ctx.noise:
            return x
        noise = torch.randn((x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype, generator=ctx.generator)
        return x + noise * F.conv1d(x, self.weight)


@dataclass(eq=False)
class _Conv(_Op):
    """'Same'-padded conv, stride 1: keeps the last (k-1)·d input samples; delays the stream by (k-1)·d/2."""

    weight: torch.Tensor  # [C_out, C_in / groups, k]
    bias: torch.Tensor | None
    dilation: int
    groups: int
    state_index: int  # [B, C_in, (k - 1) * dilation]
    mask_index: int
    samples_per_frame: int  # of its input stream

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        x = ctx.zero_outside(self.mask_index, x)
        window = ctx.window(ctx.states[self.state_index], x, self.samples_per_frame)  # [B, C_in, history + T]
        return F.conv1d(window, self.weight, self.bias, dilation=self.dilation, groups=self.groups)  # [B, C_out, T]


@dataclass(eq=False)
class _ConvTranspose(_Op):
    """Transposed conv, stride s, kernel k = m·s, as a conv of kernel m followed by a channel-to-time shuffle.

    Output block i (samples i·s .. i·s + s-1, before the one-shot's crop) is sum_q W[:, :, q·s : q·s + s]ᵀ x[i - q]
    over q < m: a causal conv over the last m inputs with C_out·s output channels. So the state is the
    last m - 1 inputs, like any conv, and no output sample is computed twice.
    """

    weight: torch.Tensor  # [C_out * s, C_in, m]
    bias: torch.Tensor | None  # [C_out * s]
    stride: int
    state_index: int  # [B, C_in, m - 1]
    mask_index: int
    samples_per_frame: int  # of its input stream

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        x = ctx.zero_outside(self.mask_index, x)
        batch, _, steps = x.shape
        window = ctx.window(ctx.states[self.state_index], x, self.samples_per_frame)  # [B, C_in, m - 1 + T]
        y = F.conv1d(window, self.weight, self.bias)  # [B, C_out * s, T]
        y = y.view(batch, -1, self.stride, steps).transpose(2, 3)  # [B, C_out, T, s]
        return y.reshape(batch, -1, steps * self.stride)  # [B, C_out, T * s]


def _as_causal_conv(conv: nn.ConvTranspose1d) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights of the kernel-m conv equivalent to `conv` (see _ConvTranspose)."""
    w = _folded_weight(conv)  # [C_in, C_out, k]
    c_in, c_out, k = w.shape
    s = conv.stride[0]
    m = k // s
    # taps[r] multiplies x[i - (m - 1 - r)]: the kernel slice q = m - 1 - r.
    taps = torch.stack([w[:, :, (m - 1 - r) * s : (m - r) * s] for r in range(m)], dim=-1)  # [C_in, C_out, s, m]
    weight = taps.permute(1, 2, 0, 3).reshape(c_out * s, c_in, m).contiguous()
    bias = _bias(conv)
    return weight, None if bias is None else bias.repeat_interleave(s).contiguous()


@dataclass(eq=False)
class _Residual(_Op):
    """x + inner(x): the skip path is delayed by the inner layers' delay so both branches stay aligned."""

    inner: list[_Op]
    delay: int
    state_index: int  # [B, C, delay]: skip-path samples not yet matched by inner output
    samples_per_frame: int  # of its stream

    def step(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        y = x
        for op in self.inner:
            y = op.step(y, ctx)
        if y is x:  # an inner chain of identities: the in-place adds below must not write into x
            y = x.clone()
        if self.delay == 0:
            return y.add_(x)
        pending = ctx.states[self.state_index]  # [B, C, delay]
        steps = x.shape[-1]
        if steps < self.delay or ctx.advance is not None:
            # [pending, x] (pending <- what follows each row's advance, as a conv's history) and its first samples.
            skip = ctx.window(pending, x, self.samples_per_frame)  # [B, C, delay + T]
            return y.add_(skip[..., :steps])
        # The skip input is [pending, x] shifted by `delay`: add it in place, no concatenated copy.
        y[..., : self.delay] += pending
        y[..., self.delay :] += x[..., : steps - self.delay]
        pending.copy_(x[..., steps - self.delay :])
        return y


# ---------------------------------------------------------------------------------------------
# Building the streaming layers from a loaded SNAC model.


@dataclass
class _Builder:
    """Walks the decoder modules, tracking the stream's delay, resolution and width at each point."""

    state_shapes: list[tuple[int, int]] = field(default_factory=list)  # (channels, samples) per slot
    edges: list[_EdgeSpec] = field(default_factory=list)  # one per windowed layer, in step order

    def state_slot(self, channels: int, samples: int) -> int:
        self.state_shapes.append((channels, samples))
        return len(self.state_shapes) - 1

    def edge(self, delay: int, samples_per_frame: int) -> int:
        self.edges.append(_EdgeSpec(delay, samples_per_frame))
        return len(self.edges) - 1

    def build(self, module: nn.Module, delay: int, spf: int, channels: int) -> tuple[list[_Op], int, int, int]:
        """Streaming ops for `module` applied to a stream with the given delay (samples), samples per frame
        and channels; returns (ops, delay, samples per frame, channels) of its output stream."""
        ops: list[_Op] = []
        if isinstance(module, nn.Sequential):
            for child in module:
                child_ops, delay, spf, channels = self.build(child, delay, spf, channels)
                ops += child_ops
        elif isinstance(module, DecoderBlock):
            return self.build(module.block, delay, spf, channels)
        elif isinstance(module, Snake1d):
            alpha = module.alpha.detach().clone()
            ops.append(_Snake(alpha, (alpha + 1e-9).reciprocal()))
        elif isinstance(module, nn.Tanh):
            ops.append(_Tanh())
        elif isinstance(module, NoiseBlock | SeededNoiseBlock):
            ops.append(_Noise(_folded_weight(module.linear)))
        elif isinstance(module, nn.Identity):
            pass  # a NoiseBlock the loader switched off
        elif isinstance(module, ResidualUnit):
            inner, inner_delay, inner_spf, inner_channels = self.build(module.block, delay, spf, channels)
            if inner_spf != spf or inner_channels != channels:
                raise ValueError("residual unit changes its stream's rate or width; cannot add the skip path")
            skip_delay = inner_delay - delay
            slot = self.state_slot(channels, skip_delay) if skip_delay else -1
            ops.append(_Residual(inner, skip_delay, slot, spf))
            delay = inner_delay
        elif isinstance(module, nn.ConvTranspose1d):
            (k,), (s,), (p,), (out_pad,) = module.kernel_size, module.stride, module.padding, module.output_padding
            if module.dilation != (1,) or module.groups != 1 or k % s or k - s - 2 * p + out_pad != 0:
                raise ValueError(f"transposed conv {module} is not an ungrouped k = m*stride map of T to T*stride")
            mask = self.edge(delay, spf)
            slot = self.state_slot(module.in_channels, k // s - 1)
            weight, bias = _as_causal_conv(module)
            ops.append(_ConvTranspose(weight, bias, s, slot, mask, spf))
            delay, spf, channels = delay * s + p, spf * s, module.out_channels
        elif isinstance(module, nn.Conv1d):
            (k,), (d,), (stride,) = module.kernel_size, module.dilation, module.stride
            pad = module.padding
            if stride != 1 or isinstance(pad, str) or 2 * pad[0] != (k - 1) * d or module.padding_mode != "zeros":
                raise ValueError(f"conv {module} is not a stride-1, zero 'same'-padded conv")
            if k == 1 and module.groups == 1:
                bias = _bias(module)
                ops.append(_Pointwise(_folded_weight(module)[:, :, 0], None if bias is None else bias[:, None]))
            else:
                mask = self.edge(delay, spf)
                slot = self.state_slot(module.in_channels, (k - 1) * d)
                ops.append(_Conv(_folded_weight(module), _bias(module), d, module.groups, slot, mask, spf))
                delay += pad[0]
            channels = module.out_channels
        elif isinstance(module, LocalMHA):
            raise NotImplementedError("SNAC models with windowed attention (attn_window_size set) are not supported")
        else:
            raise TypeError(f"no streaming form for decoder layer {type(module).__name__}")
        return ops, delay, spf, channels


def _folded_weight(conv: nn.Module) -> torch.Tensor:
    # Under torch's weight-norm parametrization `.weight` computes g·v/|v|; read it once.
    return conv.weight.detach().clone()


def _bias(conv: nn.Conv1d | nn.ConvTranspose1d) -> torch.Tensor | None:
    return None if conv.bias is None else conv.bias.detach().clone()


# ---------------------------------------------------------------------------------------------
# The decoder.


@dataclass(slots=True)
class _Session:
    row: int  # row of the state pool
    frames_in: int = 0  # frames stepped so far, real and flush
    total_frames: int | None = None  # known once the final push arrived


@dataclass(slots=True)
class _Work:
    """What one push asks for in this call: frames to step (real, then zero flush frames) and the audio out."""

    session: _Session
    frames: np.ndarray  # [steps, 7] int64
    done: int = 0
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)  # (step output, row, lo, hi)


@dataclass(eq=False, slots=True)
class _StaticShape:
    """Fixed buffers of one (bucket, frames, edges) step shape: views of the decoder's static buffers."""

    batch: int  # the bucket: rows of every buffer below
    n_frames: int
    edges: bool  # the layers apply edge masks
    inputs: torch.Tensor  # [batch * (4 + 7 n)] int64, one host copy: rows | first | total | advance | codes
    rows: torch.Tensor  # [batch] pool rows; padding rows read the always-zero row
    first: torch.Tensor  # [batch] frames each row had stepped before this step
    total: torch.Tensor  # [batch] each row's utterance length in frames (a huge number while unknown)
    advance: torch.Tensor  # [batch] frames each row advances (read by ragged decoders only)
    codes: torch.Tensor  # [batch, 7 n] c0 | c1 | c2
    state: torch.Tensor  # [batch, state_size], gathered before and scattered after the layers
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None  # [batch, n * samples_per_frame], the graph's (captured) output


# Edge position of a row whose utterance's end is not known yet: never reached, and far from int64 overflow
# once multiplied by a layer's samples per frame.
_NO_END = np.iinfo(np.int64).max // 2**20


class StatefulDecoder:
    """Streaming SNAC decoder with per-session layer state (implements codec.base.StreamingDecoder).

    `model` is a loaded `snac.SNAC` without attention (snac_24khz). Its weights are read once (weight norm
    folded) and the model is not modified. `max_batch` caps the sessions in one forward step, `noise`
    enables the decoder's NoiseBlocks (off: deterministic audio equal to the one-shot decode with noise
    bypassed), `seed` seeds the noise (the same pushes in the same order give the same audio from run to
    run; None: unseeded), `step_frames` is the fixed set of frames-per-step shapes.

    `static`: every step runs on preallocated buffers padded to a batch bucket (see the module doc);
    `cuda_graphs` (CUDA only, implies `static`): each static shape is captured as a CUDA graph here, in
    the constructor, and steps replay it. `ragged`: a call's pushes of unequal lengths share steps, each row
    advancing by what it has (`base.step_schedule`; module doc): one step where even steps take two or
    three, for padding computed and discarded; worth it where a step is launch-bound (a GPU).

    On CUDA, codes go in and audio comes out through pinned staging buffers (`codec.transfer`) on the
    caller's current stream (the codec worker's own); everything the constructor puts on the device is
    complete before it returns, so a decoder built on one stream may be used on another.
    """

    def __init__(
        self,
        model: SNAC,
        *,
        max_batch: int = 64,
        noise: bool = False,
        seed: int | None = None,
        step_frames: Sequence[int] = STATEFUL_STEP_FRAMES,
        static: bool = False,
        cuda_graphs: bool = False,
        ragged: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not step_frames or 1 not in step_frames or min(step_frames) < 1:
            raise ValueError("step_frames must contain 1 and only positive sizes")
        if tuple(model.vq_strides) != _ORPHEUS_VQ_STRIDES:
            raise ValueError(
                f"Orpheus frames need vq_strides {list(_ORPHEUS_VQ_STRIDES)}, model has {model.vq_strides}"
            )
        param = next(model.decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a model on CUDA, not {self.device}")
        self.max_batch = max_batch
        self.noise = noise
        self.ragged = ragged
        self._generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self._transfer = HostTransfer(self.device)
        self.step_frames = tuple(sorted(set(step_frames), reverse=True))
        self.sample_rate: int = int(model.sampling_rate)
        self.codebook_size: int = int(model.codebook_size)

        with torch.no_grad(), full_fp32_convolutions(self.dtype):
            # Per codebook, the latent each code contributes: out_proj(embedding), a [codebook_size, D] table.
            self._latent_tables = [
                F.conv1d(q.codebook.weight.t()[None], _folded_weight(q.out_proj), _bias(q.out_proj))[0].t().contiguous()
                for q in model.quantizer.quantizers
            ]
            self._latent_per_frame = _ORPHEUS_VQ_STRIDES[0]  # latent samples per frame
            builder = _Builder()
            self._ops, delay, spf, _ = builder.build(
                model.decoder.model, 0, self._latent_per_frame, int(model.latent_dim)
            )
        self._edges = builder.edges
        self._state_slots: list[tuple[int, int, int, int]] = []  # (offset, channels, samples, size)
        offset = 0
        for channels, samples in builder.state_shapes:
            self._state_slots.append((offset, channels, samples, channels * samples))
            offset += channels * samples
        self.state_size = offset  # state elements per session

        self.samples_per_frame: int = spf  # 2048 for snac_24khz
        self.lookahead_samples: int = delay  # output samples that wait for later frames (4757 for snac_24khz)
        self.lookahead_frames: int = math.ceil(delay / spf)  # frames after a frame before its audio is final
        # Frames that must be in before the first sample can come out, and that in tokens (21 for snac_24khz).
        self.first_audio_frames: int = delay // spf + 1
        self.first_audio_tokens: int = self.first_audio_frames * TOKENS_PER_FRAME
        # A step needs edge masks while any of its frames is within this many frames of the stream start.
        self._start_edge_frames = max(math.ceil(e.delay / e.samples_per_frame) for e in self._edges)

        self.static = static or cuda_graphs
        self.cuda_graphs = cuda_graphs
        # Static steps: one extra pool row, never handed out and never written, is the padding rows' zero state.
        self._zero_row = max_batch if self.static else None
        self._pool = torch.zeros((max_batch + int(self.static), self.state_size), device=self.device, dtype=self.dtype)
        self._free_rows = list(range(max_batch))  # min-heap: lowest rows first keeps batches contiguous
        self._sessions: dict[Hashable, _Session] = {}
        self.batch_buckets: list[int] = padded_sizes(max_batch) if self.static else []
        self._shapes: dict[tuple[int, int, bool], _StaticShape] = {}
        if self.static:
            widest = max(self.step_frames)
            self._static_inputs = torch.zeros(max_batch * (4 + TOKENS_PER_FRAME * widest), dtype=torch.int64,
                                              device=self.device)
            self._static_state = torch.zeros((max_batch, self.state_size), device=self.device, dtype=self.dtype)
        if cuda_graphs:
            self._capture_graphs()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # see the class docstring

    # -- StreamingDecoder ---------------------------------------------------------------------

    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        keys = [push.key for push in pushes]
        if len(set(keys)) != len(keys):
            raise ValueError("at most one push per session key per decode call")
        frames_per_push = [self._checked_frames(push) for push in pushes]

        with torch.inference_mode(), full_fp32_convolutions(self.dtype):
            work: list[_Work] = []
            for push, frames in zip(pushes, frames_per_push, strict=True):
                session = self._sessions.get(push.key)
                if session is None:
                    session = self._sessions[push.key] = _Session(self._allocate_row())
                if push.final:
                    session.total_frames = session.frames_in + len(frames)
                    if session.total_frames > 0:
                        flush = np.zeros((self.lookahead_frames, TOKENS_PER_FRAME), dtype=np.int64)
                        frames = np.concatenate([frames, flush])
                work.append(_Work(session, frames))
            outputs: list[torch.Tensor] = []
            self._run(work, outputs)
            audio = self._collect(work, outputs)
            results = [CodecResult(push.key, pcm, push.final) for push, pcm in zip(pushes, audio, strict=True)]
        for push in pushes:
            if push.final:
                self.close(push.key)
        return results

    def close(self, key: Hashable) -> None:
        """Forget a session (no-op for an unknown key, so a cancel may race a final push)."""
        session = self._sessions.pop(key, None)
        if session is not None:
            heapq.heappush(self._free_rows, session.row)

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    @property
    def graph_count(self) -> int:
        """CUDA graphs captured (0 without cuda_graphs)."""
        return sum(shape.graph is not None for shape in self._shapes.values())

    # -- internals ----------------------------------------------------------------------------

    def _checked_frames(self, push: CodecPush) -> np.ndarray:
        frames = np.asarray(push.frames)
        if frames.size == 0:
            return np.zeros((0, TOKENS_PER_FRAME), dtype=np.int64)
        if frames.ndim != 2 or frames.shape[1] != TOKENS_PER_FRAME or not np.issubdtype(frames.dtype, np.integer):
            raise ValueError(
                f"push for {push.key!r}: frames must be [n, {TOKENS_PER_FRAME}] integers, got "
                f"{frames.dtype} {frames.shape}"
            )
        if frames.min() < 0 or frames.max() >= self.codebook_size:
            raise ValueError(f"push for {push.key!r}: codes must lie in 0..{self.codebook_size - 1}")
        return frames.astype(np.int64, copy=False)

    def _allocate_row(self) -> int:
        if not self._free_rows:
            # More sessions than rows: double the pool (rare; off the steady-state path). A static decoder's
            # zero row stays where it is; the new rows start past it.
            old = self._pool.shape[0]
            self._pool = torch.cat([self._pool, torch.zeros_like(self._pool)])
            self._free_rows = list(range(old, 2 * old))
        row = heapq.heappop(self._free_rows)
        self._pool[row].zero_()  # zero history = the one-shot decode's left zero padding
        return row

    def _run(self, work: list[_Work], outputs: list[torch.Tensor]) -> None:
        """Step every session with pending frames (`step_schedule`), rows in ascending order."""
        step = self._step_static if self.static else self._step
        ordered = sorted(work, key=lambda w: w.session.row)
        for planned in step_schedule([len(w.frames) for w in ordered], self.step_frames, self.max_batch,
                                     ragged=self.ragged):
            group = [ordered[i] for i in planned.rows]
            outputs.append(step(group, planned.frames, planned.advances))
            self._advance(group, planned.advances, len(outputs) - 1)

    def _step_codes(self, group: list[_Work], n_frames: int) -> np.ndarray:
        """[B, 7n] int64: per row c0 [n] | c1 [2n] | c2 [4n] of the frames this step decodes (a row of a ragged
        step with fewer frames left is padded with code 0: padding, which nothing keeps)."""
        frames = np.zeros((len(group), n_frames, TOKENS_PER_FRAME), dtype=np.int64)  # [B, n, 7]
        for row, w in enumerate(group):
            part = w.frames[w.done : w.done + n_frames]
            frames[row, : len(part)] = part
        return np.concatenate([c.reshape(len(group), -1) for c in frames_to_snac_codes(frames)], axis=1)

    def _at_edge(self, group: list[_Work], advances: list[int]) -> bool:
        """Whether some row's step touches the zero padding before its first frame or after its last."""
        return any(
            w.session.frames_in < self._start_edge_frames
            or (w.session.total_frames is not None and w.session.frames_in + n > w.session.total_frames)
            for w, n in zip(group, advances, strict=True)
        )

    def _step(self, group: list[_Work], n_frames: int, advances: list[int]) -> torch.Tensor:
        """One forward step on tensors shaped for exactly this group; returns its audio [B, n * spf]."""
        batch = len(group)
        rows = [w.session.row for w in group]
        codes = self._transfer.codes_to_device(self._step_codes(group, n_frames))  # one host-to-device copy
        advance = self._transfer.codes_to_device(np.asarray(advances, dtype=np.int64)) if self.ragged else None
        contiguous = rows == list(range(rows[0], rows[0] + batch))
        if contiguous:
            state = self._pool[rows[0] : rows[0] + batch]  # a view: updated in place
        else:
            # Through the pinned ring (transfer.py): a pageable copy would wait for this stream's queued work.
            row_index = self._transfer.codes_to_device(np.asarray(rows, dtype=np.int64))
            state = self._pool.index_select(0, row_index)  # [B, state_size]
        edges = None
        if self._at_edge(group, advances):
            positions = np.array([[w.session.frames_in, _NO_END if w.session.total_frames is None
                                   else w.session.total_frames] for w in group], dtype=np.int64)
            edges = self._transfer.codes_to_device(positions).unbind(1)  # one pinned copy (transfer.py)
        pcm = self._forward(codes, state, edges, n_frames, advance)
        if not contiguous:
            self._pool.index_copy_(0, row_index, state)
        return pcm

    def _step_static(self, group: list[_Work], n_frames: int, advances: list[int]) -> torch.Tensor:
        """One forward step on the fixed buffers of its padded shape (module doc); returns [B, n * spf]."""
        batch = len(group)
        shape = self._static_shape(next(b for b in self.batch_buckets if b >= batch), n_frames,
                                   self._at_edge(group, advances))
        bucket = shape.batch
        host = np.zeros((4, bucket), dtype=np.int64)  # rows, first, total, advance (the codes follow them)
        host[0, :batch] = [w.session.row for w in group]
        host[0, batch:] = self._zero_row
        host[1, :batch] = [w.session.frames_in for w in group]
        host[2, :] = _NO_END
        host[2, :batch] = [_NO_END if w.session.total_frames is None else w.session.total_frames for w in group]
        host[3, :] = n_frames
        host[3, :batch] = advances
        codes = np.zeros((bucket, TOKENS_PER_FRAME * n_frames), dtype=np.int64)  # padding rows: code 0
        codes[:batch] = self._step_codes(group, n_frames)
        self._transfer.copy_to_device(np.concatenate([host.reshape(-1), codes.reshape(-1)]), shape.inputs)
        torch.index_select(self._pool, 0, shape.rows, out=shape.state)  # gather: [bucket, state_size]
        if shape.graph is not None:
            shape.graph.replay()
            assert shape.output is not None
            pcm = shape.output[:batch].clone()  # the next replay of this shape overwrites the output
        else:
            pcm = self._forward_static(shape)[:batch]
        self._pool.index_copy_(0, shape.rows[:batch], shape.state[:batch])  # scatter the real rows only
        return pcm

    def _static_shape(self, bucket: int, n_frames: int, edges: bool) -> _StaticShape:
        key = (bucket, n_frames, edges)
        shape = self._shapes.get(key)
        if shape is None:
            if self.cuda_graphs:
                raise RuntimeError(f"no CUDA graph was captured for step shape {key}")
            shape = self._shapes[key] = self._make_static_shape(bucket, n_frames, edges)
        return shape

    def _make_static_shape(self, bucket: int, n_frames: int, edges: bool) -> _StaticShape:
        inputs = self._static_inputs[: bucket * (4 + TOKENS_PER_FRAME * n_frames)]
        rows, first, total, advance, codes = inputs.split(
            [bucket, bucket, bucket, bucket, bucket * TOKENS_PER_FRAME * n_frames])
        return _StaticShape(bucket, n_frames, edges, inputs, rows, first, total, advance,
                            codes.view(bucket, TOKENS_PER_FRAME * n_frames), self._static_state[:bucket])

    def _forward_static(self, shape: _StaticShape) -> torch.Tensor:
        edges = (shape.first, shape.total) if shape.edges else None
        return self._forward(shape.codes, shape.state, edges, shape.n_frames, shape.advance if self.ragged else None)

    def _capture_graphs(self) -> None:
        """One CUDA graph per static shape, largest first, all in one memory pool (as the engine's decode graphs).

        The static buffers hold zeros meanwhile (code 0, zero state); each shape runs once eagerly before its
        capture (kernel selection, library handles). Captured on a stream of their own
        that first waits for everything queued so far (weights, buffers)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for bucket in reversed(self.batch_buckets):
                for n_frames in self.step_frames:  # largest first
                    for edges in (True, False):
                        shape = self._shapes[(bucket, n_frames, edges)] = self._make_static_shape(
                            bucket, n_frames, edges)
                        self._forward_static(shape)
                        graph = torch.cuda.CUDAGraph()
                        if self.noise and self._generator is not None:
                            graph.register_generator_state(self._generator)  # replays draw fresh noise from it
                        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                            shape.output = self._forward_static(shape)
                        shape.graph = graph
        stream.synchronize()
        self._static_state.zero_()

    def _forward(self, codes: torch.Tensor, state: torch.Tensor, edges: tuple[torch.Tensor, torch.Tensor] | None,
                 n_frames: int, advance: torch.Tensor | None = None) -> torch.Tensor:
        """The layers over one step: codes [B, 7n] and state [B, state_size] (updated in place) -> audio
        [B, n * spf]. `edges` (first, total) [B] each when some row is at an utterance edge; `advance` [B] the
        frames each row of a ragged step advances (its audio: the first advance * spf samples)."""
        batch = codes.shape[0]
        codebooks = codes.split([n_frames, 2 * n_frames, 4 * n_frames], dim=1)
        latent = None
        for table, codebook, stride in zip(self._latent_tables, codebooks, _ORPHEUS_VQ_STRIDES, strict=True):
            part = F.embedding(codebook, table)  # [B, n*4/stride, D]
            # Each code's latent held for `stride` samples: repeat_interleave as a broadcast, which never asks
            # the device for its output size (a CUDA graph capture must not wait on the device).
            part = part[:, :, None, :].expand(batch, part.shape[1], stride, part.shape[2]).reshape(
                batch, -1, part.shape[2])  # [B, n*4, D]
            latent = part if latent is None else latent + part
        x = latent.transpose(1, 2)  # [B, D, n*4]
        ctx = _StepContext(
            states=[state[:, off : off + size].view(batch, c, t) for off, c, t, size in self._state_slots],
            outside=None if edges is None else self._edge_masks(*edges, n_frames),
            noise=self.noise,
            generator=self._generator,
            advance=advance,
        )
        for op in self._ops:
            x = op.step(x, ctx)
        return x[:, 0]  # [B, n * samples_per_frame]

    def _advance(self, group: list[_Work], advances: list[int], output: int) -> None:
        """After a step: each row's share of its audio (as a piece of step `output`) and its new position."""
        spf = self.samples_per_frame
        for batch_row, (w, n_frames) in enumerate(zip(group, advances, strict=True)):
            session = w.session
            start = session.frames_in * spf - self.lookahead_samples  # one-shot time of this step's first sample
            end = start + n_frames * spf
            lo, hi = max(start, 0), end
            if session.total_frames is not None:
                hi = min(hi, session.total_frames * spf)
            if hi > lo:
                w.pieces.append((output, batch_row, lo - start, hi - start))
            session.frames_in += n_frames
            w.done += n_frames

    def _edge_masks(self, first: torch.Tensor, total: torch.Tensor, n_frames: int) -> list[torch.Tensor]:
        """Per windowed layer, [B, 1, T] True where its input lies before time 0 or past the utterance end;
        `first` [B]: frames each row had stepped before this step, `total` [B]: its length in frames."""
        first, total = first[:, None], total[:, None]  # [B, 1]
        masks = []
        for edge in self._edges:
            r = edge.samples_per_frame
            time = first * r - edge.delay + torch.arange(n_frames * r, device=self.device)  # [B, T]
            masks.append(((time < 0) | (time >= total * r))[:, None, :])  # [B, 1, T]
        return masks

    def _collect(self, work: list[_Work], outputs: list[torch.Tensor]) -> list[np.ndarray]:
        """Each push's audio as float32 numpy: every step's output in one device-to-host copy, cut on the host."""
        if not work:
            return []
        flat = self._transfer.audio_to_host([pcm.reshape(-1) for pcm in outputs])
        host = [audio.reshape(pcm.shape[0], -1) for audio, pcm in zip(flat, outputs, strict=True)]  # [B, T] each
        empty = np.zeros(0, dtype=np.float32)
        return [np.concatenate([host[step][row, lo:hi] for step, row, lo, hi in w.pieces]) if w.pieces else empty
                for w in work]
