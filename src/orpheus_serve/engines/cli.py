"""Generate audio token ids with the token engine alone: prompt ids in, generated ids out.

    python -m orpheus_serve generate --model models/orpheus --prompt-ids 128259,128000,...,128257

Prints the generated ids (end_of_speech included when sampled) as one JSON list on stdout;
a one-line summary goes to stderr. One session, prefilled in chunks, decoded until
end_of_speech or --max-tokens, exactly as the scheduler would drive the engine.
"""

from __future__ import annotations

import argparse
import json
import sys

from orpheus_serve import token_format as P
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan


def _ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("at least one prompt id is needed")
    return ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face Llama folder")
    parser.add_argument("--prompt-ids", required=True, type=_ids, help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=700, help="generated tokens at most (default 700)")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-constraint", action="store_true",
                        help="sample from the whole vocabulary instead of the frame-position constraint")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: prompt + max tokens")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill step")
    parser.add_argument("--no-cuda-graphs", action="store_true")


def run(args: argparse.Namespace) -> int:
    from orpheus_serve.config import resolve_device, resolve_dtype
    from orpheus_serve.engines.torch_engine import TorchEngine

    prompt: tuple[int, ...] = args.prompt_ids
    if args.max_tokens < 1 or args.prefill_chunk < 1:
        print("error: --max-tokens and --prefill-chunk must be >= 1", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    engine = TorchEngine(
        args.model,
        num_slots=1,
        max_seq_len=args.max_seq_len or len(prompt) + args.max_tokens,
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        max_batch_size=1,
        cuda_graphs=not args.no_cuda_graphs,
    )
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                              seed=args.seed, constrained=not args.no_constraint)
    generated: list[int] = []
    decode_s = 0.0
    reason = "max_tokens"
    try:
        for start in range(0, len(prompt), args.prefill_chunk):
            end = min(start + args.prefill_chunk, len(prompt))
            out = engine.step(StepPlan(prefill=[PrefillChunk(0, "generate", prompt, start, end, sampling)]))
            if out.failed:
                print(f"error: {out.failed[0]}", file=sys.stderr)
                return 1
            generated += out.tokens.get(0, [])
        while generated and generated[-1] != P.END_OF_SPEECH and len(generated) < args.max_tokens:
            out = engine.step(StepPlan(decode=[0]))
            if out.failed:
                reason = f"failed: {out.failed[0]}"
                break
            decode_s += out.elapsed_s
            generated += out.tokens[0]
    finally:
        engine.close()
    if generated and generated[-1] == P.END_OF_SPEECH:
        reason = "end_of_speech"
    print(json.dumps(generated))
    rate = (len(generated) - 1) / decode_s if decode_s > 0 else 0.0
    print(f"{len(generated)} tokens ({reason}), decode {rate:.1f} tokens/s on {device}", file=sys.stderr)
    return 0 if not reason.startswith("failed") else 1
