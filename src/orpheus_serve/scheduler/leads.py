"""Admission from what the admitted streams experience (ARCHITECTURE §5a): their production and their audio lead.

Every `TICK_S` the controller reads each playing stream (first audio out, still generating, not a slow
reader, out of its first `MIN_AGE_S`):

- its **lead**: audio its client holds unplayed (`Session.client_held_s`);
- its **production**: audio generated per second over the last `WINDOW_S`, as a multiple of real time
  (tokens / 82.03 per second: a token is 1/7 of an 85.3 ms frame). Production counts what the engine gave
  the stream, so the engine's pace, the codec's (a stream whose frames wait for the codec is held back,
  and produces less) and every host cost in between show in it.

The **codec's load** is read beside them: the share of the last second it spent in passes. A codec
working back to back is full whatever the streams' production says (its backlog holds a stream back
only once it reaches `max_undecoded_frames`, a second of audio later), so past `CODEC_BUSY_HOLD`
admission holds (not even the prediction raises the limit), and past `CODEC_BUSY_BACK_OFF` it backs off
(reason `codec`). This reading needs no stream old enough to read, and it is applied whether or not there
is one: on a host whose codec is the bottleneck (SNAC on a CPU) short utterances spend most of their lives
younger than `MIN_AGE_S`, so the prediction would otherwise rule while the codec runs back to back.

A stream **keeps real time** when its client's buffer is nearly full (it is ahead: flow control holds it),
or when its lead, carried forward `HORIZON_S` at its production less the margin, stays above
`LEAD_FLOOR_S`, and its client has not run dry since the last reading:

    lead + (production - (1 + margin)) * HORIZON_S >= LEAD_FLOOR_S

A young stream with 200 ms in hand must be produced about `1 + margin` times real time; one holding a
second and a half can dip well under real time for a moment (flow control holds a stream back while its
codec backlog is deep, or its client's buffer full) without being at risk. The others are **falling**.
(A small lead alone is no alarm: audio arrives in pushes of two frames, so a stream running just ahead of
real time holds anywhere between 0 and 170 ms.)

The limit (streams admission allows) moves on those readings, never on a prediction:

- **grow** while at most `GROW_FALL_SHARE` of the streams fall, the codec is busy under
  `CODEC_BUSY_HOLD`, the API processes keep up (event-loop lag under `grow_lag_s`: past it the host that
  hands audio to the sockets is the limit, which production does not show) and demand fills the limit
  (the streams reach it, or `admission: reject` turned a request away since the last reading: refused
  requests are demand too, or a server that refuses would never see itself full): to what the median
  producer's spare pace says the engine carries (`demand * median / (1 + margin)`) and the codec's spare
  time says it carries (`demand * CODEC_BUSY_HOLD / codec_busy`), at least one more, at most `GROW_FACTOR` at a time and once per `GROW_EVERY_S`, so each rise is measured
  before the next. Far from every bound (the slowest stream produced `SLOW_START_PACE` times what it needs,
  the codec busy under half of `CODEC_BUSY_HOLD`) a rise may double the limit (`SLOW_START_FACTOR`): a
  cold or idle server's prediction can be a small fraction of what it carries, and rising 1.25x at a time
  from it turns requests away (`reject`) or keeps them waiting for seconds;
- **hold** (admit nobody more) while more fall, up to `fall_share` of them, or while the gateway lags or
  the codec is busy (whether or not any stream can be read);
- **back off** when more fall: to `demand * median production / (1 + margin)` where production fell short,
  else (clients ran dry while production kept up) to the share of streams keeping real time, never below
  half and at most 95% of demand; for a codec busy past `CODEC_BUSY_BACK_OFF` (whether or not any stream
  can be read), to `demand * CODEC_BUSY_HOLD / codec_busy`; once per `WINDOW_S`, so a back-off is measured
  before the next. Streams already playing are never cut: fewer are admitted as they end.

The limit never drops below the streams keeping real time now: admission never holds back what the
pipeline is serving well. The one exception is a codec past `CODEC_BUSY_BACK_OFF`: it is over capacity
now, and the streams' leads only hide that while its queue grows. Before any stream has played long enough
to be read (a cold server, or an idle one) the cost model's prediction may raise the limit (`model`): it
predicts the first ramp, and never pulls the limit below what the last readings allowed. Pure Python; the
scheduler calls it under its lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, replace

from ..token_format import TOKENS_PER_SECOND_REALTIME
from .session import Session, SessionState

TICK_S = 0.1  # readings at most this often (a plan comes every few ms)
WINDOW_S = 1.0  # production is measured over this much of a stream's recent life
MIN_AGE_S = 0.5  # a stream is read once it has played this long (its first tokens were prioritised)
GROW_EVERY_S = 0.5
GROW_FACTOR = 1.25
# Slow start: while the slowest stream produces at least SLOW_START_PACE times what it needs (with the margin)
# and the codec is under half of CODEC_BUSY_HOLD, the limit may double at a time instead.
SLOW_START_PACE = 2.0
SLOW_START_FACTOR = 2.0
AHEAD_SHARE = 0.8  # a client holding this share of max_client_buffer_s is ahead (flow control holds it back)
MAX_BACK_OFF = 0.95  # a back-off admits at most this share of the streams running
HORIZON_S = 3.0  # a stream's lead is carried forward this far at its production (module docstring)
LEAD_FLOOR_S = 0.1
GROW_FALL_SHARE = 0.03  # falling streams (a share of those read) that still let the limit grow
CODEC_BUSY_HOLD = 0.8  # the codec busy this share of the time admits nobody more
CODEC_BUSY_BACK_OFF = 0.95  # and this share backs off


@dataclass(frozen=True, slots=True)
class LeadReading:
    playing: int  # streams read
    keeping: int  # of those, keeping real time (ahead included)
    falling: int
    ahead: int  # clients whose buffer is nearly full
    slowest: float | None  # lowest production of the streams not ahead, x real time
    median: float | None
    lead_p5_s: float | None  # 5th percentile of the read streams' leads
    codec_busy: float | None = None  # share of the last second the codec spent in passes


class LeadAdmission:
    def __init__(self, *, margin: float, max_client_buffer_s: float, max_server_buffer_s: float,
                 fall_share: float = 0.05, grow_lag_s: float = 0.03) -> None:
        self.margin = margin
        self.grow_lag_s = grow_lag_s
        self.ahead_s = AHEAD_SHARE * max_client_buffer_s
        self.max_server_buffer_s = max_server_buffer_s
        self.fall_share = fall_share
        self.limit: int | None = None  # None until the first reading or prediction
        self.reason = "model"  # model | lead | codec (what set the limit last)
        self.last: LeadReading | None = None
        self._last_tick = -math.inf
        self._last_grow = -math.inf
        self._last_back_off = -math.inf
        self._refused_seen = 0  # `refused_total` at the last reading
        # Per stream: (clock, tokens generated) readings over the last window, and the stalls seen.
        self._history: dict[str, deque[tuple[float, int]]] = {}
        self._stalls: dict[str, int] = {}

    def update(self, now: float, admitted: Collection[Session], *, demand: int, model_limit: int,
               slots: int, codec_busy: float | None = None, gateway_lag_s: float = 0.0,
               refused_total: int = 0) -> int:
        """The limit now. `demand`: the streams that need real-time production; `model_limit`: the cost model's
        prediction (used only while nothing can be read); `slots`: the ceiling; `codec_busy`: the codec's share
        of the last second in passes; `gateway_lag_s`: how late the most lagging API process's loop runs;
        `refused_total`: requests refused for capacity so far (a count that only grows)."""
        if now - self._last_tick >= TICK_S:
            self._last_tick = now
            self.last = replace(self._read(now, admitted), codec_busy=codec_busy)
            refused, self._refused_seen = refused_total > self._refused_seen, refused_total
            self._decide(now, self.last, demand, model_limit, gateway_lag_s, refused)
        if self.limit is None:
            self.limit = model_limit
        self.limit = max(1, min(self.limit, slots))
        return self.limit

    # ------------------------------------------------------------ readings

    def _read(self, now: float, admitted: Collection[Session]) -> LeadReading:
        live: set[str] = set()
        leads: list[float] = []
        rates: list[float] = []
        keeping = falling = ahead = 0
        for session in admitted:
            if (session.state is not SessionState.DECODING or session.first_flush_at is None
                    or session.server_buffered_s > self.max_server_buffer_s):
                continue
            rid = session.request_id
            live.add(rid)
            history = self._history.setdefault(rid, deque())
            history.append((now, session.generated))
            while len(history) > 2 and history[1][0] <= now - WINDOW_S:
                history.popleft()
            stalled = session.stalls > self._stalls.get(rid, session.stalls)
            self._stalls[rid] = session.stalls
            then, generated_then = history[0]
            if now - session.first_flush_at < MIN_AGE_S or now - then < MIN_AGE_S / 2:
                continue  # too young to read
            lead = session.client_held_s(now) or 0.0
            leads.append(lead)
            if lead >= self.ahead_s and not stalled:
                ahead += 1
                keeping += 1
                continue
            rate = (session.generated - generated_then) / (now - then) / TOKENS_PER_SECOND_REALTIME
            rates.append(rate)
            if not stalled and lead + (rate - 1.0 - self.margin) * HORIZON_S >= LEAD_FLOOR_S:
                keeping += 1
            else:
                falling += 1
        for rid in [r for r in self._history if r not in live]:
            del self._history[rid]
            self._stalls.pop(rid, None)
        rates.sort()
        leads.sort()
        return LeadReading(
            playing=len(leads), keeping=keeping, falling=falling, ahead=ahead,
            slowest=rates[0] if rates else None, median=rates[len(rates) // 2] if rates else None,
            lead_p5_s=leads[int(0.05 * (len(leads) - 1))] if leads else None)

    # ------------------------------------------------------------ decisions

    def _decide(self, now: float, reading: LeadReading, demand: int, model_limit: int, lag_s: float,
                refused: bool = False) -> None:
        codec = reading.codec_busy or 0.0
        if reading.playing == 0:
            # Nothing to read (cold, idle, or every stream too young): the prediction may ramp up again, but not
            # below what the last readings allowed.
            limit, floor, self.reason = max(model_limit, self.limit or 0), 1, "model"
        else:
            limit, floor, self.reason = self._from_streams(now, reading, demand, model_limit, lag_s, refused), \
                reading.keeping, "lead"
        # The codec's load is a reading of its own, whether or not any stream is old enough to be read: short
        # utterances on a host whose codec is the bottleneck (SNAC on a CPU) spend most of their lives too young
        # to read, while the codec runs back to back.
        if codec > CODEC_BUSY_HOLD:  # nobody more: not even the prediction raises the limit
            held = min(limit, demand, limit if self.limit is None else self.limit)
            if codec > CODEC_BUSY_BACK_OFF:
                if now - self._last_back_off >= WINDOW_S:
                    held = min(held, math.floor(demand * CODEC_BUSY_HOLD / codec))
                    self._last_back_off = now
                # A codec past its back-off is over capacity now: the streams' leads only hide it for a while
                # (each push waits behind the others), so the streams keeping real time are no floor.
                floor = 1
            if held < limit:
                limit, self.reason = held, "codec"
        self.limit = max(limit, floor, 1)

    def _from_streams(self, now: float, reading: LeadReading, demand: int, model_limit: int, lag_s: float,
                      refused: bool) -> int:
        """The limit the playing streams' readings allow (the codec's load is applied after)."""
        limit = self.limit if self.limit is not None else model_limit
        codec = reading.codec_busy or 0.0
        if reading.falling > self.fall_share * reading.playing:
            if now - self._last_back_off >= WINDOW_S:
                if reading.median is not None and reading.median < 1 + self.margin:  # production fell short
                    share = min(MAX_BACK_OFF, reading.median / (1 + self.margin))
                else:  # production kept up, clients ran dry: what reaches them is the limit
                    share = min(MAX_BACK_OFF, max(0.5, reading.keeping / reading.playing))
                self._last_back_off = now
                return min(limit, math.floor(demand * share))
            return min(limit, demand)
        if reading.falling > int(GROW_FALL_SHARE * reading.playing) or codec > CODEC_BUSY_HOLD \
                or lag_s > self.grow_lag_s:
            return min(limit, demand)
        if (demand >= limit or refused) and now - self._last_grow >= GROW_EVERY_S:
            demand = max(demand, limit)  # a refusal: demand was at the limit when it came
            target = limit + max(1, math.ceil(0.1 * limit)) if reading.median is None \
                else math.floor(demand * reading.median / (1 + self.margin))
            if codec > 0:
                target = min(target, math.floor(demand * CODEC_BUSY_HOLD / codec))
            factor = GROW_FACTOR
            if (reading.slowest is not None and reading.slowest >= SLOW_START_PACE * (1 + self.margin)
                    and codec < CODEC_BUSY_HOLD / 2):
                factor = SLOW_START_FACTOR  # far from every bound: a cold server's ramp
            self._last_grow = now
            return min(max(target, limit + 1), math.ceil(limit * factor))
        return limit
