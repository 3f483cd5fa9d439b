"""Host <-> device copies of a torch engine step that never wait for the step in flight.

With one step in flight (engines/base.PipelinedEngine), a copy that waits for
the engine's stream waits for that step, and the overlap is gone. A pageable
host-to-device copy does (it is staged through the driver after the stream's
earlier work), and so does reading a device tensor on the host. So:

- ids go to the device from page-locked memory (PyTorch's caching host
  allocator, which keeps a block until the copy made from it has run) with
  `non_blocking=True` on the current stream;
- a step's sampled tokens come back through one page-locked buffer, copied
  with `non_blocking=True` after the step's work, with an event recorded after
  the copy: `StepReadback.collect` waits on that event only.

On CPU both are plain tensors and `collect` only converts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..scheduler.step import StepOutput


def ints_to_device(values: Sequence[int] | Tensor, device: torch.device) -> Tensor:
    """int64 values -> a tensor on `device`, without waiting for the device's queued work."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(slots=True)
class StepReadback:
    """A launched step: its per-slot failures (known at launch) and its sampled tokens on their way to the
    host, in sampling order, with the slots they belong to."""

    output: StepOutput
    slots: list[list[int]] = field(default_factory=list)  # per sampling call, the slots of its rows
    tokens: Tensor | None = None  # [n] every sampled token in order: on the host (pinned on CUDA)
    copied: torch.cuda.Event | None = None  # recorded after the copy to `tokens` (CUDA)
    started: torch.cuda.Event | None = None  # recorded before the step's work (CUDA), for its device time
    launch_s: float = 0.0  # host time of launch (the step's time on CPU)

    @classmethod
    def begin(cls, device: torch.device) -> StepReadback:
        readback = cls(StepOutput())
        if device.type == "cuda":
            readback.started = torch.cuda.Event(enable_timing=True)
            readback.started.record()
        return readback

    def finish_launch(self, sampled: list[tuple[Tensor, Tensor, list[int]]], launch_s: float) -> None:
        """Start the copy of every sampled token (device tensors, each with its slots) to the host."""
        self.launch_s = launch_s
        self.slots = [host_slots for _, _, host_slots in sampled]
        if not sampled:
            return
        tokens = torch.cat([t for _, t, _ in sampled]) if len(sampled) > 1 else sampled[0][1]
        if tokens.device.type != "cuda":
            self.tokens = tokens
            return
        self.tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.tokens.copy_(tokens, non_blocking=True)
        self.copied = torch.cuda.Event(enable_timing=self.started is not None)
        self.copied.record()

    def collect(self) -> StepOutput:
        out = self.output
        if self.copied is not None:
            self.copied.synchronize()
        if self.tokens is not None:
            values = self.tokens.tolist()
            i = 0
            for slots in self.slots:
                for slot in slots:
                    out.tokens.setdefault(slot, []).append(values[i])
                    i += 1
        if self.started is not None and self.copied is not None:
            out.elapsed_s = self.started.elapsed_time(self.copied) / 1000.0  # device time of the step
        else:
            out.elapsed_s = self.launch_s
        return out

