#!/usr/bin/env python3
"""What batched LoRA voices cost: decode tokens/s of a batch with adapters against the same batch without.

    python scripts/bench_lora.py                              # tiny + ~100M Llamas, batch 16, 8 adapters of rank 16
    python scripts/bench_lora.py --presets 100m --batch 16 --adapters 0,1,8,16 --rank 64 --rounds 9
    python scripts/bench_lora.py --presets "" --model models/orpheus --adapters-dir voices --device cuda
    python scripts/bench_lora.py --presets "" --model models/orpheus-3b --device cuda --dtype bf16 \
        --batch 128 --adapters 0,8,32 --adapters-dir /tmp/lora-r16 --write-adapters --json lora.json

One engine (adapters pool of max(adapters) entries) holds one group of `batch` sessions per
adapter count: the sessions of the group with N adapters use adapter i % N (none for N = 0),
all prefilled before timing. Each round runs `--steps` decode steps of every group in turn, so
every group sees the same machine conditions (a shared, loaded machine changes speed from one
second to the next); the median round per group is reported, with its ratio to the group
without adapters. Random adapters (all seven target modules) are written into a temporary
folder unless --adapters-dir is given (with --write-adapters, into --adapters-dir, kept for the next
run: the adapters already there are reused). CUDA graphs are on (the engine's default, the production
shape) unless `--graphs off`. `--json` writes one row per (model, adapter count): step ms, tokens/s
and the ratio to the batch without adapters.

`--lora-kernels` (default auto) names the ways of adding the adapters to measure (voices.lora_kernel: the
segmented Triton kernels, the torch gather). auto is the one the server would use, resolved as the engine
resolves voices.lora_kernel's default (triton on CUDA with Triton installed, torch elsewhere): one engine,
the rows the server's. A comma list (`triton,torch`) measures each on the same loaded weights, one engine
after the other. `rows` are the first kernel's, each with its `kernel`; each row's `by_kernel` holds every
kernel's numbers for that adapter count (and `rows_by_kernel` every kernel's rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from orpheus_serve import token_format as P  # noqa: E402
from orpheus_serve.config import resolve_device, resolve_dtype  # noqa: E402
from orpheus_serve.engines.llama import Transformer, load_transformer, torch_dtype  # noqa: E402
from orpheus_serve.engines.torch_engine import TorchEngine, resolve_lora_kernel  # noqa: E402
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan  # noqa: E402
from orpheus_serve.weights.tiny import write_lora_adapter  # noqa: E402

PRESET_FOLDERS = {"tiny": "tiny-orpheus", "100m": "orpheus-100m"}
SAMPLING = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=0)


def ensure_model(models_dir: Path, preset: str) -> Path:
    folder = models_dir / PRESET_FOLDERS[preset]
    if not (folder / "config.json").exists():
        from scripts.make_tiny_models import main as make_tiny_models

        make_tiny_models(["--out", str(models_dir), "--preset", preset, "--skip-snac"])
    return folder


def measure(model: Path, adapters_dir: Path, names: list[str], *, batch: int, counts: list[int], steps: int,
            rounds: int, device: str, dtype: str, rank: int, graphs: bool = True, lora_kernel: str = "auto",
            weights: Transformer | None = None) -> list[tuple[int, float]]:
    """[(adapters in the batch, median tokens/s)]; `weights`: the model already loaded (shared by engines run
    one after another)."""
    engine = TorchEngine(model, num_slots=batch * len(counts), max_seq_len=64 + steps * rounds + 8, device=device,
                         dtype=dtype, max_batch_size=batch, adapters_dir=adapters_dir, cuda_graphs=graphs,
                         max_loras=max(1, max(counts)), max_lora_rank=rank, seed=0, lora_kernel=lora_kernel,
                         model=weights)
    groups: list[list[int]] = []
    for g, count in enumerate(counts):
        slots = list(range(g * batch, (g + 1) * batch))
        for i, slot in enumerate(slots):
            prompt = (P.START_OF_HUMAN, P.BOS, *range(100 + i, 120 + i), *P.PROMPT_SUFFIX)
            adapter = names[i % count] if count else None
            out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"g{g}s{i}", prompt, 0, len(prompt), SAMPLING,
                                                             adapter=adapter)]))
            assert not out.failed, out.failed
        groups.append(slots)
    engine.step(StepPlan(decode=groups[0]))  # warm-up
    times: list[list[float]] = [[] for _ in counts]
    for _ in range(rounds):
        for g, slots in enumerate(groups):
            started = time.perf_counter()
            for _ in range(steps):
                out = engine.step(StepPlan(decode=slots))
                assert not out.failed, out.failed
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            times[g].append(time.perf_counter() - started)
    engine.close()
    return [(count, batch * steps / statistics.median(t)) for count, t in zip(counts, times, strict=True)]


def _adapters(args: argparse.Namespace, folder: Path, scratch: Path, needed: int) -> tuple[Path, list[str]]:
    """(adapters folder, the adapter names in it): --adapters-dir, or random ones written into `scratch`
    (or into --adapters-dir with --write-adapters)."""
    if args.adapters_dir and not args.write_adapters:
        adapters_dir = Path(args.adapters_dir)
        names = sorted(p.name for p in adapters_dir.iterdir() if (p / "adapter_config.json").is_file())
    else:
        adapters_dir = Path(args.adapters_dir) if args.adapters_dir else scratch
        names = [f"voice{i}" for i in range(needed)]
        for i, name in enumerate(names):
            if not (adapters_dir / name / "voice.json").is_file():  # written last: a whole adapter
                # 16-bit files for a 16-bit model: half the writing (32 adapters of a 3B model are GBs)
                file_dtype = torch.bfloat16 if args.dtype in ("bf16", "fp16") else torch.float32
                write_lora_adapter(adapters_dir / name, folder, seed=i, rank=args.rank, dtype=file_dtype)
    if needed > len(names):
        raise SystemExit(f"{adapters_dir} holds {len(names)} adapters, fewer than {needed}")
    return adapters_dir, names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,100m", help="random-weight models to run (comma list; '' for none)")
    ap.add_argument("--model", default=None, help="also run this Llama folder")
    ap.add_argument("--models-dir", default=str(ROOT / "models"))
    ap.add_argument("--adapters-dir", default=None, help="PEFT adapters for --model (default: random ones)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", default="0,8", help="adapter counts in a batch (comma list; 0 = base model)")
    ap.add_argument("--rank", type=int, default=16, help="rank of the random adapters (and the pool)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--graphs", choices=["on", "off"], default="on", help="CUDA graphs (CUDA only; default on)")
    ap.add_argument("--write-adapters", action="store_true",
                    help="write the random adapters missing from --adapters-dir into it (and keep them)")
    ap.add_argument("--lora-kernels", default="auto",
                    help="comma list of voices.lora_kernel values to measure, the first one's rows first "
                         "(auto: the one the server would use: triton on CUDA, torch elsewhere)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    counts = [int(c) for c in args.adapters.split(",")]
    models = [(p, ensure_model(Path(args.models_dir), p)) for p in args.presets.split(",") if p]
    if args.model:
        models.append((Path(args.model).name, Path(args.model)))

    kernels = _kernels(args.lora_kernels, device)
    print(f"device {device}, dtype {dtype}, batch {args.batch}, rank {args.rank}, {args.steps} steps x "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}, LoRA kernels {', '.join(kernels)}")
    print(f"{'model':<14}{'kernel':>8}{'adapters':>9}{'tokens/s':>11}{'vs base':>9}")
    rows_by_kernel: dict[str, list[dict[str, object]]] = {k: [] for k in kernels}
    for label, folder in models:
        with tempfile.TemporaryDirectory() as tmp:
            adapters_dir, names = _adapters(args, folder, Path(tmp), max(counts))
            weights = load_transformer(folder, dtype=torch_dtype(dtype), device=device)
            for kernel in kernels:
                results = measure(folder, adapters_dir, names, batch=args.batch, counts=counts, steps=args.steps,
                                  rounds=args.rounds, device=device, dtype=dtype, rank=args.rank,
                                  graphs=args.graphs == "on", lora_kernel=kernel, weights=weights)
                base = dict(results).get(0)
                for count, tps in results:
                    ratio = f"{tps / base:.2f}" if base else "-"
                    print(f"{label:<14}{kernel:>8}{count:>9}{tps:>11.0f}{ratio:>9}", flush=True)
                    rows_by_kernel[kernel].append({
                        "model": label, "batch": args.batch, "adapters": count, "rank": args.rank,
                        "graphs": args.graphs == "on" and device.startswith("cuda"), "kernel": kernel,
                        "step_ms": round(args.batch / tps * 1e3, 3), "tokens_per_s": round(tps, 1),
                        "vs_base": round(tps / base, 3) if base else None})
            del weights
    rows = rows_by_kernel[kernels[0]]
    for i, row in enumerate(rows):  # the same (model, adapter count) in every kernel's list
        row["by_kernel"] = {k: {f: rows_by_kernel[k][i][f] for f in ("step_ms", "tokens_per_s", "vs_base")}
                            for k in kernels}
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device, "dtype": dtype, "torch": torch.__version__, "batch": args.batch, "rank": args.rank,
            "steps": args.steps, "rounds": args.rounds, "lora_kernel": kernels[0], "kernels": kernels,
            "rows": rows, "rows_by_kernel": rows_by_kernel}, indent=2) + "\n")
    return 0


def _kernels(spec: str, device: str) -> list[str]:
    """The voices.lora_kernel values to measure: `auto` is the server's (one engine), resolved as the engine
    resolves voices.lora_kernel: auto."""
    if spec == "auto":
        return [resolve_lora_kernel("auto", torch.device(device))]
    kernels = [k for k in spec.split(",") if k]
    unknown = sorted(set(kernels) - {"triton", "torch"})
    if unknown or not kernels:
        raise SystemExit(f"--lora-kernels: {', '.join(unknown) or 'none given'}; expected triton and/or torch")
    return kernels


if __name__ == "__main__":
    sys.exit(main())
