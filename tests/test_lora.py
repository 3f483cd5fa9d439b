"""Custom voices as LoRA adapters (engines/lora.py) in the torch engine, on the tiny model (fp32, CPU).

The reference is independent: real PEFT loads the adapters scripts/make_tiny_models.py writes and
merges each into the base weights (`merge_and_unload`); a greedy session on an adapter must give
exactly the tokens of the merged model, alone and in steps shared with other adapters and base
sessions.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from orpheus_serve import token_format as P
from orpheus_serve.engines.llama import LlamaConfig, load_transformer
from orpheus_serve.engines.lora import (
    AdapterError,
    LoraBatch,
    LoraManager,
    LoraPool,
    pool_bytes,
    read_peft_adapter,
)
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepOutput, StepPlan
from orpheus_serve.weights.tiny import write_lora_adapter, write_lora_adapters

GREEDY = SamplingParams(temperature=0.0)
MAX_RANK = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory: pytest.TempPathFactory, tiny_orpheus: Path) -> Path:
    """voice0..voice3: ranks 8, 4, 2, 8; voice2 on attention only."""
    out = tmp_path_factory.mktemp("adapters")
    write_lora_adapters(out, tiny_orpheus, 4, seed=0)
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory, tiny_orpheus: Path, adapters_dir: Path) -> dict[str, Path]:
    """Each adapter merged into the base weights by PEFT, saved as a plain Llama folder."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("merged")
    folders = {}
    for name in ("voice0", "voice1", "voice2"):
        base = LlamaForCausalLM.from_pretrained(tiny_orpheus, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapters_dir / name).merge_and_unload()
        model.save_pretrained(out / name, safe_serialization=True)
        folders[name] = out / name
    return folders


def make_engine(folder: Path, adapters: Path | None = None, *, num_slots: int = 8, max_loras: int = 4) -> TorchEngine:
    return TorchEngine(folder, num_slots=num_slots, max_seq_len=256, device="cpu", dtype="fp32", max_batch_size=16,
                       cuda_graphs=False, adapters_dir=adapters, max_loras=max_loras, max_lora_rank=MAX_RANK)


def make_prompt(n_text: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 1000, (n_text,), generator=gen).tolist()
    return (P.START_OF_HUMAN, P.BOS, *text, *P.PROMPT_SUFFIX)


@dataclass
class Job:
    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    adapter: str | None = None
    admit_at: int = 0
    chunk: int = 1 << 30
    sampling: SamplingParams = GREEDY
    tokens: list[int] = field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0
    done: bool = False
    failure: str | None = None


def drive(engine: TorchEngine, jobs: list[Job], *, between_steps=None, max_steps: int = 5000) -> list[StepOutput]:
    """Run jobs the way the scheduler would (admit at admit_at, chunked prefill, one decode step for
    all, release when done); `between_steps(step)` runs before each step (admin calls)."""
    free = list(range(engine.num_slots))
    outputs = []
    for step in range(max_steps):
        if all(job.done for job in jobs) and all(job.slot is None for job in jobs):
            return outputs
        plan = StepPlan()
        for job in jobs:
            if job.slot is not None and job.done:
                plan.release.append(job.slot)
                free.append(job.slot)
                job.slot = None
        free.sort()
        for job in jobs:
            if job.done or step < job.admit_at:
                continue
            if job.slot is None and free and job.prefilled == 0:
                job.slot = free.pop(0)
            if job.slot is None:
                continue
            if job.prefilled < len(job.prompt):
                end = min(len(job.prompt), job.prefilled + job.chunk)
                plan.prefill.append(PrefillChunk(job.slot, job.name, job.prompt, job.prefilled, end, job.sampling,
                                                 adapter=job.adapter))
                job.prefilled = end
            elif job.tokens:
                plan.decode.append(job.slot)
        if between_steps is not None:
            between_steps(step)
        out = engine.step(plan)
        outputs.append(out)
        for job in jobs:
            if job.slot is None or job.done:
                continue
            if job.slot in out.failed:
                job.failure, job.done = out.failed[job.slot], True
                free.append(job.slot)
                job.slot = None
                continue
            job.tokens += out.tokens.get(job.slot, [])
            job.done = len(job.tokens) >= job.max_tokens
    raise AssertionError("jobs did not finish")


def alone(folder: Path, job: Job, adapters: Path | None = None) -> list[int]:
    solo = Job(job.name, job.prompt, job.max_tokens, adapter=job.adapter if adapters else None)
    drive(make_engine(folder, adapters, num_slots=1), [solo])
    assert solo.failure is None, solo.failure
    return solo.tokens


# ----------------------------------------------------------------------------- format and validation


def test_tiny_adapters_are_peft_format_and_read_the_same(tiny_orpheus: Path, adapters_dir: Path) -> None:
    """Real PEFT loads the written folders; our reader sees the same A, B and scale as PEFT's modules."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(tiny_orpheus, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters_dir / "voice1")
    ours = read_peft_adapter(adapters_dir / "voice1", LlamaConfig.from_folder(tiny_orpheus), max_rank=MAX_RANK)
    assert ours.rank == 4 and ours.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj")
    module = model.base_model.model.model.layers[1].mlp.up_proj
    a, b = ours.weights[(1, "up_proj")]
    assert torch.equal(module.lora_A["default"].weight, a)
    assert torch.equal(module.lora_B["default"].weight, b)
    assert module.scaling["default"] == pytest.approx(ours.scale)
    attention_only = read_peft_adapter(adapters_dir / "voice2", LlamaConfig.from_folder(tiny_orpheus),
                                       max_rank=MAX_RANK)
    assert attention_only.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")


def _broken_copy(src: Path, dst: Path, *, config: dict | None = None, tensors=None, text: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        current = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**current, **config}))
    if text is not None:
        (dst / "adapter_config.json").write_text(text)
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize(("change", "reason"), [
    ({"text": "{not json"}, "not valid JSON"),
    ({"config": {"use_dora": True}}, "use_dora"),
    ({"config": {"peft_type": "IA3"}}, "not LORA"),
    ({"config": {"target_modules": ["q_proj", "embed_tokens"]}}, "target modules embed_tokens"),
    ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"config": {"r": 16}}, "rank 16 is over engine.max_lora_rank 8"),
    ({"tensors": lambda t: {**t, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 4)}},
     "not LoRA on a supported target module"),
    ({"tensors": lambda t: {k: v for k, v in t.items() if "layers.0.mlp.up_proj.lora_B" not in k}},
     "without its pair"),
    ({"tensors": lambda t: {k: (v[:, :32].contiguous() if k.endswith("q_proj.lora_A.weight") else v) for k, v in t.items()}},
     "trained on another model"),
    ({"tensors": lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}},
     "layer 7 does not exist"),
    ({"tensors": lambda t: {k: v * float("nan") for k, v in t.items()}}, "non-finite"),
])
def test_bad_adapters_are_refused_with_the_reason(tmp_path: Path, tiny_orpheus: Path, adapters_dir: Path,
                                                  change: dict, reason: str) -> None:
    folder = _broken_copy(adapters_dir / "voice0", tmp_path / "bad", **change)
    with pytest.raises(AdapterError, match=reason):
        read_peft_adapter(folder, LlamaConfig.from_folder(tiny_orpheus), max_rank=MAX_RANK)


def test_missing_files_and_unknown_names(tmp_path: Path, tiny_orpheus: Path, adapters_dir: Path) -> None:
    config = LlamaConfig.from_folder(tiny_orpheus)
    folder = _broken_copy(adapters_dir / "voice0", tmp_path / "noweights")
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"no adapter_model\.safetensors"):
        read_peft_adapter(folder, config, max_rank=MAX_RANK)
    manager = LoraManager(config, adapters_dir=adapters_dir, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32,
                          device="cpu")
    with pytest.raises(AdapterError, match="no adapter named 'nobody'"):
        manager.load("nobody")


# ----------------------------------------------------------------------------- numerics


def test_pool_mode_equals_gather_mode_and_peft_logits(tiny_orpheus: Path, adapters_dir: Path) -> None:
    """Rows with different adapters (and none) in one forward pass: the capture-safe pool mode (all rows,
    fixed shapes) and the gather mode agree, and each row matches PEFT's unmerged model."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    config = LlamaConfig.from_folder(tiny_orpheus)
    pool = LoraPool(config, max_loras=3, max_rank=MAX_RANK, dtype=torch.float32, device="cpu")
    names = ["voice0", "voice1", "voice2"]
    for entry, name in enumerate(names, start=1):
        pool.write(entry, read_peft_adapter(adapters_dir / name, config, max_rank=MAX_RANK))
    model = load_transformer(tiny_orpheus, dtype=torch.float32, device="cpu")
    model.setup_caches(num_slots=4, max_seq_len=64)
    tokens = torch.randint(0, 1000, (4, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12).expand(4, 12)
    slots = torch.arange(4)
    entries = [2, 0, 1, 3]  # voice1, base, voice0, voice2
    with torch.inference_mode():
        gathered = model.logits(model.forward(tokens, slots, positions, 12, LoraBatch.for_rows(pool, entries,
                                                                                              mode="gather")))
        pooled = model.logits(model.forward(tokens, slots, positions, 12, LoraBatch.for_rows(pool, entries,
                                                                                            mode="pool",
                                                                                            tokens_per_row=12)))
        assert LoraBatch.for_rows(pool, [0, 0, 0, 0], mode="gather") is None  # no adapter: no LoRA work
    torch.testing.assert_close(pooled, gathered, rtol=0, atol=1e-4)  # summation order differs: rounding only
    for row, entry in enumerate(entries):
        base = LlamaForCausalLM.from_pretrained(tiny_orpheus, dtype=torch.float32).eval()
        ref_model = base if entry == 0 else PeftModel.from_pretrained(base, adapters_dir / names[entry - 1]).eval()
        with torch.no_grad():
            ref = ref_model(tokens[row : row + 1]).logits[0]
        assert (gathered[row] - ref).abs().max().item() < 1e-4, (row, entry)


def test_greedy_adapter_session_alone_equals_merged_model(tiny_orpheus: Path, adapters_dir: Path,
                                                          merged: dict[str, Path]) -> None:
    job = Job("x", make_prompt(17, seed=5), 60, adapter="voice0")
    with_adapter = alone(tiny_orpheus, job, adapters_dir)
    assert with_adapter == alone(merged["voice0"], job)
    assert with_adapter != alone(tiny_orpheus, job)  # the adapter really changes the voice


def mixed_jobs() -> list[Job]:
    """Three adapters (ranks 8, 4 and an attention-only 2) and two base sessions, staggered, prefilled in
    chunks, decoded in shared steps."""
    adapters = ["voice0", None, "voice1", "voice2", None, "voice0"]
    return [Job(f"s{i}", make_prompt(6 + 5 * i, seed=10 + i), 42 + 7 * i, adapter=a, admit_at=2 * i, chunk=11)
            for i, a in enumerate(adapters)]


def test_mixed_step_each_session_equals_its_merged_model(tiny_orpheus: Path, adapters_dir: Path,
                                                         merged: dict[str, Path]) -> None:
    jobs = mixed_jobs()
    outputs = drive(make_engine(tiny_orpheus, adapters_dir, num_slots=6), jobs)
    assert max(len(o.tokens) for o in outputs) == 6  # all six shared steps
    for job in jobs:
        assert job.failure is None and len(job.tokens) == job.max_tokens
        reference = alone(merged[job.adapter], job) if job.adapter else alone(tiny_orpheus, job)
        assert job.tokens == reference, (job.name, job.adapter)


# ----------------------------------------------------------------------------- pool management


def test_hot_load_and_unload_while_streams_run_leave_them_identical(tiny_orpheus: Path, adapters_dir: Path) -> None:
    quiet = mixed_jobs()
    drive(make_engine(tiny_orpheus, adapters_dir, num_slots=6, max_loras=4), quiet)

    engine = make_engine(tiny_orpheus, adapters_dir, num_slots=6, max_loras=4)
    manager = engine.lora
    assert manager is not None
    seen: list[str] = []

    def admin(step: int) -> None:
        if step == 3:  # voice0 is in use (s0): unloading waits for its sessions
            seen.append(manager.unload("voice0").state)
        if step == 5:
            seen.append(manager.load("voice3").state)  # enters the pool at the next step
        if step == 9:
            seen.append(manager.status("voice3").state)
            seen.append(manager.unload("voice3").state)  # not in use: gone at once
            seen.append(manager.load("voice1").state)  # already resident
        if step == 12:
            seen.append(manager.status("voice0").state)

    busy = mixed_jobs()
    drive(engine, busy, between_steps=admin)
    assert [j.tokens for j in busy] == [j.tokens for j in quiet]
    # s5 (voice0 again, admitted at step 10, while s0 still runs) called the pending unload off.
    assert seen == ["unloading", "loaded", "resident", "available", "resident", "resident"]
    listing = {s.name: s for s in manager.list()}
    assert set(listing) == {"voice0", "voice1", "voice2", "voice3"}
    assert all(s.sessions == 0 for s in listing.values())  # every pin given back


def test_lru_eviction_and_a_full_pool_fails_only_the_new_session(tiny_orpheus: Path, adapters_dir: Path,
                                                                  merged: dict[str, Path]) -> None:
    engine = make_engine(tiny_orpheus, adapters_dir, num_slots=4, max_loras=2)
    manager = engine.lora
    assert manager is not None
    # Two long sessions pin both entries; a third adapter cannot come in, and only its session fails.
    jobs = [Job("a", make_prompt(8, 1), 40, adapter="voice0"), Job("b", make_prompt(9, 2), 40, adapter="voice1"),
            Job("c", make_prompt(10, 3), 20, adapter="voice2", admit_at=3), Job("d", make_prompt(7, 4), 30, admit_at=3)]
    drive(engine, jobs)
    assert jobs[2].failure is not None and "all 2 LoRA pool entries" in jobs[2].failure
    assert [j.failure for j in (jobs[0], jobs[1], jobs[3])] == [None, None, None]
    assert jobs[0].tokens == alone(merged["voice0"], jobs[0])
    # Sequentially, the least recently used one makes room: voice0 is evicted for voice2, then comes back.
    for name in ("voice2", "voice0"):
        job = Job(name, make_prompt(12, 7), 21, adapter=name)
        drive(engine, [job])
        assert job.tokens == alone(merged[name], job)
    states = {s.name: s.state for s in manager.list()}
    assert states == {"voice0": "resident", "voice1": "available", "voice2": "resident", "voice3": "available"}


def test_adapter_without_a_pool_or_unknown_fails_its_session_only(tiny_orpheus: Path, adapters_dir: Path) -> None:
    prompt = make_prompt(5, 1)
    plain = make_engine(tiny_orpheus)
    out = plain.step(StepPlan(prefill=[PrefillChunk(0, "a", prompt, 0, len(prompt), GREEDY, adapter="voice0"),
                                       PrefillChunk(1, "b", prompt, 0, len(prompt), GREEDY)]))
    assert "LoRA adapters are off" in out.failed[0] and 1 in out.tokens
    engine = make_engine(tiny_orpheus, adapters_dir)
    out = engine.step(StepPlan(prefill=[PrefillChunk(0, "a", prompt, 0, len(prompt), GREEDY, adapter="ghost")]))
    assert "no adapter named 'ghost'" in out.failed[0]


def test_bad_adapter_dropped_in_is_refused_and_the_rest_serve(tmp_path: Path, tiny_orpheus: Path,
                                                              adapters_dir: Path) -> None:
    folder = tmp_path / "voices"
    shutil.copytree(adapters_dir / "voice1", folder / "good")
    write_lora_adapter(folder / "big", tiny_orpheus, seed=1, rank=16)
    engine = make_engine(tiny_orpheus, folder)
    assert engine.lora is not None
    with pytest.raises(AdapterError, match="rank 16 is over"):
        engine.lora.load("big")
    listing = {s.name: s for s in engine.lora.list()}
    assert listing["big"].state == "available" and "rank 16" in (listing["big"].error or "")
    assert engine.lora.load("good").state == "loaded"
    job = Job("g", make_prompt(6, 1), 14, adapter="good")
    drive(engine, [job])
    assert job.failure is None and engine.lora.status("good").state == "resident"


def test_memory_plan_counts_the_pool(tiny_orpheus: Path, adapters_dir: Path) -> None:
    engine = make_engine(tiny_orpheus, adapters_dir, max_loras=3)
    assert engine.lora is not None
    expected = pool_bytes(engine.config, max_loras=3, max_rank=MAX_RANK, dtype=torch.float32)
    assert engine.memory_plan.lora_pool_bytes == expected == engine.lora.pool.nbytes() > 0
    assert "LoRA pool" in engine.memory_plan.describe()
    assert make_engine(tiny_orpheus).memory_plan.lora_pool_bytes == 0


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_graphs_with_adapters_equal_eager(tiny_orpheus: Path, adapters_dir: Path) -> None:
    """Pool mode inside captured decode graphs (adapters and base rows mixed, padded batches) gives the
    tokens of eager CUDA steps in gather mode (fp32)."""

    def run(cuda_graphs: bool) -> list[list[int]]:
        engine = TorchEngine(tiny_orpheus, num_slots=6, max_seq_len=256, device="cuda", dtype="fp32",
                             max_batch_size=4, cuda_graphs=cuda_graphs, adapters_dir=adapters_dir, max_loras=4,
                             max_lora_rank=MAX_RANK)
        jobs = mixed_jobs()
        drive(engine, jobs)
        engine.close()
        assert all(job.failure is None for job in jobs)
        return [job.tokens for job in jobs]

    assert run(True) == run(False)
