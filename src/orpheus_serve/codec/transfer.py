"""Host <-> device copies for the codec, pinned and asynchronous on CUDA.

A decode call moves a few KB of codes in and a few hundred KB of audio out.
On CUDA both copies go through page-locked staging buffers that are reused
from call to call (grown by doubling, never freed on the hot path) and are
issued with `non_blocking=True` on the *current* stream, which inside the
codec worker is the worker's own stream. The only wait is on an event
recorded after the device-to-host copy: it blocks this thread until this
stream's work is done, never the device, so the LLM's stream keeps running.

Codes go in through a small ring of staging buffers, one per copy in flight:
a decoder that runs several steps in one call copies each step's codes while
earlier steps still compute, and a buffer is only reused once the copy made
from it `CODE_BUFFERS` copies ago has finished (normally long before).

On CPU the same calls are plain conversions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Host-to-device copies of codes that may be in flight at once: a decode step makes up to three (codes,
# rows of the state pool, edge positions), and a buffer's reuse waits for the stream to reach its last copy.
CODE_BUFFERS = 8


class HostTransfer:
    """Staging buffers for one thread's copies to and from `device`. Not thread-safe."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._codes_in: list[torch.Tensor | None] = [None] * CODE_BUFFERS  # pinned int64, flat
        self._copied_in = [torch.cuda.Event() for _ in range(CODE_BUFFERS)] if self._cuda else []
        self._next_in = 0
        self._audio_out: torch.Tensor | None = None  # pinned float32, flat
        # Blocking: the thread sleeps until the audio is copied instead of spinning on a core the engine loop's
        # process needs (a pass waits milliseconds; waking costs microseconds), and its CPU time counts no wait.
        self._copied_out = torch.cuda.Event(blocking=True) if self._cuda else None

    @staticmethod
    def _pinned(buffer: torch.Tensor | None, size: int, dtype: torch.dtype) -> torch.Tensor:
        if buffer is not None and buffer.numel() >= size:
            return buffer
        capacity = max(size, 2 * (buffer.numel() if buffer is not None else 0), 4096)
        return torch.empty(capacity, dtype=dtype, pin_memory=True)

    def codes_to_device(self, codes: np.ndarray) -> torch.Tensor:
        """int64 array (any shape) -> the same on the device."""
        host = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int64))
        if not self._cuda:
            return host.to(self.device)
        on_device = torch.empty(host.shape, dtype=torch.int64, device=self.device)
        self.copy_to_device(codes, on_device)
        return on_device

    def copy_to_device(self, values: np.ndarray, out: torch.Tensor) -> None:
        """int64 array -> `out` (a device tensor of as many elements), in place: one copy, staged as above."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).view(out.shape)
        if not self._cuda:
            out.copy_(host)
            return
        index = self._next_in
        self._next_in = (index + 1) % CODE_BUFFERS
        copied = self._copied_in[index]
        # The copy made from this staging buffer last time must have finished before it is overwritten.
        copied.synchronize()
        buffer = self._codes_in[index] = self._pinned(self._codes_in[index], host.numel(), torch.int64)
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        out.copy_(staged, non_blocking=True)
        copied.record()

    def audio_to_host(self, pieces: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """1-D device tensors -> float32 numpy arrays (owned by the caller), one copy in all."""
        if not pieces:
            return []
        sizes = [int(p.numel()) for p in pieces]
        if not self._cuda:
            return [p.detach().to(torch.float32).numpy().copy() for p in pieces]
        flat = torch.cat([p.reshape(-1) for p in pieces]).to(torch.float32)  # [sum(sizes)]
        self._audio_out = self._pinned(self._audio_out, flat.numel(), torch.float32)
        staged = self._audio_out[: flat.numel()]
        staged.copy_(flat, non_blocking=True)
        assert self._copied_out is not None
        self._copied_out.record()
        self._copied_out.synchronize()
        host = staged.numpy().copy()  # the staging buffer is reused by the next call
        return np.split(host, np.cumsum(sizes)[:-1])
