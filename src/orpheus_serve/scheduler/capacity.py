"""A running measure of what the pipeline sustains, for admission and first-chunk sizing (ARCHITECTURE §5a).

Two cost models are fitted online from what the engine core and the codec
worker observe, by exponentially weighted least squares (old observations fade
with `forget` per observation, so the model follows a warming GPU or a noisy
neighbour):

    engine loop period  step_s = a + b * batch + c * context_tokens + d * prefill_tokens
    codec pass          pass_s = e + f * frames

A stream runs dry when its steps are slow for a while, not on average, so the
step time admission plans with is the fit plus its jitter: the spread of the
measured periods around it (the interpreter lock, the gateway's bursts, a noisy
neighbour), taken over a frame's worth of consecutive steps. A stream needs 7
steps per frame and its client holds at least a frame, so a single slow period
that the next ones make up for costs nothing; a run of slow periods does, and
the mean error over 7 steps keeps all of such a run while it averages away
lone spikes (by up to √7 when they are independent).

`step_s` is the whole period of the engine core loop around one step
(schedule, engine step, update, dispatch): what a stream really waits between
two of its tokens. One real-time stream needs a frame (7 tokens) every
`FRAME_SECONDS` (85.3 ms): 82 tokens/s.

`max_streams(mean_context)` is the largest number of streams that all stay
real-time with a margin to spare:

    engine:  with n streams and at most B per step, each stream gets a token
             every fit(min(n, B)) * ceil(n / B) seconds, and needs 7 of them,
             times (1 + engine margin), within FRAME_SECONDS;
    codec:   n streams need n / FRAME_SECONDS frames per second; a pass of at
             most F frames (fewer if pass_s(F) would pass `max_pass_s`)
             decodes F / pass_s(F) frames per second, divided by
             (1 + codec margin).

The margins come from the measured spread, not a fixed allowance: each is
`z` times the fit's jitter (for the engine, over a frame's 7 periods) relative
to the predicted period or pass, and at least `margin_floor`:

    engine margin = max(margin_floor, z * jitter(loop periods over 7) / fit(load))
    codec margin  = max(margin_floor, z * jitter(passes) / pass_s(F))

With z = 2 a frame comes late only where the spread is more than two of its
standard deviations (about 2% of frames if it were normal), and the client's
buffer covers those; a quiet machine gets the floor and admits up to it, a
noisy one keeps what its noise costs. `headroom` set to a number fixes both
margins instead (`scheduler.admission_headroom`).

Extrapolation is kept honest: the fit only knows the loads it has seen, and a
new stream's full cost shows only once its audio flows (its first tokens are
prefill and priority steps; its delivery loads the gateway a moment later).
So admission never runs more than `probe_factor` past the most streams held
for at least `settle_s` (a cold deployment ramps up as it measures, 1.5x per
half second by default, instead of admitting 200 streams on the strength of
one measurement).

Pure Python and numpy; the scheduler owns one and the engine core and codec
worker feed it through the scheduler's lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..token_format import FRAME_SECONDS, TOKENS_PER_FRAME

# Feature scales: keep the normal equations well conditioned (batch ~1..512, context ~1e2..1e6 tokens).
_CTX_SCALE = 1e-4
_PREFILL_SCALE = 1e-2
_RIDGE = 1e-6  # keeps the solve defined before the features vary; negligible once they do
_MIN_OBSERVATIONS = 8
_SOLVE_EVERY = 8  # observations between two solves: one per step would cost the engine core ~30 us a step


class _OnlineLinearFit:
    """Exponentially weighted least squares with non-negative slopes, and the spread of what it
    does not explain (`jitter`: the root mean square of its one-step-ahead errors, each averaged
    over `jitter_window` consecutive observations)."""

    def __init__(self, n_features: int, forget: float, *, jitter_window: int = 1) -> None:
        self._forget = forget
        self._xtx = np.zeros((n_features, n_features))
        self._xty = np.zeros(n_features)
        self._weight = 0.0
        self.observations = 0
        self._coef: np.ndarray | None = None
        self._unsolved = 0  # observations added since the last solve
        self._jitter_window = jitter_window
        self._window_forget = forget**jitter_window  # the same fading per observation as the fit's
        self._window_error = 0.0  # errors summed over the window being filled
        self._window_count = 0
        self._square_error = 0.0  # exponentially weighted mean of squared window-mean errors

    @property
    def jitter(self) -> float:
        return math.sqrt(self._square_error)

    def add(self, x: np.ndarray, y: float) -> None:
        coef = self.coef
        if coef is not None:
            self._window_error += y - float(coef @ x)
            self._window_count += 1
            if self._window_count == self._jitter_window:
                mean = self._window_error / self._jitter_window
                self._square_error = self._window_forget * self._square_error + (1 - self._window_forget) * mean * mean
                self._window_error = 0.0
                self._window_count = 0
        self._xtx *= self._forget
        self._xty *= self._forget
        self._weight = self._weight * self._forget + 1.0
        self._xtx += np.outer(x, x)
        self._xty += x * y
        self.observations += 1
        self._unsolved += 1

    @property
    def coef(self) -> np.ndarray | None:
        if self.observations < _MIN_OBSERVATIONS:
            return None
        if self._coef is None or self._unsolved >= _SOLVE_EVERY:
            self._coef = self._solve()
            self._unsolved = 0
        return self._coef

    def _solve(self) -> np.ndarray:
        n = self._xty.shape[0]
        active = list(range(n))
        coef = np.zeros(n)
        # Drop slopes that come out negative (noise on a feature that barely varied) and refit:
        # a step never gets cheaper with more work.
        for _ in range(n):
            idx = np.array(active)
            a = self._xtx[np.ix_(idx, idx)] + _RIDGE * self._weight * np.eye(len(idx))
            sol = np.linalg.solve(a, self._xty[idx])
            negative = [i for i, v in zip(active, sol, strict=True) if i > 0 and v < 0]
            if not negative:
                coef[:] = 0.0
                coef[idx] = sol
                break
            active = [i for i in active if i not in negative]
        coef[0] = max(coef[0], 0.0)
        return coef


@dataclass(frozen=True, slots=True)
class CapacityEstimate:
    max_streams: int  # streams admission allows now (the measured bound, or the probe limit past it)
    measured_streams: int | None  # the measured bound alone (None: nothing measured yet)
    engine_streams: int | None  # the engine's bound alone
    codec_streams: int | None  # the codec's bound alone
    step_ms: float | None  # predicted loop period at the current load
    codec_pass_ms: float | None  # predicted pass at the current load
    engine_margin: float | None = None  # the margins admission plans with now (module docstring)
    codec_margin: float | None = None


class CapacityModel:
    def __init__(
        self,
        *,
        max_batch: int,
        max_frames_per_pass: int,
        max_pass_s: float | None = None,
        headroom: float | None = None,
        margin_floor: float = 0.05,
        margin_z: float = 2.0,
        forget: float = 0.995,
        probe_factor: float = 1.5,
        probe_min: int = 4,
        settle_s: float = 0.5,
    ) -> None:
        self.max_batch = max_batch
        self.max_frames_per_pass = max_frames_per_pass
        self.max_pass_s = max_pass_s
        self.headroom = headroom  # a fixed margin; None: measured (module docstring)
        self.margin_floor = margin_floor
        self.margin_z = margin_z
        self.probe_factor = probe_factor
        self.probe_min = probe_min
        self.settle_s = settle_s
        self._engine = _OnlineLinearFit(4, forget, jitter_window=TOKENS_PER_FRAME)
        self._codec = _OnlineLinearFit(2, forget)
        self._max_streams_seen = 0  # the most streams held for settle_s at least
        self._recent_loads: deque[tuple[float, int]] = deque()  # (time, streams), a sliding window's minima
        self._recent_pass_s: float | None = None

    # ------------------------------------------------------------ observations

    def observe_step(self, batch: int, context_tokens: int, prefill_tokens: int, seconds: float, *,
                     streams: int, now: float) -> None:
        """One loop period: `batch` sessions decoded over `context_tokens` of context in all,
        `prefill_tokens` prompt ids prefilled, while `streams` sessions held slots (at clock `now`)."""
        if seconds <= 0 or batch + prefill_tokens <= 0:
            return
        self._engine.add(self._step_features(batch, context_tokens, prefill_tokens), seconds)
        self._observe_load(streams, now)

    def _observe_load(self, streams: int, now: float) -> None:
        """Keep the most streams held for settle_s: the minimum over a sliding window (monotone deque)."""
        loads = self._recent_loads
        while loads and loads[-1][1] > streams:
            loads.pop()
        loads.append((now, streams))
        while len(loads) > 1 and loads[1][0] <= now - self.settle_s:
            loads.popleft()
        if loads[0][0] <= now - self.settle_s or self.settle_s <= 0:
            self._max_streams_seen = max(self._max_streams_seen, loads[0][1])

    def observe_codec_pass(self, frames: int, seconds: float) -> None:
        if seconds <= 0 or frames <= 0:
            return
        self._codec.add(np.array([1.0, float(frames)]), seconds)
        self._recent_pass_s = seconds if self._recent_pass_s is None else 0.8 * self._recent_pass_s + 0.2 * seconds

    # ------------------------------------------------------------ predictions

    @staticmethod
    def _step_features(batch: int, context_tokens: int, prefill_tokens: int) -> np.ndarray:
        return np.array([1.0, float(batch), context_tokens * _CTX_SCALE, prefill_tokens * _PREFILL_SCALE])

    def fit_step_s(self, batch: int, mean_context: float, prefill_tokens: int = 0) -> float | None:
        """Predicted loop period."""
        coef = self._engine.coef
        if coef is None:
            return None
        return float(coef @ self._step_features(batch, int(batch * mean_context), prefill_tokens))

    def step_s(self, batch: int, mean_context: float, prefill_tokens: int = 0) -> float | None:
        """Predicted loop period, plus the jitter the fit does not explain (a slow run of periods)."""
        fit = self.fit_step_s(batch, mean_context, prefill_tokens)
        return None if fit is None else fit + self._engine.jitter

    def engine_margin(self, fit_step_s: float) -> float:
        """How much faster than real time the streams must run, for a predicted period of `fit_step_s`."""
        if self.headroom is not None:
            return self.headroom
        return max(self.margin_floor, self.margin_z * self._engine.jitter / max(fit_step_s, 1e-9))

    def codec_margin(self, pass_s: float) -> float:
        if self.headroom is not None:
            return self.headroom
        return max(self.margin_floor, self.margin_z * self._codec.jitter / max(pass_s, 1e-9))

    def pass_s(self, frames: int) -> float | None:
        coef = self._codec.coef
        if coef is None:
            return None
        return float(coef[0] + coef[1] * frames)

    def token_interval_s(self, streams: int, mean_context: float) -> float | None:
        """Seconds between two tokens of one stream when `streams` share the engine."""
        streams = max(streams, 1)
        batch = min(streams, self.max_batch)
        step = self.step_s(batch, mean_context)
        if step is None:
            return None
        return step * math.ceil(streams / self.max_batch)

    def codec_latency_s(self) -> float | None:
        """Push -> audio: the pass in progress, then the one that takes the push."""
        if self._recent_pass_s is None:
            return None
        return 2.0 * self._recent_pass_s

    def _engine_ok(self, streams: int, mean_context: float) -> bool | None:
        streams = max(streams, 1)
        fit = self.fit_step_s(min(streams, self.max_batch), mean_context)
        if fit is None:
            return None
        interval = fit * math.ceil(streams / self.max_batch)
        return interval * TOKENS_PER_FRAME * (1.0 + self.engine_margin(fit)) <= FRAME_SECONDS

    def _codec_streams(self) -> int | None:
        coef = self._codec.coef
        if coef is None:
            return None
        frames = self.max_frames_per_pass
        if self.max_pass_s is not None and coef[1] > 0:  # the worker keeps passes within max_pass_s
            frames = max(1, min(frames, int((self.max_pass_s - coef[0]) / coef[1])))
        seconds = self.pass_s(frames)
        if seconds is None or seconds <= 0:
            return None
        frames_per_s = frames / seconds
        return int(frames_per_s * FRAME_SECONDS / (1.0 + self.codec_margin(seconds)))

    def _engine_streams(self, mean_context: float, limit: int) -> int | None:
        if self._engine_ok(1, mean_context) is None:
            return None
        lo, hi = 0, limit  # largest n in [0, limit] that stays real-time (monotone in n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._engine_ok(mid, mean_context):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def probe_limit(self) -> int:
        """How far past the measured range admission may go before it has measured more."""
        return max(self.probe_min, int(self._max_streams_seen * self.probe_factor) + 1)

    def estimate(self, *, mean_context: float, streams: int, limit: int) -> CapacityEstimate:
        """`streams`: the current load (for the predicted step and pass); `limit`: the slots."""
        engine = self._engine_streams(mean_context, limit)
        codec = self._codec_streams()
        # A part not measured yet does not bound anything, but nothing is admitted far past the load
        # measured so far. Never below one: a pipeline too slow for even one real-time stream still
        # serves one at a time.
        measured = max(1, min(b for b in (engine, codec, limit) if b is not None))
        max_streams = measured
        if max_streams > self._max_streams_seen:
            max_streams = min(max_streams, self.probe_limit())
        step = self.step_s(min(max(streams, 1), self.max_batch), mean_context)
        fit = self.fit_step_s(min(max(streams, 1), self.max_batch), mean_context)
        frames = min(self.max_frames_per_pass, max(1, round(streams * (self._recent_pass_s or 0) / FRAME_SECONDS)))
        pass_s = self.pass_s(frames)
        return CapacityEstimate(
            max_streams=max_streams,
            measured_streams=measured if engine is not None or codec is not None else None,
            engine_streams=engine,
            codec_streams=codec,
            step_ms=None if step is None else round(step * 1000, 3),
            codec_pass_ms=None if pass_s is None else round(pass_s * 1000, 3),
            engine_margin=None if fit is None else round(self.engine_margin(fit), 4),
            codec_margin=None if pass_s is None else round(self.codec_margin(pass_s), 4),
        )
