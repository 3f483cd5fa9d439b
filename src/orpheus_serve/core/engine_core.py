"""The engine core: one thread that drives the token engine.

It runs in the server's process (core.client.InprocClient) or in an
engine-core process of its own (core/process.py, `server.engine_process`);
either way `core.client.CoreRuntime` wires it to the scheduler and the
codec worker, and it never touches a socket.

    loop (engine.overlap, an engine with launch/collect: engines/base.PipelinedEngine):
        plan N+1 = scheduler.schedule()      # pure bookkeeping, made while step N runs
        handle N+1 = engine.launch(plan)     # queued on the device; returns at once
        out N = engine.collect(handle N)     # step N's tokens, on the host
        events = scheduler.update(plan N, out N)
        FramesReady      -> codec worker (batched SNAC decode on its own thread)
        other events     -> on_event (the service hops them onto its asyncio loop)

    loop (no overlap, or an engine with step() only):
        plan = scheduler.schedule(); out = engine.step(plan); events = scheduler.update(plan, out); ...

With a step in flight the host's work (update, dispatch, the next plan) runs while the device runs
the next step, so a loop period is max(device, host) instead of their sum. The scheduler plans from
what it knows before a step's tokens are read back (ARCHITECTURE §5, "Overlapped steps"); a session
that ended in step N has its token in step N+1 dropped.

`submit` and `cancel` come from the asyncio thread (or, in the engine-core
process, from its input thread); the scheduler's own lock
makes that safe. When there is no work the thread waits on a condition that
`submit`/`cancel`/`stop`/`wake` notify (after changing the scheduler, so no
wake-up is lost); it never polls. While sessions exist but none can step
(all held back by flow control, or queued for capacity) it waits at most
`idle_tick_s`, or until `wake()`: the codec and the service call it when a
session's backlog shrinks.

Each loop period (schedule -> step -> update -> dispatch; overlapped, from one
read-back to the next) is reported to the scheduler (`record_step_time`):
that, not the engine call alone, is what a stream waits between two tokens,
and it feeds the capacity measure that admission uses. Each iteration that ran a step is also timed in
phases (plan, launch, device wait, codec hand-off, output, other) with its thread CPU time, on `host_clock`
(host_time.py): GET /v1/stats' `core_host`, what the card run records of the host's share of a step.

The armed step profiler (engine.profile_dir) is a diagnostic: when it raises, starting, stopping or writing
its result, the loop logs it, writes `{"status": "failed", "stage", "reason"}` as the profile's result, and
serves on.

A step that raises fails only its culprit. (Overlapped, a launch that raises has changed nothing:
the step in flight is read back first, then the plan runs as below. A read-back that raises means
the device failed under a launched step: the engine is declared dead.) The engine core runs the plan's
releases on their own, then its sessions again in halves (and halves of
those) until every session has either run in a sub-step that succeeded, so
its one token for this step is delivered as if nothing had happened, or
failed alone, with its own error. Engines make this safe: a step that raises
changes no session (see each engine's docstring), so a session's token is
the one it would have got in the full batch. A plan of n sessions with one
culprit costs about 2·log2(n) extra engine calls, once.

An engine that fails sessions that have nothing in common is broken, not
attacked: when `DEAD_AFTER_LONE_FAILURES` sessions have failed alone in
failed steps where nothing else ran either, with no successful engine call
in between, the engine is declared dead.
From then on no step reaches it, every session fails at once, `submit`
refuses new work (ServiceUnavailableError: 503 / UNAVAILABLE), and
`engine_alive` is False (the gateway's /ready answers 503 `engine_failed`).
Only a restart brings it back. An engine that knows it is dead (its runtime
died: `step.EngineDeadError`) is declared dead by the first step that raises
it, with the engine's own message, without isolating anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ..codec.base import CodecPush
from ..codec.pass_clock import name_os_thread
from ..engines.base import PipelinedEngine, TokenEngine
from ..request.errors import ServiceUnavailableError
from ..scheduler import FramesReady, Scheduler, SchedulerEvent, SchedulerStats, SessionFinished, SessionRequest
from ..scheduler.step import EngineDeadError, PrefillChunk, StepOutput, StepPlan
from .host_time import CODEC_HANDOFF, DEVICE_WAIT, LAUNCH, OTHER, OUTPUT, PLAN, LoopClock

if TYPE_CHECKING:
    from ..engines.profiling import ArmedStepProfiler

log = logging.getLogger(__name__)

# Sessions in a row that must fail on their own, with no success in between, before the engine is dead. One is
# a bad request (and fails alone); two unrelated ones failing alone means it is not about the requests.
DEAD_AFTER_LONE_FAILURES = 2
# Failures in a row of the armed step profiler (engine.profile_dir) before the loop stops using it.
PROFILE_FAILURES_KEPT = 3


class CodecSink(Protocol):
    """What the engine core needs from the codec worker."""

    def submit_many(self, pushes: Sequence[CodecPush]) -> None: ...

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
        overlap: bool = True,
        step_profiler: ArmedStepProfiler | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._engine = engine
        # One step in flight while the next is planned (module docstring), where the engine can.
        self._pipelined = engine if overlap and isinstance(engine, PipelinedEngine) else None
        self._last_read_at = 0.0  # perf_counter when the last step's output was read back and dispatched
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
        self.busy_s = 0.0  # wall time inside engine.step
        self.engine_elapsed_s = 0.0  # what the engine says its steps took (the sim engine: its cost model)
        self.loop_s = 0.0  # whole loop periods that ran a step: schedule -> step -> update -> dispatch
        self.engine_failure: str | None = None  # set when the engine is declared dead
        self._lone_failures = 0  # sessions failed alone since the engine last ran anything successfully
        # Profiles loop iterations on request (engine.profile_dir; engines/profiling.py).
        self._step_profiler = step_profiler
        self._profile_failures = 0  # profiler failures in a row (each one logged and written as the result)
        # Host time of each loop iteration, by phase (core_host in /v1/stats; host_time.py).
        self.host_clock = LoopClock()

    # ------------------------------------------------------------ from asyncio

    @property
    def engine_alive(self) -> bool:
        return self.engine_failure is None

    def submit(self, req: SessionRequest) -> None:
        """Queue a session; raises the scheduler's SchedulerFullError at once when the queue is full, and
        ServiceUnavailableError once the engine is dead."""
        if self.engine_failure is not None:
            raise ServiceUnavailableError(f"the engine has failed and the server needs a restart: {self.engine_failure}")
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

    @property
    def overlapped(self) -> bool:
        return self._pipelined is not None

    def _run(self) -> None:
        name_os_thread(threading.current_thread().name)
        if self._pipelined is not None:
            self._run_overlapped(self._pipelined)
            return
        clock = self.host_clock
        while (seen := self._await_work()) is not None:
            period_start = clock.begin()
            plan = self._scheduler.schedule()
            clock.mark(PLAN)
            if plan.empty:
                self._idle(seen)
                continue

            t0 = time.perf_counter()
            with self._profiled(plan):
                clock.mark(OTHER)
                # One engine call, launch and read-back together: the record counts it as device_wait, and the
                # iteration's thread CPU time says how much of it held the host.
                output = self._step(plan)
                clock.mark(DEVICE_WAIT)
            self.busy_s += time.perf_counter() - t0
            self.engine_elapsed_s += output.elapsed_s
            self.steps += 1
            events = self._scheduler.update(plan, output)
            clock.mark(OUTPUT)
            self._dispatch(events)
            clock.mark(OUTPUT)
            period = time.perf_counter() - period_start
            self.loop_s += period
            self._scheduler.record_step_time(plan, period)
            _record_plan(clock, plan, period)
            clock.finish()

    def _run_overlapped(self, engine: PipelinedEngine) -> None:
        """The loop with one step in flight: plan and launch N+1, then read N back (module docstring)."""
        inflight: _Launched | None = None
        clock = self.host_clock
        while (seen := self._await_work(step_in_flight=inflight is not None)) is not None:
            planned_at = clock.begin()
            plan = self._scheduler.schedule()
            clock.mark(PLAN)
            if plan.empty:
                if inflight is not None:
                    self._read_back(engine, inflight)
                    inflight = None
                    clock.finish()
                else:
                    self._idle(seen)
                continue
            with self._profiled(plan):
                launched = self._launch(engine, plan, planned_at)
                if inflight is not None:
                    self._read_back(engine, inflight)
            inflight = launched
            if launched.handle is None:  # refused at launch: run it on its own, isolating the culprits
                self._read_back(engine, launched)
                inflight = None
            clock.finish()

    def _profiled(self, plan: StepPlan) -> AbstractContextManager[None]:
        if self._step_profiler is None:
            return nullcontext()
        return _GuardedProfile(self, self._step_profiler.around_step(len(plan.decode)))

    def _profile_failed(self, stage: str, exc: BaseException) -> None:
        """The armed profiler raised (starting, stopping or writing its result): a diagnostic, never a reason to
        stop serving. Logged, and written where the profile would have gone so that whoever armed it sees a
        failed profile instead of waiting for one. The profiler is made anew (its state is unknown now), and
        dropped after PROFILE_FAILURES_KEPT failures in a row."""
        profiler = self._step_profiler
        assert profiler is not None
        self._profile_failures += 1
        log.error("the engine-core step profiler failed (at %s); serving goes on without this profile", stage,
                  exc_info=exc)
        # Shaped as a profile that failed (engines/profiling.StepProfile.as_dict): status and reason.
        record = {"status": "failed", "stage": stage,
                  "reason": f"the step profiler raised at {stage}: {type(exc).__name__}: {exc}"}
        with contextlib.suppress(OSError):
            profiler.arm_path.unlink(missing_ok=True)  # not armed again by the same request
        try:
            scratch = profiler.result_path.with_name(profiler.result_path.name + ".failed.tmp")
            scratch.write_text(json.dumps(record, indent=2))
            scratch.replace(profiler.result_path)
        except OSError:
            log.error("could not write the failed profile's record to %s", profiler.result_path, exc_info=True)
        if self._profile_failures >= PROFILE_FAILURES_KEPT:
            log.error("the step profiler failed %d times in a row; profiling is off until a restart",
                      self._profile_failures)
            self._step_profiler = None
            return
        try:
            self._step_profiler = type(profiler)(profiler.folder, profiler.device)
        except Exception:
            log.exception("could not set the step profiler up again; profiling is off until a restart")
            self._step_profiler = None

    def _await_work(self, step_in_flight: bool = False) -> int | None:
        """Block until the scheduler has work (or a step is in flight); the wake-up count seen, None: stop.
        The time it waits with no session at all, and the process's CPU time meanwhile, go to the host clock
        (idle_cpu_share: threads that spin while nothing runs)."""
        with self._cond:
            if not self._stopping and not step_in_flight and not self._scheduler.has_work:
                self.host_clock.idle_begin()
                while not self._stopping and not self._scheduler.has_work:
                    self._cond.wait()
                self.host_clock.idle_end()
            return None if self._stopping else self._wakeups

    def _idle(self, seen: int) -> None:
        """An empty plan: dispatch what the scheduler has to tell, else wait for a wake-up or the idle tick."""
        events = self._scheduler.drain_events()
        if events:
            self._dispatch(events)
            return
        with self._cond:
            if self._wakeups == seen and not self._stopping:
                self._cond.wait(self._idle_tick_s)

    def _launch(self, engine: PipelinedEngine, plan: StepPlan, planned_at: float) -> _Launched:
        if self.engine_failure is not None:
            return _Launched(plan, None, planned_at, 0.0)
        self.host_clock.mark(OTHER)
        t0 = time.perf_counter()
        try:
            handle = engine.launch(plan)
        except Exception:  # nothing was launched and nothing changed: the step runs again, serially, after N
            log.debug("launching a step raised; it runs again on its own", exc_info=True)
            return _Launched(plan, None, planned_at, time.perf_counter() - t0)
        finally:
            self.host_clock.mark(LAUNCH)
        return _Launched(plan, handle, planned_at, time.perf_counter() - t0)

    def _read_back(self, engine: PipelinedEngine, launched: _Launched) -> None:
        """Collect a launched step (or run a refused one serially), update the scheduler and dispatch."""
        plan = launched.plan
        clock = self.host_clock
        clock.mark(OTHER)
        t0 = time.perf_counter()
        if launched.handle is None:
            output = self._step(plan)
        else:
            try:
                output = engine.collect(launched.handle)
            except Exception as exc:  # the device failed under a launched step: nothing after it can be trusted
                self.step_errors += 1
                self._declare_dead(f"reading a step back failed: {exc}")
                output = StepOutput(failed={slot: f"engine failed: {exc}" for slot in _slots_of(plan)})
            else:
                if plan.prefill or plan.decode:
                    self._lone_failures = 0
        clock.mark(DEVICE_WAIT)
        self.busy_s += launched.launch_s + time.perf_counter() - t0
        self.engine_elapsed_s += output.elapsed_s
        self.steps += 1
        events = self._scheduler.update(plan, output)
        clock.mark(OUTPUT)
        self._dispatch(events)
        clock.mark(OUTPUT)
        done = time.perf_counter()
        # What a stream waits between two tokens: from the previous read-back (or, after an idle gap, from when
        # this plan was made) to this one.
        period = done - max(self._last_read_at, launched.planned_at)
        self._last_read_at = done
        self.loop_s += period
        self._scheduler.record_step_time(plan, period)
        _record_plan(clock, plan, period)

    def _step(self, plan: StepPlan) -> StepOutput:
        if self.engine_failure is not None:
            return StepOutput(failed={slot: f"engine failed: {self.engine_failure}" for slot in _slots_of(plan)})
        try:
            output = self._engine.step(plan)
        except EngineDeadError as exc:
            self.step_errors += 1
            self._declare_dead(str(exc))
            return self._step(plan)
        except Exception as exc:  # find the session(s) at fault; everybody else keeps this step's token
            self.step_errors += 1
            log.exception("engine step over %d sessions failed; running them again in smaller groups",
                          len(plan.decode) + len(plan.prefill))
            return self._isolate(plan, exc)
        if plan.prefill or plan.decode:
            self._lone_failures = 0
        return output

    def _isolate(self, plan: StepPlan, error: Exception) -> StepOutput:
        """The output `plan` would have had if only its culprits had failed (see the module docstring)."""
        out = StepOutput()
        if plan.release:  # released slots belong to nobody: free them first, on their own
            try:
                _merge(out, self._engine.step(StepPlan(release=plan.release)))
            except Exception as exc:
                self._declare_dead(f"releasing slots failed: {exc}")
                return self._step(plan)
        units: list[PrefillChunk | int] = [*plan.prefill, *plan.decode]
        pending: list[tuple[list[PrefillChunk | int], Exception]] = [(units, error)]
        succeeded = False  # some sub-step ran: the engine works, the failures are the sessions' own
        alone = 0
        while pending:
            group, exc = pending.pop()
            if len(group) == 1:
                [unit] = group
                out.failed[unit.slot if isinstance(unit, PrefillChunk) else unit] = f"engine error: {exc}"
                alone += 1
                continue
            for half in (group[: len(group) // 2], group[len(group) // 2 :]):
                sub = StepPlan(prefill=[u for u in half if isinstance(u, PrefillChunk)],
                               decode=[u for u in half if not isinstance(u, PrefillChunk)])
                sub.priority = {s: p for s, p in plan.priority.items() if s in _slots_of(sub)}
                try:
                    _merge(out, self._engine.step(sub))
                except EngineDeadError as dead:
                    self._declare_dead(str(dead))
                    return self._step(plan)
                except Exception as sub_error:
                    pending.append((half, sub_error))
                else:
                    succeeded = True
        log.warning("isolated the failed step: %d of %d sessions failed (%s)", len(out.failed), len(units),
                    ", ".join(f"slot {s}: {e}" for s, e in sorted(out.failed.items())))
        self._lone_failures = 0 if succeeded else self._lone_failures + alone
        if self._lone_failures >= DEAD_AFTER_LONE_FAILURES:
            self._declare_dead(f"{self._lone_failures} sessions in a row failed on their own; last: {error}")
        return out

    def _declare_dead(self, reason: str) -> None:
        if self.engine_failure is None:
            self.engine_failure = reason
            log.critical("the engine is dead (%s); refusing new requests until the server is restarted", reason)

    def _dispatch(self, events: list[SchedulerEvent]) -> None:
        pushes = []
        for event in events:
            if isinstance(event, FramesReady):
                pushes.append(CodecPush(event.request_id, event.frames, event.final))
                if self._on_frames is not None:
                    self._on_frames(event)
                continue
            if isinstance(event, SessionFinished) and event.reason not in ("stop", "length"):
                # No final push will come: drop the codec's state for it, after the pushes before this event.
                self.host_clock.mark(OUTPUT)
                if pushes:
                    self._codec.submit_many(pushes)
                    pushes = []
                self._codec.close_session(event.request_id)
                self.host_clock.mark(CODEC_HANDOFF)
            self._on_event(event)
        if pushes:
            self.host_clock.mark(OUTPUT)
            self._codec.submit_many(pushes)  # one wake-up of the codec thread per step
            self.host_clock.mark(CODEC_HANDOFF)


class _GuardedProfile:
    """One loop iteration inside the armed profiler's `around_step`, with the profiler's own failures caught:
    the iteration's work runs whatever the profiler does, and an exception from the work itself is raised as
    it is."""

    __slots__ = ("_core", "_entered", "_inner")

    def __init__(self, core: EngineCore, inner: AbstractContextManager[None]) -> None:
        self._core = core
        self._inner = inner
        self._entered = False

    def __enter__(self) -> None:
        try:
            self._inner.__enter__()
        except Exception as exc:
            self._core._profile_failed("start", exc)
        else:
            self._entered = True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if not self._entered:
            return False
        if exc is not None:  # the work raised: the profiler unwinds, the work's exception goes on
            with contextlib.suppress(Exception):
                self._inner.__exit__(kind, exc, tb)
            return False
        try:
            self._inner.__exit__(None, None, None)
        except Exception as failure:
            self._core._profile_failed("finish", failure)
        else:
            self._core._profile_failures = 0
        return False


@dataclass(frozen=True, slots=True)
class _Launched:
    plan: StepPlan
    handle: Any  # the engine's, for collect; None: not launched (refused at launch, or the engine is dead)
    planned_at: float  # perf_counter when the plan was made
    launch_s: float  # time in engine.launch


def _record_plan(clock: LoopClock, plan: StepPlan, period_s: float) -> None:
    clock.record_plan(period_s, len(plan.decode), len(plan.prefill), sum(c.end - c.start for c in plan.prefill))


def _slots_of(plan: StepPlan) -> set[int]:
    return {*plan.decode, *(c.slot for c in plan.prefill)}


def _merge(out: StepOutput, part: StepOutput) -> None:
    """Add one sub-step's output to a step's; tokens in order, as an engine that batches itself returns them."""
    for slot, ids in part.tokens.items():
        out.tokens.setdefault(slot, []).extend(ids)
    out.finished.update(part.finished)
    out.failed.update(part.failed)
    out.elapsed_s += part.elapsed_s
