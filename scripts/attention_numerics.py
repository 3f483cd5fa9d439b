#!/usr/bin/env python3
"""How far FP8 K/V and FP8 weights move the model from bf16: token agreement and SNAC audio SNR.

    python scripts/attention_numerics.py                        # 100m random Llama, tiny SNAC, 280 tokens
    python scripts/attention_numerics.py --preset tiny --tokens 140 --device cuda --attention triton

For each variant (the model dtype, KV cache dtype, weight quantisation and fused kernels of `VARIANTS`;
fused ones on a CPU only under TRITON_INTERPRET=1) one
model with a one-slot cache runs the same Orpheus-layout prompt, then:

- teacher-forced top-1 agreement: fed the bf16 run's own greedy tokens, the fraction of
  positions where the variant's constrained argmax (the frame position's 4096 audio ids) is the
  bf16 one. This isolates per-step error: one early disagreement does not change later inputs.
- free-running agreement: the variant's own greedy tokens against bf16's, position by position,
  and the first position where they part.
- audio SNR: the free-running tokens decoded by SNAC (noise off) against the bf16 run's audio,
  10 log10(|bf16|^2 / |variant - bf16|^2) in dB.

Random weights have flatter logits than a trained model (more near-ties), so agreement here is a
pessimistic reading. `--attention sdpa` (the default on CPU) runs the same arithmetic as the Triton
kernel over the dequantised cache (tests/test_decode_attention.py holds the two to fp32 rounding);
`--attention triton` runs the kernel itself (on a CPU only under TRITON_INTERPRET=1, slowly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from orpheus_serve import token_format as P  # noqa: E402
from orpheus_serve.codec.loader import decode_offline, load_snac  # noqa: E402
from orpheus_serve.config import resolve_device  # noqa: E402
from orpheus_serve.engines.llama import Transformer, kv_torch_dtype, load_transformer, torch_dtype  # noqa: E402

# name: (model dtype, KV cache dtype, weight quantisation, fused kernels)
VARIANTS: dict[str, tuple[str, str, str, bool]] = {
    "bf16": ("bf16", "bf16", "none", False),
    "fp32": ("fp32", "fp32", "none", False),
    "bf16 + fp8 KV": ("bf16", "fp8", "none", False),
    "bf16 + fp8 weights": ("bf16", "bf16", "fp8", False),
    "bf16 + fp8 KV + fp8 weights": ("bf16", "fp8", "fp8", False),
    "bf16 fused": ("bf16", "bf16", "none", True),
    "bf16 fused + fp8 weights": ("bf16", "bf16", "fp8", True),
}
PRESET_FOLDERS = {"tiny": "tiny-orpheus", "100m": "orpheus-100m"}


def build(folder: Path, variant: str, *, device: str, attention: str, max_seq_len: int) -> Transformer:
    dtype, kv_dtype, quantization, fused = VARIANTS[variant]
    model = load_transformer(folder, dtype=torch_dtype(dtype), device=device)
    if quantization == "fp8":
        model.quantize_weights_fp8()
    model.use_fused_kernels(fused)
    model.setup_caches(1, max_seq_len, kv_dtype=kv_torch_dtype(kv_dtype), attention=attention)
    return model


def constrained_argmax(model: Transformer, hidden: torch.Tensor, position: int) -> int:
    lo, hi = P.slot_token_range(position)
    return lo + int(model.logits(hidden)[lo:hi].argmax())


@torch.inference_mode()
def run(model: Transformer, prompt: list[int], tokens: int, forced: list[int] | None) -> list[int]:
    """Greedy constrained tokens; with `forced`, each step is fed forced[i] instead of its own choice."""
    device = model.output.weight.device
    hidden = model.prefill(torch.tensor(prompt, device=device), 0, 0)[-1]
    out = [constrained_argmax(model, hidden, 0)]
    for i in range(1, tokens):
        fed = out[-1] if forced is None else forced[i - 1]
        hidden = model.decode(torch.tensor([fed], device=device), torch.tensor([0], device=device),
                              torch.tensor([len(prompt) + i - 1], device=device), len(prompt) + i)[0]
        out.append(constrained_argmax(model, hidden, i))
    return out


def audio(snac: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    whole = len(tokens) - len(tokens) % P.TOKENS_PER_FRAME
    codes = np.array([P.token_to_code(t, i) for i, t in enumerate(tokens[:whole])]).reshape(-1, P.TOKENS_PER_FRAME)
    return decode_offline(snac, codes)


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    noise = float(np.sum((other.astype(np.float64) - reference) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / noise)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="100m", choices=sorted(PRESET_FOLDERS))
    ap.add_argument("--model", default=None, help="a local checkpoint folder instead of a random preset")
    ap.add_argument("--models-dir", default=str(ROOT / "models"))
    ap.add_argument("--snac", default=None, help="SNAC folder (default: the models dir's tiny-snac)")
    ap.add_argument("--tokens", type=int, default=280)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "triton"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    models_dir = Path(args.models_dir)
    folder = Path(args.model) if args.model else models_dir / PRESET_FOLDERS[args.preset]
    snac_dir = Path(args.snac) if args.snac else models_dir / "tiny-snac"
    if not (folder / "config.json").exists() or not (snac_dir / "config.json").exists():
        from scripts.make_tiny_models import main as make_tiny_models

        make_tiny_models(["--out", str(models_dir), "--preset", args.preset])
    device = resolve_device(args.device)
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 1000, (max(1, args.prompt_len - 6),), generator=gen).tolist()
    prompt = [P.START_OF_HUMAN, P.BOS, *text, *P.PROMPT_SUFFIX]
    max_seq_len = len(prompt) + args.tokens + 1
    snac = load_snac(snac_dir, device=device, noise=False)

    reference_model = build(folder, "bf16", device=device, attention=args.attention, max_seq_len=max_seq_len)
    reference = run(reference_model, prompt, args.tokens, None)
    reference_audio = audio(snac, reference)
    del reference_model
    print(f"{folder.name} on {device}, attention {args.attention}, {args.tokens} tokens; against bf16")
    print(f"{'variant':<30} {'teacher-forced top-1':>21} {'free-running':>13} {'first diff':>10} {'audio SNR dB':>13}")
    rows = []
    for variant in VARIANTS:
        if variant == "bf16":
            continue
        if VARIANTS[variant][3] and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            print(f"{variant:<30} skipped: fused kernels on a CPU run under TRITON_INTERPRET=1 only", flush=True)
            continue
        model = build(folder, variant, device=device, attention=args.attention, max_seq_len=max_seq_len)
        forced = run(model, prompt, args.tokens, reference)
        free = run(model, prompt, args.tokens, None)
        del model
        teacher = float(np.mean([a == b for a, b in zip(forced, reference, strict=True)]))
        same = [a == b for a, b in zip(free, reference, strict=True)]
        first = same.index(False) if not all(same) else None
        snr = snr_db(reference_audio, audio(snac, free))
        rows.append({"variant": variant, "teacher_forced_top1": round(teacher, 4),
                     "free_running_agreement": round(float(np.mean(same)), 4), "first_difference": first,
                     "audio_snr_db": None if snr == float("inf") else round(snr, 2)})
        print(f"{variant:<30} {teacher:>21.3f} {np.mean(same):>13.3f} {first!s:>10} {snr:>13.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": folder.name, "device": device, "attention": args.attention,
                                               "tokens": args.tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
