"""The engine core: one thread that drives the token engine.

    loop:
        plan = scheduler.schedule()          # pure bookkeeping
        out = engine.step(plan)              # the model runs here
        events = scheduler.update(plan, out)
        FramesReady      -> codec worker (batched SNAC decode on its own thread)
        other events     -> on_event (the service hops them onto its asyncio loop)

`submit` and `cancel` come from the asyncio thread; the scheduler's own lock
makes that safe. When there is no work the thread waits on a condition that
`submit`/`cancel`/`stop`/`wake` notify (after changing the scheduler, so no
wake-up is lost); it never polls. While sessions exist but none can step
(all held back by flow control, or queued for capacity) it waits at most
`idle_tick_s`, or until `wake()`: the codec and the service call it when a
session's backlog shrinks.

Each loop period (schedule -> step -> update -> dispatch) is reported to the
scheduler (`record_step_time`): that, not the engine call alone, is what a
stream waits between two tokens, and it feeds the capacity measure that
admission uses.

An exception from `engine.step` fails the sessions in that plan (the
scheduler releases their slots) and the loop goes on for everybody else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .codec.base import CodecPush
from .engines.base import StepOutput, StepPlan, TokenEngine
from .scheduler import FramesReady, Scheduler, SchedulerEvent, SchedulerStats, SessionFinished, SessionRequest

log = logging.getLogger(__name__)


class CodecSink(Protocol):
    """What the engine core needs from the codec worker."""

    def submit(self, push: CodecPush) -> None: ...

    def close_session(self, key: str) -> None: ...


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        engine: TokenEngine,
        codec: CodecSink,
        on_event: Callable[[SchedulerEvent], None],
        *,
        on_frames: Callable[[FramesReady], None] | None = None,
        idle_tick_s: float = 0.05,
    ) -> None:
        self._scheduler = scheduler
        self._engine = engine
        self._codec = codec
        self._on_event = on_event
        self._on_frames = on_frames  # optional tap (token logs for tooling)
        # Upper bound on how long the loop waits while sessions exist but nothing
        # can be planned (all queued behind busy slots): timeouts are checked then.
        self._idle_tick_s = idle_tick_s
        self._cond = threading.Condition()
        self._stopping = False
        self._wakeups = 0  # counts notifications, so a wait after a check misses none
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.step_errors = 0
        self.busy_s = 0.0

    # ------------------------------------------------------------ from asyncio

    def submit(self, req: SessionRequest) -> None:
        """Queue a session; raises QueueFullError at once when the queue is full."""
        self._scheduler.submit(req)
        self._wake()

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self._scheduler.cancel(request_id, reason)
        self._wake()

    def scheduler_stats(self) -> SchedulerStats:
        return self._scheduler.stats()

    def wake(self) -> None:
        """Something a held-back session waits for has changed (codec progress, client took audio)."""
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._wakeups += 1
            self._cond.notify()

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine core already started")
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._wakeups += 1
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._scheduler.has_work:
                    self._cond.wait()
                if self._stopping:
                    return
                seen = self._wakeups
            period_start = time.perf_counter()
            plan = self._scheduler.schedule()
            if plan.empty:
                events = self._scheduler.drain_events()
                if events:
                    self._dispatch(events)
                else:
                    with self._cond:
                        if self._wakeups == seen and not self._stopping:
                            self._cond.wait(self._idle_tick_s)
                continue

            t0 = time.perf_counter()
            output = self._step(plan)
            self.busy_s += time.perf_counter() - t0
            self.steps += 1
            self._dispatch(self._scheduler.update(plan, output))
            self._scheduler.record_step_time(plan, time.perf_counter() - period_start)

    def _step(self, plan: StepPlan) -> StepOutput:
        try:
            return self._engine.step(plan)
        except Exception as exc:  # the engine failed this plan: fail its sessions, keep serving
            self.step_errors += 1
            log.exception("engine step failed; failing the %d sessions in it", len(plan.decode) + len(plan.prefill))
            slots = set(plan.decode) | {c.slot for c in plan.prefill}
            return StepOutput(failed={s: f"engine error: {exc}" for s in slots})

    def _dispatch(self, events: list[SchedulerEvent]) -> None:
        for event in events:
            if isinstance(event, FramesReady):
                self._codec.submit(CodecPush(event.request_id, event.frames, event.final))
                if self._on_frames is not None:
                    self._on_frames(event)
                continue
            if isinstance(event, SessionFinished) and event.reason not in ("stop", "length"):
                # No final push will come: drop the codec's state for it (queued behind its pushes).
                self._codec.close_session(event.request_id)
            self._on_event(event)
