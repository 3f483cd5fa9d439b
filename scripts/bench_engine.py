#!/usr/bin/env python3
"""Decode throughput of the torch token engine at several batch sizes.

    python scripts/bench_engine.py                       # tiny + ~100M random Llamas, batch 1, 4, 16, 32
    python scripts/bench_engine.py --presets 100m --batches 1,16 --rounds 5
    python scripts/bench_engine.py --model models/orpheus --device cuda   # a real checkpoint on a GPU

For each model, one engine holds max(batches) sessions (prompt prefilled, Orpheus sampling:
temperature 0.6, top_p 0.8, repetition penalty 1.1, constrained, seeded). Each round runs
`--steps` decode steps at every batch size in turn (the first B sessions), so all batch sizes
see the same machine conditions; the median round per batch size is reported. Prints a table of
step time, aggregate tokens/s and the ratio to batch 1. Random-weight models are written with
scripts/make_tiny_models.py into --models-dir when missing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from orpheus_serve import protocol as P  # noqa: E402
from orpheus_serve.config import resolve_device, resolve_dtype  # noqa: E402
from orpheus_serve.engines.llama import LlamaConfig  # noqa: E402
from orpheus_serve.engines.torch_engine import TorchEngine  # noqa: E402
from orpheus_serve.step import PrefillChunk, SamplingParams, StepPlan  # noqa: E402

PRESET_FOLDERS = {"tiny": "tiny-orpheus", "100m": "orpheus-100m"}


def ensure_model(models_dir: Path, preset: str) -> Path:
    folder = models_dir / PRESET_FOLDERS[preset]
    if not (folder / "config.json").exists():
        from scripts.make_tiny_models import main as make_tiny_models

        make_tiny_models(["--out", str(models_dir), "--preset", preset, "--skip-snac"])
    return folder


def bench_model(folder: Path, *, batches: list[int], steps: int, rounds: int, warmup: int, device: str,
                dtype: str, prompt_len: int) -> dict[int, float]:
    """Median seconds per decode step, per batch size."""
    max_batch = max(batches)
    max_seq_len = prompt_len + 1 + warmup * len(batches) + rounds * steps * len(batches) + 8
    engine = TorchEngine(folder, num_slots=max_batch, max_seq_len=max_seq_len, device=device, dtype=dtype,
                         max_batch_size=max_batch)
    gen = torch.Generator().manual_seed(0)
    for slot in range(max_batch):
        text = torch.randint(0, 1000, (prompt_len - 6,), generator=gen).tolist()
        prompt = (P.START_OF_HUMAN, P.BOS, *text, *P.PROMPT_SUFFIX)
        sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=slot)
        engine.step(StepPlan(prefill=[PrefillChunk(slot, f"bench-{slot}", prompt, 0, len(prompt), sampling)]))
    for batch in batches:
        for _ in range(warmup):
            engine.step(StepPlan(decode=list(range(batch))))
    per_round: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(rounds):
        for batch in batches:
            plan_slots = list(range(batch))
            started = time.perf_counter()
            for _ in range(steps):
                out = engine.step(StepPlan(decode=plan_slots))
                assert not out.failed, out.failed
            per_round[batch].append((time.perf_counter() - started) / steps)
    engine.close()
    return {b: statistics.median(times) for b, times in per_round.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,100m", help="random-weight models to bench (tiny, 100m)")
    ap.add_argument("--model", action="append", default=[], help="also bench this local checkpoint folder")
    ap.add_argument("--models-dir", default=str(ROOT / "models"), help="where the random-weight models live")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per batch size per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = sorted({int(b) for b in args.batches.split(",") if b})
    if 1 not in batches:
        batches.insert(0, 1)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    folders = [ensure_model(Path(args.models_dir), p) for p in args.presets.split(",") if p]
    folders += [Path(m) for m in args.model]

    print(f"device {device}, dtype {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds x {args.steps} steps per batch size, median round")
    print(f"{'model':<16} {'params':>8} {'batch':>5} {'step ms':>9} {'tokens/s':>10} {'x batch 1':>10}")
    for folder in folders:
        params = LlamaConfig.from_folder(folder).num_parameters
        step_s = bench_model(folder, batches=batches, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                             device=device, dtype=dtype, prompt_len=args.prompt_len)
        base = 1 / step_s[1]
        for batch in batches:
            rate = batch / step_s[batch]
            print(f"{folder.name:<16} {params / 1e6:>7.1f}M {batch:>5} {step_s[batch] * 1e3:>9.2f} "
                  f"{rate:>10.1f} {rate / base:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
