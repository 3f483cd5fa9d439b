"""The reference implementation's decode scheme, reproduced for the baseline mode and benchmarks.

Every 7 tokens, once 28 are there, the reference decodes the last 28 tokens
(a 4-frame window) and keeps samples 2048:4096 — the window's second frame,
with one frame of left context and two of lookahead. It recomputes four frames
for every frame it emits, never emits the first frame (no window has it in
second place) and never emits the last two (no window follows them). This
class keeps all of that, on purpose: it is the baseline the project is
measured against, not a decoder to serve with.

Windows of every session in one `decode` call go through SNAC as one batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..token_format import SAMPLE_RATE, SAMPLES_PER_FRAME, frames_to_snac_codes
from .base import CodecPush, CodecResult
from .loader import full_fp32_convolutions

WINDOW_FRAMES = 4
KEEP = slice(SAMPLES_PER_FRAME, 2 * SAMPLES_PER_FRAME)


class ReferenceWindowDecoder:
    sample_rate = SAMPLE_RATE
    lookahead_frames = 2

    def __init__(self, model: torch.nn.Module, *, max_batch: int = 64) -> None:
        self.model = model
        self.max_batch = max_batch
        self._frames: dict[Hashable, list[np.ndarray]] = {}

    @torch.inference_mode()
    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        windows: list[np.ndarray] = []  # [4, 7] each
        owners: list[int] = []  # index into pushes
        for i, push in enumerate(pushes):
            frames = self._frames.setdefault(push.key, [])
            for frame in np.asarray(push.frames, dtype=np.int64).reshape(-1, 7):
                frames.append(frame)
                if len(frames) >= WINDOW_FRAMES:
                    windows.append(np.stack(frames[-WINDOW_FRAMES:]))
                    owners.append(i)
            del frames[:-WINDOW_FRAMES]  # only the last window's frames are ever needed again
            if push.final:
                self._frames.pop(push.key, None)

        pieces: list[list[np.ndarray]] = [[] for _ in pushes]
        for start in range(0, len(windows), self.max_batch):
            batch = windows[start : start + self.max_batch]
            audio = self._decode_windows(np.stack(batch))  # [B, 4 * 2048]
            for j, row in enumerate(audio):
                pieces[owners[start + j]].append(row[KEEP])
        return [
            CodecResult(
                push.key,
                np.concatenate(p).astype(np.float32) if p else np.zeros(0, dtype=np.float32),
                push.final,
            )
            for push, p in zip(pushes, pieces, strict=True)
        ]

    def close(self, key: Hashable) -> None:
        self._frames.pop(key, None)

    def _decode_windows(self, windows: np.ndarray) -> np.ndarray:
        """[B, 4, 7] frame codes -> [B, 4 * 2048] float32 audio."""
        param = next(self.model.parameters())
        codes = [frames_to_snac_codes(w) for w in windows]
        c0, c1, c2 = (
            torch.from_numpy(np.stack([c[k] for c in codes])).to(param.device) for k in range(3)
        )  # [B, 4], [B, 8], [B, 16]
        with full_fp32_convolutions(param.dtype):
            audio = self.model.decode([c0, c1, c2])  # [B, 1, 8192]
        return audio[:, 0].float().cpu().numpy()
