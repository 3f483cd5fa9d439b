"""The fused decoder kernels (engines/fused.py, `engine.fused`) against the unfused path.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before
Triton is imported). Tolerances: each kernel reproduces the unfused arithmetic (fp32, rounding to the model
dtype where the unfused path rounds), so in fp32 the two agree to fp32 rounding of a reordered sum
(KERNEL_FP32_TOLERANCE, relative), in bf16 to one bf16 rounding step per rounding, and FP8 outputs are exactly the
per-row e4m3 quantisation (fp8.quantize_rows) of the kernel's own dtype output. A whole tiny model, fp32,
prefill and decode: logits within MODEL_TOLERANCE (absolute, logits of order 1) and the same greedy tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from orpheus_serve import token_format as P
from orpheus_serve.engines.fp8 import FP8_DTYPE, Fp8Linear, kv_scales, quantize_fp8, quantize_rows
from orpheus_serve.engines.fused import add_rms_norm, rope_cache_write, silu_mul
from orpheus_serve.engines.llama import KVCache, RMSNorm, RopeConfig, apply_rotary_emb, load_transformer, rope_tables
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.weights.tiny import write_lora_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# The kernels on CPU tensors, in Triton's interpreter; a CUDA machine runs the gpu tests at the end instead.
ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter")

KERNEL_FP32_TOLERANCE = 1e-5  # relative: fp32 rounding of a reordered sum of squares / an fma
MODEL_TOLERANCE = 1e-4  # absolute, on fp32 logits (the same bound test_llama.py holds against transformers)
BF16_STEP = 2.0**-7  # one bf16 rounding step, relative


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_add_rms_norm_matches_add_then_rmsnorm(dtype: torch.dtype, with_delta: bool) -> None:
    n = 96  # not a power of two: the kernel's masked tail
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = rand(n, seed=3).abs().to(dtype) + 0.5
    residual, delta = rand(2, 5, n, seed=1, dtype=dtype), rand(2, 5, n, seed=2, dtype=dtype)
    expected_residual = residual + delta if with_delta else residual
    new_residual, out, quantized = add_rms_norm(delta if with_delta else None, residual, norm.weight, 1e-5)
    assert quantized is None and out.dtype == dtype and out.shape == residual.shape
    rel = BF16_STEP if dtype == torch.bfloat16 else KERNEL_FP32_TOLERANCE
    assert torch.equal(new_residual, expected_residual)  # the add rounds as `x + delta` rounds
    # The norm of the kernel's own sum: two roundings to the dtype (the normalised value, then x weight).
    expected = norm(new_residual)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 * rel, atol=rel * 1e-3)


@ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_quantises_its_output_to_e4m3_per_row(dtype: torch.dtype) -> None:
    n = 160
    weight = rand(n, seed=4, dtype=dtype)
    residual = rand(7, n, seed=5, dtype=dtype) * 3
    residual[0, :] = 0  # a zero row: the scale's floor, not a division by zero
    residual[1, 9] = 1e4  # one outlier: everything else of the row lands in e4m3's subnormals
    _, out, quantized = add_rms_norm(rand(7, n, seed=6, dtype=dtype), residual, weight, 1e-5, fp8=True)
    assert quantized is not None
    values, scales = quantized
    ref_values, ref_scales = quantize_rows(out)
    assert values.dtype == FP8_DTYPE and scales.shape == (7, 1)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(values.float(), ref_values.float())  # round to nearest even on the e4m3 grid, exactly


@ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_matches_silu_times_up(dtype: torch.dtype) -> None:
    gate_up = rand(3, 2, 2 * 80, seed=7, dtype=dtype) * 4
    gate, up = gate_up.split(80, dim=-1)
    expected = F.silu(gate) * up
    out, none = silu_mul(gate_up)
    assert none is None and out.shape == expected.shape
    rel = BF16_STEP if dtype == torch.bfloat16 else KERNEL_FP32_TOLERANCE
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 * rel, atol=rel * 1e-3)  # SiLU, then x up
    out, quantized = silu_mul(gate_up, fp8=True)
    assert quantized is not None
    assert torch.equal(quantized[0].float(), quantize_rows(out.reshape(6, 80))[0].float())


@ON_CPU
@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8_DTYPE])
def test_fused_rope_and_cache_write_match_rotary_then_write(kv_dtype: torch.dtype) -> None:
    B, T, H, Hkv, D, slots_n, S = 3, 2, 4, 2, 16, 5, 12
    qkv = rand(B, T, (H + 2 * Hkv) * D, seed=8) * 2
    cos_table, sin_table = rope_tables(RopeConfig(theta=500000.0), D, S)
    positions = torch.tensor([[3, 4], [0, 1], [10, 11]])
    slots = torch.tensor([4, 0, 2])
    cos, sin = cos_table[positions], sin_table[positions]
    scales = (kv_scales(torch.full((Hkv,), 6.0)), kv_scales(torch.full((Hkv,), 5.0))) if kv_dtype == FP8_DTYPE \
        else None
    reference = KVCache(slots_n, Hkv, S, D, kv_dtype, torch.device("cpu"), compute_dtype=torch.float32, scales=scales)
    fused = KVCache(slots_n, Hkv, S, D, kv_dtype, torch.device("cpu"), compute_dtype=torch.float32, scales=scales)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    expected_q = apply_rotary_emb(q.view(B, T, H, D), cos, sin)
    reference.write(slots, positions, apply_rotary_emb(k.view(B, T, Hkv, D), cos, sin), v.reshape(B, T, Hkv, D))

    out_q = rope_cache_write(qkv, cos, sin, fused.k_cache, fused.v_cache, slots, positions, n_heads=H,
                             n_kv_heads=Hkv, k_scale=fused.k_scale, v_scale=fused.v_scale)
    torch.testing.assert_close(out_q, expected_q, rtol=KERNEL_FP32_TOLERANCE, atol=1e-6)
    written = torch.zeros(slots_n, S, dtype=torch.bool)
    written[slots.unsqueeze(1), positions] = True
    assert (fused.k_cache.float()[~written.unsqueeze(1).expand(-1, Hkv, -1)] == 0).all()  # nothing else touched
    assert torch.equal(fused.v_cache.float(), reference.v_cache.float())
    if kv_dtype == FP8_DTYPE:  # a rotated k a last fp32 bit apart may round to the neighbouring e4m3 value
        assert scales is not None
        step = (reference.k_cache.float().abs() * 2.0**-3).clamp(min=2.0**-9)
        assert ((fused.k_cache.float() - reference.k_cache.float()).abs() <= step).all()
        assert (fused.k_cache.float() == reference.k_cache.float()).float().mean() > 0.99
    else:
        torch.testing.assert_close(fused.k_cache, reference.k_cache, rtol=KERNEL_FP32_TOLERANCE, atol=1e-6)


def model_logits(folder: Path, *, fused: bool, attention: str, fp8: bool = False) -> list[torch.Tensor]:
    """Logits of a chunked prefill in two slots, then decode steps with both slots in a batch."""
    model = load_transformer(folder, dtype=torch.float32, device="cpu")
    if fp8:
        model.quantize_weights_fp8()
    model.use_fused_kernels(fused)
    model.setup_caches(num_slots=3, max_seq_len=64, attention=attention)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in (20, 13)]
    out = []
    with torch.inference_mode():
        for slot, prompt in zip((2, 0), prompts, strict=True):
            out.append(model.logits(model.prefill(prompt[:8], slot, 0)))
            out.append(model.logits(model.prefill(prompt[8:], slot, 8)))
        tokens = torch.tensor([int(prompts[0][-1]), int(prompts[1][-1])])
        positions = torch.tensor([20, 13])
        for _ in range(4):
            logits = model.logits(model.decode(tokens, torch.tensor([2, 0]), positions, int(positions.max()) + 1))
            out.append(logits)
            tokens, positions = logits.argmax(-1), positions + 1
    return out


@ON_CPU
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_fused_model_logits_match_the_unfused_model(tiny_orpheus: Path, attention: str) -> None:
    plain = model_logits(tiny_orpheus, fused=False, attention=attention)
    fused = model_logits(tiny_orpheus, fused=True, attention=attention)
    for a, b in zip(plain, fused, strict=True):
        assert (a - b).abs().max().item() < MODEL_TOLERANCE
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@ON_CPU
def test_fused_fp8_quantises_inside_the_norm_and_matches_the_unfused_fp8_model(tiny_orpheus: Path) -> None:
    plain = model_logits(tiny_orpheus, fused=False, attention="sdpa", fp8=True)
    fused = model_logits(tiny_orpheus, fused=True, attention="sdpa", fp8=True)
    # A last-bit difference in a normalised value can move one activation to the neighbouring e4m3 value:
    # the bound is e4m3's relative step (2^-4) of one input, far below the distance FP8 itself adds.
    reference = model_logits(tiny_orpheus, fused=False, attention="sdpa")
    for a, b, full in zip(plain, fused, reference, strict=True):
        assert (a - b).abs().max().item() <= 0.25 * max((a - full).abs().max().item(), 1e-3)
    # The norms hand the FP8 GEMMs their input already quantised: no quantisation of its own is called.
    model = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
    model.quantize_weights_fp8()
    model.use_fused_kernels(True)
    model.setup_caches(num_slots=1, max_seq_len=16)
    calls: list[str] = []
    for layer in model.layers:
        for name in ("wqkv",):
            linear = getattr(layer.attention, name)
            assert isinstance(linear, Fp8Linear)
            linear.forward = lambda x, _n=name: calls.append(_n)  # type: ignore[method-assign]
    with torch.inference_mode():
        model.prefill(torch.arange(5), 0, 0)
    assert calls == []


def greedy_rows(engine: TorchEngine, prompts: list[tuple[int, ...]], steps: int,
                adapters: list[str | None] | None = None) -> list[list[int]]:
    """Each prompt prefilled in its own slot (greedy, with its adapter), then all decoded together `steps` times;
    each slot's tokens. Closes the engine."""
    plan = StepPlan()
    for slot, prompt in enumerate(prompts):
        plan.prefill.append(PrefillChunk(slot, f"s{slot}", prompt, 0, len(prompt), SamplingParams(temperature=0.0),
                                         adapter=None if adapters is None else adapters[slot]))
    out = engine.step(plan)
    assert not out.failed, out.failed
    rows = [list(out.tokens[slot]) for slot in range(len(prompts))]
    for _ in range(steps):
        out = engine.step(StepPlan(decode=list(range(len(prompts)))))
        assert not out.failed
        for slot in range(len(prompts)):
            rows[slot] += out.tokens[slot]
    engine.close()
    return rows


# Three short prompts differing in one token.
SHORT_PROMPTS = [(P.START_OF_HUMAN, P.BOS, 10 + slot, 20, 30, *P.PROMPT_SUFFIX) for slot in range(3)]


def greedy_engine_tokens(folder: Path, *, sessions: int = 3, steps: int = 10, **options: object) -> list[list[int]]:
    engine = TorchEngine(folder, num_slots=sessions, max_seq_len=96, device="cpu", dtype="fp32", cuda_graphs=False,
                         **options)  # type: ignore[arg-type]
    prompts = []
    for slot in range(sessions):
        gen = torch.Generator().manual_seed(slot)
        prompts.append((P.START_OF_HUMAN, P.BOS, *torch.randint(0, 1000, (4 + 7 * slot,), generator=gen).tolist(),
                        *P.PROMPT_SUFFIX))
    return greedy_rows(engine, prompts, steps)


@ON_CPU
@pytest.mark.parametrize("options", [{"attention": "triton"}, {"attention": "triton", "kv_cache_dtype": "fp8"}],
                         ids=["triton", "fp8kv"])
def test_fused_engine_greedy_tokens_equal_the_unfused_engine(tiny_orpheus: Path, options: dict[str, str]) -> None:
    assert greedy_engine_tokens(tiny_orpheus, fused=True, **options) == greedy_engine_tokens(tiny_orpheus, **options)


@ON_CPU
def test_fused_engine_with_lora_applies_each_adapter_to_its_slice(tiny_orpheus: Path, tmp_path: Path) -> None:
    """LoRA on q, k, v and gate, up adds to the concatenated GEMMs' outputs: the fused engine gives each
    session the tokens the unfused engine gives it, adapters and all."""
    for i in range(2):
        write_lora_adapter(tmp_path / f"voice{i}", tiny_orpheus, seed=i, rank=4)
    lora = {"adapters_dir": tmp_path, "max_loras": 2, "max_lora_rank": 8}

    def tokens(fused: bool) -> list[list[int]]:
        engine = TorchEngine(tiny_orpheus, num_slots=3, max_seq_len=96, device="cpu", dtype="fp32",
                             cuda_graphs=False, fused=fused, **lora)  # type: ignore[arg-type]
        return greedy_rows(engine, SHORT_PROMPTS, 8, adapters=["voice0", None, "voice1"])

    fused, plain = tokens(True), tokens(False)
    assert fused == plain
    assert plain[0] != plain[1] or plain[2] != plain[1]  # the adapters change what is generated


def test_fused_on_cpu_without_the_interpreter_is_refused(tiny_orpheus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineError, match=r"engine.fused on cpu runs in Triton's interpreter only"):
        TorchEngine(tiny_orpheus, num_slots=1, max_seq_len=32, device="cpu", fused=True)


@ON_CPU
def test_fused_quantize_fp8_of_the_cache_is_the_kernels() -> None:
    """The FP8 cache's quantisation (fp8.quantize_fp8) and the kernel's e4m3 rounding agree on values at
    and around every e4m3 rounding boundary of a binade, ties included."""
    grid = torch.arange(0, 16, dtype=torch.float32)
    values = torch.cat([(8 + grid) * 2.0**e for e in range(-9, 6)])  # e4m3 values (and subnormal multiples)
    mids = torch.cat([values + d for d in (-1e-3, 0.0, 1e-3)]) + 0.5 * 2.0**-9
    probe = torch.cat([values, mids, -mids]).clamp(-448, 448)
    D = 2 * 64
    n = probe.numel() // D * D
    v = probe[:n].view(-1, 1, D)  # [tokens, 1 kv head, D]
    tokens = v.shape[0]
    qkv = torch.cat([torch.zeros(tokens, D), torch.zeros(tokens, D), v[:, 0]], dim=-1).view(tokens, 1, 3 * D)
    cache = torch.zeros(tokens, 1, 1, D, dtype=FP8_DTYPE)
    ones = torch.ones(1)
    rope_cache_write(qkv, torch.ones(tokens, 1, D // 2), torch.zeros(tokens, 1, D // 2), cache.clone(), cache,
                     torch.arange(tokens), torch.zeros(tokens, 1, dtype=torch.int64), n_heads=1, n_kv_heads=1,
                     k_scale=ones, v_scale=ones)
    assert torch.equal(cache[:, 0, 0].float(), quantize_fp8(v[:, 0], ones).float())


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}],
                         ids=["bf16", "fp8kv", "fp8w"])
def test_fused_cuda_graphs_match_the_unfused_engine(tiny_orpheus: Path, options: dict[str, str]) -> None:
    """On a card, bf16, graphs on: the fused engine's greedy tokens follow the unfused engine's (a prefix: a
    near-tie far into a run may go either way, see the graphs-vs-eager test of test_decode_attention.py)."""
    def run(fused: bool) -> list[list[int]]:
        engine = TorchEngine(tiny_orpheus, num_slots=4, max_seq_len=256, device="cuda", dtype="bf16",
                             max_batch_size=4, cuda_graphs=True, attention="triton", fused=fused,
                             **options)  # type: ignore[arg-type]
        return greedy_rows(engine, SHORT_PROMPTS, 40)

    fused, plain = run(True), run(False)
    assert [r[:20] for r in fused] == [r[:20] for r in plain]


def test_fused_graph_sampler_draws_what_the_eager_sampler_draws(tiny_orpheus: Path) -> None:
    """The draw a fused engine captures in its CUDA graphs (`_sample_in_graph`: every row's work done, no host
    parameters) gives constrained rows the tokens the eager `_sample` gives them, greedy, top-k, top-p and
    repetition penalty mixed in one batch, at every frame position."""
    engine = TorchEngine(tiny_orpheus, num_slots=4, max_seq_len=96, device="cpu", dtype="fp32", cuda_graphs=False)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=50, seed=1),
              SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=2),
              SamplingParams(temperature=1.2, seed=3)]
    plan = StepPlan()
    for slot, p in enumerate(params):
        prompt = (P.START_OF_HUMAN, P.BOS, 10 + slot, 20, 30, *P.PROMPT_SUFFIX)
        plan.prefill.append(PrefillChunk(slot, f"s{slot}", prompt, 0, len(prompt), p))
    engine.step(plan)
    compared = 0
    for _ in range(9):  # past a frame boundary: end_of_speech allowed at phase 0 only
        sessions = [engine._sessions[s] for s in range(4)]
        slots = torch.arange(4)
        positions = torch.tensor([s.cached for s in sessions])  # type: ignore[union-attr]
        steps = torch.tensor([s.generated for s in sessions])  # type: ignore[union-attr]
        with torch.inference_mode():
            hidden = engine.model.decode(engine._last_token[slots], slots, positions, int(positions.max()) + 1)
            eager = engine._sample(hidden, slots, steps, steps.tolist(), params)
            captured = engine._sample_in_graph(hidden, slots, steps)
        assert torch.equal(eager, captured), (eager, captured)
        compared += 1
        engine.step(StepPlan(decode=[0, 1, 2, 3]))
    assert compared == 9
    engine.close()
