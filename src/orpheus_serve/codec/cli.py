"""Decode Orpheus audio token ids to a 24 kHz 16-bit mono WAV through the codec.

    python -m orpheus_serve decode --snac models/snac_24khz --tokens ids.json --out x.wav
    python -m orpheus_serve decode --tokens ids.json --out x.wav --offline --noise off

The tokens file is a JSON list of generated ids (what `python -m orpheus_serve
generate` prints; `-` reads stdin); they are parsed into frames with the
Orpheus token format, end_of_speech included. By default the frames are
streamed through the configured decoder in pushes of `--push-frames`, the
last push final, exactly as the server feeds it; `--offline` decodes the whole
utterance in one call instead (the reference the streamed audio is measured
against). Defaults come from the `codec` and `scheduler` sections of the config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import wave
from pathlib import Path

import numpy as np

from ..audio.pcm import float_to_pcm16
from ..config import ConfigError, load_config
from ..token_format import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME, FrameParser, ProtocolError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", required=True, help="JSON list of audio token ids ('-': stdin)")
    parser.add_argument("--out", required=True, help="output WAV path")
    parser.add_argument("--snac", default=None, help="SNAC folder or hub id (default: codec.path)")
    parser.add_argument("--offline", action="store_true", help="decode in one call instead of streaming")
    parser.add_argument("--noise", choices=["on", "off"], default=None, help="SNAC noise injection (default: codec.noise)")
    parser.add_argument("--seed", type=int, default=None, help="seed for the noise (default: codec.seed)")
    parser.add_argument("--decoder", choices=["windowed", "stateful"], default=None, help="default: codec.decoder")
    parser.add_argument("--left", type=int, default=None, help="windowed: left context frames")
    parser.add_argument("--lookahead", type=int, default=None, help="windowed: lookahead frames")
    parser.add_argument("--push-frames", type=int, default=None,
                        help="frames per streamed push (default: scheduler.flush_every_n_tokens / 7)")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda[:N] (default: codec.device)")
    parser.add_argument("--dtype", default=None, choices=["auto", "fp32", "fp16", "bf16"], help="default: codec.dtype")
    parser.add_argument("--config", default=None, help="config file (default: config/model_config.yaml)")


def read_token_ids(source: str) -> list[int]:
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    ids = json.loads(text)
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("the tokens file must hold a JSON list of integer token ids")
    return ids


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """float32 samples in [-1, 1] -> 16-bit mono PCM WAV (clipped, rounded)."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(float_to_pcm16(np.asarray(pcm)))


def run(args: argparse.Namespace) -> int:
    from . import build_decoder, decode_offline, load_snac
    from .base import CodecPush

    try:
        overrides: dict[str, object] = {}
        for key, value in (("path", args.snac), ("decoder", args.decoder), ("left_context_frames", args.left),
                           ("lookahead_frames", args.lookahead), ("device", args.device), ("dtype", args.dtype),
                           ("seed", args.seed)):
            if value is not None:
                overrides[f"codec.{key}"] = value
        if args.noise is not None:
            overrides["codec.noise"] = args.noise == "on"
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    push_frames = args.push_frames or cfg.scheduler.flush_every_n_tokens // TOKENS_PER_FRAME
    if push_frames < 1:
        print("error: --push-frames must be >= 1", file=sys.stderr)
        return 2

    try:
        parser = FrameParser()
        frames = parser.feed_many(read_token_ids(args.tokens))
    except (OSError, ValueError, ProtocolError) as exc:
        print(f"error: {args.tokens}: {exc}", file=sys.stderr)
        return 1
    if parser.dropped_tokens:
        print(f"note: {parser.dropped_tokens} token(s) of an unfinished last frame dropped", file=sys.stderr)

    codec = cfg.codec
    model = load_snac(codec.path, device=codec.device, dtype=codec.dtype, noise=codec.noise, seed=codec.seed,
                      compile=codec.compile)
    started = time.perf_counter()
    if args.offline:
        pcm = decode_offline(model, frames)
        how = "offline (one call)"
    else:
        decoder = build_decoder(codec, model)
        chunks: list[np.ndarray] = []
        first_audio_frames: int | None = None
        n = frames.shape[0]
        starts = range(0, n, push_frames) if n else [0]
        for start in starts:
            end = min(n, start + push_frames)
            (result,) = decoder.decode([CodecPush("cli", frames[start:end], final=end >= n)])
            if result.pcm.size and first_audio_frames is None:
                first_audio_frames = end
            chunks.append(result.pcm)
        pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        how = (f"streamed ({codec.decoder}, {len(starts)} pushes of {push_frames} frames, "
               f"first audio after {first_audio_frames} frames)")
        if codec.decoder == "windowed":
            how += f", L={codec.left_context_frames} R={codec.lookahead_frames}"
    elapsed = time.perf_counter() - started
    if pcm.shape[0] != SAMPLES_PER_FRAME * frames.shape[0]:
        print(f"error: decoded {pcm.shape[0]} samples for {frames.shape[0]} frames", file=sys.stderr)
        return 1
    write_wav(args.out, pcm)
    seconds = pcm.shape[0] / SAMPLE_RATE
    rtf = elapsed / seconds if seconds else 0.0
    print(f"{args.out}: {frames.shape[0]} frames, {seconds:.2f} s of audio, {how}; "
          f"decode {elapsed:.2f} s (RTF {rtf:.2f})", file=sys.stderr)
    return 0
