#!/usr/bin/env python3
"""Write seeded random-weight stand-ins for the real checkpoints, in their real on-disk formats.

    python scripts/make_tiny_models.py --out models [--seed 0] [--preset tiny|tiny-trt|100m|3b]
    python scripts/make_tiny_models.py --out models --preset 3b --device cuda --dtype bf16 --skip-snac
    python scripts/make_tiny_models.py --out models --lora-adapters 4   # + OUT/tiny-lora/voice0..voice3

Writes OUT/tiny-orpheus (or OUT/orpheus-<preset>) and OUT/tiny-snac; see
orpheus_serve.weights.tiny for what they contain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from orpheus_serve.weights.tiny import LLAMA_PRESETS, write_lora_adapters, write_tiny_models

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
    ap.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                    help="also write N seeded PEFT-format LoRA adapters for the model into OUT/tiny-lora "
                         "(a voices.adapters_dir)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    llama = write_tiny_models(out, seed=args.seed, preset=args.preset, name=args.name, snac=not args.skip_snac,
                              device=args.device, dtype=DTYPES[args.dtype])
    print(f"wrote {llama}")
    if not args.skip_snac:
        print(f"wrote {out / 'tiny-snac'}")
    if args.lora_adapters:
        for folder in write_lora_adapters(out / "tiny-lora", llama, args.lora_adapters, seed=args.seed):
            print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
