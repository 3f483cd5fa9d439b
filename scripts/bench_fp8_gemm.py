#!/usr/bin/env python3
"""The decoder's four GEMMs per shape: bf16 against FP8 `torch._scaled_mm`, by batch size.

    python scripts/bench_fp8_gemm.py --model models/orpheus-3b --device cuda --batches 1,128,256 --json gemm.json

For a Llama folder's shapes (q|k|v: N = q + 2 kv, K = dim; o: dim x q; gate|up: 2 I x dim; down:
dim x I) and each M in --batches, the mean time of one GEMM:

- bf16: `F.linear(x, w)` with x [M, K], w [N, K] (what the engine runs without quantization);
- fp8 rowwise: `_scaled_mm(x_fp8, w_fp8.t(), scale_a [M, 1], scale_b [1, N])`, the layout Hopper's FP8
  path takes (A row-major, B column-major: w_fp8 [N, K] contiguous, transposed as a view) with one
  scale per token and per output channel (fp8.Fp8Linear);
- fp8 tensorwise: the same with one scale per tensor (a scalar each), the path cuBLAS serves best.

Activation quantisation is not in these times: with `engine.fused` it happens inside the RMSNorm
that precedes the GEMM (fused.py). `--json` writes one row per (GEMM, M). On a CPU the numbers
only show that the script runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from orpheus_serve.engines.fp8 import FP8_DTYPE, FP8_MAX, scaled_mm_rowwise  # noqa: E402
from orpheus_serve.engines.llama import LlamaConfig  # noqa: E402


def gemm_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the decoder layer's GEMMs, as llama.py concatenates them."""
    return {"qkv": (config.q_size + 2 * config.kv_size, config.dim), "o": (config.dim, config.q_size),
            "gate_up": (2 * config.intermediate_size, config.dim), "down": (config.dim, config.intermediate_size)}


def mean_us(fn: object, *, device: torch.device, iters: int, warmup: int = 3) -> float:
    assert callable(fn)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) * 1e6 / iters


def measure(n: int, k: int, m: int, *, device: torch.device, iters: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=torch.bfloat16)
    w_scale = (w.float().abs().amax(dim=1) / FP8_MAX).view(1, n)  # [1, N]
    w_fp8 = (w.float() / w_scale.view(n, 1)).to(FP8_DTYPE)  # [N, K] row-major: .t() is column-major [K, N]
    x_scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [M, 1]
    x_fp8 = (x.float() / x_scale).to(FP8_DTYPE)  # [M, K] row-major
    x_scale_t, w_scale_t = x_scale.max().reshape(()), w_scale.max().reshape(())
    out = torch.bfloat16
    return {
        "bf16_us": mean_us(lambda: F.linear(x, w), device=device, iters=iters),
        # fp8.Fp8Linear's GEMM (on a CPU: unit scales, then the row and channel scales).
        "fp8_rowwise_us": mean_us(lambda: scaled_mm_rowwise(x_fp8, w_fp8.t(), x_scale, w_scale), device=device,
                                  iters=iters),
        "fp8_tensorwise_us": mean_us(lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale_t,
                                                              scale_b=w_scale_t, out_dtype=out),
                                     device=device, iters=iters),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Llama folder (its config.json gives the shapes)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,128,256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = LlamaConfig.from_folder(args.model)
    rows = []
    print(f"{'GEMM':<8} {'M':>5} {'N x K':>13} {'bf16 us':>9} {'fp8 row us':>11} {'fp8 tensor us':>14} {'best/bf16':>9}")
    for name, (n, k) in gemm_shapes(config).items():
        for m in (int(b) for b in args.batches.split(",") if b):
            t = measure(n, k, m, device=device, iters=args.iters)
            best = min(t["fp8_rowwise_us"], t["fp8_tensorwise_us"]) / t["bf16_us"]
            row = {"gemm": name, "m": m, "n": n, "k": k, **{key: round(v, 2) for key, v in t.items()},
                   "best_vs_bf16": round(best, 3)}
            rows.append(row)
            print(f"{name:<8} {m:>5} {f'{n} x {k}':>13} {row['bf16_us']:>9} {row['fp8_rowwise_us']:>11} "
                  f"{row['fp8_tensorwise_us']:>14} {row['best_vs_bf16']:>9}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__, "iters": args.iters,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
