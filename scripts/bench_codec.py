#!/usr/bin/env python3
"""Streaming SNAC decode: compute per second of emitted audio, and fidelity, per decoding scheme.

    PYTHONPATH=src python scripts/bench_codec.py            # the comparison table
    PYTHONPATH=src python scripts/bench_codec.py --sweep    # fidelity and compute over L, R and push size

Each scheme streams S concurrent sessions (S = each of --batches) of --frames random
frames through a StreamingDecoder, all sessions in lock-step: every tick one frame
arrives at every session, the pushes that are due form one `decode()` call (what the
codec worker does), and the schemes take turns tick by tick so that all of them run
under the same machine load. Reported per scheme and batch:

- cost/emitted: compute per frame emitted, in frames of a plain full-rate decode,
  context and padding included, counted from the pass shapes, not timed (schemes
  that decode through WindowBatcher);
- CPU ms per emitted audio second (process CPU time inside decode(), robust to other
  load on a shared machine) and its ratio to the reference at the same batch;
- SNR dB of the emitted audio against the one-shot decode of the same frames (noise
  off), over the frames the scheme emits, worst of the sessions checked;
- tokens added to time-to-first-audio: audio tokens that must exist beyond the first
  frame's 7 before the first sample can go out.

The reference scheme is the one from the original Orpheus streaming code: after
every 7th token from the 28th on, decode the last 28 tokens (4 frames) and keep
samples 2048:4096, i.e. the second frame of the window. It never emits the first
frame nor the last two, and decodes 4 frames per frame emitted; its SNR is measured
on the frames it does emit. Here it is batched across sessions like the others, so
the ratios isolate what each scheme recomputes.

Add a scheme by appending to `schemes()`: a name, a decoder factory, and the push
cadence it is fed with.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from orpheus_serve.codec.base import CodecPush, StreamingDecoder
from orpheus_serve.codec.loader import decode_offline, load_snac
from orpheus_serve.codec.reference import ReferenceWindowDecoder
from orpheus_serve.codec.stateful import StatefulDecoder
from orpheus_serve.codec.windowed import WindowBatcher, WindowedDecoder
from orpheus_serve.config import load_config
from orpheus_serve.service.service import audible_lookahead
from orpheus_serve.token_format import CODEBOOK_SIZE, SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from orpheus_serve.weights.tiny import write_snac

REFERENCE_WINDOW_FRAMES = 4  # 28 tokens
REFERENCE_KEEP_FRAME = 1  # samples 2048:4096


@dataclass(frozen=True)
class Scheme:
    name: str
    make: Callable[[torch.nn.Module], StreamingDecoder]
    push_frames: int  # new frames per push after the first
    first_push_frames: int  # frames in the first push
    ttfa_tokens_added: int
    emitted: Callable[[int], tuple[int, int]] = lambda n: (0, n)  # [first, end) frames emitted of n

    def push_due(self, have: int, n: int) -> bool:
        if have == n:
            return True
        if have < self.first_push_frames:
            return False
        return (have - self.first_push_frames) % self.push_frames == 0


def reference_scheme() -> Scheme:
    return Scheme("reference 28-token window", ReferenceWindowDecoder, push_frames=1, first_push_frames=1,
                  ttfa_tokens_added=(REFERENCE_WINDOW_FRAMES - 1) * TOKENS_PER_FRAME,
                  emitted=lambda n: (REFERENCE_KEEP_FRAME, max(REFERENCE_KEEP_FRAME, n - 2)))


def windowed_scheme(left: int, right: int, push_frames: int, max_batch: int, *, crop: bool = True,
                    label: str = "windowed") -> Scheme:
    return Scheme(
        f"{label} L={left} R={right}{'' if crop else ' uncropped'}, push {push_frames}",
        lambda model: WindowedDecoder(model, left_context_frames=left, lookahead_frames=right, max_batch=max_batch,
                                      crop=crop),
        push_frames=push_frames,
        first_push_frames=1 + right,  # the scheduler's first flush: one frame plus the lookahead
        ttfa_tokens_added=right * TOKENS_PER_FRAME,
    )


def schemes(args: argparse.Namespace, model: torch.nn.Module) -> list[Scheme]:
    """The rows of the comparison table. Append here to compare another decoder."""
    cfg = load_config(args.config)
    left, right, max_batch = cfg.codec.left_context_frames, cfg.codec.lookahead_frames, cfg.codec.max_batch
    push = args.push_frames or cfg.scheduler.flush_every_n_tokens // TOKENS_PER_FRAME
    out = [
        reference_scheme(),
        windowed_scheme(left, right, push, max_batch, label="windowed default"),
        windowed_scheme(3, 3, push, max_batch),
    ]
    lookahead = audible_lookahead(StatefulDecoder(model))  # what the service's first flush waits for
    out.append(Scheme(f"stateful, push {push}", lambda m: StatefulDecoder(m, max_batch=max_batch),
                      push_frames=push, first_push_frames=1 + lookahead,
                      ttfa_tokens_added=lookahead * TOKENS_PER_FRAME))
    return out


@dataclass
class Run:
    scheme: Scheme
    decoder: StreamingDecoder
    audio: dict[Hashable, list[np.ndarray]]
    sent: int = 0  # frames pushed so far (the same for every session: lock-step)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    calls: int = 0

    @property
    def frame_cost(self) -> float | None:
        batcher = getattr(self.decoder, "batcher", None)
        return batcher.frame_cost if isinstance(batcher, WindowBatcher) else None


def snr_db(test: np.ndarray, ref: np.ndarray) -> float:
    err = float(np.sum((test.astype(np.float64) - ref) ** 2))
    return float("inf") if err == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / err)


def stream_all(model: torch.nn.Module, plan: Sequence[Scheme], utterances: Sequence[np.ndarray]) -> list[Run]:
    """Stream every utterance through every scheme, lock-step, schemes interleaved tick by tick."""
    n = utterances[0].shape[0]
    runs = [Run(s, s.make(model), {i: [] for i in range(len(utterances))}) for s in plan]
    for have in range(1, n + 1):
        for run in runs:
            if not run.scheme.push_due(have, n):
                continue
            pushes = [CodecPush(i, u[run.sent : have], final=have == n) for i, u in enumerate(utterances)]
            run.sent = have
            cpu, wall = time.process_time(), time.perf_counter()
            results = run.decoder.decode(pushes)
            run.cpu_s += time.process_time() - cpu
            run.wall_s += time.perf_counter() - wall
            run.calls += 1
            for r in results:
                run.audio[r.key].append(r.pcm)
    return runs


@dataclass(frozen=True)
class Row:
    scheme: str
    batch: int
    emitted_frames: int  # per session
    total_frames: int
    decoded_per_emitted: float | None
    cpu_ms_per_audio_s: float
    wall_ms_per_audio_s: float
    snr_db: float
    ttfa_tokens_added: int


def measure(run: Run, utterances: Sequence[np.ndarray], offline: dict[int, np.ndarray]) -> Row:
    n = utterances[0].shape[0]
    first, end = run.scheme.emitted(n)
    emitted = end - first
    snrs = []
    for i, audio_parts in run.audio.items():
        audio = np.concatenate(audio_parts)
        if audio.shape[0] != emitted * SAMPLES_PER_FRAME:
            raise AssertionError(f"{run.scheme.name}: {audio.shape[0]} samples for {emitted} emitted frames")
        if i in offline:
            snrs.append(snr_db(audio, offline[i][first * SAMPLES_PER_FRAME : end * SAMPLES_PER_FRAME]))
    audio_s = len(utterances) * emitted * SAMPLES_PER_FRAME / SAMPLE_RATE
    decoded = run.frame_cost
    return Row(
        scheme=run.scheme.name,
        batch=len(utterances),
        emitted_frames=emitted,
        total_frames=n,
        decoded_per_emitted=None if decoded is None else decoded / (len(utterances) * emitted),
        cpu_ms_per_audio_s=1000 * run.cpu_s / audio_s,
        wall_ms_per_audio_s=1000 * run.wall_s / audio_s,
        snr_db=min(snrs),
        ttfa_tokens_added=run.scheme.ttfa_tokens_added,
    )


def random_utterances(count: int, frames: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CODEBOOK_SIZE, (frames, TOKENS_PER_FRAME), dtype=np.int64) for _ in range(count)]


def fmt_db(value: float) -> str:
    return "exact" if value == float("inf") else f"{value:.1f}"


def print_table(rows: Sequence[Row]) -> None:
    reference = {r.batch: r for r in rows if r.scheme.startswith("reference")}
    header = (f"{'scheme':<36} {'batch':>5} {'emitted':>8} {'cost/':>8} {'CPU ms per':>11} {'ratio to':>9} "
              f"{'wall ms per':>11} {'SNR dB':>7} {'TTFA +':>7}")
    sub = f"{'':<36} {'':>5} {'frames':>8} {'emitted':>8} {'audio s':>11} {'reference':>9} {'audio s':>11} {'':>7} {'tokens':>7}"
    print(header)
    print(sub)
    for r in rows:
        ref = reference.get(r.batch)
        ratio = f"{r.cpu_ms_per_audio_s / ref.cpu_ms_per_audio_s:.2f}" if ref else "-"
        decoded = f"{r.decoded_per_emitted:.2f}" if r.decoded_per_emitted is not None else "-"
        print(f"{r.scheme:<36} {r.batch:>5} {f'{r.emitted_frames}/{r.total_frames}':>8} {decoded:>8} "
              f"{r.cpu_ms_per_audio_s:>11.0f} {ratio:>9} {r.wall_ms_per_audio_s:>11.0f} {fmt_db(r.snr_db):>7} "
              f"{r.ttfa_tokens_added:>7}")


def compare(model: torch.nn.Module, args: argparse.Namespace) -> None:
    plan = schemes(args, model)
    rows: list[Row] = []
    for batch in args.batches:
        utterances = random_utterances(batch, args.frames, seed=batch)
        checked = range(min(batch, args.fidelity_sessions))
        offline = {i: decode_offline(model, utterances[i]) for i in checked}
        for run in stream_all(model, plan, utterances):
            rows.append(measure(run, utterances, offline))
        print(f"(batch {batch} done)", file=sys.stderr, flush=True)
    print_table(rows)


def sweep(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Fidelity and compute over L, R and push size at batch 1, with the reference measured alongside."""
    utterances = random_utterances(1, args.frames, seed=0)
    offline = {0: decode_offline(model, utterances[0])}
    plan = [reference_scheme()]
    for left in args.sweep_left:
        for right in args.sweep_right:
            for push in args.sweep_push:
                plan.append(windowed_scheme(left, right, push, 64))
    cfg = load_config(args.config)
    for push in args.sweep_push:  # what cropping saves, at the configured windows
        plan.append(windowed_scheme(cfg.codec.left_context_frames, cfg.codec.lookahead_frames, push, 64, crop=False))
    rows = [measure(run, utterances, offline) for run in stream_all(model, plan, utterances)]
    print_table(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snac", default=None, help="SNAC folder (default: build the tiny random-weight SNAC in a temp dir)")
    ap.add_argument("--config", default=None, help="config file for the project's defaults")
    ap.add_argument("--frames", type=int, default=12, help="frames per utterance (default 12)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="concurrent sessions (default 1 8 32)")
    ap.add_argument("--push-frames", type=int, default=None,
                    help="new frames per push after the first (default: scheduler.flush_every_n_tokens / 7)")
    ap.add_argument("--fidelity-sessions", type=int, default=2, help="sessions per batch checked against the one-shot decode")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--sweep", action="store_true", help="sweep L, R and push size instead (batch 1)")
    ap.add_argument("--sweep-left", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--sweep-right", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--sweep-push", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    if args.frames < REFERENCE_WINDOW_FRAMES + 2:
        ap.error(f"--frames must be at least {REFERENCE_WINDOW_FRAMES + 2}")

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        snac_dir = args.snac
        if snac_dir is None:
            snac_dir = Path(tmp) / "tiny-snac"
            write_snac(snac_dir, seed=0)
        model = load_snac(snac_dir, device="cpu", noise=False)
        print(f"SNAC {snac_dir}, noise off, CPU, {torch.get_num_threads()} thread(s), {args.frames} frames per "
              f"utterance ({args.frames * SAMPLES_PER_FRAME / SAMPLE_RATE:.2f} s)", file=sys.stderr)
        started = time.perf_counter()
        if args.sweep:
            sweep(model, args)
        else:
            compare(model, args)
        print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
