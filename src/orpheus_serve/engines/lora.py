"""LoRA adapters served together: custom voices as per-session adapters in one batch.

A fine-tuned voice is most often a PEFT (or Unsloth, same format) LoRA adapter on
`q,k,v,o,gate,up,down`: a folder with `adapter_config.json` and `adapter_model.safetensors`.
Instead of merging each into its own model, every target linear computes, per row of a step,

    y = x W^T + scale_s · (x A_s^T) B_s^T

with A_s, B_s gathered from a fixed device pool (ARCHITECTURE §6):

- `LoraPool`: per fused linear of llama.py (wqkv, wo, w13, w2) and per layer, two tensors
  A [P, in, S·R] and B [P, R, out], allocated once: P = max_loras + 1 entries (entry 0 is all
  zeros: "no adapter"), S the projections fused in that linear (3 for q|k|v, 2 for gate|up), R =
  max_lora_rank. Projection s of an adapter occupies rank columns s·R .. s·R + r of A, and rows
  0 .. r of B in its own output columns (the projections' columns are disjoint, so B needs no
  block per projection); smaller ranks are zero-padded and `scale` is folded into B, so any mix
  of adapters and ranks runs with the same shapes, and the zero padding adds exact zeros.
- `LoraBatch`: which pool entry each row of a forward pass uses, in one of three modes. Kernel
  mode (CUDA, graphs or not): the rows grouped by adapter on the device (`LoraSegments`) and two
  Triton kernels per linear, each group reading its adapter once (lora_kernels.py). Pool mode
  (the same math in plain torch, `lora_reference`): each row's A and B gathered, batched matmuls.
  Both take every row with fixed shapes (rows without an adapter have entry 0), so a captured
  graph serves any adapter mix. Gather mode (CPU, and prefill): rows grouped by adapter on the
  host, each group multiplied by its adapter's blocks in place, at its own rank and on its own
  targets. A step in which no row has an adapter passes no LoraBatch at all: no extra work.
- `LoraManager`: adapters on disk (`voices.adapters_dir`), validated when read, kept in the pool
  LRU. Its state is guarded by a lock, so any thread can list, read (`load`, `prefetch`) or
  unload, but the pool's device memory is written only by the engine thread at the start of a
  step, before its first forward pass: an adapter never changes under a running step. An adapter
  in use by a session is pinned (never evicted); unloading it is deferred until its last session
  is released.

Exactness: y = xW + (xA)B is the merged model's x(W + BA) up to float rounding (the products are
associated differently), so logits agree to rounding and greedy tokens are the merged model's
(tests/test_lora.py, against PEFT's merge_and_unload).
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch import Tensor

from orpheus_serve.engines.lora_segments import LoraSegments
from orpheus_serve.engines.transfer import ints_to_device
from orpheus_serve.scheduler.step import EngineError


class ModelShape(Protocol):
    """The shapes of the base model an adapter must fit (engines/llama.LlamaConfig has them; not imported
    here, since llama.py imports this module's LayerLora and LoraBatch)."""

    @property
    def dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def n_layers(self) -> int: ...

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The fused linears of llama.py and the Hugging Face projections each holds, in output-column order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}
PROJECTION_TO_FUSED = {proj: fused for fused, projs in FUSED_PROJECTIONS.items() for proj in projs}
TARGET_MODULES = tuple(PROJECTION_TO_FUSED)
_MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT's saved names: base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Rows per tile of the segmented kernels (tl.dot's smallest M on GPUs): a decode step's adapter groups are small.
LoraMode = Literal["gather", "pool", "kernel"]


class AdapterError(ValueError):
    """An adapter that cannot be served, with the reason (refused at load; the server goes on)."""


class AdapterBusyError(EngineError):
    """Every pool entry holds an adapter some running session uses: a new one cannot come in now."""


def projection_shapes(config: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target projection."""
    d, f = config.dim, config.intermediate_size
    return {"q_proj": (d, config.q_size), "k_proj": (d, config.kv_size), "v_proj": (d, config.kv_size),
            "o_proj": (config.q_size, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def valid_adapter_name(name: str) -> bool:
    return bool(_NAME.match(name))


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A validated adapter on the host: per (layer, projection), A [r, in] and B [out, r] in fp32."""

    name: str
    folder: Path
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _read_adapter_config(folder: Path, name: str, max_rank: int) -> tuple[int, float, float]:
    """(rank, alpha, scale) from a PEFT folder's adapter_config.json, checked to be plain LoRA on the
    supported target modules; AdapterError says what is wrong (also a missing weights file)."""
    cfg_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not cfg_path.is_file():
        raise AdapterError(f"adapter {name!r}: no {ADAPTER_CONFIG} in {folder}")
    if not weights_path.is_file():
        hint = " (save it with safe_serialization=True)" if (folder / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"adapter {name!r}: no {ADAPTER_WEIGHTS} in {folder}{hint}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_CONFIG} is not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {name!r}: {ADAPTER_CONFIG} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    # Variants whose forward is not x W + scale (x A) B are refused rather than served wrong.
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)):
        if cfg.get(key, ok) not in (ok, None):
            raise AdapterError(f"adapter {name!r}: {key}={cfg[key]!r} is not supported (only plain LoRA: {key}={ok!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"adapter {name!r}: per-module ranks ({key}) are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save {cfg['modules_to_save']!r} would replace base "
                           f"weights per voice; only LoRA on {', '.join(TARGET_MODULES)} is served")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        wrong = sorted({str(t) for t in targets} - set(TARGET_MODULES))
        if wrong:
            raise AdapterError(f"adapter {name!r}: target modules {', '.join(wrong)} are not supported "
                               f"(supported: {', '.join(TARGET_MODULES)})")
    try:
        rank = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_CONFIG} needs an integer r and a number lora_alpha") from exc
    if rank < 1:
        raise AdapterError(f"adapter {name!r}: rank {rank} must be >= 1")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is over engine.max_lora_rank {max_rank}")
    scale = alpha / rank**0.5 if cfg.get("use_rslora") else alpha / rank
    return rank, alpha, scale


def read_peft_adapter(folder: str | Path, config: ModelShape, *, max_rank: int, name: str | None = None) -> LoraAdapter:
    """Read and validate a PEFT LoRA folder against the base model; AdapterError says what is wrong."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    name = name or folder.name
    rank, alpha, scale = _read_adapter_config(folder, name, max_rank)
    weights_path = folder / ADAPTER_WEIGHTS

    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], dict[str, Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} is not LoRA on a supported target module "
                                       f"({', '.join(TARGET_MODULES)})")
                layer, parent, proj, half = int(match[1]), match[2], match[3], match[4]
                if proj not in shapes or _MODULE_PARENT[proj] != parent:
                    raise AdapterError(f"adapter {name!r}: target module {parent}.{proj} is not supported "
                                       f"(supported: {', '.join(TARGET_MODULES)})")
                if layer >= config.n_layers:
                    raise AdapterError(f"adapter {name!r}: layer {layer} does not exist in the base model "
                                       f"({config.n_layers} layers)")
                halves.setdefault((layer, proj), {})[half] = f.get_tensor(key)
    except SafetensorError as exc:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_WEIGHTS} is not a valid safetensors file ({exc})") from exc
    if not halves:
        raise AdapterError(f"adapter {name!r}: {ADAPTER_WEIGHTS} holds no LoRA tensors")

    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    for (layer, proj), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {proj} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        n_in, n_out = shapes[proj]
        if a.ndim != 2 or b.ndim != 2 or tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the base "
                f"model with rank {rank} needs A {(rank, n_in)} and B {(n_out, rank)} (trained on another model?)")
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"adapter {name!r}: layer {layer} {proj} holds non-finite values")
        weights[(layer, proj)] = (a, b)
    found = tuple(p for p in TARGET_MODULES if any(proj == p for _, proj in weights))
    return LoraAdapter(name=name, folder=folder, rank=rank, alpha=alpha, scale=scale, target_modules=found,
                       weights=weights)


# ----------------------------------------------------------------------------- device pool


def pool_bytes(config: ModelShape, *, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device memory of the pool (the memory planner counts it): max_loras + 1 entries."""
    if max_loras <= 0:
        return 0
    shapes = projection_shapes(config)
    per_layer = 0
    for projs in FUSED_PROJECTIONS.values():
        n_in = shapes[projs[0]][0]
        n_out = sum(shapes[p][1] for p in projs)
        per_layer += max_rank * (len(projs) * n_in + n_out)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (max_loras + 1) * config.n_layers * per_layer * itemsize


class LoraPool:
    """The fixed device tensors adapters are copied into (see the module docstring)."""

    def __init__(self, config: ModelShape, *, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if max_loras < 1 or max_rank < 1:
            raise EngineError("a LoRA pool needs max_loras >= 1 and max_lora_rank >= 1")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        shapes = projection_shapes(config)
        self.a: dict[str, list[Tensor]] = {}
        self.b: dict[str, list[Tensor]] = {}
        self.out_offsets: dict[str, dict[str, tuple[int, int]]] = {}
        self.bounds: dict[str, list[int]] = {}  # the projections' column boundaries in `out` [S + 1]
        self.bounds_device: dict[str, Tensor] = {}  # the same, int32 on the device (the kernels read them)
        for fused, projs in FUSED_PROJECTIONS.items():
            n_in = shapes[projs[0]][0]
            offsets, col = {}, 0
            for p in projs:
                offsets[p] = (col, col + shapes[p][1])
                col += shapes[p][1]
            self.out_offsets[fused] = offsets
            self.bounds[fused] = [0, *(hi for _, hi in offsets.values())]
            self.bounds_device[fused] = torch.tensor(self.bounds[fused], dtype=torch.int32, device=self.device)
            width = len(projs) * max_rank
            self.a[fused] = [torch.zeros(max_loras + 1, n_in, width, dtype=dtype, device=self.device)
                             for _ in range(config.n_layers)]
            self.b[fused] = [torch.zeros(max_loras + 1, max_rank, col, dtype=dtype, device=self.device)
                             for _ in range(config.n_layers)]
        # Per entry (host): the adapter's rank and target projections, for gather mode's exact-size products.
        self.ranks = [0] * (max_loras + 1)
        self.targets: list[frozenset[str]] = [frozenset()] * (max_loras + 1)

    def write(self, entry: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into entry 1..max_loras (zeroing whatever was there)."""
        if not 1 <= entry <= self.max_loras:
            raise ValueError(f"pool entry {entry} is outside 1..{self.max_loras}")
        for fused, projs in FUSED_PROJECTIONS.items():
            for layer in range(self.config.n_layers):
                a = torch.zeros_like(self.a[fused][layer][entry], device="cpu", dtype=torch.float32)
                b = torch.zeros_like(self.b[fused][layer][entry], device="cpu", dtype=torch.float32)
                for s, proj in enumerate(projs):
                    pair = adapter.weights.get((layer, proj))
                    if pair is None:
                        continue
                    la, lb = pair  # [r, in], [out, r]
                    lo, hi = self.out_offsets[fused][proj]
                    rows = slice(s * self.max_rank, s * self.max_rank + adapter.rank)
                    a[:, rows] = la.t()
                    b[: adapter.rank, lo:hi] = lb.t() * adapter.scale
                self.a[fused][layer][entry].copy_(a.to(self.dtype), non_blocking=True)
                self.b[fused][layer][entry].copy_(b.to(self.dtype), non_blocking=True)
        self.ranks[entry] = adapter.rank
        self.targets[entry] = frozenset(adapter.target_modules)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for side in (self.a, self.b) for ts in side.values() for t in ts)


def lora_reference(x: Tensor, y: Tensor, a_all: Tensor, b_all: Tensor, entries: Tensor,
                   bounds: Sequence[int], rank: int) -> Tensor:
    """x [M, in], y [M, out], a_all [P, in, S*R], b_all [P, R, out], entries [M]; `bounds`: the S + 1
    column boundaries of the fused projections in `out`. Returns y with every row's LoRA term added."""
    a = a_all.index_select(0, entries)  # [M, in, S*R]
    b = b_all.index_select(0, entries)  # [M, R, out]
    xa = torch.bmm(x.unsqueeze(1), a)  # [M, 1, S*R]
    deltas = [torch.bmm(xa[..., s * rank : (s + 1) * rank], b[..., lo:hi])
              for s, (lo, hi) in enumerate(itertools.pairwise(bounds))]  # [M, 1, out_s] each
    return y + torch.cat(deltas, dim=-1).squeeze(1)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """Which pool entry each row of one forward pass uses (module docstring: the three modes).

    Kernel and pool modes: `entries` [M], one per row of the flattened [B * T] rows (0: no adapter);
    kernel mode adds `segments`. Gather mode: `groups`, (pool entry, the rows [n] that use it, or None
    for every row)."""

    pool: LoraPool
    entries: Tensor | None = None
    segments: LoraSegments | None = None
    groups: tuple[tuple[int, Tensor | None], ...] = ()

    @classmethod
    def for_rows(cls, pool: LoraPool, entries: Sequence[int], *, mode: LoraMode,
                 tokens_per_row: int = 1) -> LoraBatch | None:
        """Rows' pool entries from the host; None when no row has an adapter (the step then does no LoRA
        work at all). `tokens_per_row`: T of the forward pass (the rows' tokens share their adapter)."""
        if not any(entries):
            return None
        device = torch.device(pool.device)
        if mode != "gather":
            return cls.on_device(pool, ints_to_device(list(entries), device), kernel=mode == "kernel",
                                 tokens_per_row=tokens_per_row)
        groups: dict[int, list[int]] = {}
        for row, entry in enumerate(entries):
            if entry:
                groups.setdefault(entry, []).append(row)
        return cls(pool, groups=tuple((entry, None if len(rows) == len(entries) else ints_to_device(rows, device))
                                      for entry, rows in groups.items()))

    @classmethod
    def on_device(cls, pool: LoraPool, entries: Tensor, *, kernel: bool, tokens_per_row: int = 1) -> LoraBatch:
        """Kernel or pool mode from entries [B] already on the device (a graph's static buffer): device
        work only, so a CUDA graph can capture it with the forward pass."""
        rows = entries if tokens_per_row == 1 else entries.repeat_interleave(tokens_per_row)  # [B * T]
        segments = LoraSegments.from_entries(rows, pool.max_loras + 1) if kernel else None
        return cls(pool, entries=rows, segments=segments)

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)

    def apply(self, fused: str, layer: int, x: Tensor, y: Tensor) -> Tensor:
        """x [B, T, in] (the linear's input), y [B, T, out] (its output) -> y + the rows' LoRA terms."""
        pool = self.pool
        a_all, b_all = pool.a[fused][layer], pool.b[fused][layer]
        R = pool.max_rank
        if self.entries is not None:
            x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])  # [B*T, in], [B*T, out]
            if self.segments is not None:
                from orpheus_serve.engines.lora_kernels import lora_segmented

                out = lora_segmented(x2.contiguous(), y2.contiguous(), a_all, b_all, self.segments,
                                     pool.bounds_device[fused], R)
            else:
                out = lora_reference(x2, y2, a_all, b_all, self.entries, pool.bounds[fused], R)
            return out.view(y.shape)
        projections = FUSED_PROJECTIONS[fused]
        for entry, rows in self.groups:
            rank, targets = pool.ranks[entry], pool.targets[entry]
            if targets.isdisjoint(projections):
                continue
            xs = x if rows is None else x.index_select(0, rows)
            # One product with A for all of this linear's projections when the adapter fills the pool's rank
            # (no padding to multiply), one per projection otherwise; then each projection's own B columns.
            xa = xs @ a_all[entry] if rank == R else None
            for s, proj in enumerate(projections):
                if proj not in targets:
                    continue
                lo, hi = pool.out_offsets[fused][proj]
                xa_s = xa[..., s * R : s * R + rank] if xa is not None else xs @ a_all[entry, :, s * R : s * R + rank]
                delta = xa_s @ b_all[entry, :rank, lo:hi]
                if rows is None:
                    y[..., lo:hi] += delta
                else:
                    y[..., lo:hi].index_add_(0, rows, delta)
        return y


@dataclass(frozen=True, slots=True, eq=False)
class LayerLora:
    """A LoraBatch bound to one layer: what llama.py's linears call. Hashed by identity (eq=False): dynamo
    (torch 2.11) hashes an object made inside a traced function before its fields are set."""

    batch: LoraBatch
    index: int

    def __call__(self, fused: str, x: Tensor, y: Tensor) -> Tensor:
        return self.batch.apply(fused, self.index, x, y)


# ----------------------------------------------------------------------------- manager

AdapterState = Literal["available", "loaded", "resident", "unloading"]


@dataclass(slots=True)
class AdapterStatus:
    name: str
    state: AdapterState  # on disk only | read and checked (copied into the pool at the next step) | in the pool | ...
    sessions: int = 0  # running sessions that use it
    rank: int | None = None
    target_modules: list[str] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "state": self.state, "sessions": self.sessions, "rank": self.rank,
                "target_modules": list(self.target_modules), "error": self.error}


class LoraManager:
    """Adapters on disk, the LRU device pool, and which sessions pin which entry (module docstring)."""

    def __init__(self, config: ModelShape, *, adapters_dir: str | Path | None, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.config = config
        self.adapters_dir = Path(adapters_dir) if adapters_dir else None
        self.max_rank = max_rank
        self.pool = LoraPool(config, max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=device)
        self._lock = threading.Lock()
        self._staged: dict[str, LoraAdapter] = {}  # read and checked, waiting for the engine thread
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> pool entry, least recently used first
        self._info: dict[str, LoraAdapter] = {}  # metadata of staged or resident adapters (weights dropped)
        self._pins: dict[str, int] = {}
        self._unloading: set[str] = set()
        self._errors: dict[str, str] = {}  # the last refusal per name, for the listing

    # -- any thread

    def folders(self) -> dict[str, Path]:
        """Adapter folders in adapters_dir (scanned on every call: a dropped-in folder is seen at once)."""
        if self.adapters_dir is None or not self.adapters_dir.is_dir():
            return {}
        return {p.name: p for p in sorted(self.adapters_dir.iterdir())
                if p.is_dir() and valid_adapter_name(p.name) and (p / ADAPTER_CONFIG).is_file()}

    def read(self, name: str) -> LoraAdapter:
        folder = self.folders().get(name)
        if folder is None:
            raise AdapterError(f"no adapter named {name!r} in {self.adapters_dir}")
        try:
            adapter = read_peft_adapter(folder, self.config, max_rank=self.max_rank, name=name)
        except AdapterError as exc:
            with self._lock:
                self._errors[name] = str(exc)
            raise
        with self._lock:
            self._errors.pop(name, None)
        return adapter

    def load(self, name: str) -> AdapterStatus:
        """Read and check now (AdapterError with the reason); copied into the pool at the next step."""
        with self._lock:
            if name in self._resident and name not in self._unloading:
                self._resident.move_to_end(name)
                return self._status(name)
        adapter = self.read(name)
        with self._lock:
            self._unloading.discard(name)
            if name not in self._resident:
                self._staged[name] = adapter
                self._info[name] = adapter
            return self._status(name)

    def prefetch(self, name: str) -> None:
        """Read and check `name` for a session about to be submitted, unless it is in the pool or staged
        already: off the engine thread, so that the step that starts the session only copies it into the
        pool. AdapterError with the reason."""
        with self._lock:
            if name in self._resident or name in self._staged:
                return
        adapter = self.read(name)
        with self._lock:
            if name not in self._resident:
                self._staged[name] = adapter
                self._info[name] = adapter

    def unload(self, name: str) -> AdapterStatus:
        """Drop from the pool; while sessions use it, once the last of them is released."""
        with self._lock:
            self._staged.pop(name, None)
            if self._pins.get(name):
                self._unloading.add(name)
            else:
                self._resident.pop(name, None)
                self._info.pop(name, None)
            return self._status(name)

    def list(self) -> list[AdapterStatus]:
        names = set(self.folders())
        with self._lock:
            names |= set(self._resident) | set(self._staged)
            return [self._status(n) for n in sorted(names)]

    def status(self, name: str) -> AdapterStatus:
        with self._lock:
            return self._status(name)

    def _status(self, name: str) -> AdapterStatus:
        info = self._info.get(name)
        state: AdapterState = "available"
        if name in self._unloading:
            state = "unloading"
        elif name in self._resident:
            state = "resident"
        elif name in self._staged:
            state = "loaded"
        return AdapterStatus(name=name, state=state, sessions=self._pins.get(name, 0),
                             rank=info.rank if info else None,
                             target_modules=list(info.target_modules) if info else [],
                             error=self._errors.get(name))

    # -- the engine thread, between forward passes

    def acquire(self, name: str) -> int:
        """Pin `name` for a starting session and return its pool entry, loading it (LRU) if needed.
        AdapterError: unknown or bad adapter; AdapterBusyError: every entry is pinned."""
        with self._lock:
            entry = self._resident.get(name)
            if entry is not None:  # an unload still pending is called off: the pool copy is good
                self._unloading.discard(name)
                return self._pin(name, entry)
            staged = self._staged.pop(name, None)
        adapter = staged or self.read(name)
        with self._lock:
            entry = self._free_entry(name)
            self.pool.write(entry, adapter)
            self._resident[name] = entry
            self._info[name] = adapter
            return self._pin(name, entry)

    def _pin(self, name: str, entry: int) -> int:
        self._resident.move_to_end(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        return entry

    def release(self, name: str) -> None:
        """A session that used `name` has ended."""
        with self._lock:
            left = self._pins.get(name, 0) - 1
            if left > 0:
                self._pins[name] = left
                return
            self._pins.pop(name, None)
            if name in self._unloading:
                self._unloading.discard(name)
                self._resident.pop(name, None)
                self._info.pop(name, None)

    def apply_staged(self) -> None:
        """Copy adapters loaded through `load` into the pool (evicting unpinned ones, LRU first)."""
        with self._lock:
            while self._staged:
                name, adapter = next(iter(self._staged.items()))
                try:
                    entry = self._free_entry(name)
                except AdapterBusyError:
                    return  # stays staged until an entry frees up
                del self._staged[name]
                self.pool.write(entry, adapter)
                self._resident[name] = entry
                self._resident.move_to_end(name)

    def _free_entry(self, name: str) -> int:
        used = set(self._resident.values())
        for entry in range(1, self.pool.max_loras + 1):
            if entry not in used:
                return entry
        for victim, entry in self._resident.items():  # least recently used first
            if not self._pins.get(victim):
                del self._resident[victim]
                self._unloading.discard(victim)
                if victim not in self._staged:
                    self._info.pop(victim, None)
                return entry
        raise AdapterBusyError(f"adapter {name!r} cannot be loaded: all {self.pool.max_loras} LoRA pool entries "
                               f"(voices.max_loras) hold adapters of running sessions")


ADAPTER_OPERATIONS = ("list", "load", "unload")


def adapter_call(manager: LoraManager | None, op: str, name: str | None = None) -> list[dict[str, object]]:
    """The admin operations on custom-voice adapters, as both process modes run them: "list" (every
    adapter), "load" or "unload" one (its status). AdapterError with the reason otherwise."""
    if manager is None:
        if op == "list":
            return []
        raise AdapterError("this engine has no adapter pool to manage: custom voices are off (voices.adapters_dir "
                           "is unset), or the TensorRT-LLM backend serves them from its own LoRA cache")
    if op == "list":
        return [s.as_dict() for s in manager.list()]
    if op not in ADAPTER_OPERATIONS:
        raise AdapterError(f"unknown adapter operation {op!r} (one of {', '.join(ADAPTER_OPERATIONS)})")
    if not isinstance(name, str) or not valid_adapter_name(name):
        raise AdapterError(f"adapter name {name!r} is not valid (letters, digits and '_.-', at most 64)")
    return [(manager.load(name) if op == "load" else manager.unload(name)).as_dict()]
