#!/usr/bin/env python3
"""Decode compute per emitted audio second: stateful streaming SNAC decoder vs one-shot vs windowed.

    PYTHONPATH=src:. python scripts/bench_codec_stateful.py [--snac models/tiny-snac] [--batches 1,16]

Three ways to turn B utterances of N frames into audio, timed side by side in one run (methods
interleaved, best of --repeats, torch threads fixed, noise off, weight norm folded in all three):

- one-shot:  `SNAC.decode` of the whole utterances at once (the compute floor; no streaming);
- windowed:  the reference streaming scheme, L=2 left-context frames, R=2 lookahead frames, 2 new
             frames per push: each push decodes a 6-frame window and keeps its middle;
- stateful:  `codec.stateful.StatefulDecoder`, 2 new frames per push, final push flushes.

Only the decode calls are timed (CUDA synchronised). Prints a table of seconds of decode compute per
second of audio and the ratios, the fidelity of each streamed output against the one-shot decode,
and the first-audio delay in tokens. Without --snac a seeded random-weight snac_24khz is used (the
cost does not depend on the weight values).

Then, per batch of --pass-batches, codec passes as the worker runs them in steady state (every session
past its first audio, 2 new frames each) on the stateful decoder's two step paths, side by side:

- dynamic: tensors shaped for each step's exact batch (the CPU path);
- static:  steps padded to a batch bucket on fixed buffers; on CUDA replayed as CUDA graphs captured
           per (bucket, frames) at construction (`codec.cuda_graphs`), on a CPU run eagerly.

For each: wall ms per pass, host ms per pass (`time.thread_time` of the calling thread around
`decode`: the interpreter and launch work a pass costs; on CUDA the audio read-back waits on a
blocking event, so a wait for the GPU is not counted), and torch operators dispatched per pass (a
replayed graph dispatches none of its layers' operators). On a CPU the host time is the whole pass
(the kernels run on the calling thread), so it shows what padding costs there, not what graphs save.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from snac import SNAC
from snac.layers import NoiseBlock
from torch.nn.utils import parametrize

from orpheus_serve.codec.base import CodecPush
from orpheus_serve.codec.stateful import StatefulDecoder
from orpheus_serve.token_format import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME, frames_to_snac_codes

WINDOW_LEFT = 2  # frames of left context of the windowed baseline
WINDOW_RIGHT = 2  # frames of lookahead of the windowed baseline
PUSH_FRAMES = 2  # new frames per push, both streaming methods


def load_model(path: str | None, device: str, dtype: torch.dtype) -> SNAC:
    if path:
        model = SNAC.from_pretrained(path)
    else:
        from orpheus_serve.weights.tiny import SNAC_24KHZ_CONFIG

        torch.manual_seed(0)
        model = SNAC(**SNAC_24KHZ_CONFIG)
    model = model.eval()
    for module in list(model.modules()):
        if isinstance(module, NoiseBlock):
            module.forward = lambda x: x  # noise off everywhere, as the stateful decoder runs here
        if parametrize.is_parametrized(module):
            parametrize.remove_parametrizations(module, "weight")  # fold weight norm once, as a server would
    return model.to(device=device, dtype=dtype)


def codes_of(frames: np.ndarray, device: str) -> list[torch.Tensor]:
    """[B, n, 7] frames -> SNAC codes [B, n], [B, 2n], [B, 4n]."""
    batch = frames.shape[0]
    return [torch.from_numpy(c).to(device).view(batch, -1) for c in frames_to_snac_codes(frames)]


@dataclass
class Timer:
    device: str
    seconds: float = 0.0

    def run(self, fn: Callable[[], object]) -> object:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        return out


def one_shot(model: SNAC, frames: np.ndarray, timer: Timer) -> np.ndarray:
    codes = codes_of(frames, timer.device)
    with torch.inference_mode():
        audio = timer.run(lambda: model.decode(codes))
    return audio[:, 0].float().cpu().numpy()  # [B, n * 2048]


def windowed(model: SNAC, frames: np.ndarray, timer: Timer) -> np.ndarray:
    n = frames.shape[1]
    pieces = []
    for first in range(0, n, PUSH_FRAMES):
        new_end = min(n, first + PUSH_FRAMES)
        lo, hi = max(0, first - WINDOW_LEFT), min(n, new_end + WINDOW_RIGHT)
        codes = codes_of(frames[:, lo:hi], timer.device)
        with torch.inference_mode():
            audio = timer.run(lambda codes=codes: model.decode(codes))  # [B, 1, (hi - lo) * 2048]
        pieces.append(audio[:, 0, (first - lo) * SAMPLES_PER_FRAME : (new_end - lo) * SAMPLES_PER_FRAME].float().cpu())
    return torch.cat(pieces, dim=-1).numpy()


def stateful(decoder: StatefulDecoder, frames: np.ndarray, timer: Timer, tag: str) -> np.ndarray:
    batch, n = frames.shape[:2]
    audio: list[list[np.ndarray]] = [[] for _ in range(batch)]
    for first in range(0, n, PUSH_FRAMES):
        final = first + PUSH_FRAMES >= n
        pushes = [CodecPush((tag, b), frames[b, first : first + PUSH_FRAMES], final) for b in range(batch)]
        results = timer.run(lambda pushes=pushes: decoder.decode(pushes))
        for b, result in enumerate(results):
            audio[b].append(result.pcm)
    return np.stack([np.concatenate(parts) for parts in audio])


@dataclass
class PassTimes:
    wall_s: list[float]
    host_s: list[float]  # thread CPU time of the calling thread


def time_passes(decoder: StatefulDecoder, batch: int, passes: int, rng: np.random.Generator, tag: str,
                sync: Callable[[], None] = lambda: None, push_frames: int = PUSH_FRAMES) -> PassTimes:
    """`passes` decode passes of `batch` sessions with `push_frames` new frames each, every session past its first
    audio (a first push of lookahead_frames frames, untimed); the sessions are closed afterwards."""
    keys = [(tag, b) for b in range(batch)]

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, 4096, size=(n, TOKENS_PER_FRAME), dtype=np.int64)

    decoder.decode([CodecPush(key, frames(decoder.lookahead_frames)) for key in keys])
    times = PassTimes([], [])
    for _ in range(passes):
        pushes = [CodecPush(key, frames(push_frames)) for key in keys]
        sync()
        started, host_started = time.perf_counter(), time.thread_time()
        decoder.decode(pushes)  # returns host PCM: the pass has finished
        times.host_s.append(time.thread_time() - host_started)
        sync()
        times.wall_s.append(time.perf_counter() - started)
    for key in keys:
        decoder.close(key)
    return times


def time_mixed_passes(decoder: StatefulDecoder, batch: int, passes: int, rng: np.random.Generator, tag: str,
                      sync: Callable[[], None] = lambda: None) -> PassTimes:
    """`passes` passes as a server makes them at steady state: `batch` - 2 streaming sessions with PUSH_FRAMES new
    frames each, one session's first push (lookahead_frames) and one session's final push (1 frame, then the flush).
    Even steps take such a pass in three steps, ragged ones (`ragged=True`) in one."""
    if batch < 3:
        raise ValueError("a mixed pass needs batch >= 3")

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, 4096, size=(n, TOKENS_PER_FRAME), dtype=np.int64)

    streaming = [(tag, b) for b in range(batch - 2)]
    lookahead = decoder.lookahead_frames
    decoder.decode([CodecPush(key, frames(lookahead)) for key in [*streaming, (tag, "new", 0)]])
    times = PassTimes([], [])
    for i in range(passes):
        pushes = [CodecPush(key, frames(PUSH_FRAMES)) for key in streaming]
        pushes += [CodecPush((tag, "new", i + 1), frames(lookahead)), CodecPush((tag, "new", i), frames(1), final=True)]
        sync()
        started, host_started = time.perf_counter(), time.thread_time()
        decoder.decode(pushes)
        times.host_s.append(time.thread_time() - host_started)
        sync()
        times.wall_s.append(time.perf_counter() - started)
    for key in [*streaming, (tag, "new", passes)]:
        decoder.close(key)
    return times


def ops_per_pass(decoder: StatefulDecoder, batch: int, rng: np.random.Generator) -> int:
    """Torch operators one steady-state pass dispatches from Python (a replayed graph's layers are not among them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    keys = [("ops", b) for b in range(batch)]
    decoder.decode([CodecPush(k, rng.integers(0, 4096, (decoder.lookahead_frames, TOKENS_PER_FRAME))) for k in keys])
    with Count():
        decoder.decode([CodecPush(k, rng.integers(0, 4096, (PUSH_FRAMES, TOKENS_PER_FRAME))) for k in keys])
    for key in keys:
        decoder.close(key)
    return Count.calls


def pass_table(model: SNAC, batches: list[int], passes: int, device: str, rng: np.random.Generator) -> None:
    """Steady-state passes on the dynamic and the static step path, side by side (see the module doc)."""
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    paths = {"dynamic": StatefulDecoder(model, max_batch=max(batches)),
             "graphs" if cuda else "static (eager)": StatefulDecoder(model, max_batch=max(batches), static=True,
                                                                     cuda_graphs=cuda)}
    graphs = sum(decoder.graph_count for decoder in paths.values())
    print(f"\npasses of {PUSH_FRAMES} new frames per session; decoders built in {time.perf_counter() - started:.1f} s "
          f"({graphs} CUDA graphs captured)")
    print(f"{'batch':>5}  {'path':<15} {'wall ms/pass':>12} {'host ms/pass':>12} {'ops/pass':>9} "
          f"{'host vs dynamic':>15}")
    for batch in batches:
        medians = {}
        for decoder in paths.values():
            time_passes(decoder, batch, 2, rng, f"warm{batch}", sync)
        results = {name: PassTimes([], []) for name in paths}
        for repeat in range(3):  # interleaved, so drifting load hits both paths alike
            for name, decoder in paths.items():
                times = time_passes(decoder, batch, passes, rng, f"r{repeat}", sync)
                results[name].wall_s += times.wall_s
                results[name].host_s += times.host_s
        for name, times in results.items():
            medians[name] = (float(np.median(times.wall_s)), float(np.median(times.host_s)))
        for name, decoder in paths.items():
            wall, host = medians[name]
            ratio = host / medians["dynamic"][1]
            print(f"{batch:>5}  {name:<15} {wall * 1e3:>12.2f} {host * 1e3:>12.2f} "
                  f"{ops_per_pass(decoder, batch, rng):>9} {ratio:>15.2f}")


def snr_db(reference: np.ndarray, audio: np.ndarray) -> float:
    error = float(np.sum((reference.astype(np.float64) - audio) ** 2))
    return float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / error)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snac", default=None, help="SNAC folder (config.json + pytorch_model.bin)")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    ap.add_argument("--frames", type=int, default=32, help="frames per utterance (default: 32 = 2.7 s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per method; best is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="default: float16 on CUDA, float32 on CPU",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pass-batches", default="1,8,32", help="batches of the pass table (default: 1,8,32; "
                    "empty: no pass table)")
    ap.add_argument("--passes", type=int, default=10, help="timed passes per path, batch and round (default: 10)")
    ap.add_argument("--passes-only", action="store_true", help="only the pass table")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    model = load_model(args.snac, args.device, dtype)
    decoder = StatefulDecoder(model, max_batch=max(int(b) for b in args.batches.split(",")))
    rng = np.random.default_rng(args.seed)
    audio_seconds_per_utterance = args.frames * SAMPLES_PER_FRAME / SAMPLE_RATE
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"device {device_name} {dtype_name}, torch threads {torch.get_num_threads()}, "
        f"{args.frames} frames ({audio_seconds_per_utterance:.2f} s) per utterance, "
        f"best of {args.repeats}, pushes of {PUSH_FRAMES} frames"
    )

    if args.passes_only:
        pass_table(model, [int(b) for b in args.pass_batches.split(",")], args.passes, args.device, rng)
        return 0
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        frames = rng.integers(0, 4096, size=(batch, args.frames, TOKENS_PER_FRAME), dtype=np.int64)
        # Warm-up (allocator, kernel selection) outside the timings.
        warm = Timer(args.device)
        one_shot(model, frames[:, :8], warm)
        windowed(model, frames[:, :8], warm)
        stateful(decoder, frames[:, :8], warm, "warm")
        best = {"one-shot": float("inf"), "windowed L2 R2": float("inf"), "stateful": float("inf")}
        outputs: dict[str, np.ndarray] = {}
        for repeat in range(args.repeats):
            for name in best:
                timer = Timer(args.device)
                if name == "one-shot":
                    outputs[name] = one_shot(model, frames, timer)
                elif name == "windowed L2 R2":
                    outputs[name] = windowed(model, frames, timer)
                else:
                    outputs[name] = stateful(decoder, frames, timer, f"r{repeat}")
                best[name] = min(best[name], timer.seconds)
        audio_seconds = batch * audio_seconds_per_utterance
        per_second = {name: seconds / audio_seconds for name, seconds in best.items()}
        fidelity = {name: snr_db(outputs["one-shot"], outputs[name]) for name in outputs}
        for name, cost in per_second.items():
            rows.append((batch, name, cost, fidelity[name], per_second["stateful"] / cost))

    print()
    print(f"{'batch':>5}  {'method':<15} {'decode s / audio s':>18} {'SNR vs one-shot':>16} {'stateful / this':>16}")
    for batch, name, cost, fidelity, ratio in rows:
        snr = "reference" if name == "one-shot" else f"{fidelity:.1f} dB"
        print(f"{batch:>5}  {name:<15} {cost:>18.4f} {snr:>16} {ratio:>16.2f}")
    print()
    window_tokens = (1 + WINDOW_RIGHT) * TOKENS_PER_FRAME  # first frame + its lookahead (flush policy default)
    first_samples = decoder.first_audio_frames * SAMPLES_PER_FRAME - decoder.lookahead_samples
    print(
        f"first-audio delay: stateful {decoder.first_audio_tokens} tokens ({first_samples} samples out at that "
        f"point, lookahead {decoder.lookahead_samples} samples = {decoder.lookahead_frames} frames); "
        f"windowed default {window_tokens} tokens ({SAMPLES_PER_FRAME} samples)"
    )
    if args.pass_batches:
        pass_table(model, [int(b) for b in args.pass_batches.split(",")], args.passes, args.device, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
