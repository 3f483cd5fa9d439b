"""`engine.compile`: the decode pass under torch.compile (inductor), then captured in CUDA graphs as before.

The way vLLM does it: `Transformer.decode` is compiled once with a dynamic batch dimension (every
tensor argument's first dimension is marked dynamic), and the compiled callable is what
`DecodeGraphs` captures per padded batch size, so a step replays inductor's fused kernels without
Python or guards in the way. Without CUDA graphs (a CPU) the compiled callable runs each step.

Compilations: one for every batch size, with and without LoRA when the adapter pool is on. Dynamo
specialises a dimension of size 1, so a batch of 1 runs as a batch of 2, its row twice (the twin
writes the same K/V to the same cache entry; reading the weights, not the rows, is a small batch's
cost). SDPA attention's `kv_len` becomes symbolic after its second value (one recompilation). The
Triton decode attention is an opaque custom op (decode_attention.py): its split count, a function of
the batch size, is chosen inside the op, so it adds no guard and no compilation per batch size.
`warm_up` triggers them at start-up, so the first request pays none, and measures the time
(`compile_s`, in the engine's memory report and stats).

No silent eager: the decode is compiled with `fullgraph=True`, so a graph break, or a recompilation past
dynamo's recompile limit (8 per code object, where dynamo would otherwise run the frame eagerly from then
on), raises instead of running slower unnoticed. `compilations` counts what the backend compiled, and a
compilation after the warm-up is logged as a warning (`compilations_after_warm_up`).

Cache: inductor's FX graph cache (and the Triton kernels it builds) live in `cache_dir`
(TORCHINDUCTOR_CACHE_DIR), so a restart with the same model, shapes and torch reads compiled code
back instead of generating it again; dynamo still traces the model (seconds).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from orpheus_serve.engines.llama import Transformer
from orpheus_serve.engines.lora import LoraBatch, LoraPool

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/orpheus-serve/torch-compile")


def use_cache_dir(cache_dir: str | Path | None) -> Path:
    """Point inductor's on-disk caches at `cache_dir` (default DEFAULT_CACHE_DIR), created if missing.

    Inductor reads the folder from the environment when it first compiles: the process's compilations
    all share it (a compiled engine and a compiled codec, say)."""
    folder = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


class CompiledDecode:
    """`Transformer.decode` compiled with a dynamic batch: the same call, the same result to rounding."""

    def __init__(self, model: Transformer, *, cache_dir: str | Path | None = None,
                 backend: str | Callable[..., Any] = "inductor") -> None:
        """`backend`: torch.compile's (a name or a callable); "aot_eager" (tracing without code generation) is
        for fast tests."""
        self.cache_dir = use_cache_dir(cache_dir)
        self.device = model.output.weight.device
        inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.compilations = 0  # graphs the backend compiled (every one of them: a recompilation shows here)
        self._warm_compilations: int | None = None  # compilations once warm_up ran

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
            self.compilations += 1
            if self._warm_compilations is not None:
                logger.warning("the compiled decode pass compiled again after its warm-up (%d compilations, %d at "
                               "warm-up): a shape or argument the warm-up did not cover; set TORCH_LOGS=recompiles "
                               "to see why", self.compilations, self._warm_compilations)
            return inner(gm, example_inputs)

        self._compiled = torch.compile(model.decode, dynamic=None, backend=counting_backend, fullgraph=True)
        self.compile_s: float | None = None  # the warm-up's wall time, once run

    @property
    def compilations_after_warm_up(self) -> int:
        """Compilations since `warm_up` (0 as designed; before the warm-up, all of them)."""
        return self.compilations - (self._warm_compilations or 0)

    def __call__(self, tokens: Tensor, slots: Tensor, positions: Tensor, kv_len: int,
                 lora: LoraBatch | None = None) -> Tensor:
        if tokens.shape[0] == 1:  # the row twice (module docstring)
            tokens, slots, positions = tokens.repeat(2), slots.repeat(2), positions.repeat(2)
            if lora is not None:
                assert lora.entries is not None, "decode takes kernel or pool mode"
                lora = LoraBatch.on_device(lora.pool, lora.entries.repeat(2), kernel=lora.segments is not None)
            return self(tokens, slots, positions, kv_len, lora)[:1]
        for tensor in (tokens, slots, positions):
            torch._dynamo.mark_dynamic(tensor, 0)
        if lora is None:  # the plain call: no LoRA argument for dynamo to guard on
            return self._compiled(tokens, slots, positions, kv_len)
        assert lora.entries is not None, "decode takes kernel or pool mode"
        torch._dynamo.mark_dynamic(lora.entries, 0)
        if lora.segments is not None:
            torch._dynamo.mark_dynamic(lora.segments.order, 0)
            torch._dynamo.mark_dynamic(lora.segments.tiles, 1)
        return self._compiled(tokens, slots, positions, kv_len, lora)

    def warm_up(self, *, slot: int, lora_pool: LoraPool | None, lora_kernel: bool,
                kv_lens: Sequence[int]) -> float:
        """Compile every variant a step can call (module docstring) by running it on `slot` (the graphs'
        scratch slot, or any slot: a decode writes only its row's cache entry at position 0, which a
        session's prefill overwrites before reading). Returns and records the seconds it took."""
        device = self.device
        started = time.perf_counter()
        for with_lora in (False, True) if lora_pool is not None else (False,):
            for kv_len in kv_lens:  # one batch size: every other one runs the same compiled code
                rows = torch.full((2,), slot, dtype=torch.int64, device=device)
                zeros = torch.zeros(2, dtype=torch.int64, device=device)
                # Entries of their own: were they the tokens' tensor, dynamo would guard on the aliasing
                # (`tokens is lora.entries`) and compile again at the first real step with adapters.
                entries = torch.zeros(2, dtype=torch.int64, device=device)
                lora = LoraBatch.on_device(lora_pool, entries, kernel=lora_kernel) \
                    if with_lora and lora_pool is not None else None
                self(zeros, rows, zeros.clone(), kv_len, lora)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.compile_s = time.perf_counter() - started
        self._warm_compilations = self.compilations
        logger.info("torch.compile of the decode pass: %.1f s, %d compilations (cache %s)", self.compile_s,
                    self.compilations, self.cache_dir)
        return self.compile_s
