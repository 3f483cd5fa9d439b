"""Allocator over the engine's pre-allocated KV-cache slots (ARCHITECTURE §5).

Slots are rows of a cache allocated once at start-up; this only tracks which
are bound to a session. The lowest free index is handed out first so that a
lightly loaded server keeps touching the same few rows and runs reproduce.
"""

from __future__ import annotations

import heapq


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a heap
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def is_used(self, slot: int) -> bool:
        return slot in self._used

    def allocate(self) -> int | None:
        """The lowest free slot, now bound; None when every slot is taken."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
