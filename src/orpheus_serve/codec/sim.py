"""SimDecoder: a stand-in for batched SNAC decoding on a GPU, for capacity simulation.

It cannot produce speech. It returns exactly 2048 samples per frame (a quiet
tone whose pitch follows the frame's first code, so audio is not silence and
chunk joins are seamless) and blocks the codec worker for a modelled time,

    decode_ms = base_ms + per_frame_ms * frames_in_batch

standing in for one batched SNAC forward pass on a GPU. Together with the sim
engine it lets the gateway, scheduler and codec plumbing run at GPU-scale
concurrency on a CPU. Selected with `codec.decoder: sim`.

With a `ModelledCard` (replay/: a measured card, `engine.sim.profile`) it stands in for the card's stateful
decoder: the same lookahead (the first push waits for it, the final push flushes it) and the same forward
steps per call (`base.step_schedule`: even steps, where pushes of unequal lengths take several, or ragged
ones, as `codec.ragged_steps` runs them on CUDA), each step costing what the card's codec stage measured for
its rows times its frames (padding included), its launch time spent on the interpreter, on the device
timeline it shares with the sim engine.

Basis of the default cost: ARCHITECTURE §4 counts 9.7 GFLOP per second of audio
(~0.83 GFLOP per frame); at a few TFLOP/s of effective FP16 throughput for
small convolutions that is ~0.2-0.3 ms per frame, plus ~1.5 ms of launch
overhead per batched pass.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np

from ..replay import ModelledCard
from ..token_format import SAMPLE_RATE, SAMPLES_PER_FRAME
from .base import STATEFUL_STEP_FRAMES, CodecPush, CodecResult, step_schedule


class SimDecoder:
    sample_rate = SAMPLE_RATE

    def __init__(self, *, base_ms: float = 1.5, per_frame_ms: float = 0.25, realtime: bool = True,
                 card: ModelledCard | None = None, max_batch: int = 64, ragged: bool = True) -> None:
        self.base_ms = base_ms
        self.per_frame_ms = per_frame_ms
        self.realtime = realtime
        self.card = card if realtime else None
        self.max_batch = max_batch
        self.ragged = ragged and self.card is not None
        self.lookahead_frames = 0 if self.card is None else self.card.profile.codec_lookahead_frames
        # Replaying the stateful decoder, its step shapes (the codec worker evens its passes to them).
        self.step_frames = None if self.card is None else STATEFUL_STEP_FRAMES

    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        started = time.perf_counter()
        frames = sum(len(p.frames) for p in pushes)
        if self.card is not None:
            counts = [len(p.frames) + (self.lookahead_frames if p.final else 0) for p in pushes]
            for step in step_schedule(counts, STATEFUL_STEP_FRAMES, self.max_batch, ragged=self.ragged):
                self.card.codec_pass(len(step.rows) * step.frames)
            return [CodecResult(p.key, self._tone(p.frames), p.final) for p in pushes]
        results = [CodecResult(p.key, self._tone(p.frames), p.final) for p in pushes]
        if self.realtime and frames:
            # The modelled GPU time includes making the audio: sleep only for what is left of it.
            remaining = (self.base_ms + self.per_frame_ms * frames) / 1000.0 - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
        return results

    def close(self, key: Hashable) -> None:
        """No per-session state."""

    @staticmethod
    def _tone(frames: np.ndarray) -> np.ndarray:
        # One whole-period tone per frame, picked by the frame's first code: joins are seamless.
        return _TONES[np.asarray(frames, dtype=np.int64)[:, 0] % len(_TONES)].reshape(-1)


# 64 tones of 10..73 whole periods per frame (117..855 Hz), 2048 samples each, at -20 dBFS.
_TONES = (0.1 * np.sin(2 * np.pi * np.outer(np.arange(10, 74), np.arange(SAMPLES_PER_FRAME)) / SAMPLES_PER_FRAME)
          ).astype(np.float32)
