"""The seam between the codec worker and the SNAC decoders.

A `StreamingDecoder` decodes the frame streams of many sessions at once. The
codec worker (one thread, its own CUDA stream) gathers every push that is
ready across sessions and hands them to `decode` in one call; the decoder
batches them into as few forward passes as it can and returns, per push, the
audio that is now final for that session.

Contract, per session (`key`):
- frames arrive in order, each frame exactly once, as [n, 7] int64 codes
  (protocol.frames_to_snac_codes gives the SNAC layout);
- the concatenation of every returned `pcm` equals the one-shot decode of all
  the session's frames (up to the decoder's stated fidelity), 2048 samples per
  frame, first frame to last: nothing dropped, nothing repeated;
- the push with `final=True` flushes everything that is left and drops the
  session's state; `close(key)` drops it early (cancel).

`lookahead_frames` is how many frames must follow a frame before its audio is
final (the first-audio delay the decoder adds, in frames of 7 tokens).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True, slots=True)
class CodecPush:
    key: Hashable  # session identity
    frames: np.ndarray  # [n, 7] int64 codes, n >= 0
    final: bool = False


@dataclass(frozen=True, slots=True)
class CodecResult:
    key: Hashable
    pcm: np.ndarray  # [samples] float32 in [-1, 1] (not clipped by the decoder), 24 kHz mono
    final: bool
    # Set (with empty pcm and final=True) when decoding this session's batch failed; the
    # session's decoder state is gone and its stream ends here.
    error: str | None = None
    frames: int = 0  # frames of the push this result answers (set by the codec worker)


@runtime_checkable
class StreamingDecoder(Protocol):
    lookahead_frames: int
    sample_rate: int

    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        """One result per push, in the same order. At most one push per key per call."""
        ...

    def close(self, key: Hashable) -> None:
        """Forget a session's state (cancelled before its final push)."""
        ...


STATEFUL_STEP_FRAMES = (1, 2, 4)  # the stateful decoder's step shapes (frames per row per forward step)


@dataclass(frozen=True, slots=True)
class CodecStep:
    """One forward step of a decode call: which pushes it takes and how far each advances."""

    rows: list[int]  # the pushes in the step, by index (at most max_batch)
    frames: int  # the step's shape: frames per row, one of the decoder's step sizes
    advances: list[int]  # frames each row advances: all `frames`, or fewer for a row of a ragged step


def step_schedule(frame_counts: Sequence[int], step_frames: Sequence[int], max_batch: int, *,
                  ragged: bool = False) -> list[CodecStep]:
    """The forward steps one decode call takes for pushes of `frame_counts` frames.

    Even steps (`ragged=False`): every row of a step advances by the same number of frames, the largest of
    `step_frames` that the shortest push still pending allows, so pushes of unequal lengths cost several steps
    (pushes of 1 and 4 frames: steps of 1, 2 and 1 frames).

    Ragged steps: a step takes the smallest size that holds the longest push still pending (else the largest
    size), and each row advances by what it has, up to that size; the rest of a shorter row is padding that
    no output and no state keeps (stateful.py). Pushes of 1 and 4 frames: one step of 4. A step computes its
    padding, so ragged steps pay where a step is launch-bound (a GPU), not where it is compute-bound (a CPU).

    Each step is one launch of every layer: the replay of a card (replay/) charges a pass per step, from this
    same schedule."""
    sizes = sorted(set(step_frames), reverse=True)
    done = [0] * len(frame_counts)
    steps: list[CodecStep] = []
    while active := [i for i, n in enumerate(frame_counts) if done[i] < n]:
        left = [frame_counts[i] - done[i] for i in active]
        if ragged:
            n_frames = min((n for n in sizes if n >= max(left)), default=sizes[0])
            advances = [min(n, n_frames) for n in left]
        else:
            n_frames = next(n for n in sizes if n <= min(left))
            advances = [n_frames] * len(active)
        for start in range(0, len(active), max_batch):
            steps.append(CodecStep(active[start : start + max_batch], n_frames, advances[start : start + max_batch]))
        for i, n in zip(active, advances, strict=True):
            done[i] += n
    return steps
