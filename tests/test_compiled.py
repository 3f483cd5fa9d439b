"""`engine.compile` (engines/compiled.py): the decode pass under torch.compile, on inductor's CPU backend.

Inductor generates and builds C++ for the CPU (gcc): minutes per compilation on a small shared machine.
So the default lane runs the decode-pass check and the engine end to end with the "aot_eager" backend
(dynamo's and AOTAutograd's tracing with the dynamic batch, no code generation: seconds), and the same checks
on inductor and the on-disk cache across a restart are `slow`. The eager reference is always a second model
or engine with its own KV cache, so the compiled pass is checked against what it wrote itself; a counting
backend shows that the compiled code ran each step and that nothing compiled again. Tolerance: fp32 logits within
1e-4 of eager (inductor fuses and reorders reductions; the tiny model's logits are of order 1).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # the Triton decode attention runs in Triton's interpreter (before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from orpheus_serve import token_format as P
from orpheus_serve.engines import decode_attention
from orpheus_serve.engines.compiled import CompiledDecode
from orpheus_serve.engines.llama import LlamaConfig, Transformer, load_transformer
from orpheus_serve.engines.lora import LoraBatch, LoraPool, read_peft_adapter
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.weights.tiny import write_lora_adapters

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGITS_ATOL = 1e-4
KV_ATOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


class CountingBackend:
    """torch.compile's `backend` by name, counting its compilations and every call into the code it compiled:
    a decode that fell back to eager, or that recompiled, shows in the counts."""

    def __init__(self, backend: str) -> None:
        self.inner = torch._dynamo.lookup_backend(backend)
        self.compiles = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.compiles += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


def assert_same_kv(got: Transformer, expected: Transformer, what: str) -> None:
    """Every layer's K and V cache, all of it: what each model wrote itself."""
    for i, (mine, theirs) in enumerate(zip(got.layers, expected.layers, strict=True)):
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(mine.attention.kv_cache, name), getattr(theirs.attention.kv_cache, name),
                                       rtol=0, atol=KV_ATOL, msg=lambda m, i=i, name=name: f"{what}, layer {i} {name}: {m}")


@pytest.mark.parametrize(("backend", "with_lora"), [
    ("aot_eager", False), ("aot_eager", True), pytest.param("inductor", False, marks=pytest.mark.slow)])
def test_compiled_decode_equals_eager_for_every_batch_size(tiny_orpheus: Path, tmp_path: Path, backend: str,
                                                            with_lora: bool) -> None:
    """Two models, each with its own KV cache: the same prompts prefilled into both, then decode steps of 3,
    5, 1 and 2 rows over growing contexts, eager on one and compiled on the other. Each step: logits within
    LOGITS_ATOL, the same greedy tokens, and the same K and V caches, each written by its own pass (so a
    step reads what the compiled pass wrote before it). Every step runs the compiled code; after the first
    two (kv_len symbolic from its second value), nothing recompiles. With LoRA, rows on mixed adapters (the
    torch path: the kernels' own path needs CUDA)."""
    torch._dynamo.reset()
    slots_total, max_seq_len = 6, 48

    def model() -> Transformer:
        m = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
        m.setup_caches(num_slots=slots_total, max_seq_len=max_seq_len)
        return m

    eager_model, compiled_model = model(), model()
    counter = CountingBackend(backend)
    compiled = CompiledDecode(compiled_model, cache_dir=tmp_path / "cache", backend=counter)
    pool = None
    if with_lora:
        config = LlamaConfig.from_folder(tiny_orpheus)
        write_lora_adapters(tmp_path / "adapters", tiny_orpheus, 2, seed=3)
        pool = LoraPool(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
        for entry in (1, 2):
            pool.write(entry, read_peft_adapter(tmp_path / "adapters" / f"voice{entry - 1}", config, max_rank=8))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache").resolve())
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(4, 12, (slots_total,), generator=gen)
    last = torch.zeros(slots_total, dtype=torch.int64)
    with torch.inference_mode():
        for slot in range(slots_total):  # the same prompt into both caches (prefill is eager either way)
            prompt = torch.randint(0, 150_000, (int(lengths[slot]),), generator=gen)
            for m in (eager_model, compiled_model):
                m.prefill(prompt, slot, 0)
            last[slot] = int(prompt[-1])
        assert_same_kv(compiled_model, eager_model, "after prefill")
        # The same three rows twice (kv_len one longer: it turns symbolic), then other sizes and rows.
        batches = (3, 3, 5, 1, 3, 5, 1, 2)
        for step, batch in enumerate(batches):
            slots = torch.arange(3) if step < 2 else torch.randperm(slots_total, generator=gen)[:batch]
            positions = lengths[slots].clone()
            kv_len = int(positions.max()) + 1
            tokens = last[slots].clone()
            lora = None if pool is None else LoraBatch.on_device(pool, (torch.arange(batch) + 1) % 3, kernel=False)
            eager = eager_model.logits(eager_model.decode(tokens, slots, positions, kv_len, lora))
            calls = counter.calls
            got = compiled_model.logits(compiled(tokens, slots, positions, kv_len, lora))
            assert counter.calls == calls + 1, f"step {step}: the decode did not run the compiled code"
            torch.testing.assert_close(got, eager, rtol=0, atol=LOGITS_ATOL)
            assert torch.equal(got.argmax(-1), eager.argmax(-1))
            assert_same_kv(compiled_model, eager_model, f"after decode step {step} (batch {batch})")
            lengths[slots] += 1
            last[slots] = eager.argmax(-1)
            if step == 1:
                compiles = counter.compiles
                assert compiles == 2, compiles  # one compilation, one more as kv_len turns symbolic
        assert counter.compiles == compiles, f"recompiled: {counter.compiles} compilations, {compiles} after two steps"
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


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_engine_gives_eager_greedy_tokens(tiny_orpheus: Path, tmp_path: Path, backend: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.compile end to end: warm-up at start (its time reported), then steps of several sizes and
    growing contexts. Two engines, each writing its own KV cache: the compiled one gives the eager one's
    greedy tokens and ends with the same K and V caches; every decode step ran the compiled code, and the
    warm-up compiled everything the steps needed (no compilation after it). `backend` stands in for the
    engine's inductor, counted."""
    torch._dynamo.reset()
    counter = CountingBackend(backend)
    monkeypatch.setattr("orpheus_serve.engines.torch_engine.CompiledDecode",
                        functools.partial(CompiledDecode, backend=counter))

    def engine(compiled: bool) -> TorchEngine:
        return TorchEngine(tiny_orpheus, num_slots=3, max_seq_len=64, device="cpu", dtype="fp32", max_batch_size=4,
                           cuda_graphs=False, compile_decode=compiled, compile_cache_dir=tmp_path / "cache")

    steps = 8
    eager = engine(False)
    assert eager.memory_report().compile_s is None
    assert counter.compiles == counter.calls == 0
    expected = greedy_run(eager, 3, steps)
    compiled = engine(True)
    assert compiled.memory_report().compile_s is not None and compiled.compile_s > 0
    warmed_compiles, warmed_calls = counter.compiles, counter.calls
    assert warmed_compiles == warmed_calls == 2  # the warm-up's two kv_lens: kv_len symbolic from the second
    assert greedy_run(compiled, 3, steps) == expected
    assert counter.calls - warmed_calls == steps, "a decode step did not run the compiled code"
    assert counter.compiles == warmed_compiles, "a decode step compiled again after the warm-up"
    assert_same_kv(compiled.model, eager.model, f"after {steps} decode steps")


def test_compiled_triton_attention_with_lora_compiles_once_for_every_batch_size(
        tiny_orpheus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.compile with the server's CUDA attention (the Triton kernel, here in Triton's interpreter) and LoRA
    on, stepped at padded batch sizes 1 to 32, more of them (twice that, with and without adapters) than
    dynamo's recompile limit of 8. The split count is a compile-time constant of the kernel chosen from the
    batch size; behind its custom op (decode_attention.py) the graph does not specialise on it. So: the
    warm-up's two compilations (without and with the adapters' argument) are all there are, every step runs
    the compiled code (nothing fell back to eager), dynamo made no more graphs, and the greedy tokens are the
    eager engine's (the same kernel, eagerly)."""
    torch._dynamo.reset()
    counter = CountingBackend("aot_eager")
    monkeypatch.setattr("orpheus_serve.engines.torch_engine.CompiledDecode",
                        functools.partial(CompiledDecode, backend=counter))
    write_lora_adapters(tmp_path / "adapters", tiny_orpheus, 2, seed=5)
    batches, max_seq_len = (1, 2, 4, 8, 16, 32), 256
    # The tiny model's two KV heads fill a GPU's programs at any batch; aim at fewer, so that the split count
    # changes with the batch size here as it does at the served model's shapes (what would recompile).
    monkeypatch.setattr(decode_attention, "TARGET_PROGRAMS", 32)
    splits = {decode_attention.choose_num_splits(max(2, b), 2, max_seq_len) for b in batches}
    assert len(splits) >= 3, splits

    def engine(compiled: bool) -> TorchEngine:
        return TorchEngine(tiny_orpheus, num_slots=max(batches), max_seq_len=max_seq_len, device="cpu", dtype="fp32",
                           max_batch_size=max(batches), cuda_graphs=False, attention="triton",
                           adapters_dir=tmp_path / "adapters", max_loras=2, max_lora_rank=8,
                           compile_decode=compiled, compile_cache_dir=tmp_path / "cache")

    def run(engine: TorchEngine) -> list[list[int]]:
        tokens: list[list[int]] = [[] for _ in range(max(batches))]
        for slot in range(max(batches)):  # every third session on the base model, the others on an adapter
            prompt = (P.START_OF_HUMAN, P.BOS, 100 + slot, 200 + slot, *P.PROMPT_SUFFIX)
            adapter = None if slot % 3 == 0 else f"voice{slot % 2}"
            out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"r{slot}", prompt, 0, len(prompt),
                                                             SamplingParams(temperature=0.0), adapter=adapter)]))
            assert not out.failed, out.failed
            tokens[slot] += out.tokens[slot]
        base_only = [slot for slot in range(max(batches)) if slot % 3 == 0]
        for batch in batches:  # the first rows (adapters mixed; batch 1 has none), then base-model rows only
            for rows in (list(range(batch)), base_only[:batch]):
                if len(rows) < batch:
                    continue
                calls = counter.calls
                out = engine.step(StepPlan(decode=rows))
                assert not out.failed, out.failed
                if engine.compiled_decode is not None:
                    assert counter.calls == calls + 1, f"batch {batch}: the step did not run the compiled code"
                for slot, new in out.tokens.items():
                    tokens[slot] += new
        return tokens

    expected = run(engine(False))
    assert counter.compiles == 0
    compiled = engine(True)
    assert compiled.attention == "triton" and compiled.compiled_decode is not None
    warmed = counter.compiles
    assert warmed == 2, f"the warm-up compiled {warmed} graphs, expected one without LoRA and one with"
    graphs_after_warm_up = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert run(compiled) == expected
    assert counter.compiles == warmed, f"recompiled: {counter.compiles} compilations after {warmed} at warm-up"
    assert compiled.compiled_decode.compilations == warmed
    assert compiled.compiled_decode.compilations_after_warm_up == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_warm_up


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
