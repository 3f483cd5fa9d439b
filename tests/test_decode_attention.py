"""The Triton decode-attention kernel, the FP8 KV cache and FP8 weights (docs/ATTENTION.md).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before the kernel module is imported), so shapes stay tiny. The reference is independent of the
kernel: SDPA in fp64 over each row's slot gathered up to its own length.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from orpheus_serve import token_format as P
from orpheus_serve.config import load_config
from orpheus_serve.engines import decode_attention as decode_attention_module
from orpheus_serve.engines.decode_attention import choose_num_splits, decode_attention
from orpheus_serve.engines.fp8 import FP8_DTYPE, Fp8Linear, kv_scales, quantize_fp8, rounding_bound
from orpheus_serve.engines.llama import LlamaConfig
from orpheus_serve.engines.memory import plan_memory, weights_bytes
from orpheus_serve.engines.torch_engine import GraphKey, TorchEngine, decode_graph_keys
from orpheus_serve.request.types import PROTOCOLS
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_cache(*, num_slots: int, kv_heads: int, max_seq_len: int, head_dim: int, heads: int, batch: int,
                 seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A filled cache, a batch of queries, distinct slots in shuffled order and random lengths that
    include 1 and max_seq_len."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots, kv_heads, max_seq_len, head_dim)
    lengths = torch.randint(1, max_seq_len + 1, (batch,), generator=gen)
    lengths[0], lengths[-1] = 1, max_seq_len
    return {
        "k": torch.randn(shape, generator=gen).to(dtype),
        "v": torch.randn(shape, generator=gen).to(dtype),
        "q": torch.randn((batch, heads, head_dim), generator=gen).to(dtype),
        "slots": torch.randperm(num_slots, generator=gen)[:batch],
        "lengths": lengths,
    }


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """SDPA per row over its own slot up to its own length, K/V heads repeated for the group."""
    group = q.shape[1] // k.shape[1]
    rows = []
    for b in range(q.shape[0]):
        keys = k[slots[b], :, : lengths[b]].to(dtype).repeat_interleave(group, 0)  # [H, L, D]
        values = v[slots[b], :, : lengths[b]].to(dtype).repeat_interleave(group, 0)
        rows.append(F.scaled_dot_product_attention(q[b].to(dtype).unsqueeze(1), keys, values).squeeze(1))
    return torch.stack(rows)


def on_device(case: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(DEVICE) for name, t in case.items()}


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_fp32_matches_fp64_reference(group: int, num_splits: int, head_dim: int) -> None:
    c = random_cache(num_slots=7, kv_heads=2, max_seq_len=90, head_dim=head_dim, heads=2 * group, batch=5,
                     seed=group * 10 + num_splits)
    d = on_device(c)
    out = decode_attention(d["q"], d["k"], d["v"], d["slots"], d["lengths"], num_splits=num_splits)
    assert out.shape == c["q"].shape and out.dtype == torch.float32
    expected = reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"])
    torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=2e-6)


def test_compiled_with_a_dynamic_batch_is_the_eager_kernel_bit_for_bit_with_one_compilation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile (fullgraph, a dynamic batch) the kernels run behind the `orpheus_serve::decode_attention`
    op: at batch sizes whose split counts differ, the output is the eager call's to the bit, and one graph
    serves them all (the split count is chosen inside the op, so the graph never specialises on it). Few
    programs are aimed at, so that small shapes get different split counts, as the served model's do."""
    monkeypatch.setattr(decode_attention_module, "TARGET_PROGRAMS", 16)
    compiles = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiles.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    attend = torch.compile(decode_attention, backend=backend, fullgraph=True)
    splits = set()
    for batch in (2, 3, 5, 6):
        c = on_device(random_cache(num_slots=7, kv_heads=2, max_seq_len=128, head_dim=16, heads=4, batch=batch,
                                   seed=batch))
        for name in ("q", "slots", "lengths"):
            torch._dynamo.mark_dynamic(c[name], 0)
        eager = decode_attention(c["q"], c["k"], c["v"], c["slots"], c["lengths"])
        got = attend(c["q"], c["k"], c["v"], c["slots"], c["lengths"])
        assert torch.equal(got, eager), batch
        splits.add(choose_num_splits(batch, 2, 128))
    assert len(splits) >= 3, splits  # the batches did ask for different split counts
    assert len(compiles) == 1, f"{len(compiles)} compilations"
    assert any(n.target is torch.ops.orpheus_serve.decode_attention.default for n in compiles[0].graph.nodes)


def test_bf16_error_within_twice_sdpa_bf16() -> None:
    c = random_cache(num_slots=6, kv_heads=2, max_seq_len=100, head_dim=32, heads=6, batch=4, seed=3,
                     dtype=torch.bfloat16)
    d = on_device(c)
    expected = reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"])
    sdpa_bf16 = reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"], dtype=torch.bfloat16).double()
    for splits in (1, 4):
        out = decode_attention(d["q"], d["k"], d["v"], d["slots"], d["lengths"], num_splits=splits)
        assert out.dtype == torch.bfloat16
        kernel_error = (out.cpu().double() - expected).abs()
        sdpa_error = (sdpa_bf16 - expected).abs()
        for reduce in (torch.max, torch.mean):
            assert reduce(kernel_error) <= 2 * reduce(sdpa_error), (reduce, kernel_error, sdpa_error)


def test_reads_only_each_rows_own_slot_up_to_its_length() -> None:
    """NaN everywhere a row must not look (other slots, past its length): the output stays finite and equal."""
    c = random_cache(num_slots=5, kv_heads=1, max_seq_len=70, head_dim=16, heads=3, batch=3, seed=4)
    poisoned = {name: c[name].clone() for name in ("k", "v")}
    for tensor in poisoned.values():
        keep = torch.zeros_like(tensor, dtype=torch.bool)
        for slot, length in zip(c["slots"].tolist(), c["lengths"].tolist(), strict=True):
            keep[slot, :, :length] = True
        tensor[~keep] = float("nan")
    d = on_device({**c, **poisoned})
    out = decode_attention(d["q"], d["k"], d["v"], d["slots"], d["lengths"], num_splits=4).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"]),
                               rtol=0, atol=2e-6)


def test_fp8_cache_within_the_documented_bound() -> None:
    """e4m3 K/V with per-head scales: tight against the reference over the dequantised cache, and within
    docs/ATTENTION.md's bound against the unquantised one:
    |err| <= (exp(2 eps) - 1) max_i |v'_i| + max_i dv_i, eps = max_i sm_scale sum_d |q_d| dk_id."""
    c = random_cache(num_slots=6, kv_heads=2, max_seq_len=80, head_dim=16, heads=4, batch=4, seed=5)
    k_scale = kv_scales(c["k"].abs().amax(dim=(0, 2, 3)))
    v_scale = kv_scales(c["v"].abs().amax(dim=(0, 2, 3)))
    per_head = (1, -1, 1, 1)
    k8 = quantize_fp8(c["k"], k_scale.view(per_head))
    v8 = quantize_fp8(c["v"], v_scale.view(per_head))
    assert k8.dtype == FP8_DTYPE and k8.element_size() * 4 == c["k"].element_size()
    k_deq, v_deq = k8.float() * k_scale.view(per_head), v8.float() * v_scale.view(per_head)
    d = on_device({**c, "k": k8, "v": v8})
    out = decode_attention(d["q"], d["k"], d["v"], d["slots"], d["lengths"], k_scale=k_scale.to(DEVICE),
                           v_scale=v_scale.to(DEVICE), num_splits=2).cpu().double()
    torch.testing.assert_close(out, reference(c["q"], k_deq, v_deq, c["slots"], c["lengths"]), rtol=0, atol=2e-6)

    exact = reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"])
    error = (out - exact).abs()
    assert error.max() > 0  # really quantised
    dk = rounding_bound(c["k"], k_scale.view(per_head))
    dv = rounding_bound(c["v"], v_scale.view(per_head))
    group, sm_scale = 2, 1 / math.sqrt(16)
    for b, (slot, length) in enumerate(zip(c["slots"].tolist(), c["lengths"].tolist(), strict=True)):
        for h in range(4):
            kv = h // group
            eps = sm_scale * (c["q"][b, h].abs().double() @ dk[slot, kv, :length].double().T).max()
            bound = (torch.exp(2 * eps) - 1) * v_deq[slot, kv, :length].abs().amax(0) + dv[slot, kv, :length].amax(0)
            assert (error[b, h] <= bound + 1e-6).all(), (b, h, error[b, h], bound)


def test_split_count_depends_only_on_shapes() -> None:
    assert choose_num_splits(1, 8, 4096) == 64  # a lone row is spread over many programs
    assert choose_num_splits(256, 8, 4096) == 1  # a full batch fills the GPU by itself
    assert choose_num_splits(1, 8, 20) == 1  # never more splits than blocks
    splits = choose_num_splits(4, 2, 256)
    assert splits & (splits - 1) == 0


def test_rejects_a_cache_that_does_not_match() -> None:
    c = random_cache(num_slots=2, kv_heads=2, max_seq_len=8, head_dim=16, heads=4, batch=1, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        decode_attention(c["q"][:, :3], c["k"], c["v"], c["slots"], c["lengths"])
    with pytest.raises(ValueError, match="FP8 cache needs"):
        decode_attention(c["q"], c["k"].to(FP8_DTYPE), c["v"].to(FP8_DTYPE), c["slots"], c["lengths"])


# ----------------------------------------------------------------------------- FP8 weights


def test_fp8_linear_matches_the_matmul_within_e4m3_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen) * torch.rand(48, 1, generator=gen)  # rows of different ranges
    x = torch.randn(2, 5, 64, generator=gen) * 3
    layer = Fp8Linear(weight)
    assert layer.weight_fp8.dtype == FP8_DTYPE and layer.weight_scale.shape == (1, 48)
    y = layer(x)
    assert y.shape == (2, 5, 48) and y.dtype == x.dtype
    exact = x.double() @ weight.double().T
    # Each product carries at most two e4m3 roundings (2^-4 each, relative) plus subnormal slack.
    bound = (2 * 2**-4 + 2**-8) * (x.abs().double() @ weight.abs().double().T) + 1e-4
    error = (y.double() - exact).abs()
    assert (error <= bound).all()
    assert 0 < error.norm() / exact.norm() < 0.05


def test_fp8_weights_shrink_the_plan(tiny_orpheus: Path) -> None:
    config = LlamaConfig.from_folder(tiny_orpheus)
    full, fp8 = weights_bytes(config, torch.bfloat16), weights_bytes(config, torch.bfloat16, "fp8")
    gemm_params = config.dims.layer_matmul_params * config.n_layers
    assert full - fp8 == gemm_params - 4 * config.n_layers * (
        config.q_size + 2 * config.kv_size + 2 * config.dim + 2 * config.intermediate_size)
    engine = TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=64, device="cpu", dtype="fp32",
                         cuda_graphs=False, quantization="fp8")
    assert engine.memory_report().weights_bytes == engine.memory_plan.weights_bytes
    engine.close()


# ----------------------------------------------------------------------------- engine


def greedy_tokens(engine: TorchEngine, *, sessions: int, steps: int) -> list[list[int]]:
    """`sessions` prompts of different lengths prefilled, then decoded together, greedy and constrained."""
    tokens: list[list[int]] = []
    plan = StepPlan()
    for slot in range(sessions):
        gen = torch.Generator().manual_seed(slot)
        prompt = (P.START_OF_HUMAN, P.BOS, *torch.randint(0, 1000, (4 + 7 * slot,), generator=gen).tolist(),
                  *P.PROMPT_SUFFIX)
        plan.prefill.append(PrefillChunk(slot, f"s{slot}", prompt, 0, len(prompt), SamplingParams(temperature=0.0)))
    out = engine.step(plan)
    assert not out.failed
    tokens = [out.tokens[slot] for slot in range(sessions)]
    for _ in range(steps):
        out = engine.step(StepPlan(decode=list(range(sessions))))
        assert not out.failed
        for slot in range(sessions):
            tokens[slot] += out.tokens[slot]
    return tokens


def make_engine(folder: Path, **options: object) -> TorchEngine:
    return TorchEngine(folder, num_slots=3, max_seq_len=96, device="cpu", dtype="fp32", cuda_graphs=False,
                       **options)  # type: ignore[arg-type]


def test_triton_greedy_tokens_equal_sdpa(tiny_orpheus: Path) -> None:
    sdpa = greedy_tokens(make_engine(tiny_orpheus, attention="sdpa"), sessions=3, steps=12)
    triton_engine = make_engine(tiny_orpheus, attention="triton")
    assert triton_engine.model.attention_kernel == "triton"
    assert greedy_tokens(triton_engine, sessions=3, steps=12) == sdpa


def test_fp8_cache_is_a_quarter_of_fp32_and_decodes(tiny_orpheus: Path) -> None:
    fp32 = make_engine(tiny_orpheus)
    fp8 = make_engine(tiny_orpheus, attention="triton", kv_cache_dtype="fp8")
    full, small = fp32.memory_report(), fp8.memory_report()
    assert small.kv_bytes_per_slot * 4 == full.kv_bytes_per_slot
    assert small.kv_cache_bytes * 4 == full.kv_cache_bytes
    assert fp8.memory_plan.kv_bytes_per_slot == small.kv_bytes_per_slot
    assert (small.kv_cache_dtype, full.kv_cache_dtype) == ("float8_e4m3fn", "float32")
    cache = fp8.model.layers[0].attention.kv_cache
    assert cache is not None and cache.k_scale is not None and (cache.k_scale > 0).all()
    tokens = greedy_tokens(fp8, sessions=2, steps=14)
    for row in tokens:
        for position, token in enumerate(row):
            lo, hi = P.slot_token_range(position)
            assert lo <= token < hi


def test_plan_counts_kv_bytes_by_dtype(tiny_orpheus: Path) -> None:
    config = LlamaConfig.from_folder(tiny_orpheus)
    plans = {dtype: plan_memory(config, num_slots=4, max_seq_len=256, dtype=torch.bfloat16, max_batch_size=4,
                                budget_bytes=None, kv_dtype=dtype) for dtype in (torch.bfloat16, FP8_DTYPE)}
    assert plans[torch.bfloat16].kv_bytes_per_slot == 2 * plans[FP8_DTYPE].kv_bytes_per_slot
    assert "float8_e4m3fn" in plans[FP8_DTYPE].describe()


def test_config_options_reach_the_engine(tiny_orpheus: Path, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"engine: {{model_path: {tiny_orpheus}, device: cpu, attention: triton, kv_cache_dtype: fp8, "
                    "quantization: fp8, max_seq_len: 64}\nscheduler: {max_concurrent_sessions: 2, max_batch_size: 2}\n")
    config = load_config(path, env={})
    engine = TorchEngine.from_config(config)
    assert engine.attention == "triton" and engine.kv_dtype == FP8_DTYPE
    assert type(engine.model.layers[0].feed_forward.w2).__name__ == "Fp8Linear"
    engine.close()


def triton_graph_kv_lens(engine: TorchEngine) -> set[int]:
    """The KV length buckets of the decode graphs `engine` captures (planned: on a CPU none are)."""
    return {key.kv_len for key in engine.planned_graph_keys()}


def test_triton_decode_graphs_are_one_length_bucket_per_padded_batch(tiny_orpheus: Path) -> None:
    """What the CUDA test below checks of the captured graphs, checked here on the plan they are captured from:
    keys are (batch, kv_len, with_lora), one length bucket with the Triton kernel, several with SDPA."""
    triton_engine = TorchEngine(tiny_orpheus, num_slots=4, max_seq_len=512, device="cpu", dtype="fp32",
                                max_batch_size=4, cuda_graphs=False, attention="triton")
    keys = triton_engine.planned_graph_keys()
    assert [(k.batch, k.kv_len, k.with_lora) for k in keys] == [(4, 512, False), (2, 512, False), (1, 512, False)]
    assert triton_graph_kv_lens(triton_engine) == {512} and triton_engine.graph_keys == []  # no graphs on a CPU
    sdpa_engine = TorchEngine(tiny_orpheus, num_slots=4, max_seq_len=512, device="cpu", dtype="fp32",
                              max_batch_size=4, cuda_graphs=False, attention="sdpa")
    assert triton_graph_kv_lens(sdpa_engine) == {256, 512}
    assert decode_graph_keys(max_batch_size=2, max_seq_len=256, attention="triton", lora=True) == [
        GraphKey(2, 256, False), GraphKey(2, 256, True), GraphKey(1, 256, False), GraphKey(1, 256, True)]


def test_triton_on_cpu_without_the_interpreter_is_refused(tiny_orpheus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineError, match="TRITON_INTERPRET=1"):
        make_engine(tiny_orpheus, attention="triton")
    with pytest.raises(EngineError, match="unsupported KV cache dtype"):
        make_engine(tiny_orpheus, kv_cache_dtype="int4")


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_graphs_with_triton_equal_eager(tiny_orpheus: Path, kv_cache_dtype: str) -> None:
    """One graph per padded batch size (no length buckets) replays what eager decoding computes. Eager runs
    pick their split count from the real batch, graphs from the padded one: the same sums in another order,
    so only a prefix is compared (a near-tie far into a run may go either way)."""
    def run(cuda_graphs: bool) -> list[list[int]]:
        engine = TorchEngine(tiny_orpheus, num_slots=4, max_seq_len=512, device="cuda", dtype="fp32",
                             max_batch_size=4, cuda_graphs=cuda_graphs, attention="triton",
                             kv_cache_dtype=kv_cache_dtype)
        if cuda_graphs:
            assert engine.graph_keys == engine.planned_graph_keys() and triton_graph_kv_lens(engine) == {512}
        tokens = greedy_tokens(engine, sessions=3, steps=200)
        engine.close()
        return tokens

    graphed, eager = run(True), run(False)
    assert [t[:60] for t in graphed] == [t[:60] for t in eager]


@pytest.mark.gpu
def test_cuda_bf16_kernel_matches_reference_at_orpheus_shapes() -> None:
    c = random_cache(num_slots=16, kv_heads=8, max_seq_len=1024, head_dim=128, heads=24, batch=12, seed=9,
                     dtype=torch.bfloat16)
    d = on_device(c)
    expected = reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"])
    sdpa_bf16 = reference(c["q"], c["k"], c["v"], c["slots"], c["lengths"], dtype=torch.bfloat16).double()
    out = decode_attention(d["q"], d["k"], d["v"], d["slots"], d["lengths"]).cpu().double()
    assert (out - expected).abs().max() <= 2 * (sdpa_bf16 - expected).abs().max()


# ----------------------------------------------------------------------------- server


@pytest.mark.slow
@pytest.mark.parametrize("protocols", [
    ("grpc",),  # the CI lane: the engine's attention is the same whatever protocol asked
    pytest.param(PROTOCOLS, marks=pytest.mark.full_size),  # every protocol in one batch: scripts/test.sh --all
], ids=["one-protocol", "every-protocol"])
def test_server_with_triton_and_fp8_cache_serves_every_protocol(tiny_orpheus: Path, tiny_snac: Path,
                                                                protocols: tuple[str, ...]) -> None:
    """The whole server (real uvicorn and gRPC) with engine.attention=triton and engine.kv_cache_dtype=fp8:
    each protocol streams audio, and /v1/stats shows the FP8 cache at a quarter of the fp32 bytes per slot.
    Under the Triton interpreter a step costs about a second per session in the batch."""
    import asyncio

    from orpheus_serve.client import protocols as api_client
    from orpheus_serve.engines.memory import kv_bytes_per_slot
    from tests.gateway_support import start_server, stats, tiny_config

    # One slot per protocol and a long queue timeout: the interpreter takes about a second per decode step.
    config = tiny_config(tiny_orpheus, tiny_snac, **{
        "engine.attention": "triton", "engine.kv_cache_dtype": "fp8", "engine.max_seq_len": 256,
        "scheduler.max_concurrent_sessions": len(protocols), "scheduler.max_batch_size": len(protocols),
        "scheduler.queue_timeout_s": 600.0, "server.stalled_client_timeout_s": 600.0})
    server = start_server(config)
    try:
        async def every_protocol() -> list[api_client.ClientResult]:
            return await asyncio.gather(*(
                api_client.synthesize(p, "Hello there.", url=server.base_url, grpc_addr=server.grpc_address,
                                      voice="tara", fmt="pcm", temperature=0.0, seed=1, max_tokens=28)
                for p in protocols))

        results = asyncio.run(every_protocol())
        for result in results:
            assert result.ok, (result.protocol, result.error)
            assert len(result.audio) > 0
        kv = stats(server)["kv_cache"]
        fp32_bytes = kv_bytes_per_slot(LlamaConfig.from_folder(tiny_orpheus), 256, torch.float32)
        assert kv["dtype"] == "float8_e4m3fn" and kv["bytes_per_slot"] * 4 == fp32_bytes
    finally:
        server.stop()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=["fp32", "bf16", "fp8"])
def test_fused_pipelined_blocks_match_the_reference(cache_dtype: torch.dtype) -> None:
    """engine.fused's decode attention: blocks of block_rows(dtype) rows (16, 32, 64: equal bytes), the loop
    Triton pipelines on a GPU (the interpreter runs the same block in its plain loop). Exact against the
    reference over what the cache holds."""
    from orpheus_serve.engines.decode_attention import block_rows

    assert [block_rows(d) for d in (torch.float32, torch.bfloat16, FP8_DTYPE)] == [16, 32, 64]
    c = random_cache(num_slots=5, kv_heads=2, max_seq_len=150, head_dim=16, heads=4, batch=4, seed=12)
    per_head = (1, -1, 1, 1)
    scales: dict[str, torch.Tensor] = {}
    k, v = c["k"].to(cache_dtype), c["v"].to(cache_dtype)
    if cache_dtype == FP8_DTYPE:
        scales = {"k_scale": kv_scales(c["k"].abs().amax(dim=(0, 2, 3))),
                  "v_scale": kv_scales(c["v"].abs().amax(dim=(0, 2, 3)))}
        k, v = quantize_fp8(c["k"], scales["k_scale"].view(per_head)), quantize_fp8(c["v"], scales["v_scale"].view(per_head))
    k_held = k.float() * scales["k_scale"].view(per_head) if scales else k.float()
    v_held = v.float() * scales["v_scale"].view(per_head) if scales else v.float()
    d = on_device({**c, "k": k, "v": v, **scales})
    for splits in (1, 2):
        out = decode_attention(d["q"], d["k"], d["v"], d["slots"], d["lengths"], num_splits=splits, pipelined=True,
                               **{n: d[n] for n in scales})
        expected = reference(c["q"], k_held, v_held, c["slots"], c["lengths"])
        torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=2e-6)
