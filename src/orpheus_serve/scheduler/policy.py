"""Which decoding sessions get a token this step (ARCHITECTURE §5).

`fair`: sessions before their first audio (and under `ttfb_priority_tokens`
generated, but never fewer than the first push needs, so the boost cannot
lapse one token before the first audio) first, then the least recently
stepped. Once the new arrivals
have their first audio, every decoding session is stepped at least once
every ceil(decoding / max_batch_size) steps, so nothing starves.

`deadline`: earliest playback deadline first, the deadline being the moment
the client's buffer runs dry (`Session.playback_end_s`), in four ranks:

1. sessions before their first audio (their client waits for its first byte);
2. streams that have not stalled, earliest deadline first;
3. streams that already stalled, oldest first, until their client has been
   waiting `deadline_stalled_max_wait_s`; then they rank by deadline in 2,
   so no stream starves;
4. streams more than `deadline_yield_s` ahead of real time: they yield their
   turn to everyone above and only fill a batch that has room to spare (a
   decode step is memory-bound, so an extra sequence costs ~1% of the step,
   while an empty place in the batch helps nobody).

Why rank 3: when demand exceeds what the engine can generate, plain
earliest-deadline-first spreads the deficit evenly and every stream stutters
(the classic overload collapse of EDF; in the simulation it kept fewer
streams real-time than `fair`). Serving the streams that are still whole
first, and the stalled ones one at a time, oldest first, keeps as many
streams real-time as the capacity allows (numbers: `scripts/sim_policies.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import SchedulerConfig
from .session import Session


class SchedulingPolicy(Protocol):
    name: str

    def select(self, candidates: Sequence[Session], limit: int, now: float) -> list[Session]:
        """At most `limit` of `candidates` (all decoding) to step now."""
        ...

    def admission_order(self, waiting: Sequence[Session]) -> Sequence[Session]:
        """The order in which waiting sessions take free slots (`waiting` is in arrival order)."""
        ...


def arrival_order(waiting: Sequence[Session]) -> Sequence[Session]:
    """First come, first served: both policies admit in arrival order (a request's place in the
    queue is what its client was promised by Retry-After and the queue bound)."""
    return waiting


@dataclass(frozen=True, slots=True)
class FairPolicy:
    ttfb_priority_tokens: int
    name: str = "fair"

    def select(self, candidates: Sequence[Session], limit: int, now: float) -> list[Session]:
        if len(candidates) <= limit:
            return list(candidates)
        tokens = self.ttfb_priority_tokens

        def key(s: Session) -> tuple[int, int, int]:
            return (0 if s.in_ttfb_priority(tokens) else 1, s.last_decoded_step, s.order)

        return heapq.nsmallest(limit, candidates, key=key)

    def admission_order(self, waiting: Sequence[Session]) -> Sequence[Session]:
        return arrival_order(waiting)


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    yield_s: float
    stalled_max_wait_s: float
    name: str = "deadline"

    def select(self, candidates: Sequence[Session], limit: int, now: float) -> list[Session]:
        if len(candidates) <= limit:
            return list(candidates)

        def key(s: Session) -> tuple[int, float, int]:
            deadline = s.deadline_s
            if deadline is None:  # no audio yet: the client waits for its first byte
                return (0, s.request.arrival_s, s.order)
            if deadline - now > self.yield_s:  # far ahead of real time: yields its turn
                return (3, deadline, s.order)
            if s.stalls and now - deadline < self.stalled_max_wait_s:
                return (2, 0.0, s.order)  # already stuttered: behind the whole streams, oldest first
            return (1, deadline, s.order)

        return heapq.nsmallest(limit, candidates, key=key)

    def admission_order(self, waiting: Sequence[Session]) -> Sequence[Session]:
        return arrival_order(waiting)


def make_policy(config: SchedulerConfig, *, first_push_tokens: int = 0) -> SchedulingPolicy:
    """`first_push_tokens`: generated tokens the first FramesReady needs (window + codec lookahead)."""
    if config.policy == "fair":
        return FairPolicy(max(config.ttfb_priority_tokens, first_push_tokens))
    if config.policy == "deadline":
        return DeadlinePolicy(config.deadline_yield_s, config.deadline_stalled_max_wait_s)
    raise ValueError(f"unknown scheduling policy {config.policy!r}")
