"""`engine.compile` (engines/compiled.py): the decode pass under torch.compile, on inductor's CPU backend.

Inductor generates and builds C++ for the CPU (gcc): minutes per compilation on a small shared machine.
So the default lane runs the decode-pass check with the "aot_eager" backend (dynamo's and AOTAutograd's
tracing with the dynamic batch, no code generation: seconds), and the same check on inductor, the engine
end to end and the on-disk cache across a restart are `slow`. Tolerance: fp32 logits within
1e-4 of eager (inductor fuses and reorders reductions; the tiny model's logits are of order 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orpheus_serve import token_format as P
from orpheus_serve.engines.compiled import CompiledDecode
from orpheus_serve.engines.llama import LlamaConfig, load_transformer
from orpheus_serve.engines.lora import LoraBatch, LoraPool, read_peft_adapter
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.weights.tiny import write_lora_adapters

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGITS_ATOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("backend", "with_lora"), [
    ("aot_eager", False), ("aot_eager", True), pytest.param("inductor", False, marks=pytest.mark.slow)])
def test_compiled_decode_equals_eager_for_every_batch_size(tiny_orpheus: Path, tmp_path: Path, backend: str,
                                                            with_lora: bool) -> None:
    """One compilation (dynamic batch) serves batches of 3, 5 and 1: logits within LOGITS_ATOL of the eager
    pass, the same greedy tokens, and the same KV cache written; with LoRA, rows on mixed adapters (the torch
    path: the kernels' own path needs CUDA)."""
    torch._dynamo.reset()
    model = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
    model.setup_caches(num_slots=6, max_seq_len=32)
    compiled = CompiledDecode(model, cache_dir=tmp_path / "cache", backend=backend)
    pool = None
    if with_lora:
        config = LlamaConfig.from_folder(tiny_orpheus)
        write_lora_adapters(tmp_path / "adapters", tiny_orpheus, 2, seed=3)
        pool = LoraPool(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
        for entry in (1, 2):
            pool.write(entry, read_peft_adapter(tmp_path / "adapters" / f"voice{entry - 1}", config, max_rank=8))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache").resolve())
    gen = torch.Generator().manual_seed(4)
    kv_len = 16
    with torch.inference_mode():
        for batch in (3, 5, 1):
            tokens = torch.randint(0, 150_000, (batch,), generator=gen)
            slots = torch.randperm(6, generator=gen)[:batch]
            positions = torch.randint(0, kv_len, (batch,), generator=gen)
            lora = None if pool is None else LoraBatch.on_device(pool, (torch.arange(batch) + 1) % 3, kernel=False)
            eager = model.logits(model.decode(tokens, slots, positions, kv_len, lora))
            k_eager = [layer.attention.kv_cache.k_cache.clone() for layer in model.layers]
            got = model.logits(compiled(tokens, slots, positions, kv_len, lora))
            torch.testing.assert_close(got, eager, rtol=0, atol=LOGITS_ATOL)
            assert torch.equal(got.argmax(-1), eager.argmax(-1))
            for layer, k in zip(model.layers, k_eager, strict=True):
                torch.testing.assert_close(layer.attention.kv_cache.k_cache, k, rtol=0, atol=1e-5)
    if backend == "inductor":
        assert any((tmp_path / "cache").iterdir())  # inductor's code went into the configured folder


def greedy_run(engine: TorchEngine, sessions: int, steps: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(sessions)]
    for slot in range(sessions):
        prompt = (P.START_OF_HUMAN, P.BOS, *range(100 + slot, 110 + 3 * slot), *P.PROMPT_SUFFIX)
        out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"r{slot}", prompt, 0, len(prompt),
                                                         SamplingParams(temperature=0.0))]))
        tokens[slot] += out.tokens[slot]
    for i in range(steps):
        rows = list(range(sessions)) if i % 3 else [1]  # full batches and a batch of one
        out = engine.step(StepPlan(decode=rows))
        assert not out.failed, out.failed
        for slot, new in out.tokens.items():
            tokens[slot] += new
    return tokens


@pytest.mark.slow
def test_compiled_engine_gives_eager_greedy_tokens(tiny_orpheus: Path, tmp_path: Path) -> None:
    """engine.compile end to end: warm-up at start (its time reported), then steps of several sizes and
    growing contexts, the greedy tokens of the eager engine."""
    def engine(compiled: bool) -> TorchEngine:
        return TorchEngine(tiny_orpheus, num_slots=3, max_seq_len=64, device="cpu", dtype="fp32", max_batch_size=4,
                           cuda_graphs=False, compile_decode=compiled, compile_cache_dir=tmp_path / "cache")

    eager = engine(False)
    assert eager.memory_report().compile_s is None
    expected = greedy_run(eager, 3, 8)
    compiled = engine(True)
    assert compiled.memory_report().compile_s is not None and compiled.compile_s > 0
    assert greedy_run(compiled, 3, 8) == expected


CHILD = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
from orpheus_serve.engines.torch_engine import TorchEngine
torch.set_num_threads(1)
engine = TorchEngine(sys.argv[1], num_slots=2, max_seq_len=64, device="cpu", dtype="fp32", max_batch_size=2,
                     cuda_graphs=False, compile_decode=True, compile_cache_dir=sys.argv[2])
print(json.dumps({"compile_s": engine.compile_s, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


@pytest.mark.slow
def test_a_restart_reads_compiled_code_from_the_cache(tiny_orpheus: Path, tmp_path: Path) -> None:
    """Two processes with the same compile_cache_dir: the first generates the code, the second finds every graph
    in inductor's FX graph cache (no miss) and starts faster."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}

    def start() -> dict[str, float]:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_orpheus), str(tmp_path / "cache")],
                              capture_output=True, text=True, env=env, timeout=600, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = start(), start()
    assert cold["misses"] > 0 and cold["hits"] == 0
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"]
    assert warm["compile_s"] < cold["compile_s"]
