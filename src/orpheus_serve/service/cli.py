"""Text to WAV through the whole service, in-process, no network.

    python -m orpheus_serve synthesize --text "Hello there." --voice tara --out out.wav
        [--config FILE] [--profile longform] [--seed N] [--temperature T] [--no-constraint]
        [--tokens-out tokens.json] [--set section.key=value ...]

Long text is split into sentence chunks that play as one stream. `--tokens-out`
writes, per chunk, its text, prompt ids and generated ids (audio tokens, then
end_of_speech when the model stopped by itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import wave
from pathlib import Path

from .. import token_format
from ..config import ConfigError, load_config
from ..request.errors import SynthesisError
from ..request.types import AudioChunk, SynthesisMetrics, SynthesisRequest
from .build import build_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", required=True)
    parser.add_argument("--voice", default=token_format.DEFAULT_VOICE)
    parser.add_argument("--out", required=True, type=Path, help="output WAV (24 kHz, 16-bit, mono)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--profile", default="longform", help="config profile (default: longform)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--no-constraint", action="store_true", help="turn off the frame-position constraint")
    parser.add_argument("--tokens-out", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")


async def synthesize_to_file(args: argparse.Namespace) -> SynthesisMetrics:

    config = load_config(args.config, profile=args.profile, overrides=args.set)
    service = build_service(config, record_tokens=args.tokens_out is not None)
    await service.start(warmup=False)
    request = SynthesisRequest(
        text=args.text,
        voice=args.voice,
        seed=args.seed,
        temperature=args.temperature,
        constrained=False if args.no_constraint else None,
    )
    metrics: SynthesisMetrics | None = None
    try:
        with wave.open(str(args.out), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(token_format.SAMPLE_RATE)
            async for item in service.synthesize(request):
                if isinstance(item, AudioChunk):
                    wav.writeframes(item.pcm)
                else:
                    metrics = item
    finally:
        await service.shutdown(grace_s=0)
    if args.tokens_out is not None and service.token_log is not None:
        chunks = [
            {
                "text": entry["text"],
                "prompt_ids": entry["prompt_ids"],
                "generated_ids": token_format.frames_to_token_ids(entry["frames"], end=entry["finish_reason"] == "stop"),
                "finish_reason": entry["finish_reason"],
            }
            for entry in service.token_log.values()
        ]
        args.tokens_out.write_text(json.dumps({"request_id": request.request_id, "chunks": chunks}))
    assert metrics is not None
    return metrics


def run(args: argparse.Namespace) -> int:
    try:
        metrics = asyncio.run(synthesize_to_file(args))
    except (ConfigError, SynthesisError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics.as_dict()))
    return 0
