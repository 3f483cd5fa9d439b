"""Padded shapes shared by everything that captures CUDA graphs (the torch engine's decode steps, the stateful
codec's forward steps): one graph per bucket, the real batch padded up to the next one."""

from __future__ import annotations


def padded_sizes(limit: int, smallest: int = 1) -> list[int]:
    """smallest, 2*smallest, 4*smallest, ... below limit, then limit itself."""
    sizes, size = [], smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]
