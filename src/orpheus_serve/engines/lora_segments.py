"""The rows of a forward pass grouped by LoRA pool entry, on the device (engines/lora.py builds them,
engines/lora_kernels.py's Triton kernels read them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SEGMENT_ROWS = 16


@dataclass(frozen=True, slots=True)
class LoraSegments:
    """The rows of a forward pass grouped by pool entry, as the kernels of lora_kernels.py read them.

    order [M] int64: row indices sorted by entry (stable). tiles [3, T] int32: per tile its entry (0:
    nothing to do), and the range [start, end) of `order` it covers, at most `block_m` long. T depends
    only on M and the pool size, so a graph captured once serves any mix of adapters.
    """

    order: Tensor
    tiles: Tensor
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[1]

    @classmethod
    def from_entries(cls, entries: Tensor, num_entries: int, block_m: int = SEGMENT_ROWS) -> LoraSegments:
        """entries [M] (int, 0..num_entries-1) on the device. Elementwise ops, cumsums and scatters only:
        nothing waits for the device, so a CUDA graph can capture it."""
        m = entries.shape[0]
        device = entries.device
        entries = entries.long()
        ids = torch.arange(num_entries, device=device)
        onehot = (entries.unsqueeze(1) == ids).long()  # [M, P]
        counts = onehot.sum(0)  # [P] rows per entry
        starts = torch.cumsum(counts, 0) - counts  # [P] first position of each entry's rows in `order`
        # A row's place in `order`: its entry's start plus the rows of that entry before it.
        rank = (torch.cumsum(onehot, 0) * onehot).sum(1) - 1  # [M]
        dest = starts.gather(0, entries) + rank
        order = torch.empty_like(entries).scatter_(0, dest, torch.arange(m, device=device))
        tiles_per_entry = torch.where(ids > 0, (counts + block_m - 1) // block_m, 0)  # [P]; entry 0: no work
        tile_end = torch.cumsum(tiles_per_entry, 0)  # [P]
        max_tiles = -(-m // block_m) + min(num_entries - 1, m)
        t = torch.arange(max_tiles, device=device)
        tile_entry = (tile_end.unsqueeze(0) <= t.unsqueeze(1)).sum(1)  # [T] the entry whose tiles hold t
        valid = tile_entry < num_entries
        e = tile_entry.clamp(max=num_entries - 1)
        first = starts[e] + (t - (tile_end[e] - tiles_per_entry[e])) * block_m
        last = torch.minimum(starts[e] + counts[e], first + block_m)
        tiles = torch.where(valid, torch.stack([tile_entry, first, last]), 0).int()  # [3, T]; unused tiles: zeros
        return cls(order=order, tiles=tiles, block_m=block_m)
