"""What the engine core, the codec and the service report back to the scheduler, and what it reports out.

The engine core reports each loop period (`record_step_time`), the codec each pass (`record_codec_pass`)
and each session's decoded frames (`note_decoded`), the service what each client took (`note_delivered`)
and how late its event loop runs (`note_gateway_lag`): flow control (ARCHITECTURE §5a) runs on these.
Out: flow stats, a session's state, the counters. `Scheduler` (scheduler.py) owns the state these read
and write, under its one lock; this base class keeps the scheduling itself apart from its feedback.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .flow import FlowControl, FlowStats
from .policy import SchedulingPolicy
from .session import Session, SessionState
from .slots import SlotAllocator
from .step import StepPlan


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    policy: str
    total_sessions: int  # ever admitted to a slot
    active_sessions: int  # holding a slot (prefilling or decoding)
    pending_sessions: int  # waiting for a slot
    max_concurrent: int  # slots
    used_slots: int  # bound to a live session, or freed by the next plan
    free_slots: int
    priority_sessions: int  # active, before their first audio
    total_tokens: int  # generated ids consumed
    prefill_tokens: int
    total_steps: int  # update() calls
    total_batches: int  # steps that decoded at least one session
    mean_batch_size: float  # sessions decoded per such step
    finished: int  # stop or length
    cancelled: int
    failed: int
    timed_out: int
    rejected: int  # SchedulerFullError at submit
    stray_tokens: int  # ids that arrived for a slot with no live session (dropped)
    adapter_waits: int  # plans in which a queued custom-voice session waited for an adapter-pool entry

    def as_dict(self) -> dict[str, int | float | str]:
        return asdict(self)


class SchedulerFeedback:
    # The Scheduler's state, as this part of it uses it (set by Scheduler.__init__).
    _lock: threading.Lock
    _clock: Callable[[], float]
    _flow: FlowControl
    _policy: SchedulingPolicy
    _slots: SlotAllocator
    _plan_loads: deque[tuple[StepPlan, int, int, int, int]]
    _waiting: dict[str, Session]
    _admitted: dict[str, Session]
    _pending_release: list[int]
    _step: int
    _total_sessions: int
    _total_tokens: int
    _prefill_tokens: int
    _total_batches: int
    _decoded_sessions: int
    _stray_tokens: int
    _adapter_waits: int
    _counts: dict[str, int]

    @property
    def num_slots(self) -> int:
        return self._slots.num_slots

    def record_step_time(self, plan: StepPlan, seconds: float) -> None:
        """The engine core's loop period around `plan` (schedule -> step -> update -> dispatch; with a step in
        flight, from the previous plan's output read back to this one's)."""
        with self._lock:
            loads = self._plan_loads
            while loads and loads[0][0] is not plan:
                loads.popleft()  # older plans whose period was not recorded (an empty or failed step)
            if not loads:
                return
            _, batch, context, prefill, streams = loads.popleft()
            self._flow.observe_step(batch, context, prefill, seconds, streams=streams, now=self._clock())

    def record_codec_pass(self, frames: int, seconds: float) -> None:
        """One codec worker pass: `frames` decoded in `seconds`."""
        with self._lock:
            self._flow.observe_codec_pass(frames, seconds, now=self._clock())

    def note_decoded(self, request_id: str, frames: int, samples: int, *, final: bool = False) -> None:
        """The codec ran `frames` more frames of this session and returned `samples` of audio;
        `final`: that was its last result (the final push, or a failure)."""
        with self._lock:
            self._flow.decoded(request_id, self._admitted.get(request_id), frames, samples, final=final)

    def note_delivered(self, request_id: str, samples: int) -> None:
        """The client's socket took `samples` more audio of this session."""
        with self._lock:
            session = self._admitted.get(request_id)
            if session is not None:
                session.record_delivery(self._clock(), samples)

    def note_gateway_lag(self, source: int, seconds: float) -> None:
        """API process `source`'s event loop runs `seconds` late (admission closes past
        `max_gateway_lag_ms`)."""
        with self._lock:
            self._flow.gateway_lag(source, seconds, self._clock())

    def client_held_s(self, request_ids: list[str]) -> list[float]:
        """Audio each client holds unplayed (0 before first audio and for ended sessions), for the codec's
        pass order: the clients closest to running dry go first."""
        with self._lock:
            now = self._clock()
            out = []
            for request_id in request_ids:
                session = self._admitted.get(request_id)
                held = None if session is None else session.client_held_s(now)
                out.append(0.0 if held is None else held)
            return out

    def flow_stats(self) -> FlowStats:
        with self._lock:
            return self._flow.stats(list(self._admitted.values()), self._clock(), self._step)

    def session_state(self, request_id: str) -> SessionState | None:
        """State of a live session; None once it has ended (or was never submitted)."""
        with self._lock:
            session = self._waiting.get(request_id) or self._admitted.get(request_id)
            return None if session is None else session.state

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._admitted or self._pending_release)

    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(
                policy=self._policy.name,
                total_sessions=self._total_sessions,
                active_sessions=len(self._admitted),
                pending_sessions=len(self._waiting),
                max_concurrent=self.num_slots,
                used_slots=self._slots.used_count,
                free_slots=self._slots.free_count,
                priority_sessions=sum(not s.had_first_audio for s in self._admitted.values()),
                total_tokens=self._total_tokens,
                prefill_tokens=self._prefill_tokens,
                total_steps=self._step,
                total_batches=self._total_batches,
                mean_batch_size=self._decoded_sessions / self._total_batches if self._total_batches else 0.0,
                finished=self._counts["finished"],
                cancelled=self._counts["cancelled"],
                failed=self._counts["failed"],
                timed_out=self._counts["timed_out"],
                rejected=self._counts["rejected"],
                stray_tokens=self._stray_tokens,
                adapter_waits=self._adapter_waits,
            )
