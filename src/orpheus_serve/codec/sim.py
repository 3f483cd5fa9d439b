"""SimDecoder: a stand-in for batched SNAC decoding on a GPU, for capacity simulation.

It cannot produce speech. It returns exactly 2048 samples per frame (a quiet
tone whose pitch follows the frame's first code, so audio is not silence and
chunk joins can be checked) and blocks the codec worker for a modelled time,

    decode_ms = base_ms + per_frame_ms * frames_in_batch

standing in for one batched SNAC forward pass on a GPU. Together with the sim
engine it lets the gateway, scheduler and codec plumbing run at GPU-scale
concurrency on a CPU. Selected with `codec.decoder: sim`.

Basis of the default cost: DESIGN §4 counts 9.7 GFLOP per second of audio
(~0.83 GFLOP per frame); at a few TFLOP/s of effective FP16 throughput for
small convolutions that is ~0.2-0.3 ms per frame, plus ~1.5 ms of launch
overhead per batched pass.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np

from ..protocol import SAMPLE_RATE, SAMPLES_PER_FRAME
from .base import CodecPush, CodecResult


class SimDecoder:
    sample_rate = SAMPLE_RATE
    lookahead_frames = 0

    def __init__(self, *, base_ms: float = 1.5, per_frame_ms: float = 0.25, realtime: bool = True) -> None:
        self.base_ms = base_ms
        self.per_frame_ms = per_frame_ms
        self.realtime = realtime
        self._phase: dict[Hashable, float] = {}

    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        frames = sum(len(p.frames) for p in pushes)
        if self.realtime and frames:
            time.sleep((self.base_ms + self.per_frame_ms * frames) / 1000.0)
        results = []
        for push in pushes:
            pcm = self._tone(push.key, push.frames)
            if push.final:
                self._phase.pop(push.key, None)
            results.append(CodecResult(push.key, pcm, push.final))
        return results

    def close(self, key: Hashable) -> None:
        self._phase.pop(key, None)

    def _tone(self, key: Hashable, frames: np.ndarray) -> np.ndarray:
        if len(frames) == 0:
            return np.zeros(0, dtype=np.float32)
        # one frequency per frame, phase-continuous across frames and pushes
        freqs = 120.0 + (np.asarray(frames)[:, 0] % 64) * 5.0
        inst = np.repeat(freqs, SAMPLES_PER_FRAME) / SAMPLE_RATE
        phase = self._phase.get(key, 0.0) + 2 * np.pi * np.cumsum(inst)
        self._phase[key] = float(phase[-1] % (2 * np.pi))
        return (0.1 * np.sin(phase)).astype(np.float32)
