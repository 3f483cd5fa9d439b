"""Flow control decisions (ARCHITECTURE §5a): who is held back, who may be admitted, how big a first push is.

Playback time is the unit. Each session knows where its audio is (`session.py`:
generated -> pushed -> decoded -> delivered -> played); this module turns that
into the scheduler's decisions:

- Backpressure (`pause_reason`): a decoding session gets no token while it has
  `max_undecoded_frames` generated but not decoded (and some of them are at the
  codec, whose feedback resumes it), while its socket has not taken
  `max_server_buffer_s` of decoded audio (a slow reader), or while its client
  holds more than `max_client_buffer_s` unplayed. It keeps its slot.
- Admission (`admission_limit`, `reject_limit`): a new stream is admitted only while the streams that
  need real-time production (every admitted session but paused slow readers, plus finished ones whose
  last frames the codec has not decoded yet: with a fast engine and a slow codec a stream's generation
  ends long before its decoding) stay under the limit `leads.py` sets from what the playing streams
  experience. The engine core's loop periods and the codec's passes feed a `CapacityModel`, which only
  predicts: the limit while no stream can be read, `reject` mode's bound before any reading, and first
  pushes. `admission: slots` turns this off (bulk synthesis).
- The context admission plans with (`planning_context`): a step costs more
  as the admitted streams' contexts grow, so admission checks the load at the
  peak of the admitted streams' total context over the rest of their lives
  (each grows a token a step until it reaches a typical length, the running
  mean of finished sessions', or its limit, and then ends). With streams of
  every age (steady state) that peak is now; after a burst of admissions it
  is when they near their ends, and admitting by the current, young contexts
  would let the steps outgrow real time a few seconds later.
- Gateway lag (`gateway_lag`): each API process reports how late its event
  loop runs. Past `max_gateway_lag_ms` it cannot hand audio to its sockets in
  time, whatever the engine sustains, so admission closes (new streams queue,
  or are refused in `reject` mode) until it catches up. Without this, a starved
  API process would look like a crowd of slow readers, whom demand does not
  count, and admission would open wider the further behind it fell.
- First push sizing (`first_push_frames`): its audible part covers
  `first_chunk_safety` times the wait for the next frame (7 token intervals plus
  the codec's latency) at the measured load.

Without delivery feedback (`feedback=False`: unit tests, the virtual-clock
simulation) a push counts as decoded and delivered the moment it leaves, and
admission is by slots alone. Not thread-safe: the scheduler calls it under its
own lock. Pure Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import asdict, dataclass

from ..config import SchedulerConfig
from ..token_format import SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from .capacity import CapacityEstimate, CapacityModel
from .flush import FlushPolicy
from .leads import WINDOW_S, LeadAdmission
from .session import Session, SessionState

GATEWAY_LAG_STALE_S = 2.0  # a gateway's lag report counts this long (they come every 50 ms)
DIAGNOSTIC_SAMPLES = 512  # loop periods and codec passes kept for the percentiles in FlowStats


@dataclass(frozen=True, slots=True)
class FlowStats:
    """Flow control at a glance (the `flow` section of /v1/stats)."""

    admission: str  # queue | reject | slots
    capacity_streams: int | None  # streams admission allows now: the measured bound (None: by slots alone)
    engine_capacity_streams: int | None
    codec_capacity_streams: int | None
    demand_streams: int  # admitted sessions that need real-time production (paused slow readers excluded)
    draining_streams: int  # of those, finished generating, last frames still at the codec
    admission_open: bool  # a new session would be admitted now
    gateway_lag_ms: float  # the most any API process's event loop lags (smoothed), as last reported
    predicted_step_ms: float | None
    predicted_codec_pass_ms: float | None
    engine_margin: float | None  # how much faster than real time admission keeps the streams (measured)
    codec_margin: float | None
    paused_codec: int  # sessions waiting for the codec to catch up
    paused_client_buffer: int  # sessions whose client holds max_client_buffer_s
    paused_server_buffer: int  # sessions whose socket has not taken max_server_buffer_s (slow readers)
    max_undecoded_frames: int  # the most frames any live session has generated but not decoded
    peak_undecoded_frames: int  # the most any session ever had, since start (never above the bound)
    in_codec_frames: int  # frames pushed to the codec and not decoded, all sessions
    backpressure_skips: int  # session-steps skipped by backpressure since start
    admission_waits: int  # steps that left a session queued for capacity with a slot free
    refused_requests: int  # requests `admission: reject` turned away for capacity since start (demand too)
    first_push_frames_last: int | None  # the last first push's size, frames
    first_push_frames_mean: float | None
    # The inputs of the admission decision (ARCHITECTURE §5a, scheduler/leads.py), over the last
    # DIAGNOSTIC_SAMPLES loop periods and codec passes, and the last reading of the playing streams.
    limit_reason: str = "slots"  # lead | codec | model | gateway | slots
    loop_period_ms_p50: float | None = None
    loop_period_ms_p99: float | None = None
    codec_pass_ms_p50: float | None = None
    codec_pass_ms_p99: float | None = None
    codec_frames_per_pass: float | None = None
    playing_streams: int | None = None  # streams read (first audio out, generating, past their first 0.5 s)
    keeping_streams: int | None = None  # of those, keeping real time
    falling_streams: int | None = None
    lead_p5_s: float | None = None  # 5th percentile of their leads (audio their clients hold)
    slowest_production: float | None = None  # lowest production among those not ahead, x real time
    codec_busy: float | None = None  # share of the last second the codec spent in passes

    def as_dict(self) -> dict[str, int | float | str | bool | None]:
        return asdict(self)


class FlowControl:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        flush_policy: FlushPolicy,
        batch_limit: int,
        num_slots: int,
        lookahead_samples: int,
        feedback: bool,
        max_frames_per_pass: int,
        max_pass_s: float | None,
    ) -> None:
        if flush_policy.first_frames > config.max_undecoded_frames:
            raise ValueError(f"the first push needs {flush_policy.first_frames} frames, more than "
                             f"scheduler.max_undecoded_frames={config.max_undecoded_frames}")
        self.config = config
        self.feedback = feedback
        self._flush_policy = flush_policy
        self._num_slots = num_slots
        self._lookahead_samples = lookahead_samples
        self.capacity = CapacityModel(max_batch=batch_limit, max_frames_per_pass=max_frames_per_pass,
                                      max_pass_s=max_pass_s, headroom=config.admission_headroom,
                                      margin_floor=config.admission_margin_floor)
        margin = config.admission_headroom if config.admission_headroom is not None else config.admission_margin_floor
        # Growth stops well before the gateway lag that closes admission (max_gateway_lag_ms): a fifth of it.
        self.leads = LeadAdmission(margin=margin, max_client_buffer_s=config.max_client_buffer_s,
                                   max_server_buffer_s=config.max_server_buffer_s,
                                   grow_lag_s=0.2 * config.max_gateway_lag_ms / 1000)
        self._limit: int | None = None  # the leads' limit, cached for one scheduler step
        self._limit_step = -1
        self._loop_periods: deque[float] = deque(maxlen=DIAGNOSTIC_SAMPLES)  # recent loop periods, s
        self._passes: deque[tuple[float, int]] = deque(maxlen=DIAGNOSTIC_SAMPLES)  # recent codec passes (s, frames)
        self._pass_ends: deque[tuple[float, float]] = deque(maxlen=DIAGNOSTIC_SAMPLES)  # (clock at its end, s)
        self._estimate: CapacityEstimate | None = None  # cached for one scheduler step
        self._estimate_step = -1
        self._mean_context = 0.0  # tokens of context per decoded session, smoothed
        self._typical_generated: float | None = None  # tokens a session generates in all, smoothed over finished ones
        # Finished generating, final push still at the codec: still codec demand (feedback only).
        self.draining: dict[str, Session] = {}
        self._skips = 0
        self._waits = 0
        self._refused = 0  # requests `admission: reject` turned away (unmet demand, which lets the limit grow)
        self._peak_undecoded = 0
        self._first_push_last: int | None = None
        self._first_push_total = 0
        self._first_push_count = 0
        self._gateway_lags: dict[int, tuple[float, float]] = {}  # API process -> (lag s, clock when reported)
        self._gateway_lag_s = 0.0  # the largest of them not older than GATEWAY_LAG_STALE_S

    # ------------------------------------------------------------ measurements

    def observe_step(self, batch: int, context: int, prefill: int, seconds: float, *, streams: int,
                     now: float) -> None:
        self.capacity.observe_step(batch, context, prefill, seconds, streams=streams, now=now)
        self._loop_periods.append(seconds)
        if batch:
            per_session = context / batch
            self._mean_context = per_session if not self._mean_context \
                else 0.95 * self._mean_context + 0.05 * per_session

    def observe_codec_pass(self, frames: int, seconds: float, *, now: float | None = None) -> None:
        self.capacity.observe_codec_pass(frames, seconds)
        if frames > 0 and seconds > 0:
            self._passes.append((seconds, frames))
            if now is not None:
                self._pass_ends.append((now, seconds))

    def codec_busy(self, now: float) -> float | None:
        """Share of the last `leads.WINDOW_S` the codec spent in passes (1: they ran back to back); None before
        any pass."""
        ends = self._pass_ends
        if not ends:
            return None
        since = now - WINDOW_S
        busy = sum(min(seconds, end - since) for end, seconds in ends if end > since)
        return busy / WINDOW_S

    def gateway_lag(self, source: int, seconds: float, now: float) -> None:
        """API process `source`'s event loop runs `seconds` late (smoothed by the reporter)."""
        self._gateway_lags[source] = (seconds, now)
        self._gateway_lag_s = max(lag for lag, _ in self._gateway_lags.values())

    @property
    def gateway_behind(self) -> bool:
        limit_ms = self.config.max_gateway_lag_ms
        return self.feedback and limit_ms > 0 and self._gateway_lag_s * 1000 > limit_ms

    # ------------------------------------------------------------ backpressure

    def pause_reason(self, session: Session, now: float) -> str | None:
        """Why a decoding session gets no token this step, or None."""
        config = self.config
        # Only while some frames are at the codec: its feedback is what resumes the session.
        if session.in_codec_frames > 0 and session.undecoded_frames >= config.max_undecoded_frames:
            return "codec"
        if session.server_buffered_s > config.max_server_buffer_s:
            return "server_buffer"
        held = session.client_held_s(now)
        if held is not None and held > config.max_client_buffer_s:
            return "client_buffer"
        return None

    def held_back(self, session: Session, now: float) -> bool:
        """`pause_reason` for the step being planned (counted)."""
        if self.pause_reason(session, now) is None:
            return False
        self._skips += 1
        return True

    def frames_added(self, session: Session) -> None:
        self._peak_undecoded = max(self._peak_undecoded, session.undecoded_frames)

    def pushed(self, session: Session, count: int, now: float, *, final: bool) -> None:
        """`count` frames left for the codec. Without feedback they count as decoded and delivered at once
        (an ideal codec and client: what the audible part of the push adds)."""
        session.record_flush(now)
        if session.buffer.flushes == 1 and not final:
            self._first_push_last = count
            self._first_push_total += count
            self._first_push_count += 1
        if self.feedback:
            return
        policy = self._flush_policy
        after = session.buffer.flushed_frames
        samples = (policy.audible_frames(after, final) - policy.audible_frames(after - count, False)) \
            * SAMPLES_PER_FRAME
        session.record_decoded(count, samples)
        session.record_delivery(now, samples)

    def finished(self, session: Session) -> None:
        """Its final push has left: it stays codec demand until the codec has decoded it."""
        typical = self._typical_generated
        self._typical_generated = float(session.generated) if typical is None \
            else 0.9 * typical + 0.1 * session.generated
        if self.feedback:
            self.draining[session.request_id] = session

    def decoded(self, request_id: str, session: Session | None, frames: int, samples: int, *, final: bool) -> None:
        session = session or self.draining.get(request_id)
        if session is not None:
            session.record_decoded(frames, samples)
        if final:
            self.draining.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Its client left: no more codec work is owed to it."""
        self.draining.pop(request_id, None)

    def expire(self, now: float) -> None:
        for request_id, session in list(self.draining.items()):
            # A final result that never came (should not happen) must not hold capacity forever.
            assert session.admitted_s is not None
            if now - session.admitted_s > self.config.session_timeout_s:
                del self.draining[request_id]
        if self._gateway_lags:
            # An API process that stopped reporting has exited (its sessions were cancelled): forget it.
            stale = [s for s, (_, at) in self._gateway_lags.items() if now - at > GATEWAY_LAG_STALE_S]
            for source in stale:
                del self._gateway_lags[source]
            if stale:
                self._gateway_lag_s = max((lag for lag, _ in self._gateway_lags.values()), default=0.0)

    # ------------------------------------------------------------ admission

    def demand(self, admitted: Collection[Session]) -> int:
        """Streams that need real-time production: a slow reader whose socket has not taken its
        server-side buffer consumes no engine steps and does not count; a draining one does."""
        limit = self.config.max_server_buffer_s
        return len(self.draining) + sum(1 for s in admitted if s.server_buffered_s <= limit)

    def admission_limit(self, admitted: Collection[Session], step: int, now: float) -> int | None:
        """Streams admission allows now (`leads.py`: from what the playing streams experience, the cost model
        only until they can be read); None: by slots alone (`admission: slots`, or no feedback). While a
        gateway lags, no more than run now."""
        if not self.feedback or self.config.admission == "slots":
            return None
        limit = self._lead_limit(admitted, step, now)
        return min(limit, self.demand(admitted)) if self.gateway_behind else limit

    def reject_limit(self, admitted: Collection[Session], step: int, now: float) -> int | None:
        """`admission: reject` refuses past the limit the playing streams support; before they can be read,
        past the measured capacity only (while a cold server ramps up to what it has not measured yet,
        requests wait). While a gateway lags, it refuses."""
        if not self.feedback or self.config.admission != "reject":
            return None
        limit = self._lead_limit(admitted, step, now)
        measured = limit if self.leads.reason in ("lead", "codec") else self.estimate(admitted, step).measured_streams
        if self.gateway_behind:
            return self.demand(admitted) if measured is None else min(measured, self.demand(admitted))
        return measured

    def _lead_limit(self, admitted: Collection[Session], step: int, now: float) -> int:
        if self._limit is None or self._limit_step != step:
            self._limit = self.leads.update(now, admitted, demand=self.demand(admitted),
                                            model_limit=self.estimate(admitted, step).max_streams,
                                            slots=self._num_slots, codec_busy=self.codec_busy(now),
                                            gateway_lag_s=self._gateway_lag_s, refused_total=self._refused)
            self._limit_step = step
        return self._limit

    @property
    def limit_reason(self) -> str:
        """What bounds admission now: lead (the playing streams' readings), codec (the codec's busy share held or
        backed it off), model (the cost model's prediction, before any stream could be read), gateway (an API
        process lags), slots (admission by free slots)."""
        if not self.feedback or self.config.admission == "slots":
            return "slots"
        if self.gateway_behind:
            return "gateway"
        return self.leads.reason

    def admission_waited(self) -> None:
        self._waits += 1

    def admission_refused(self) -> None:
        self._refused += 1

    def estimate(self, admitted: Collection[Session], step: int) -> CapacityEstimate:
        if self._estimate is None or self._estimate_step != step:
            self._estimate = self.capacity.estimate(mean_context=self.planning_context(admitted),
                                                    streams=len(admitted), limit=self._num_slots)
            self._estimate_step = step
        return self._estimate

    def planning_context(self, admitted: Collection[Session]) -> float:
        """Context per admitted stream at the peak of their total over the rest of their lives (see the
        module docstring); the measured mean while nothing has finished yet to say how long streams run."""
        typical = self._typical_generated
        if typical is None or not admitted:
            return self._mean_context
        # (tokens until it ends, context now): every stream grows a token a step until it ends.
        lives = sorted((max(s.generated, min(s.token_limit, typical)) - s.generated, s.prompt_len + s.generated)
                       for s in admitted)
        alive = len(lives)
        total_now = sum(context for _, context in lives)
        peak = total_now
        # The total rises while every stream grows and drops when one ends: its peaks are just before the ends.
        for remaining, context in lives:
            peak = max(peak, total_now + alive * remaining)
            total_now -= context
            alive -= 1
        return max(peak / len(lives), self._mean_context)

    # ------------------------------------------------------------ first push

    def first_push_frames(self, streams: int) -> int:
        """Frames the first push waits for, so that its audible part covers `first_chunk_safety` times
        the wait for the next frame at the measured load (7 token intervals + the codec's latency).
        With headroom this is the policy's minimum; under load it grows by a frame or two."""
        interval = self.capacity.token_interval_s(streams, self._mean_context)
        codec = self.capacity.codec_latency_s()
        wait_s = None if interval is None or codec is None else (
            self.config.first_chunk_safety * (TOKENS_PER_FRAME * interval + codec))
        return self._flush_policy.first_push_frames(wait_s, self._lookahead_samples, self.config.max_undecoded_frames)

    # ------------------------------------------------------------ stats

    def stats(self, admitted: Collection[Session], now: float, step: int) -> FlowStats:
        estimate = self.estimate(admitted, step)
        limit = self.admission_limit(admitted, step, now)
        reading = self.leads.last
        periods = sorted(self._loop_periods)
        passes = sorted(s for s, _ in self._passes)
        reasons = {"codec": 0, "client_buffer": 0, "server_buffer": 0}
        max_undecoded = in_codec = 0
        for session in admitted:
            reason = self.pause_reason(session, now) if session.state is SessionState.DECODING else None
            if reason is not None:
                reasons[reason] += 1
            max_undecoded = max(max_undecoded, session.undecoded_frames)
            in_codec += session.in_codec_frames
        demand = self.demand(admitted)
        return FlowStats(
            admission=self.config.admission,
            capacity_streams=limit,
            engine_capacity_streams=estimate.engine_streams,
            codec_capacity_streams=estimate.codec_streams,
            demand_streams=demand,
            draining_streams=len(self.draining),
            admission_open=limit is None or demand < limit,
            gateway_lag_ms=round(self._gateway_lag_s * 1000, 1),
            predicted_step_ms=estimate.step_ms,
            predicted_codec_pass_ms=estimate.codec_pass_ms,
            engine_margin=estimate.engine_margin,
            codec_margin=estimate.codec_margin,
            paused_codec=reasons["codec"],
            paused_client_buffer=reasons["client_buffer"],
            paused_server_buffer=reasons["server_buffer"],
            max_undecoded_frames=max_undecoded,
            peak_undecoded_frames=self._peak_undecoded,
            in_codec_frames=in_codec,
            backpressure_skips=self._skips,
            admission_waits=self._waits,
            refused_requests=self._refused,
            first_push_frames_last=self._first_push_last,
            first_push_frames_mean=round(self._first_push_total / self._first_push_count, 3)
            if self._first_push_count else None,
            limit_reason=self.limit_reason,
            loop_period_ms_p50=_percentile_ms(periods, 0.5),
            loop_period_ms_p99=_percentile_ms(periods, 0.99),
            codec_pass_ms_p50=_percentile_ms(passes, 0.5),
            codec_pass_ms_p99=_percentile_ms(passes, 0.99),
            codec_frames_per_pass=round(sum(f for _, f in self._passes) / len(self._passes), 2)
            if self._passes else None,
            playing_streams=None if reading is None else reading.playing,
            keeping_streams=None if reading is None else reading.keeping,
            falling_streams=None if reading is None else reading.falling,
            lead_p5_s=None if reading is None or reading.lead_p5_s is None else round(reading.lead_p5_s, 3),
            slowest_production=None if reading is None or reading.slowest is None else round(reading.slowest, 3),
            codec_busy=None if reading is None or reading.codec_busy is None else round(reading.codec_busy, 3),
        )


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None
