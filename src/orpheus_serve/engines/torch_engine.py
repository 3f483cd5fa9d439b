"""TorchEngine: the `TokenEngine` that runs llama.py's Llama on CPU or CUDA.

Start-up (nothing is allocated per request afterwards):

    config.json ──▶ memory plan ──▶ refuse (EngineError) if it cannot fit
                                  └▶ load weights ─▶ KV cache [slots (+1 scratch), Hkv, max_seq_len, D]
                                                 ─▶ per-slot sampling state (params, seed, presence mask)
                                                 ─▶ CUDA only: decode graphs per (padded batch, kv bucket)

`launch(plan)` then `collect(handle)` (engines/base.PipelinedEngine; `step(plan)` is both),
called by the engine core thread only. `launch` queues the work below and an asynchronous copy
of the sampled tokens to pinned host memory, and returns; `collect` waits for that copy
(engines/transfer.py). Host records (cached and generated ids) advance at launch: a step's
count of tokens is known before their values, and the next plan's rows are fed from the
device-side last tokens, so a step can be launched while the one before it still runs.

1. `release`: the slot's session is forgotten; its cache rows are simply overwritten by the
   next occupant (attention masks everything past a row's own position).
2. `prefill`: each chunk runs as one forward pass of T tokens for its slot. start == 0 starts a
   session (seed, repetition mask, counters); the last chunk also samples the first generated
   token (audio position 0) from the last position's logits.
3. `decode`: one forward pass over every listed slot (B rows, T = 1), each fed its last sampled
   token at its own position, then one sampling call per batch: one new token per slot.

Per-slot problems (a sequence that would pass max_seq_len, a chunk out of order, an unknown
slot, sampling parameters the engine cannot take: `step.sampling_problem`) are checked
on the host before any compute and reported in `StepOutput.failed`; the other slots of the step
are unaffected. The engine never ends a session by itself: end_of_speech and max_tokens are the
scheduler's call.

A step that raises changes no session, so the engine core can run the plan's sessions again in
smaller groups to find the one at fault: the host records of the plan's slots are restored from
copies taken when the step began, and the device writes a later step reads (each slot's last
token, the repetition marks of sampled tokens) are made only once every forward pass and
sampling call of the step has succeeded. What a failed step did write (KV rows at or past a
slot's position, the prompt's repetition marks, a new session's sampling row) is written again,
identically, when the session runs again, and is never read before that.

On CUDA all work runs on the engine's own stream, and decode steps replay CUDA graphs captured
at start-up for padded batch sizes (1, 2, 4, ..., max_batch_size) and power-of-two KV lengths
(256 ... max_seq_len). With `attention="triton"` (decode_attention.py: each row reads its own
slot up to its own length, whatever the batch's longest) one graph per padded batch size serves
every length. Padding rows write into a scratch slot that no session owns. With `compile_decode`
(engine.compile) what the graphs capture is the decode pass compiled by torch.compile with a dynamic
batch (compiled.py), warmed up once at start-up; without graphs (a CPU) it runs each step. Prefill
(variable length) runs eagerly, and so does sampling (a few dozen kernels, no host sync), except
with `fused`: then each graph also holds the frame constraint's projection and the draw
(`_sample_in_graph`), and a step whose rows are all constrained is one replay. The graphs'
static inputs are created on the engine's stream, after everything queued before the capture.

Batch composition. Sampling is per session: each slot draws with its own seeded generator, keyed
on the candidate token, so the same logits give the same token whatever shares the step. The
logits themselves are bit-for-bit independent of the batch on CPU (tested: a stream beside hostile
or busy neighbours equals the same request alone). On CUDA they are not: the graph a step replays
is chosen by the padded batch size and by the longest context in the step, and cuBLAS picks its
kernels by shape, so a row's hidden state can differ in the last bits (fp32) or the last bf16 place
depending on who shares the step. A draw near a tie can then go the other way, and the rest of the
session follows. What holds on CUDA: a session replayed with the same seed and the same step
composition gives the same tokens; alone vs beside others, its hidden states agree to rounding
(`test_cuda_graph_batch_composition_changes_a_row_only_by_rounding`). Making tokens exactly
batch-invariant would need batch-invariant kernels (fixed reduction order whatever the shape).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from orpheus_serve import token_format as P
from orpheus_serve.engines import vram_budget
from orpheus_serve.engines.base import MemoryReport
from orpheus_serve.engines.compiled import CompiledDecode
from orpheus_serve.engines.llama import LlamaConfig, Transformer, kv_torch_dtype, load_transformer, torch_dtype
from orpheus_serve.engines.lora import AdapterError, LoraBatch, LoraManager, LoraMode, LoraPool
from orpheus_serve.engines.lora import pool_bytes as lora_pool_bytes
from orpheus_serve.engines.memory import GRAPH_KV_BUCKET, MemoryPlan, available_bytes, plan_memory
from orpheus_serve.engines.sampling import SlotSamplingState, constrained_logits
from orpheus_serve.engines.sdpa import DEFAULT_SDPA_BACKENDS, pinned_sdpa, sdpa_backends, serving_backend
from orpheus_serve.engines.transfer import StepReadback, ints_to_device
from orpheus_serve.scheduler.step import (
    EngineError,
    PrefillChunk,
    SamplingParams,
    StepOutput,
    StepPlan,
    sampling_problem,
)
from orpheus_serve.shapes import padded_sizes

if TYPE_CHECKING:
    from orpheus_serve.config import Config

logger = logging.getLogger(__name__)

# Frames per session in the codec's widest step (the stateful decoder's largest step shape, a
# windowed decoder's [L | new | R] window is about as wide): what its working memory is sized by.
CODEC_STEP_FRAMES = 6


@dataclass(slots=True)
class _Session:
    request_id: str
    sampling: SamplingParams
    cached: int = 0  # tokens in the KV cache = position the next token is written at
    generated: int = 0  # tokens sampled so far = audio position of the next one
    ready: bool = False  # prompt complete: the last sampled token waits to be fed
    adapter: str | None = None  # LoRA adapter pinned for this session (engines/lora.py)
    lora_entry: int = 0  # its pool entry; 0: the base model


class GraphKey(NamedTuple):
    """One captured decode graph: the padded batch size, the top of its KV length bucket, and whether it runs
    the LoRA work (with an adapter pool each shape is captured twice, so a step without adapters replays a
    graph without LoRA work)."""

    batch: int
    kv_len: int
    with_lora: bool


def decode_graph_keys(*, max_batch_size: int, max_seq_len: int, attention: str, lora: bool) -> list[GraphKey]:
    """The decode graphs an engine captures on CUDA, largest first (the capture order). The Triton kernel's
    shapes do not depend on the context: one length bucket, the whole sequence."""
    kv_lens = [max_seq_len] if attention == "triton" else padded_sizes(max_seq_len, GRAPH_KV_BUCKET)
    variants = (False, True) if lora else (False,)
    return [GraphKey(batch, kv_len, with_lora) for batch in reversed(padded_sizes(max_batch_size))
            for kv_len in reversed(kv_lens) for with_lora in variants]


class DecodeGraphs:
    """`Transformer.decode` (to hidden states) captured as CUDA graphs, one per (padded batch size, KV length bucket).

    Inputs are copied into static buffers; rows past the real batch point at `scratch_slot`,
    position 0, so they never touch a session's cache. Graphs share one memory pool and are
    replayed one at a time on the engine's stream.
    """

    def __init__(self, model: Transformer, *, keys: Sequence[GraphKey], scratch_slot: int,
                 stream: torch.cuda.Stream, lora_pool: LoraPool | None = None,
                 lora_kernel: bool = False, decode: Callable[..., Tensor] | None = None,
                 sampler: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> None:
        """`keys`: the graphs to capture (`decode_graph_keys`); `decode`: what is captured, `model.decode` or its
        compiled form (`CompiledDecode`); `lora_kernel`: the rows' adapters through the segmented Triton kernels
        (lora_kernels.py) rather than the torch gather; `sampler(hidden, slots, steps)`: when given, captured
        after the forward pass too (the frame constraint's projection and the draw, engine.fused), so a step of
        constrained rows is one replay."""
        device = model.output.weight.device
        decode = decode or model.decode
        if any(key.with_lora for key in keys) and lora_pool is None:
            raise EngineError("decode graphs with LoRA need the adapter pool")
        self.batch_sizes = sorted({key.batch for key in keys})
        self.kv_lens = sorted({key.kv_len for key in keys})
        self.scratch_slot = scratch_slot
        max_batch = self.batch_sizes[-1]
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, Tensor, Tensor | None]] = {}
        self.samples = sampler is not None
        pool = torch.cuda.graph_pool_handle()
        # Whatever the caller queued on its stream (weights, caches) comes before the capture, and the
        # static inputs are made on the capture stream itself: a graph never reads a buffer whose
        # initialisation another stream may not have run yet.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.slots = torch.full((max_batch,), scratch_slot, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.lora_entries = torch.zeros(max_batch, dtype=torch.int64, device=device)
            self.steps = torch.zeros(max_batch, dtype=torch.int64, device=device)  # audio positions, for the sampler
            for key in keys:  # largest first: the shared pool is sized by the first capture, reused by the rest
                def forward(key: GraphKey = key) -> tuple[Tensor, Tensor | None]:
                    # The rows' grouping by adapter (kernel mode) is device work: captured with the pass.
                    lora = LoraBatch.on_device(lora_pool, self.lora_entries[:key.batch], kernel=lora_kernel) \
                        if key.with_lora and lora_pool is not None else None
                    hidden = decode(self.tokens[:key.batch], self.slots[:key.batch], self.positions[:key.batch],
                                    key.kv_len, lora)  # [batch, dim]
                    drawn = None if sampler is None else sampler(hidden, self.slots[:key.batch], self.steps[:key.batch])
                    return hidden, drawn

                for _ in range(2):  # warm-up outside the graph (allocator, kernel selection, compilation)
                    forward()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    hidden, drawn = forward()
                self.graphs[key] = (graph, hidden, drawn)
        stream.synchronize()

    def run(self, tokens: Tensor, slots: Tensor, positions: Tensor, kv_len: int,
            lora_entries: Tensor | None = None, steps: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Same contract as Transformer.decode, `lora_entries` [n] the rows' pool entries (None: no
        row has an adapter). Returns (hidden states [n, dim], and with a sampler and `steps` [n], the rows'
        audio positions, the tokens drawn inside the graph [n], else None): views valid until the next run."""
        n = tokens.shape[0]
        batch = next(b for b in self.batch_sizes if b >= n)
        bucket = next(k for k in self.kv_lens if k >= kv_len)
        self.tokens[:n].copy_(tokens)
        self.slots[:n].copy_(slots)
        self.positions[:n].copy_(positions)
        if batch > n:
            self.tokens[n:batch].zero_()
            self.slots[n:batch].fill_(self.scratch_slot)
            self.positions[n:batch].zero_()
        if lora_entries is not None:
            self.lora_entries[:n].copy_(lora_entries)
            self.lora_entries[n:batch].zero_()
        if steps is not None and self.samples:
            self.steps[:n].copy_(steps)
            self.steps[n:batch].zero_()
        graph, hidden, drawn = self.graphs[GraphKey(batch, bucket, lora_entries is not None)]
        graph.replay()
        return hidden[:n], None if drawn is None or steps is None else drawn[:n]


def resolved_device(device: torch.device, current_index: int) -> torch.device:
    """`device` with its index: one given without an index (`cuda`) means the current device of its type."""
    return device if device.index is not None else torch.device(device.type, current_index)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` name one device: `cuda` is `cuda:N` for the current CUDA device N (weights report
    their device with its index, an engine keeps the one it was given)."""
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return resolved_device(a, current) == resolved_device(b, current)


def _serving_sdpa(cfg: LlamaConfig, sdpa: Sequence[str], device: torch.device, dtype: torch.dtype) -> str:
    """The SDPA kernel that serves this model's decode among those allowed (engines/sdpa.py)."""
    backend = serving_backend(sdpa, device=device, dtype=dtype, kv_heads=cfg.n_kv_heads,
                              query_rows=cfg.n_heads // cfg.n_kv_heads, head_dim=cfg.head_dim)
    if device.type == "cuda":
        logger.info("attention: SDPA limited to %s; %s serves decode", ", ".join(sdpa), backend)
    return backend


def _model_bytes(model: Transformer) -> tuple[int, int, int]:
    """(weights, KV cache, KV cache per slot) of a loaded model, in bytes."""
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    caches = [b for name, b in model.named_buffers() if name.endswith(("k_cache", "v_cache"))]
    return (sum(weights.values()), sum(b.numel() * b.element_size() for b in caches),
            sum(b[0].numel() * b.element_size() for b in caches))


def _checked_folder(model_path: str | Path, *, quantization: str, shared: Transformer | None) -> Path:
    """The model folder, once what needs nothing loaded is checked."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise EngineError(f"{folder}: not a local model folder (download the checkpoint first)")
    if quantization not in ("none", "fp8"):
        raise EngineError(f"unknown quantization {quantization!r}; expected none or fp8")
    if quantization == "fp8" and shared is not None:
        raise EngineError("a shared model cannot be quantised to FP8 by one of its engines")
    return folder


def _codec_share_bytes(config: Config, device: str) -> int:
    """SNAC loads after the engine: on the same GPU its share is kept out of the engine's plan."""
    from orpheus_serve.config import resolve_device

    codec = config.codec
    beside = codec.decoder != "sim" and same_device(torch.device(resolve_device(codec.device)), torch.device(device))
    if not beside:
        return 0
    graphs = codec.decoder == "stateful" and codec.cuda_graphs and torch.device(device).type == "cuda"
    return vram_budget.snac_bytes(codec.max_batch, CODEC_STEP_FRAMES) \
        + (vram_budget.snac_graph_pool_bytes(codec.max_batch) if graphs else 0)  # its graphs' pool (codec/stateful.py)


def resolve_lora_kernel(name: str, device: torch.device) -> str:
    """voices.lora_kernel as the engine resolves it. `auto`: the segmented Triton kernels on CUDA (where triton
    is installed), the torch path elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
    if name not in ("torch", "triton"):
        raise EngineError(f"unknown LoRA kernel {name!r}; expected auto, torch or triton")
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise EngineError("voices.lora_kernel: triton needs the triton package (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise EngineError(f"voices.lora_kernel: triton on {device.type} runs in Triton's interpreter only: "
                              "set TRITON_INTERPRET=1 (slow; for tests) or use lora_kernel torch")
    return name


def resolve_attention(name: str, device: torch.device) -> str:
    """engine.attention as the engine resolves it. `auto`: the Triton decode kernel on CUDA (where triton is
    installed), SDPA elsewhere. Triton on a CPU runs in its interpreter only."""
    if name == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "sdpa"
    if name not in ("sdpa", "triton"):
        raise EngineError(f"unknown attention kernel {name!r}; expected auto, sdpa or triton")
    if name == "triton":
        _require_triton("engine.attention: triton", device)
    return name


def _require_triton(what: str, device: torch.device) -> None:
    """EngineError unless Triton kernels can run on `device` (on a CPU: in Triton's interpreter only)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise EngineError(f"{what} needs the triton package (pip install triton)") from exc
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineError(f"{what} on {device.type} runs in Triton's interpreter only: "
                          "set TRITON_INTERPRET=1 (slow; for tests) or turn it off")


def _memory_plan(engine: TorchEngine, *, shared: Transformer | None, cuda_graphs: bool, codec_bytes: int,
                 memory_fraction: float, lora_bytes: int, quantization: str) -> MemoryPlan:
    """The engine's memory plan on its device (engines/memory.py), checked: EngineError when it does not fit."""
    budget = available_bytes(engine.device)
    if budget is not None and shared is not None:  # the shared weights are resident already: the plan counts them
        budget += sum(p.numel() * p.element_size() for p in shared.parameters())
    plan = plan_memory(engine.config, num_slots=engine.num_slots, max_seq_len=engine.max_seq_len,
                       dtype=engine.dtype, max_batch_size=engine.max_batch_size, cuda_graphs=cuda_graphs,
                       codec_bytes=codec_bytes, budget_bytes=None if budget is None else int(budget * memory_fraction),
                       lora_pool_bytes=lora_bytes, kv_dtype=engine.kv_dtype, quantization=quantization)
    logger.info("torch engine memory plan on %s: %s", engine.device, plan.describe())
    plan.check()
    return plan


def _release_device_state(engine: TorchEngine) -> None:
    """Drop what an engine holds on its device (graphs, compiled pass, KV caches, sampling state): on close,
    and when the build fails part-way (only what was made by then exists; the rest, the adapter pool among
    it, goes with the engine object)."""
    engine._graphs = None
    engine._compiled = None
    model: Transformer | None = getattr(engine, "model", None)
    if model is not None:
        for layer in model.layers:  # a shared model (see __init__) must not keep this engine's caches alive
            layer.attention.kv_cache = None
    for name in ("model", "_sampling", "_last_token"):
        if hasattr(engine, name):
            delattr(engine, name)
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()


class TorchEngine:
    """Slot-batched Llama token engine (see the module docstring)."""

    def __init__(self, model_path: str | Path, *, num_slots: int, max_seq_len: int, device: str = "cpu",
                 dtype: str = "fp32", max_batch_size: int = 16, cuda_graphs: bool = True,
                 memory_fraction: float = 0.9, seed: int | None = None, codec_bytes: int = 0,
                 sdpa: Sequence[str] = DEFAULT_SDPA_BACKENDS, model: Transformer | None = None,
                 adapters_dir: str | Path | None = None, max_loras: int = 0, max_lora_rank: int = 64,
                 attention: str = "sdpa", kv_cache_dtype: str | None = None, quantization: str = "none",
                 lora_kernel: str = "auto", compile_decode: bool = False,
                 compile_cache_dir: str | Path | None = None, fused: bool = False) -> None:
        """`sdpa`: the attention kernels PyTorch may pick on CUDA (engines/sdpa.py). `model`: weights already
        loaded from `model_path` on `device` in `dtype`, shared by engines run one after another (a benchmark);
        its caches are this engine's until close(). `adapters_dir`, `max_loras`, `max_lora_rank`: lora.py;
        `lora_kernel` (auto | triton | torch): how decode steps apply the rows' adapters (lora_kernels.py).
        `attention` (sdpa | triton), `kv_cache_dtype`, `quantization` (none | fp8): docs/ATTENTION.md.
        `compile_decode`, `compile_cache_dir`: the decode pass under torch.compile (compiled.py). `fused`: the
        decoder layers' fused Triton kernels (engines/fused.py)."""
        if num_slots < 1 or max_seq_len < 2 or max_batch_size < 1:
            raise EngineError("num_slots and max_batch_size must be >= 1 and max_seq_len >= 2")
        folder = _checked_folder(model_path, quantization=quantization, shared=model)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"device {device!r} requested but CUDA is not available")
        self.dtype = torch_dtype(dtype)
        self._sdpa = sdpa_backends(sdpa)
        self.kv_dtype = kv_torch_dtype(kv_cache_dtype) if kv_cache_dtype not in (None, "auto") else self.dtype
        self.attention = resolve_attention(attention, self.device)
        self.lora_kernel = resolve_lora_kernel(lora_kernel, self.device)
        if fused:
            _require_triton("engine.fused", self.device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.config = LlamaConfig.from_folder(folder)
        if self.config.vocab_size < P.AUDIO_VOCAB_END:
            raise EngineError(f"{folder}: vocabulary of {self.config.vocab_size} ids has no Orpheus audio tokens "
                              f"(needs at least {P.AUDIO_VOCAB_END})")

        use_graphs = cuda_graphs and self.device.type == "cuda"
        use_lora = adapters_dir is not None and max_loras > 0
        self.memory_plan = _memory_plan(
            self, shared=model, cuda_graphs=use_graphs, codec_bytes=codec_bytes, memory_fraction=memory_fraction,
            lora_bytes=lora_pool_bytes(self.config, max_loras=max_loras, max_rank=max_lora_rank,
                                       dtype=self.dtype) if use_lora else 0, quantization=quantization)
        # A build that fails part-way (a kernel that does not compile, graphs that do not capture) must not leave
        # its KV caches on the device: a shared model would hold them for the next engine built on it.
        self._closed = True  # until built: close() and a failed build release the same state
        try:
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self._load_model(model, folder, quantization=quantization, fused=fused, use_graphs=use_graphs,
                             adapters_dir=adapters_dir, max_loras=max_loras, max_lora_rank=max_lora_rank,
                             use_lora=use_lora)
            self._sessions: list[_Session | None] = [None] * num_slots
            self._pinned: list[str] = []  # LoRA pins of the current step (see step())
            self._unpinned: list[str] = []
            self._seed_source = random.Random(seed)
            self._fused = fused
            self._graphs: DecodeGraphs | None = None
            self.compile_s: float | None = None  # torch.compile's start-up time (compile_decode)
            self.graph_capture_s: float | None = None
            self._compiled: CompiledDecode | None = None
            if compile_decode:
                self._compile(compile_cache_dir, scratch_slot=num_slots if use_graphs else 0)
            self.sdpa_backend = _serving_sdpa(self.config, sdpa, self.device, self.dtype)
            if use_graphs:
                self._capture_graphs()
        except BaseException:
            _release_device_state(self)
            raise
        self._closed = False

    def _load_model(self, model: Transformer | None, folder: Path, *, quantization: str, fused: bool, use_graphs: bool,
                    adapters_dir: str | Path | None, max_loras: int, max_lora_rank: int, use_lora: bool) -> None:
        """The weights (loaded, or a shared model checked), this engine's caches and sampling state on its device,
        and the adapter pool."""
        num_slots = self.num_slots
        with self._on_stream():
            if model is None:
                model = load_transformer(folder, dtype=self.dtype, device=self.device)
            elif not same_device(model.output.weight.device, self.device) or model.output.weight.dtype != self.dtype:
                raise EngineError(f"shared model is {model.output.weight.dtype} on {model.output.weight.device}, "
                                  f"this engine runs {self.dtype} on {self.device}")
            self.model = model
            if quantization == "fp8":
                self.model.quantize_weights_fp8()
            self.model.use_fused_kernels(fused)  # set either way: a shared model may come from a fused engine
            # With graphs, one extra cache row takes the padding rows' writes.
            self.model.setup_caches(num_slots + 1 if use_graphs else num_slots, self.max_seq_len,
                                    kv_dtype=self.kv_dtype, attention=self.attention)
            # A CPU filters among the 64 most likely first (exact; cheaper than sorting 4097 per row). With graphs,
            # the scratch slot has a row too: padding rows are sampled inside a fused engine's graphs.
            self._sampling = SlotSamplingState(num_slots + 1 if use_graphs else num_slots, self.config.vocab_size,
                                               self.device, fast_width=None if self.device.type == "cuda" else 64)
            self._last_token = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
            # Custom voices (ARCHITECTURE §6): None when no adapters folder is configured.
            self.lora: LoraManager | None = LoraManager(
                self.config, adapters_dir=adapters_dir, max_loras=max_loras, max_rank=max_lora_rank,
                dtype=self.dtype, device=self.device) if use_lora else None

    def _compile(self, cache_dir: str | Path | None, *, scratch_slot: int) -> None:
        """Compile the decode pass and run it once per variant (compiled.py), before any graph is captured."""
        self._compiled = CompiledDecode(self.model, cache_dir=cache_dir)
        kv_lens = sorted({key.kv_len for key in self.planned_graph_keys()})
        with torch.inference_mode(), self._on_stream():
            # Two lengths, so that SDPA's kv_len is compiled symbolic at once (the Triton kernel ignores it).
            self.compile_s = self._compiled.warm_up(
                slot=scratch_slot,
                lora_pool=self.lora.pool if self.lora is not None else None,
                lora_kernel=self.lora_kernel == "triton",
                kv_lens=[kv_lens[0], kv_lens[-1]] if len(kv_lens) > 1 else [2, 3])

    def _capture_graphs(self) -> None:
        assert self._stream is not None
        started = time.perf_counter()
        with torch.inference_mode(), self._on_stream():
            self._graphs = DecodeGraphs(
                self.model, keys=self.planned_graph_keys(), scratch_slot=self.num_slots, stream=self._stream,
                lora_pool=self.lora.pool if self.lora is not None else None,
                lora_kernel=self.lora_kernel == "triton", decode=self._compiled,
                sampler=self._sample_in_graph if self._fused else None)
        self.graph_capture_s = time.perf_counter() - started
        logger.info("captured %d decode graphs in %.1f s", len(self._graphs.graphs), self.graph_capture_s)

    def planned_graph_keys(self) -> list[GraphKey]:
        """The decode graphs this engine's configuration captures on CUDA (whatever its device)."""
        return decode_graph_keys(max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                                 attention=self.attention, lora=self.lora is not None)

    @property
    def compiled_decode(self) -> CompiledDecode | None:
        """The compiled decode pass (`compile_decode`), with its count of compilations; None when eager."""
        return self._compiled

    @property
    def graph_keys(self) -> list[GraphKey]:
        """The decode graphs captured (none without CUDA graphs)."""
        return list(self._graphs.graphs) if self._graphs is not None else []

    @classmethod
    def from_config(cls, config: Config) -> TorchEngine:
        from orpheus_serve.config import resolve_device, resolve_dtype

        device = resolve_device(config.engine.device)
        engine, voices = config.engine, config.voices
        return cls(
            engine.model_path, num_slots=config.scheduler.max_concurrent_sessions, max_seq_len=engine.max_seq_len,
            device=device, dtype=resolve_dtype(engine.dtype, device), max_batch_size=config.scheduler.max_batch_size,
            cuda_graphs=engine.cuda_graphs, memory_fraction=engine.memory_fraction,
            codec_bytes=_codec_share_bytes(config, device), adapters_dir=voices.adapters_dir,
            max_loras=voices.max_loras, max_lora_rank=voices.max_lora_rank, sdpa=engine.sdpa_backends,
            attention=engine.attention, kv_cache_dtype=engine.kv_cache_dtype, quantization=engine.quantization,
            lora_kernel=voices.lora_kernel, compile_decode=engine.compile, compile_cache_dir=engine.compile_cache_dir,
            fused=engine.fused,
        )

    # ------------------------------------------------------------------ TokenEngine

    def step(self, plan: StepPlan) -> StepOutput:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> StepReadback:
        """Queue the plan's work and the copy of its tokens to the host; returns without waiting for the device
        (engines/base.PipelinedEngine). Every host record advances now: what a step adds (cached and generated
        ids) is known before its tokens are."""
        if self._closed:
            raise EngineError("engine is closed")
        started = time.perf_counter()
        # What to restore if the step raises (see the module docstring): copies of the plan's sessions.
        touched = {*plan.release, *(c.slot for c in plan.prefill), *plan.decode}
        saved = {slot: replace(s) if (s := self._sessions[slot]) is not None else None
                 for slot in touched if 0 <= slot < self.num_slots}
        # (slots, new tokens, the slots on the host), written back once all succeeded
        sampled: list[tuple[Tensor, Tensor, list[int]]] = []
        # LoRA pins taken by sessions starting in this step (given back if it raises) and those of
        # sessions it ended (given back once it has succeeded).
        self._pinned, self._unpinned = [], []
        try:
            with torch.inference_mode(), self._on_stream():
                readback = StepReadback.begin(self.device)
                out = readback.output
                if self.lora is not None:
                    self.lora.apply_staged()  # admin loads enter the pool here, before any forward pass
                for slot in plan.release:
                    if self._valid_slot(slot, out):
                        self._drop(slot)
                for chunk in plan.prefill:
                    self._prefill(chunk, out, sampled)
                rows = self._decodable(plan.decode, out)
                for first in range(0, len(rows), self.max_batch_size):
                    self._decode(rows[first : first + self.max_batch_size], out, sampled)
                for slots, tokens, _ in sampled:
                    self._last_token[slots] = tokens
                    self._sampling.mark_seen(slots, tokens)
                readback.finish_launch(sampled, time.perf_counter() - started)
        except BaseException:
            for slot, session in saved.items():
                self._sessions[slot] = session
            self._release_adapters(self._pinned)
            raise
        self._release_adapters(self._unpinned)
        return readback

    def collect(self, handle: StepReadback) -> StepOutput:
        """The launched step's output, once its tokens are on the host."""
        return handle.collect()

    def memory_report(self) -> MemoryReport:
        if self._closed:
            raise EngineError("engine is closed")
        weights, kv_total, per_slot = _model_bytes(self.model)
        return MemoryReport(device=str(self.device), weights_bytes=weights, kv_cache_bytes=kv_total,
                            kv_bytes_per_slot=per_slot, num_slots=self.num_slots, max_seq_len=self.max_seq_len,
                            free_bytes=available_bytes(self.device),
                            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."), compile_s=self.compile_s,
                            graph_capture_s=self.graph_capture_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream.synchronize()
        _release_device_state(self)

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream), pinned_sdpa(self.device, self._sdpa):
            yield

    def _valid_slot(self, slot: int, out: StepOutput) -> bool:
        if 0 <= slot < self.num_slots:
            return True
        out.failed[slot] = f"slot {slot} is outside 0..{self.num_slots - 1}"
        return False

    def _fail(self, slot: int, reason: str, out: StepOutput) -> None:
        out.failed[slot] = reason
        self._drop(slot)

    def _drop(self, slot: int) -> None:
        session = self._sessions[slot]
        if session is not None and session.adapter is not None:
            self._unpinned.append(session.adapter)
        self._sessions[slot] = None

    def _release_adapters(self, names: list[str]) -> None:
        if self.lora is not None:
            for name in names:
                self.lora.release(name)

    def _lora_batch(self, entries: list[int], *, mode: LoraMode) -> LoraBatch | None:
        return None if self.lora is None else LoraBatch.for_rows(self.lora.pool, entries, mode=mode)

    def _prefill(self, chunk: PrefillChunk, out: StepOutput,
                 sampled: list[tuple[Tensor, Tensor, list[int]]]) -> None:
        slot = chunk.slot
        if not self._valid_slot(slot, out):
            return
        if not 0 <= chunk.start < chunk.end <= len(chunk.prompt_ids):
            self._fail(slot, f"prefill chunk [{chunk.start}, {chunk.end}) is empty or outside the prompt", out)
            return
        if chunk.end > self.max_seq_len:
            self._fail(slot, f"prompt of {chunk.end} tokens exceeds max_seq_len {self.max_seq_len}", out)
            return
        ids = chunk.prompt_ids[chunk.start : chunk.end]
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            self._fail(slot, f"prompt ids must be in 0..{self.config.vocab_size - 1}", out)
            return
        if chunk.start == 0:
            problem = sampling_problem(chunk.sampling, self.config.vocab_size)
            if problem:
                self._fail(slot, f"invalid sampling parameters: {problem}", out)
                return
            self._drop(slot)
            session = _Session(request_id=chunk.request_id, sampling=chunk.sampling)
            if chunk.adapter is not None:
                if self.lora is None:
                    self._fail(slot, f"adapter {chunk.adapter!r} requested but LoRA adapters are off "
                                     "(set voices.adapters_dir)", out)
                    return
                try:
                    session.lora_entry = self.lora.acquire(chunk.adapter)
                except (AdapterError, EngineError) as exc:  # a bad adapter or a full pool fails this session only
                    self._fail(slot, str(exc), out)
                    return
                session.adapter = chunk.adapter
                self._pinned.append(chunk.adapter)
            self._sessions[slot] = session
            seed = chunk.sampling.seed if chunk.sampling.seed is not None else self._seed_source.getrandbits(64)
            self._sampling.reset(slot, chunk.sampling, seed)
        else:
            current = self._sessions[slot]
            if current is None or current.ready or current.request_id != chunk.request_id \
                    or current.cached != chunk.start:
                self._fail(slot, f"prefill chunk starting at {chunk.start} does not continue the slot's prompt", out)
                return
            session = current

        tokens = ints_to_device(ids, self.device)
        slot_index = ints_to_device([slot], self.device)
        self._sampling.mark_seen(slot_index, tokens)
        lora = self._lora_batch([session.lora_entry], mode="gather")  # one adapter, at its own rank
        # Without adapters the call is the plain one, as before (wrappers of prefill/decode see no new argument).
        args = (tokens, slot, chunk.start) if lora is None else (tokens, slot, chunk.start, lora)
        hidden = self.model.prefill(*args)  # [T, dim]
        session.cached = chunk.end
        if not chunk.is_last:
            return
        step = torch.zeros(1, dtype=torch.int64, device=self.device)
        first = self._sample(hidden[-1:], slot_index, step, [0], [chunk.sampling])
        sampled.append((slot_index, first, [slot]))
        session.generated, session.ready = 1, True

    def _sample(self, hidden: Tensor, slots: Tensor, steps: Tensor, host_steps: list[int],
                params: list[SamplingParams]) -> Tensor:
        """hidden [B, dim] of rows that are all constrained or all not -> new token ids [B] (not yet
        recorded as seen: `step` does that once the whole step has succeeded)."""
        if params[0].constrained:
            # A CPU is compute-bound here: project each row onto its own position's 4096 rows only.
            by_position = host_steps if self.device.type == "cpu" else None
            logits = constrained_logits(hidden, self.model.output.weight, steps, by_position)  # [B, 4097]
            return self._sampling.sample_constrained(logits, slots, steps, params, record=False)
        return self._sampling.sample_full(self.model.logits(hidden), slots, steps, params, record=False)

    def _sample_in_graph(self, hidden: Tensor, slots: Tensor, steps: Tensor) -> Tensor:
        """The constrained draw with every row's work done (no host parameters, no host sync): capturable,
        and the same tokens as `_sample` gives constrained rows (sampling.sample_candidates: the work
        `_sample` may skip is a no-op for the rows it skips it for)."""
        logits = constrained_logits(hidden, self.model.output.weight, steps)  # [B, 4097]
        return self._sampling.sample_constrained(logits, slots, steps, None, record=False)

    def _decodable(self, slots: Sequence[int], out: StepOutput) -> list[int]:
        rows: list[int] = []
        listed: set[int] = set()
        for slot in slots:
            if not self._valid_slot(slot, out):
                continue
            session = self._sessions[slot]
            if slot in listed:
                self._fail(slot, "slot listed twice in one decode step", out)
            elif session is None or not session.ready:
                self._fail(slot, "decode of a slot without a prefilled session", out)
            elif session.cached >= self.max_seq_len:
                self._fail(slot, f"sequence would exceed max_seq_len {self.max_seq_len}", out)
            else:
                rows.append(slot)
            listed.add(slot)
        return [s for s in rows if self._sessions[s] is not None]

    def _decode(self, rows: list[int], out: StepOutput, sampled: list[tuple[Tensor, Tensor, list[int]]]) -> None:
        if not rows:
            return
        sessions = [self._sessions[s] for s in rows]
        assert all(s is not None for s in sessions)
        host = torch.tensor([rows, [s.cached for s in sessions], [s.generated for s in sessions]],  # type: ignore[union-attr]
                            dtype=torch.int64)
        slots, positions, steps = ints_to_device(host, self.device).unbind(0)  # [B] each
        kv_len = int(host[1].max()) + 1
        tokens = self._last_token[slots]
        entries = [s.lora_entry for s in sessions]  # type: ignore[union-attr]
        params = [s.sampling for s in sessions]  # type: ignore[union-attr]
        constrained = [p.constrained for p in params]
        drawn: Tensor | None = None
        if self._graphs is not None:
            hidden, drawn = self._graphs.run(tokens, slots, positions, kv_len,
                                             ints_to_device(entries, self.device) if any(entries) else None,
                                             steps=steps if all(constrained) else None)
        else:
            # Eager: the kernels where chosen (CUDA), else the host's grouping, which costs a CPU least. The compiled
            # pass takes the rows' entries on the device (kernel or pool mode, as its warm-up compiled it): the
            # host's grouping would be a new argument structure, compiled again per grouping.
            mode: LoraMode = "kernel" if self.lora_kernel == "triton" else "pool" if self._compiled else "gather"
            lora = self._lora_batch(entries, mode=mode)
            decode = self._compiled or self.model.decode
            args = (tokens, slots, positions, kv_len) if lora is None else (tokens, slots, positions, kv_len, lora)
            hidden = decode(*args)  # [B, dim]

        host_steps = host[2].tolist()
        if drawn is not None:  # sampled inside the graph
            new = drawn.clone()  # the graph's output buffer is overwritten by the next replay
        elif all(constrained) or not any(constrained):
            new = self._sample(hidden, slots, steps, host_steps, params)
        else:
            new = torch.empty_like(slots)
            for flag in (True, False):
                kind = [i for i, c in enumerate(constrained) if c == flag]
                idx = ints_to_device(kind, self.device)
                new[idx] = self._sample(hidden[idx], slots[idx], steps[idx], [host_steps[i] for i in kind],
                                        [params[i] for i in kind])
        sampled.append((slots, new, rows))
        for session in sessions:
            assert session is not None
            session.cached += 1
            session.generated += 1
