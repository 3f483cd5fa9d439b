"""The session scheduler: sessions ⇄ KV-cache slots, one plan per engine step.

Architecture (ARCHITECTURE §1, §5), in the style of vLLM v1's scheduler / engine-core split:

    engine core thread:  plan = scheduler.schedule()      # pure: which slots do what
                         out = engine.step(plan)          # the only model work
                         events = scheduler.update(plan, out)
    request side:        scheduler.submit(req) / scheduler.cancel(request_id)

`schedule()` checks timeouts with the injected clock, releases the slots of
sessions that ended since the last plan (the engine frees them before
anything else in that same step, so a new session may take the slot in the
same plan), picks at most `max_batch_size` decoding sessions by the policy
(`policy.py`), and admits waiting sessions with chunked prefill: at most
`prefill_chunk_tokens` prompt ids per step across all sessions.

`update()` turns the engine's tokens into frames with one `protocol.
FrameParser` per session, decides when frames go to the codec (`flush.py`)
and ends sessions: end_of_speech -> "stop", `sampling.max_tokens` or the
room left in the context (max_seq_len - prompt, in whole frames, whichever
is smaller) -> "length", a protocol error or an engine failure -> failed.
It accepts tokens for slots that were not in `plan.decode` and several per
slot, as engines with in-flight batching produce them.

Timeouts: a session waiting for a slot longer than `queue_timeout_s` (from
its arrival) or holding one longer than `session_timeout_s` (from its
admission) ends with "timeout". `submit()` refuses at once (SchedulerFullError,
with a retry hint) when every slot is taken and `max_queue` requests wait.

Flow control (ARCHITECTURE §5a, `flow.py`): decoding sessions too far ahead of
their codec or their client are left out of the step (they keep their slots);
new sessions are admitted only under the measured capacity (`admission:
queue` waits, `reject` refuses at submit, `slots` admits by free slots); the
first push is sized from the measured load. The engine core reports each loop
period (`record_step_time`), the codec each pass (`record_codec_pass`) and
each session's decoded frames (`note_decoded`), the service what each client
took (`note_delivered`) and how late its event loop runs (`note_gateway_lag`);
the playback model, and so the `deadline` policy, runs on delivered audio.

Events (`events.py`) are what the caller acts on: FramesReady for the codec,
SessionFinished / SessionFailed for the client. Events that arise outside
`update()` (cancel, timeouts found in `schedule()`) are queued and returned by
the next `update()` or by `drain_events()`.

Nothing here runs a model, starts a thread or sleeps. One lock makes the public
methods safe to call from the request side while the engine core thread
plans and updates; the lock is held only for this bookkeeping, never across
an engine step.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from ..config import SchedulerConfig
from ..token_format import SAMPLES_PER_FRAME, TOKENS_PER_FRAME, ProtocolError
from .capacity import CapacityModel
from .errors import InvalidSessionError, SchedulerFullError
from .events import FramesReady, SchedulerEvent, SessionFailed, SessionFinished
from .feedback import SchedulerFeedback
from .flow import FlowControl
from .flush import FlushPolicy, FrameBuffer
from .policy import SchedulingPolicy, make_policy
from .session import Session, SessionRequest, SessionState
from .slots import SlotAllocator
from .step import StepOutput, StepPlan

_RETRY_MIN_S = 0.5
_RETRY_MAX_S = 60.0
_SESSION_S_SMOOTHING = 0.1  # weight of the newest session in the running mean used for retry hints


class Scheduler(SchedulerFeedback):
    """Sessions and slots, one plan per engine step (see the module docstring); the feedback it takes and
    the state it reports are SchedulerFeedback's (feedback.py)."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_slots: int,
        *,
        lookahead_frames: int = 0,
        clock: Callable[[], float] = time.monotonic,
        max_seq_len: int | None = None,
        lookahead_samples: int | None = None,
        delivery_feedback: bool = False,
        max_frames_per_pass: int = 64,
        max_pass_s: float | None = None,
        max_adapters: int | None = None,
    ) -> None:
        """`lookahead_samples`: audio the decoder holds back until later frames arrive (defaults to
        `lookahead_frames` whole frames). `delivery_feedback`: the caller reports decoded frames and
        delivered audio (`note_decoded`, `note_delivered`); otherwise a push counts as both at once.
        `max_adapters`: distinct LoRA adapters (custom voices) the engine runs at once (its adapter pool,
        `voices.max_loras`); a session on another adapter waits in the queue until one is free. None: no
        limit."""
        self._config = config
        self._max_adapters = max_adapters
        self._clock = clock
        self._max_seq_len = max_seq_len
        self._batch_limit = min(config.max_batch_size, num_slots)
        self._slots = SlotAllocator(num_slots)
        self._flush_policy = FlushPolicy.from_config(config, lookahead_frames)
        self._flow = FlowControl(
            config, flush_policy=self._flush_policy, batch_limit=self._batch_limit, num_slots=num_slots,
            lookahead_samples=lookahead_frames * SAMPLES_PER_FRAME if lookahead_samples is None else lookahead_samples,
            feedback=delivery_feedback, max_frames_per_pass=max_frames_per_pass, max_pass_s=max_pass_s,
        )
        # (plan, batch, context, prefill, streams) of the plans whose loop period is not recorded yet: one, or
        # two while a step is in flight.
        self._plan_loads: deque[tuple[StepPlan, int, int, int, int]] = deque(maxlen=4)
        self._policy: SchedulingPolicy = make_policy(
            config, first_push_tokens=self._flush_policy.first_frames * TOKENS_PER_FRAME
        )
        self._lock = threading.Lock()

        # Live sessions. Dicts keep insertion order: FIFO for `_waiting`, admission order for `_admitted`.
        self._waiting: dict[str, Session] = {}
        self._admitted: dict[str, Session] = {}
        self._by_slot: dict[int, Session] = {}
        self._pending_release: list[int] = []
        # Adapters of sessions whose slots the next plan releases: the engine unpins them once that step has
        # run, so a session on a new adapter cannot take their pool entries in the same step.
        self._pending_release_adapters: list[str] = []
        self._events: list[SchedulerEvent] = []

        self._order = 0
        self._step = 0
        self._mean_session_s: float | None = None
        self._total_sessions = 0
        self._total_tokens = 0
        self._prefill_tokens = 0
        self._total_batches = 0
        self._decoded_sessions = 0
        self._stray_tokens = 0
        self._adapter_waits = 0  # plans in which a queued session waited for an adapter-pool entry
        self._counts = {"finished": 0, "cancelled": 0, "failed": 0, "timed_out": 0, "rejected": 0}

    # ------------------------------------------------------------ request side

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def capacity_model(self) -> CapacityModel:
        """The running measure admission uses (fed by `record_step_time` and `record_codec_pass`)."""
        return self._flow.capacity

    def submit(self, req: SessionRequest) -> None:
        """Queue a session. SchedulerFullError at once when every slot is taken and
        `max_queue` requests already wait; InvalidSessionError for a request that
        can never run (empty prompt, prompt too long, request id in use)."""
        if not req.prompt_ids:
            raise InvalidSessionError("empty prompt", param="prompt_ids")
        if req.sampling.max_tokens < 1:
            raise InvalidSessionError("max_tokens must be >= 1", param="max_tokens")
        token_limit = req.sampling.max_tokens
        if self._max_seq_len is not None:
            room = self._max_seq_len - len(req.prompt_ids)
            if room < 7:
                raise InvalidSessionError(
                    f"prompt of {len(req.prompt_ids)} tokens leaves no room for audio within "
                    f"max_seq_len={self._max_seq_len}",
                    param="input",
                )
            # The context ends the session like max_tokens does ("length"), after its last whole frame.
            token_limit = min(token_limit, room - room % TOKENS_PER_FRAME)
        with self._lock:
            if req.request_id in self._waiting or req.request_id in self._admitted:
                raise InvalidSessionError(f"request id {req.request_id!r} is already in use", param="request_id")
            continuation = req.is_continuation  # part of a stream already playing: never refused
            if self._config.admission == "reject" and not continuation:
                # Behind a load balancer: past the measured capacity, refuse at once so the client goes
                # elsewhere. (While a cold server ramps up to what it has not measured yet, requests wait.)
                capacity = self._flow.reject_limit(self._admitted.values(), self._step, self._clock())
                if capacity is not None and self._flow.demand(self._admitted.values()) + len(self._waiting) >= capacity:
                    self._counts["rejected"] += 1
                    self._flow.admission_refused()
                    retry = retry_after_s(self._mean_session_s, len(self._waiting), self.num_slots)
                    raise SchedulerFullError(
                        f"server at capacity: {capacity} real-time streams are running (scheduler.admission="
                        f"reject); retry in {retry:.1f} s",
                        retry_after_s=retry,
                    )
            # Waiting requests that will not be admitted at the next step: past a free slot, or past the
            # capacity admission allows.
            admissible = self._slots.free_count + len(self._pending_release)
            limit = self._flow.admission_limit(self._admitted.values(), self._step, self._clock())
            if limit is not None:
                admissible = max(0, min(admissible, limit - self._flow.demand(self._admitted.values())))
            queued = len(self._waiting) - admissible
            if queued >= self._config.max_queue and not continuation:
                self._counts["rejected"] += 1
                retry = retry_after_s(self._mean_session_s, queued, self.num_slots)
                raise SchedulerFullError(
                    f"server busy: {self._busy_reason(limit)} and {max(queued, 0)} requests are already waiting "
                    f"(max_queue={self._config.max_queue}); retry in {retry:.1f} s",
                    retry_after_s=retry,
                )
            self._order += 1
            session = Session(
                request=req,
                order=self._order,
                buffer=FrameBuffer(self._flush_policy),
                token_limit=token_limit,
            )
            self._waiting[req.request_id] = session

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a session now; idempotent, unknown ids are ignored. A waiting one
        leaves the queue; a running one's slot is released by the next plan.
        `reason` is reported verbatim in SessionFinished ("cancelled" unless the
        caller ends it for a timeout or an error of its own)."""
        with self._lock:
            self._flow.forget(request_id)  # its client may leave while the codec finishes it
            session = self._waiting.get(request_id) or self._admitted.get(request_id)
            if session is None:
                return
            state = {"timeout": SessionState.TIMED_OUT, "error": SessionState.FAILED}.get(
                reason, SessionState.CANCELLED
            )
            self._end(session, state, reason, self._clock(), self._events)

    # ------------------------------------------------------------ engine side

    def schedule(self) -> StepPlan:
        with self._lock:
            now = self._clock()
            self._expire(now)
            plan = StepPlan()

            # Releases first: the engine frees them before prefilling, so a slot can be reused at once.
            for slot in self._pending_release:
                self._slots.free(slot)
            plan.release, self._pending_release = self._pending_release, []
            releasing_adapters, self._pending_release_adapters = self._pending_release_adapters, []

            # One pass over the live sessions: this runs every step for every stream.
            decoding = []
            held_back = self._flow.held_back
            decoding_state = SessionState.DECODING
            for session in self._admitted.values():
                if session.state is decoding_state:
                    if session.generated + session.inflight < session.token_limit and not held_back(session, now):
                        decoding.append(session)
                elif session.inflight and session.decodable() and not held_back(session, now):
                    decoding.append(session)  # its last prompt chunk is in the step in flight
                # Priority changes (first audio out) go to engines that order their own batches.
                priority = session.engine_priority
                if session.reported_priority != priority and session.slot is not None:
                    plan.priority[session.slot] = priority
                    session.reported_priority = priority
            chosen = self._policy.select(decoding, self._batch_limit, now)
            plan.decode = sorted([s.slot for s in chosen])  # a decoding session holds a slot
            for session in chosen:
                session.inflight += 1
                plan.owners[session.slot] = session.request_id  # type: ignore[index]

            self._plan_prefill(plan, now, releasing_adapters)
            context = sum([len(s.request.prompt_ids) + s.generated for s in chosen])
            prefill = sum(c.end - c.start for c in plan.prefill)
            self._plan_loads.append((plan, len(plan.decode), context, prefill, len(self._admitted)))
            return plan

    def update(self, plan: StepPlan, output: StepOutput) -> list[SchedulerEvent]:
        """Read back `plan`'s output. Its slots are matched to the sessions the plan ran for them: one that
        has ended since (in an earlier update, or cancelled) gets nothing, and its token is dropped (counted
        in `stray_tokens`), even where a new session holds the slot by now."""
        with self._lock:
            self._step += 1
            now = self._clock()
            events, self._events = self._events, []
            owners = plan_owners(plan, self._by_slot)

            prefill_token_slots: set[int] = set()
            for chunk in plan.prefill:
                session = owners.get(chunk.slot)
                if session is None or chunk.slot in output.failed:
                    continue  # ended since the plan was made, or failing below
                self._prefill_tokens += chunk.end - chunk.start
                if session.state is SessionState.PREFILLING:
                    session.prefilled = max(session.prefilled, chunk.end)
                    if chunk.is_last:
                        session.state = SessionState.DECODING
                        session.last_decoded_step = self._step
                        prefill_token_slots.add(chunk.slot)

            for slot, error in output.failed.items():
                session = owners[slot] if slot in owners else self._by_slot.get(slot)
                if session is not None:
                    self._fail(session, f"engine error: {error}", now, events)

            decoded = 0
            for slot, ids in output.tokens.items():
                session = owners[slot] if slot in owners else self._by_slot.get(slot)
                if session is None or not session.state.live:
                    self._stray_tokens += len(ids)
                    continue
                if not ids:
                    continue
                if slot not in prefill_token_slots:
                    decoded += 1
                self._consume(session, ids, now, events)

            for slot, reason in output.finished.items():
                session = owners[slot] if slot in owners else self._by_slot.get(slot)
                if session is not None and session.state.live:  # the engine stopped it without an end the parser saw
                    self._complete(session, "stop" if reason == "stop" else "length", now, events)

            if decoded:
                self._total_batches += 1
                self._decoded_sessions += decoded
            return events

    def drain_events(self) -> list[SchedulerEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    # ------------------------------------------------------------ internals

    def _plan_prefill(self, plan: StepPlan, now: float, releasing_adapters: list[str]) -> None:
        budget = self._config.prefill_chunk_tokens
        # Prompts already started go on first (admission order), then new admissions (the policy's order).
        for session in self._admitted.values():
            if budget <= 0:
                return
            if session.state is SessionState.PREFILLING and session.prefilled < session.prompt_len:
                budget -= self._add_chunk(plan, session, budget)
        if budget <= 0 or not self._waiting or not self._slots.free_count:
            return
        capacity = self._flow.admission_limit(self._admitted.values(), self._step, now)
        demand = self._flow.demand(self._admitted.values()) if capacity is not None else 0
        adapters = None if self._max_adapters is None else _adapters_in_use(self._admitted.values(), releasing_adapters)
        for session in self._policy.admission_order(list(self._waiting.values())):
            if budget <= 0 or not self._slots.free_count:
                return
            continuation = session.request.is_continuation
            if capacity is not None and not continuation and demand >= capacity:
                self._flow.admission_waited()
                continue  # over capacity: new streams wait; continuations of playing streams go on
            adapter = session.request.adapter
            if adapter is not None and adapters is not None and adapter not in adapters:
                if len(adapters) >= self._max_adapters:  # type: ignore[operator]
                    self._adapter_waits += 1
                    continue  # every adapter-pool entry runs a voice: this one waits for a session to end
                adapters.add(adapter)
            demand += 1
            del self._waiting[session.request_id]
            slot = self._slots.allocate()
            assert slot is not None  # free_count was checked
            session.slot = slot
            session.state = SessionState.PREFILLING
            session.admitted_s = now
            session.last_decoded_step = self._step
            self._admitted[session.request_id] = session
            self._by_slot[slot] = session
            self._total_sessions += 1
            budget -= self._add_chunk(plan, session, budget)

    @staticmethod
    def _add_chunk(plan: StepPlan, session: Session, budget: int) -> int:
        chunk = session.prefill_chunk(budget)
        plan.prefill.append(chunk)
        return chunk.end - chunk.start

    def _expire(self, now: float) -> None:
        self._flow.expire(now)
        queue_timeout = self._config.queue_timeout_s
        for session in list(self._waiting.values()):
            if now - session.request.arrival_s > queue_timeout:
                self._end(session, SessionState.TIMED_OUT, "timeout", now, self._events)
        session_timeout = self._config.session_timeout_s
        for session in list(self._admitted.values()):
            assert session.admitted_s is not None
            if now - session.admitted_s > session_timeout:
                self._end(session, SessionState.TIMED_OUT, "timeout", now, self._events)

    def _consume(self, session: Session, ids: list[int], now: float, events: list[SchedulerEvent]) -> None:
        if session.state is SessionState.PREFILLING:
            # An engine that schedules itself finished the prompt on its own.
            session.state = SessionState.DECODING
            session.prefilled = session.prompt_len
        if session.first_token_at is None:
            session.first_token_at = now
        session.last_decoded_step = self._step

        frames: list[np.ndarray] = []
        outcome: str | None = None
        parser = session.parser
        for token in ids:
            session.generated += 1
            self._total_tokens += 1
            try:
                frame = parser.feed(token)
            except ProtocolError as exc:
                self._fail(session, f"protocol error: {exc}", now, events)
                return
            if frame is not None:
                frames.append(frame)
            if parser.ended:
                outcome = "stop"
                break
            if session.generated >= session.token_limit:
                outcome = "length"
                break
        # Ids past the end (an engine that streams ahead) are dropped with the session.
        if frames:
            session.buffer.add(frames[0][None] if len(frames) == 1 else np.stack(frames))
            self._flow.frames_added(session)
        if outcome is not None:
            self._complete(session, outcome, now, events)
        elif session.buffer.pending_frames:  # (with nothing pending no push can be due: most steps)
            if session.first_frames is None and session.buffer.pending_frames >= self._flush_policy.first_frames:
                session.first_frames = self._flow.first_push_frames(len(self._admitted))
            held_s = None if session.playback_end_s is None else session.playback_end_s - now
            policy = self._flush_policy
            ready = session.buffer.take_ready(
                eager=policy.buffer_is_thin(held_s, pushed=session.first_flush_at is not None),
                every_frames=policy.push_frames(held_s, self._config.max_undecoded_frames),
                first_frames=session.first_frames)
            if ready is not None:
                self._flow.pushed(session, int(ready.shape[0]), now, final=False)
                events.append(FramesReady(session.request_id, ready, final=False))

    def _complete(self, session: Session, reason: str, now: float, events: list[SchedulerEvent]) -> None:
        """stop / length: hand out every frame left, then end."""
        frames = session.buffer.take_final()
        self._flow.pushed(session, int(frames.shape[0]), now, final=True)
        events.append(FramesReady(session.request_id, frames, final=True))
        self._flow.finished(session)
        self._end(session, SessionState.FINISHED, reason, now, events)

    def _fail(self, session: Session, error: str, now: float, events: list[SchedulerEvent]) -> None:
        events.append(SessionFailed(session.request_id, error))
        self._end(session, SessionState.FAILED, "error", now, events)

    def _end(
        self, session: Session, state: SessionState, reason: str, now: float, events: list[SchedulerEvent]
    ) -> None:
        req = session.request
        if session.slot is not None:
            del self._by_slot[session.slot]
            self._pending_release.append(session.slot)
            if req.adapter is not None:
                self._pending_release_adapters.append(req.adapter)
            del self._admitted[req.request_id]
            assert session.admitted_s is not None
            duration = now - session.admitted_s
            self._mean_session_s = (
                duration
                if self._mean_session_s is None
                else (1 - _SESSION_S_SMOOTHING) * self._mean_session_s + _SESSION_S_SMOOTHING * duration
            )
        else:
            del self._waiting[req.request_id]
        session.state = state
        self._counts[_COUNTED_AS[state]] += 1
        queue_end = session.admitted_s if session.admitted_s is not None else now
        first_token_s = None if session.first_token_at is None else session.first_token_at - req.arrival_s
        events.append(SessionFinished(request_id=req.request_id, reason=reason, tokens=session.generated,
                                      frames=session.buffer.flushed_frames,
                                      queue_s=max(0.0, queue_end - req.arrival_s), first_token_s=first_token_s,
                                      ended_at=now, step=self._step))

    def _busy_reason(self, limit: int | None) -> str:
        if limit is not None and self._slots.free_count + len(self._pending_release):
            return f"the {limit} real-time streams the server sustains are running"
        return f"all {self.num_slots} synthesis slots are in use"


def _adapters_in_use(admitted: Iterable[Session], releasing: list[str]) -> set[str]:
    """The adapters pinned in the engine while the next plan runs."""
    return {s.request.adapter for s in admitted if s.request.adapter is not None} | {*releasing}


_COUNTED_AS = {SessionState.FINISHED: "finished", SessionState.CANCELLED: "cancelled", SessionState.FAILED: "failed",
               SessionState.TIMED_OUT: "timed_out"}


def plan_owners(plan: StepPlan, by_slot: dict[int, Session]) -> dict[int, Session | None]:
    """slot -> the live session `plan` ran for it (None: it has ended since); each gives back the token it
    had in flight. (A slot the plan does not name is read as its current holder's: an engine that
    schedules itself reports any slot.)"""
    owners: dict[int, Session | None] = {}
    for chunk in plan.prefill:
        session = by_slot.get(chunk.slot)
        owners[chunk.slot] = session if session is not None and session.request_id == chunk.request_id else None
        if owners[chunk.slot] is not None and chunk.is_last:
            session.inflight -= 1  # type: ignore[union-attr]
    for slot in plan.decode:
        session = by_slot.get(slot)
        planned_for = plan.owners.get(slot)
        if session is not None and planned_for is not None and session.request_id != planned_for:
            session = None
        owners[slot] = session
        if session is not None and planned_for is not None:
            session.inflight -= 1
    return owners


def retry_after_s(mean_session_s: float | None, queued: int, num_slots: int) -> float:
    """Rough time until a new client would get a slot: the queue ahead of it drains at about one slot per
    (mean session time / slots)."""
    mean_s = mean_session_s if mean_session_s is not None else 1.0
    estimate = mean_s * (max(queued, 0) + 1) / num_slots
    return float(min(_RETRY_MAX_S, max(_RETRY_MIN_S, math.ceil(estimate * 10) / 10)))
