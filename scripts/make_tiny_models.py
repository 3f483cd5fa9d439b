#!/usr/bin/env python3
"""Write seeded random-weight stand-ins for the real checkpoints, in their real on-disk formats.

    python scripts/make_tiny_models.py --out models [--seed 0] [--preset tiny|tiny-trt|100m|3b]
    python scripts/make_tiny_models.py --out models --preset 3b --device cuda --dtype bf16 --skip-snac

Writes OUT/tiny-orpheus (or OUT/orpheus-<preset>) and OUT/tiny-snac; see
orpheus_serve.weights.tiny for what they contain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from orpheus_serve.weights.tiny import LLAMA_PRESETS, write_tiny_models

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models", help="parent folder (default: models)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(LLAMA_PRESETS), default="tiny")
    ap.add_argument("--name", default=None, help="Llama folder name (default: tiny-orpheus, or orpheus-<preset>)")
    ap.add_argument("--skip-snac", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: fast for 3b)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the saved weights")
    args = ap.parse_args(argv)

    out = Path(args.out)
    llama = write_tiny_models(out, seed=args.seed, preset=args.preset, name=args.name, snac=not args.skip_snac,
                              device=args.device, dtype=DTYPES[args.dtype])
    print(f"wrote {llama}")
    if not args.skip_snac:
        print(f"wrote {out / 'tiny-snac'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
