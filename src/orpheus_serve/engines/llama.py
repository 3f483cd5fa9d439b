"""Llama-3 in plain torch, with a static slot-indexed KV cache.

The architecture is the one Orpheus uses (Llama-3.2-3B): RMSNorm, rotary
position embeddings with the Llama-3 frequency scaling, grouped-query
attention, a SwiGLU MLP and, optionally, an output projection tied to the
token embedding. Weights come from a local Hugging Face folder
(`config.json` + `model.safetensors` or a sharded
`model.safetensors.index.json`); q/k/v and gate/up are fused at load time.

KV cache: one `[num_slots, kv_heads, max_seq_len, head_dim]` tensor pair per
layer, allocated once. A slot is one session's row. `Transformer.forward`
takes B rows of T tokens, each row with its own slot and positions, so the
same code serves

- prefill: B = 1, T = chunk length, positions start..end-1 of one slot;
- decode:  B = live sessions, T = 1, every row at its own position.

New keys/values are scattered into the cache at (slot, position); attention
then reads each row's slot up to `kv_len` (the longest live context, not
`max_seq_len`) and masks, per row, every cache position after that row's
own query position. Stale entries left by a slot's previous occupant are
thereby never seen, so a slot needs no clearing between sessions.

`setup_caches(attention="triton")` runs single-token passes (decode) through the
split-K kernel of decode_attention.py instead: each row reads its own slot in place up
to its own length (position + 1), with no gather, mask or dependence on `kv_len`.
Prefill keeps SDPA. `kv_dtype=float8_e4m3fn` stores the cache in FP8 with one
static scale per layer and KV head, calibrated on a short prompt when the cache is set
up (fp8.py; ARCHITECTURE §6).

`use_fused_kernels()` (`engine.fused`) runs each layer through fused.py's Triton kernels instead:
the residual adds inside the norms that follow them (`TransformerBlock.forward_fused`), SiLU x up
in one kernel, rotary and the cache write in one; with FP8 weights the norms hand the GEMMs
their input already quantised.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orpheus_serve import token_format as P
from orpheus_serve.engines.fp8 import FP8_DTYPE, Fp8Linear, kv_scales, quantize_fp8
from orpheus_serve.engines.vram_budget import LlamaDims
from orpheus_serve.scheduler.step import EngineError

if TYPE_CHECKING:
    from orpheus_serve.engines.lora import LayerLora, LoraBatch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES: dict[str, torch.dtype] = {**DTYPES, "fp8": FP8_DTYPE}
ATTENTION_KERNELS = ("sdpa", "triton")
KV_CALIBRATION_TOKENS = 256  # prompt length the FP8 cache's per-head scales are measured over


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise EngineError(f"unsupported dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def kv_torch_dtype(name: str) -> torch.dtype:
    if name not in KV_DTYPES:
        raise EngineError(f"unsupported KV cache dtype {name!r}; expected one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Both spellings of a Hugging Face config: `rope_theta` + `rope_scaling` (the released
        Orpheus checkpoint) and the newer `rope_parameters` dict that holds the theta too."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise EngineError(f"config.json: rope_type {rope_type!r} is not supported (default, llama3)")
        if rope_type == "default":
            return cls(theta=float(theta))
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def dims(self) -> LlamaDims:
        """The shapes that decide memory, as the memory model (vram_budget.py) takes them."""
        return LlamaDims(hidden_size=self.dim, num_layers=self.n_layers, num_attention_heads=self.n_heads,
                         num_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                         tie_word_embeddings=self.tie_word_embeddings)

    @property
    def num_parameters(self) -> int:
        return self.dims.total_params

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        arch = hf.get("model_type", "llama")
        if arch != "llama":
            raise EngineError(f"config.json: model_type {arch!r} is not a Llama checkpoint")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise EngineError(f"config.json: hidden_act {act!r} is not supported (silu)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise EngineError("config.json: attention_bias / mlp_bias are not supported (Llama-3 has none)")
        n_heads = int(hf["num_attention_heads"])
        n_kv = int(hf.get("num_key_value_heads") or n_heads)
        if n_heads % n_kv:
            raise EngineError(f"config.json: {n_heads} attention heads is not a multiple of {n_kv} kv heads")
        dim = int(hf["hidden_size"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=int(hf.get("head_dim") or dim // n_heads),
            intermediate_size=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> LlamaConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise EngineError(f"{config_path}: no such file (expected a Hugging Face Llama folder)")
        return cls.from_hf(json.loads(config_path.read_text()))


# ----------------------------------------------------------------------------- rope


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:
    """Inverse frequencies [head_dim // 2], fp32, with Llama-3's long-context scaling: wavelengths
    beyond the original context are stretched by `factor`, short ones kept, the band between blended."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "default":
        return inv_freq
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(rope: RopeConfig, head_dim: int, max_seq_len: int) -> tuple[Tensor, Tensor]:
    """cos, sin tables [max_seq_len, head_dim // 2], fp32."""
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(rope, head_dim))
    return freqs.cos(), freqs.sin()


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos, sin [B, T, D/2]. Hugging Face layout: the two halves of a head rotate
    together (their checkpoints permute q/k for this), computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, T, H, D/2] each
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).type_as(x)


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


class KVCache(nn.Module):
    """K and V of every slot, `[num_slots, Hkv, max_seq_len, D]` each, in `dtype`. FP8 caches hold
    x / scale with the per-KV-head `scales` (k_scale, v_scale [Hkv] fp32) and read back in `compute_dtype`."""

    def __init__(self, num_slots: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, compute_dtype: torch.dtype | None = None,
                 scales: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__()
        if (dtype == FP8_DTYPE) != (scales is not None):
            raise EngineError("an FP8 KV cache needs per-head scales, and only an FP8 cache takes them")
        shape = (num_slots, n_kv_heads, max_seq_len, head_dim)
        self.compute_dtype = compute_dtype or dtype
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.k_scale: Tensor | None
        self.v_scale: Tensor | None
        self.register_buffer("k_scale", None if scales is None else scales[0].float().to(device), persistent=False)
        self.register_buffer("v_scale", None if scales is None else scales[1].float().to(device), persistent=False)
        # Calibration (Transformer.setup_caches): the largest |k| and |v| written, per KV head [2, Hkv].
        self.observed_amax: Tensor | None = None

    def write(self, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v [B, T, Hkv, D] at (slots [B], positions [B, T])."""
        if self.observed_amax is not None:
            seen = torch.stack([k.abs().amax(dim=(0, 1, 3)), v.abs().amax(dim=(0, 1, 3))]).float()
            self.observed_amax = torch.maximum(self.observed_amax, seen)
        rows = slots.unsqueeze(1)  # [B, 1], broadcast against positions [B, T]
        for cache, values, scale in ((self.k_cache, k, self.k_scale), (self.v_cache, v, self.v_scale)):
            if scale is not None:
                values = quantize_fp8(values, scale.view(1, 1, -1, 1))
            cache[rows, :, positions] = values.to(cache.dtype)

    def read(self, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Each row's slot up to kv_len as [B, Hkv, kv_len, D] in the compute dtype (a gathered copy)."""
        keys = self.k_cache[:, :, :kv_len].index_select(0, slots)
        values = self.v_cache[:, :, :kv_len].index_select(0, slots)
        if self.k_scale is not None and self.v_scale is not None:
            keys = keys.float() * self.k_scale.view(1, -1, 1, 1)
            values = values.float() * self.v_scale.view(1, -1, 1, 1)
        return keys.to(self.compute_dtype), values.to(self.compute_dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.wqkv = nn.Linear(config.dim, config.q_size + 2 * config.kv_size, bias=False)
        self.wo: nn.Module = nn.Linear(config.q_size, config.dim, bias=False)
        self.kv_cache: KVCache | None = None
        # decode_attention.decode_attention when single-token passes use the Triton kernel.
        self.decode_kernel: Callable[..., Tensor] | None = None
        # Rotary + cache write in one kernel (fused.py) and the decode kernel's pipelined loop
        # (decode_attention.py): Transformer.use_fused_kernels.
        self.fused = False

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, slots: Tensor, positions: Tensor,
                kv_len: int, lora: LayerLora | None = None, lengths: Tensor | None = None,
                x_fp8: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`lengths` [B] (given for T = 1 when the decode kernel is set): each row attends over its own
        slot up to that length, read in place; otherwise SDPA over the gathered cache with `mask`.
        `x_fp8`: x already quantised per row (the fused norm's FP8 output) for an FP8 q|k|v GEMM."""
        cfg = self.config
        B, T, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // Hkv
        base = self.wqkv(x) if x_fp8 is None else self.wqkv.forward_quantized(x, x_fp8)
        qkv = base if lora is None else lora("wqkv", x, base)
        cache = self.kv_cache
        assert cache is not None, "setup_caches() first"
        if self.fused and cache.observed_amax is None:  # (calibrating an FP8 cache: the unfused write below)
            from orpheus_serve.engines.fused import rope_cache_write

            q = rope_cache_write(qkv, cos, sin, cache.k_cache, cache.v_cache, slots, positions, n_heads=H,
                                 n_kv_heads=Hkv, k_scale=cache.k_scale, v_scale=cache.v_scale)  # [B, T, H, D]
        else:
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rotary_emb(q.view(B, T, H, D), cos, sin)  # [B, T, H, D]
            k = apply_rotary_emb(k.view(B, T, Hkv, D), cos, sin)  # [B, T, Hkv, D]
            cache.write(slots, positions, k, v.view(B, T, Hkv, D))
        if lengths is not None:
            assert self.decode_kernel is not None and T == 1
            y = self.decode_kernel(q.view(B, H, D), cache.k_cache, cache.v_cache, slots, lengths,
                                   k_scale=cache.k_scale, v_scale=cache.v_scale,
                                   pipelined=self.fused).reshape(B, T, H * D)  # [B, H, D]
        else:
            assert mask is not None
            keys, values = cache.read(slots, kv_len)  # [B, Hkv, S, D]
            # Grouped-query attention without repeating k/v: the G query heads that share a kv head
            # become G*T query rows against that head. Head h = kv * G + g (Hugging Face's grouping).
            q = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hkv, G*T, D]
            y = y.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)
        return self.wo(y) if lora is None else lora("wo", y, self.wo(y))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w13: nn.Module = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)  # gate | up
        self.w2: nn.Module = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor, lora: LayerLora | None = None, x_fp8: tuple[Tensor, Tensor] | None = None,
                fused: bool = False) -> Tensor:
        """`x_fp8`: x already quantised per row (the fused norm's FP8 output); `fused`: SiLU x up in one kernel
        (fused.silu_mul), which also quantises its output for an FP8 down projection."""
        base = self.w13(x) if x_fp8 is None else self.w13.forward_quantized(x, x_fp8)
        gate_up = base if lora is None else lora("w13", x, base)
        h_fp8 = None
        if fused:
            from orpheus_serve.engines.fused import silu_mul

            h, h_fp8 = silu_mul(gate_up, fp8=isinstance(self.w2, Fp8Linear))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = F.silu(gate) * up
        down = self.w2(h) if h_fp8 is None else self.w2.forward_quantized(h, h_fp8)
        return down if lora is None else lora("w2", h, down)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, slots: Tensor, positions: Tensor,
                kv_len: int, lora: LayerLora | None = None, lengths: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, slots, positions, kv_len, lora, lengths)
        return h + self.feed_forward(self.ffn_norm(h), lora)

    def forward_fused(self, delta: Tensor | None, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                      slots: Tensor, positions: Tensor, kv_len: int, lora: LayerLora | None = None,
                      lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The same layer with fused kernels (fused.py): the residual stream arrives as x + delta, delta being
        the previous layer's MLP output (None for the first layer), so every residual add happens inside the
        norm that follows it. Returns (x + delta + attention, MLP output): the next layer's (x, delta)."""
        from orpheus_serve.engines.fused import add_rms_norm

        fp8 = isinstance(self.attention.wqkv, Fp8Linear)
        x, normed, normed_fp8 = add_rms_norm(delta, x, self.attention_norm.weight, self.attention_norm.eps, fp8=fp8)
        attended = self.attention(normed, cos, sin, mask, slots, positions, kv_len, lora, lengths, normed_fp8)
        h, normed, normed_fp8 = add_rms_norm(attended, x, self.ffn_norm.weight, self.ffn_norm.eps, fp8=fp8)
        return h, self.feed_forward(normed, lora, normed_fp8, fused=True)


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.num_slots = 0
        self.max_seq_len = 0
        self.attention_kernel = "sdpa"
        self.fused = False

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Run the decoder layers with fused.py's Triton kernels (`engine.fused`): residual add + RMSNorm (and,
        with FP8 weights, the activations' quantisation) in one kernel, SiLU x up in one, rotary + KV cache
        write in one, and the Triton decode attention's software-pipelined loop (blocks of equal bytes for
        every cache dtype). Needs Triton (on a CPU: TRITON_INTERPRET=1)."""
        self.fused = enabled
        for layer in self.layers:
            layer.attention.fused = enabled

    def setup_caches(self, num_slots: int, max_seq_len: int, *, kv_dtype: torch.dtype | None = None,
                     attention: str = "sdpa") -> None:
        """Allocate the KV cache (once, in `kv_dtype`, default the model's) and the rope tables for
        max_seq_len positions; `attention`: sdpa or triton (the decode kernel for single-token passes).
        An FP8 cache first measures its per-head scales over a calibration prompt (module docstring)."""
        if attention not in ATTENTION_KERNELS:
            raise EngineError(f"unknown attention kernel {attention!r}; expected one of {', '.join(ATTENTION_KERNELS)}")
        dtype = self.output.weight.dtype
        kv_dtype = kv_dtype or dtype
        scales = self._calibrate_kv_scales(min(max_seq_len, KV_CALIBRATION_TOKENS)) if kv_dtype == FP8_DTYPE else None
        self._allocate_caches(num_slots, max_seq_len, kv_dtype, scales)
        kernel = None
        if attention == "triton":
            from orpheus_serve.engines.decode_attention import decode_attention

            kernel = decode_attention
        for layer in self.layers:
            layer.attention.decode_kernel = kernel
        self.attention_kernel = attention

    def _allocate_caches(self, num_slots: int, max_seq_len: int, kv_dtype: torch.dtype,
                         scales: list[tuple[Tensor, Tensor]] | None) -> None:
        cfg = self.config
        dtype, device = self.output.weight.dtype, self.output.weight.device
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = KVCache(num_slots, cfg.n_kv_heads, max_seq_len, cfg.head_dim, kv_dtype, device,
                                               compute_dtype=dtype, scales=None if scales is None else scales[i])
        cos, sin = rope_tables(cfg.rope, cfg.head_dim, max_seq_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)  # [S, D/2] fp32
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.register_buffer("cache_positions", torch.arange(max_seq_len, device=device), persistent=False)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len

    def _calibrate_kv_scales(self, length: int) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the FP8 scales (k [Hkv], v [Hkv]) from the amax of K and V over a seeded prompt of
        `length` tokens in the Orpheus layout (text ids, then audio ids) run at the model's precision in a
        one-slot cache that is dropped afterwards."""
        device = self.output.weight.device
        self._allocate_caches(1, length, self.output.weight.dtype, None)
        gen = torch.Generator().manual_seed(0)
        n_text = max(1, length // 4 - len(P.PROMPT_SUFFIX) - 2)
        text = torch.randint(0, P.BOS, (n_text,), generator=gen).tolist()
        prompt = [P.START_OF_HUMAN, P.BOS, *text, *P.PROMPT_SUFFIX]
        audio = torch.randint(P.AUDIO_TOKEN_BASE, P.AUDIO_VOCAB_END, (max(0, length - len(prompt)),), generator=gen).tolist()
        tokens = torch.tensor([*prompt, *audio][:length], dtype=torch.int64, device=device)
        caches = [layer.attention.kv_cache for layer in self.layers]
        for cache in caches:
            assert cache is not None
            cache.observed_amax = torch.zeros(2, self.config.n_kv_heads, device=device)
        self.prefill(tokens, 0, 0)
        scales = []
        for cache in caches:
            assert cache is not None and cache.observed_amax is not None
            scales.append((kv_scales(cache.observed_amax[0]), kv_scales(cache.observed_amax[1])))
            cache.observed_amax = None
        for layer in self.layers:
            layer.attention.kv_cache = None
        return scales

    def quantize_weights_fp8(self) -> None:
        """Replace every decoder layer's four GEMMs by FP8 ones (fp8.py); norms, embedding and LM head stay."""
        for layer in self.layers:
            attention, mlp = layer.attention, layer.feed_forward
            attention.wqkv = Fp8Linear.from_linear(attention.wqkv)
            attention.wo = Fp8Linear.from_linear(attention.wo)
            mlp.w13 = Fp8Linear.from_linear(mlp.w13)
            mlp.w2 = Fp8Linear.from_linear(mlp.w2)

    def forward(self, tokens: Tensor, slots: Tensor, positions: Tensor, kv_len: int,
                lora: LoraBatch | None = None) -> Tensor:
        """tokens, positions [B, T]; slots [B]; every position < kv_len <= max_seq_len; `lora`: the
        rows' LoRA adapters (engines/lora.py), None when no row has one.
        Returns the final-norm hidden states [B, T, dim]: the caller projects only the rows and
        vocabulary entries it needs (`logits`, or sampling.constrained_logits). With the Triton
        kernel, single-token passes ignore kv_len (each row reads up to its own position)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, D/2]
        G = self.config.n_heads // self.config.n_kv_heads
        B, T = tokens.shape
        mask: Tensor | None = None
        lengths: Tensor | None = None
        if T == 1 and self.attention_kernel == "triton":
            lengths = positions[:, 0] + 1
        else:
            visible = self.cache_positions[:kv_len] <= positions.unsqueeze(-1)  # [B, T, S]
            mask = visible.unsqueeze(1).expand(B, G, T, kv_len).reshape(B, 1, G * T, kv_len)  # query rows g*T + t
        x = self.tok_embeddings(tokens)
        if self.fused:
            from orpheus_serve.engines.fused import add_rms_norm

            delta: Tensor | None = None
            for i, layer in enumerate(self.layers):
                x, delta = layer.forward_fused(delta, x, cos, sin, mask, slots, positions, kv_len,
                                               None if lora is None else lora.layer(i), lengths)
            return add_rms_norm(delta, x, self.norm.weight, self.norm.eps)[1]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, slots, positions, kv_len, None if lora is None else lora.layer(i), lengths)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., dim] -> fp32 logits [..., vocab] (the full output projection)."""
        return self.output(hidden).float()

    def prefill(self, tokens: Tensor, slot: int, start: int, lora: LoraBatch | None = None) -> Tensor:
        """Prompt tokens [T] of one slot at positions start..start+T-1 -> hidden states [T, dim]."""
        T = tokens.shape[0]
        positions = torch.arange(start, start + T, device=tokens.device).unsqueeze(0)  # [1, T]
        slots = torch.tensor([slot], device=tokens.device)
        return self.forward(tokens.unsqueeze(0), slots, positions, start + T, lora)[0]

    def decode(self, tokens: Tensor, slots: Tensor, positions: Tensor, kv_len: int,
               lora: LoraBatch | None = None) -> Tensor:
        """One token per row: tokens, slots, positions [B] -> hidden states [B, dim]."""
        return self.forward(tokens.unsqueeze(1), slots, positions.unsqueeze(1), kv_len, lora)[:, 0]


# ----------------------------------------------------------------------------- loading


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise EngineError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _iter_checkpoint(folder: Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    for path in _checkpoint_files(folder):
        if not path.is_file():
            raise EngineError(f"{path}: shard listed in the index is missing")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_transformer(path: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    """Build the model from a Hugging Face Llama folder, weights in `dtype` on `device`."""
    folder = Path(path)
    config = LlamaConfig.from_folder(folder)
    hf: dict[str, Tensor] = {}
    # Straight to the device: the fused projections below are concatenated there, not in host memory
    # (a 3B checkpoint is 6.6 GB; one pass over it instead of a host copy and a second upload).
    for name, tensor in _iter_checkpoint(folder, device):
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        hf[name] = tensor

    def take(name: str) -> Tensor:
        if name not in hf:
            raise EngineError(f"{folder}: checkpoint has no tensor {name!r}")
        return hf.pop(name)

    state: dict[str, Tensor] = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
                                "norm.weight": take("model.norm.weight")}
    for i in range(config.n_layers):
        pre, out = f"model.layers.{i}.", f"layers.{i}."
        state[out + "attention.wqkv.weight"] = torch.cat(
            [take(pre + f"self_attn.{p}_proj.weight") for p in "qkv"], dim=0)
        state[out + "attention.wo.weight"] = take(pre + "self_attn.o_proj.weight")
        state[out + "feed_forward.w13.weight"] = torch.cat(
            [take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")], dim=0)
        state[out + "feed_forward.w2.weight"] = take(pre + "mlp.down_proj.weight")
        state[out + "attention_norm.weight"] = take(pre + "input_layernorm.weight")
        state[out + "ffn_norm.weight"] = take(pre + "post_attention_layernorm.weight")
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    else:
        state["output.weight"] = take("lm_head.weight")
    if hf:
        raise EngineError(f"{folder}: unexpected tensors in checkpoint: {', '.join(sorted(hf)[:5])}")

    with torch.device("meta"):
        model = Transformer(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    if config.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval().requires_grad_(False)
