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


def step_schedule(frame_counts: Sequence[int], step_frames: Sequence[int],
                  max_batch: int) -> list[tuple[list[int], int]]:
    """The forward steps one decode call takes for pushes of `frame_counts` frames: (the pushes in the step, by
    index, at most `max_batch`; the frames each advances). Every row of a step advances by the same number of
    frames, the largest of `step_frames` that the shortest push still pending allows, so pushes of unequal
    lengths cost several steps (pushes of 1 and 4 frames: steps of 1, 2 and 1 frames). Each step is one launch of every
    layer: the replay of a card (replay/) charges a pass per step, from this same schedule."""
    sizes = sorted(set(step_frames), reverse=True)
    done = [0] * len(frame_counts)
    steps: list[tuple[list[int], int]] = []
    while active := [i for i, n in enumerate(frame_counts) if done[i] < n]:
        least = min(frame_counts[i] - done[i] for i in active)
        n_frames = next(n for n in sizes if n <= least)
        steps.extend((active[start : start + max_batch], n_frames) for start in range(0, len(active), max_batch))
        for i in active:
            done[i] += n_frames
    return steps
