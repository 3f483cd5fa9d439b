"""Windowed streaming SNAC decode, batched across sessions.

Architecture
------------
SNAC's decoder is non-causal: a frame's audio depends on about 3 frames on
each side (ARCHITECTURE §4). A windowed decoder therefore holds a frame back until
`lookahead_frames` (R) frames follow it, then decodes a window

    [ L left-context frames | the new frames | R lookahead frames ]

and keeps exactly the new frames' samples (2048 per frame). L and R set the
fidelity against the one-shot decode (docs/CODEC.md has the measured table).
The context frames are decoded again by the neighbouring windows, but only as
far as the kept samples need them: each pass crops its activations, layer by
layer, to the kept range plus the receptive field still ahead
(codec.cropped), so a window costs about n + 0.8 frames of full-rate compute
for n new frames instead of L + n + R (L, R >= 2), and the kept samples are those of the
whole-window decode. At the utterance start there is no left context and at
its end no lookahead: the one-shot decode is zero-padded at both edges
exactly as a window is, so the edges are exact. The final push emits every
remaining frame. Each frame is emitted once, in order; total samples =
2048 × frames.

Batching (`WindowBatcher`). One `decode()` call receives every session's push
that is ready; each push yields at most one window. Windows are grouped by
shape (length, frames kept), and each group is one forward pass of
[B, frames, 7]. Windows of different shapes share a pass only where it pays:
a pass costs a fixed overhead (kernel launches, Python) plus its windows'
compute, and the grouping minimising that cost is found by a small dynamic
programme over the distinct shapes. On CPU the overhead is about one frame's
compute, so merging rarely wins; on CUDA launches dominate and most windows
share a pass. Padding a window to a longer one first extends its left context
with real earlier frames (which only makes it more exact); only what remains
is padded on the right, behind the lookahead that already shields the kept
frames, and never past the true end of an utterance. Passes are also capped
at `max_batch` windows and, on CPU, at `max_pass_frames` frames of compute,
past which SNAC's activations fall out of cache and each frame costs more.

`decode()` is all-or-nothing: sessions advance only after every pass of the
call succeeded, so after an exception no session has lost or skipped a frame.
Not thread-safe: one codec worker owns an instance.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from snac import SNAC

from ..token_format import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from .base import CodecPush, CodecResult
from .cropped import CroppedDecoder
from .loader import check_frames, decode_frames, full_fp32_convolutions, model_device
from .transfer import HostTransfer

# Real frames kept before a session's left context, to pad windows with true history.
HISTORY_FRAMES = 16
# Per-pass overhead in units of one frame's decode compute (see module doc). The CPU value is
# measured (a 1-frame pass costs ~2 frames); the CUDA value is an estimate of launch overhead.
CPU_PASS_OVERHEAD_FRAMES = 1.0
CUDA_PASS_OVERHEAD_FRAMES = 32.0
# On CPU, passes above ~48 frames of compute cost more per frame (activations leave cache).
CPU_MAX_PASS_FRAMES = 48

_EMPTY_PCM = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class Window:
    """One window to decode and the part of it to keep."""

    frames: np.ndarray  # [n, 7] int64
    keep_start: int  # first kept frame, index into `frames`
    keep_end: int  # one past the last kept frame
    history: np.ndarray  # [h, 7] the real frames just before `frames` (left padding material)
    at_end: bool  # the window ends where the utterance ends: no right padding allowed

    @property
    def length(self) -> int:
        return int(self.frames.shape[0])

    def max_pad(self) -> float:
        return math.inf if not self.at_end else float(self.history.shape[0])

    def padded(self, length: int) -> tuple[np.ndarray, int]:
        """The window grown to `length` frames, and how many frames were added on its left."""
        pad = length - self.length
        if pad == 0:
            return self.frames, 0
        left = min(pad, self.history.shape[0])
        right = pad - left
        if right and self.at_end:
            raise ValueError("cannot pad a window past the end of its utterance")
        parts = [self.history[self.history.shape[0] - left :], self.frames]
        if right:
            parts.append(np.repeat(self.frames[-1:], right, axis=0))  # edge frame, behind the lookahead
        return np.concatenate(parts, axis=0), left


@dataclass(frozen=True, slots=True)
class Pass:
    length: int  # frames per window in this forward pass
    keep: int  # the most frames any member keeps (what the cropped layers compute)
    members: tuple[int, ...]  # indices into the windows list


class WindowBatcher:
    """Runs many windows through SNAC in as few, well-shaped forward passes as pays off.

    With `crop` (the default) each pass computes only its windows' kept frames plus the
    receptive field they need (codec.cropped); without it, whole windows are decoded, as a
    plain window decode would (kept as the baseline that cropping is measured against).
    """

    def __init__(
        self,
        model: SNAC,
        *,
        max_batch: int = 64,
        max_pass_frames: int | None = None,
        pass_overhead_frames: float | None = None,
        crop: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model = model
        self.device = model_device(model)
        on_cuda = self.device.type == "cuda"
        self.max_batch = max_batch
        self.max_pass_frames = max_pass_frames if max_pass_frames is not None else (None if on_cuda else CPU_MAX_PASS_FRAMES)
        if pass_overhead_frames is None:
            pass_overhead_frames = CUDA_PASS_OVERHEAD_FRAMES if on_cuda else CPU_PASS_OVERHEAD_FRAMES
        self.pass_overhead_frames = pass_overhead_frames
        self.cropper = CroppedDecoder(model) if crop else None
        self.transfer = HostTransfer(self.device)
        self.passes_run = 0
        self.frame_cost = 0.0  # compute spent, in frames of a plain full decode (context and padding included)

    def window_cost(self, length: int, keep: int) -> float:
        """Compute for one window, in frames of a plain decode."""
        return self.cropper.cost_frames(length, keep) if self.cropper is not None else float(length)

    def _per_pass(self, length: int, keep: int) -> int:
        if self.max_pass_frames is None:
            return self.max_batch
        return max(1, min(self.max_batch, int(self.max_pass_frames // self.window_cost(length, keep))))

    def _cost(self, length: int, keep: int, count: int) -> float:
        passes = math.ceil(count / self._per_pass(length, keep))
        return passes * self.pass_overhead_frames + count * self.window_cost(length, keep)

    def plan(self, windows: Sequence[Window]) -> list[Pass]:
        """Group windows into passes. Shapes (length, keep) are sorted largest first; each pass
        takes a contiguous run of them, padded to the run's longest window and sized for its
        largest keep; a small dynamic programme picks the runs that minimise total cost."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, w in enumerate(windows):
            if w.keep_end > w.keep_start:
                by_shape.setdefault((w.keep_end - w.keep_start, w.length), []).append(i)
        shapes = sorted(by_shape, reverse=True)  # (keep, length), largest first
        k = len(shapes)
        best = [0.0] + [math.inf] * k  # best[j]: cheapest plan for shapes[:j]
        cut = [0] * (k + 1)
        for j in range(1, k + 1):
            count, length, keep = 0, 0, 0
            for i in range(j - 1, -1, -1):  # one group of shapes[i:j]
                keep = max(keep, shapes[i][0])
                length = max(length, shapes[i][1])
                if any(windows[m].max_pad() < length - shapes[g][1] for g in range(i, j) for m in by_shape[shapes[g]]):
                    break  # a larger group only needs more padding
                count += len(by_shape[shapes[i]])
                cost = best[i] + self._cost(length, keep, count)
                if cost < best[j]:  # strict: on a tie, pad less
                    best[j], cut[j] = cost, i
        groups: list[tuple[int, int]] = []
        j = k
        while j > 0:
            groups.append((cut[j], j))
            j = cut[j]
        passes: list[Pass] = []
        for i, j in reversed(groups):
            members = [m for g in range(i, j) for m in by_shape[shapes[g]]]
            keep = max(shape[0] for shape in shapes[i:j])
            length = max(shape[1] for shape in shapes[i:j])
            per_pass = self._per_pass(length, keep)
            passes += [Pass(length, keep, tuple(members[s : s + per_pass])) for s in range(0, len(members), per_pass)]
        return passes

    def run(self, windows: Sequence[Window]) -> list[np.ndarray]:
        """Kept samples of each window ([keep frames * 2048] float32), in input order."""
        passes = self.plan(windows)
        batches: list[np.ndarray] = []  # per pass [B, length, 7]
        keep_starts: list[np.ndarray] = []  # per pass [B], after padding
        for p in passes:
            padded = [windows[m].padded(p.length) for m in p.members]
            batches.append(np.stack([frames for frames, _ in padded]))
            keep_starts.append(np.array([left + windows[m].keep_start for m, (_, left) in zip(p.members, padded,
                                                                                                strict=True)]))
        host = [b.reshape(-1) for b in batches] + keep_starts
        flat = np.concatenate(host) if host else np.zeros(0, np.int64)
        device_flat = self.transfer.codes_to_device(flat)  # one host-to-device copy for the call
        pieces: list[torch.Tensor] = []
        order: list[int] = []
        offset = 0
        frames_on_device = []
        for batch in batches:
            frames_on_device.append(device_flat[offset : offset + batch.size].view(batch.shape))  # [B, length, 7]
            offset += batch.size
        for p, frames, starts in zip(passes, frames_on_device, keep_starts, strict=True):
            if self.cropper is not None:
                starts_on_device = device_flat[offset : offset + starts.size]
                audio, origin = self.cropper.decode(frames, starts_on_device, starts, p.keep)  # [B, W], [B]
            else:
                audio, origin = decode_frames(self.model, frames), np.zeros(len(p.members), np.int64)
            offset += starts.size
            self.passes_run += 1
            self.frame_cost += len(p.members) * self.window_cost(p.length, p.keep)
            for row, (m, start) in enumerate(zip(p.members, starts, strict=True)):
                w = windows[m]
                begin = int(start) * SAMPLES_PER_FRAME - int(origin[row])
                pieces.append(audio[row, begin : begin + (w.keep_end - w.keep_start) * SAMPLES_PER_FRAME])
                order.append(m)
        host_audio = self.transfer.audio_to_host(pieces)  # one device-to-host copy, one wait
        out: list[np.ndarray] = [_EMPTY_PCM] * len(windows)
        for m, pcm in zip(order, host_audio, strict=True):
            out[m] = pcm
        return out


@dataclass(slots=True)
class _Session:
    frames: np.ndarray  # [m, 7] the frames kept, absolute indices base .. base + m
    base: int = 0  # absolute index of frames[0]
    emitted: int = 0  # frames whose audio has been returned

    @property
    def total(self) -> int:
        return self.base + int(self.frames.shape[0])


class WindowedDecoder:
    """`StreamingDecoder` that decodes [L | new | R] windows and keeps the new frames' samples."""

    sample_rate: int = SAMPLE_RATE

    def __init__(
        self,
        model: SNAC,
        *,
        left_context_frames: int,
        lookahead_frames: int,
        max_batch: int = 64,
        max_pass_frames: int | None = None,
        pass_overhead_frames: float | None = None,
        crop: bool = True,
    ) -> None:
        if left_context_frames < 0 or lookahead_frames < 0:
            raise ValueError("left_context_frames and lookahead_frames must be >= 0")
        self.left_context_frames = left_context_frames
        self.lookahead_frames = lookahead_frames
        self.batcher = WindowBatcher(
            model, max_batch=max_batch, max_pass_frames=max_pass_frames, pass_overhead_frames=pass_overhead_frames,
            crop=crop,
        )
        self._sessions: dict[Hashable, _Session] = {}

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    def close(self, key: Hashable) -> None:
        self._sessions.pop(key, None)

    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        seen: set[Hashable] = set()
        updates: list[tuple[Hashable, _Session | None]] = []  # applied only once every pass succeeded
        windows: list[Window] = []
        window_of: list[int | None] = []
        for push in pushes:
            if push.key in seen:
                raise ValueError(f"more than one push for session {push.key!r} in one decode call")
            seen.add(push.key)
            new = check_frames(push.frames)
            old = self._sessions.get(push.key)
            if old is None:
                old = _Session(np.zeros((0, TOKENS_PER_FRAME), dtype=np.int64))
            state = _Session(np.concatenate([old.frames, new]) if new.shape[0] else old.frames, old.base, old.emitted)
            window, state = self._next_window(state, push.final)
            window_of.append(len(windows) if window is not None else None)
            if window is not None:
                windows.append(window)
            updates.append((push.key, None if push.final else state))

        with full_fp32_convolutions(next(self.batcher.model.parameters()).dtype):
            pcm = self.batcher.run(windows)

        for key, state in updates:
            if state is None:
                self._sessions.pop(key, None)
            else:
                self._sessions[key] = state
        return [
            CodecResult(push.key, pcm[w] if w is not None else _EMPTY_PCM, push.final)
            for push, w in zip(pushes, window_of, strict=True)
        ]

    def _next_window(self, s: _Session, final: bool) -> tuple[Window | None, _Session]:
        """The window that emits what is ready now, and the session state after it."""
        total = s.total
        ready = total if final else max(s.emitted, total - self.lookahead_frames)
        if ready <= s.emitted:
            return None, s
        lo = max(0, s.emitted - self.left_context_frames)  # absolute
        # The window always runs to the last known frame: for a non-final push that is exactly
        # R frames after `ready`; for the final push it is the utterance's end.
        window = Window(
            frames=s.frames[lo - s.base :],
            keep_start=s.emitted - lo,
            keep_end=ready - lo,
            history=s.frames[max(0, lo - s.base - HISTORY_FRAMES) : lo - s.base],
            at_end=final,
        )
        keep_from = max(s.base, ready - self.left_context_frames - HISTORY_FRAMES)
        return window, _Session(s.frames[keep_from - s.base :], keep_from, ready)
