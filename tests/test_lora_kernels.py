"""The segmented LoRA kernels (engines/lora_kernels.py) against the plain torch reference (engines/lora.py).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before
the kernel module is imported), so shapes stay small. Exactness against merged weights is tests/test_lora.py's:
the reference here is `lora_reference`, whose pool-mode forward pass that file checks against PEFT.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from orpheus_serve import token_format as P
from orpheus_serve.engines.lora import LoraBatch, LoraPool, lora_reference, read_peft_adapter
from orpheus_serve.engines.lora_kernels import lora_segmented
from orpheus_serve.engines.lora_segments import LoraSegments
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.weights.tiny import write_lora_adapters

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_RANK = 8


def random_pool(*, entries: int, n_in: int, bounds: list[int], rank: int, ranks: list[int],
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [P, in, S*R] and B [P, R, out] laid out as LoraPool lays them out: entry 0 zero, entry e of rank
    ranks[e] (< R: zero-padded columns of A and rows of B)."""
    gen = torch.Generator().manual_seed(seed)
    slices = len(bounds) - 1
    a = torch.randn(entries, n_in, slices * rank, generator=gen)
    b = torch.randn(entries, rank, bounds[-1], generator=gen)
    a[0], b[0] = 0, 0
    for e, r in enumerate(ranks):
        b[e, r:] = 0
        for s in range(slices):
            a[e, :, s * rank + r : (s + 1) * rank] = 0
    return a, b


@pytest.mark.parametrize(("rows", "n_in", "bounds", "entries"), [
    (37, 40, [0, 48, 64, 80], 5),  # q|k|v-like: three projections in one column block
    (9, 300, [0, 150, 300], 3),  # gate|up-like: the shrink splits `in`, projections straddle column blocks
    (1, 64, [0, 200], 2),  # one row, one projection, two column blocks
    (40, 24, [0, 24], 9),  # more rows per adapter than a tile holds
])
def test_segmented_kernels_equal_the_torch_reference(rows: int, n_in: int, bounds: list[int],
                                                     entries: int) -> None:
    """Mixed adapters, rows without one, ranks below the pool's: the kernels add what the gathered
    torch path adds (fp32: rounding only), and leave rows without an adapter bit for bit alone."""
    ranks = [0] + [[8, 3, 5, 1][e % 4] for e in range(1, entries)]
    a, b = random_pool(entries=entries, n_in=n_in, bounds=bounds, rank=MAX_RANK, ranks=ranks, seed=rows)
    gen = torch.Generator().manual_seed(100 + rows)
    row_entries = torch.randint(0, entries, (rows,), generator=gen)
    if rows > 1:
        row_entries[0] = 0
    x = torch.randn(rows, n_in, generator=gen)
    y = torch.randn(rows, bounds[-1], generator=gen)
    a, b, x, y, row_entries = (t.to(DEVICE) for t in (a, b, x, y, row_entries))
    expected = lora_reference(x, y, a, b, row_entries, bounds, MAX_RANK)
    segments = LoraSegments.from_entries(row_entries, entries)
    got = lora_segmented(x, y.clone(), a, b, segments, torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
                         MAX_RANK)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    base = row_entries == 0
    assert torch.equal(got[base], y[base])
    assert not torch.equal(got[~base], y[~base])  # the adapters did add something


def test_segments_group_rows_by_adapter_in_fixed_shapes() -> None:
    entries = torch.tensor([3, 0, 1, 3, 3, 0, 1, 2, 3, 3])
    seg = LoraSegments.from_entries(entries, num_entries=4, block_m=2)
    assert seg.order.tolist() == [1, 5, 2, 6, 7, 0, 3, 4, 8, 9]  # stable within each entry
    # tiles: entry 1 (rows 2, 6), entry 2 (row 7), entry 3 in tiles of 2, then the unused ones (entry 0)
    assert seg.tiles.tolist() == [[1, 2, 3, 3, 3, 0, 0, 0],
                                  [2, 4, 5, 7, 9, 0, 0, 0],
                                  [4, 5, 7, 9, 10, 0, 0, 0]]
    # the tile count depends only on the row count and the pool size: a graph captured once serves any mix
    other = LoraSegments.from_entries(torch.zeros(10, dtype=torch.int64), num_entries=4, block_m=2)
    assert other.num_tiles == seg.num_tiles and not other.tiles[0].any()


def test_kernel_mode_forward_pass_equals_pool_and_gather_modes(tiny_orpheus: Path, tmp_path: Path) -> None:
    """The model's decode pass with the rows' adapters through the kernels, the torch gather and the host's
    grouping: the same hidden states to rounding."""
    from orpheus_serve.engines.llama import LlamaConfig, load_transformer

    write_lora_adapters(tmp_path, tiny_orpheus, 3, seed=1)
    config = LlamaConfig.from_folder(tiny_orpheus)
    pool = LoraPool(config, max_loras=3, max_rank=MAX_RANK, dtype=torch.float32, device="cpu")
    for entry in (1, 2, 3):
        pool.write(entry, read_peft_adapter(tmp_path / f"voice{entry - 1}", config, max_rank=MAX_RANK))
    model = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
    model.setup_caches(num_slots=6, max_seq_len=32)
    tokens = torch.randint(0, 1000, (6,), generator=torch.Generator().manual_seed(7))
    slots, positions = torch.arange(6), torch.tensor([0, 3, 1, 5, 2, 4])
    entries = [2, 0, 1, 3, 2, 0]
    with torch.inference_mode():
        hidden = {mode: model.decode(tokens, slots, positions, 8, LoraBatch.for_rows(pool, entries, mode=mode))
                  for mode in ("kernel", "pool", "gather")}
        base = model.decode(tokens, slots, positions, 8)
    torch.testing.assert_close(hidden["kernel"], hidden["pool"], rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden["kernel"], hidden["gather"], rtol=0, atol=1e-5)
    assert not torch.allclose(hidden["kernel"][0], base[0])  # adapters change their rows


def greedy_tokens(engine: TorchEngine, adapters: list[str | None], steps: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in adapters]
    for slot, adapter in enumerate(adapters):
        prompt = (P.START_OF_HUMAN, P.BOS, *range(200 + slot, 207 + 2 * slot), *P.PROMPT_SUFFIX)
        out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"r{slot}", prompt, 0, len(prompt),
                                                         SamplingParams(temperature=0.0), adapter=adapter)]))
        assert not out.failed, out.failed
        tokens[slot] += out.tokens[slot]
    for _ in range(steps):
        out = engine.step(StepPlan(decode=list(range(len(adapters)))))
        assert not out.failed, out.failed
        for slot, new in out.tokens.items():
            tokens[slot] += new
    return tokens


def test_engine_with_triton_lora_kernel_gives_the_tokens_of_the_torch_path(tiny_orpheus: Path,
                                                                           tmp_path: Path) -> None:
    write_lora_adapters(tmp_path, tiny_orpheus, 3, seed=0)
    adapters = ["voice0", None, "voice1", "voice2", "voice0"]

    def run(kernel: str) -> list[list[int]]:
        engine = TorchEngine(tiny_orpheus, num_slots=5, max_seq_len=64, device=DEVICE, dtype="fp32",
                             max_batch_size=8, cuda_graphs=False, adapters_dir=tmp_path, max_loras=3,
                             max_lora_rank=MAX_RANK, lora_kernel=kernel)
        assert engine.lora_kernel == kernel
        try:
            return greedy_tokens(engine, adapters, steps=6)
        finally:
            engine.close()

    assert run("triton") == run("torch")


def test_triton_lora_kernel_on_cpu_without_the_interpreter_is_refused(tiny_orpheus: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineError, match="TRITON_INTERPRET=1"):
        TorchEngine(tiny_orpheus, num_slots=1, max_seq_len=64, device="cpu", adapters_dir=tmp_path, max_loras=1,
                    lora_kernel="triton")
    auto = TorchEngine(tiny_orpheus, num_slots=1, max_seq_len=64, device="cpu", lora_kernel="auto")
    assert auto.lora_kernel == "torch"  # auto: the kernels on CUDA only


@pytest.mark.gpu
def test_cuda_graphs_with_the_lora_kernels_equal_eager_torch_path(tiny_orpheus: Path, tmp_path: Path) -> None:
    """Kernel mode inside captured decode graphs (padded batches, mixed adapters) gives the tokens of eager
    CUDA steps on the torch path (fp32)."""
    write_lora_adapters(tmp_path, tiny_orpheus, 3, seed=0)
    adapters = ["voice0", None, "voice1", "voice2", "voice0"]

    def run(kernel: str, graphs: bool) -> list[list[int]]:
        engine = TorchEngine(tiny_orpheus, num_slots=5, max_seq_len=64, device="cuda", dtype="fp32",
                             max_batch_size=8, cuda_graphs=graphs, adapters_dir=tmp_path, max_loras=3,
                             max_lora_rank=MAX_RANK, lora_kernel=kernel)
        try:
            return greedy_tokens(engine, adapters, steps=12)
        finally:
            engine.close()

    assert run("triton", True) == run("torch", False)
