"""Per-stream measurements (ARCHITECTURE §8) computed from what a client saw.

A client records when it sent the request, and the arrival time and size of
every audio chunk. From that:
- TTFB: request sent -> first audio byte received.
- Underrun: playback starts at the first byte and consumes audio in real time;
  an underrun is a chunk that arrives after the audio received before it ran
  out. A stream with no underrun is real-time.
- RTF: (last byte - request sent) / audio duration.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

BYTES_PER_SECOND = 24000 * 2  # 16-bit mono PCM at 24 kHz


@dataclass(slots=True)
class StreamRecord:
    protocol: str
    sent_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, PCM bytes)
    status: str = "ok"  # ok | rejected | error
    error: str | None = None
    text_chars: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.chunks)

    @property
    def audio_bytes(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def audio_seconds(self) -> float:
        return self.audio_bytes / BYTES_PER_SECOND

    @property
    def ttfb_s(self) -> float | None:
        return self.chunks[0][0] - self.sent_s if self.chunks else None

    @property
    def wall_s(self) -> float:
        return (self.chunks[-1][0] - self.sent_s) if self.chunks else 0.0

    @property
    def rtf(self) -> float | None:
        return self.wall_s / self.audio_seconds if self.audio_seconds > 0 else None

    def underruns(self) -> tuple[int, float]:
        """(count, total stall seconds) for a player that starts at the first byte."""
        if not self.chunks:
            return 0, 0.0
        t0 = self.chunks[0][0]
        buffered_until = t0  # wall time at which the audio received so far runs out
        count, stall = 0, 0.0
        for t, n in self.chunks:
            if t > buffered_until + 1e-4:
                count += 1
                stall += t - buffered_until
                buffered_until = t  # playback resumes when the chunk arrives
            buffered_until += n / BYTES_PER_SECOND
        return count, stall

    @property
    def realtime(self) -> bool:
        return self.ok and self.underruns()[0] == 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def concurrent_streams(records: list[StreamRecord]) -> tuple[int, float]:
    """(peak, time-weighted mean) of streams playing at once, each from its first to its last chunk;
    the mean is over the time at least one was playing."""
    edges = sorted([(r.chunks[0][0], 1) for r in records if r.chunks]
                   + [(r.chunks[-1][0], -1) for r in records if r.chunks], key=lambda e: (e[0], e[1]))
    peak = playing = 0
    area = busy = 0.0
    last = None
    for t, delta in edges:
        if last is not None and playing > 0:
            area += playing * (t - last)
            busy += t - last
        playing += delta
        peak = max(peak, playing)
        last = t
    return peak, (area / busy if busy > 0 else 0.0)


def summarize(records: list[StreamRecord], wall_s: float) -> dict[str, float | int | None]:
    ok = [r for r in records if r.ok]
    ttfb = [r.ttfb_s for r in ok if r.ttfb_s is not None]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    audio = sum(r.audio_seconds for r in ok)
    under = [r.underruns() for r in ok]
    n = len(records)
    started = [r for r in records if r.chunks]  # got audio, whether or not they then completed
    peak, mean = concurrent_streams(ok)

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    return {
        "requests": n,
        "succeeded": len(ok),
        "rejected": sum(r.status == "rejected" for r in records),
        "errors": sum(r.status == "error" for r in records),
        "success_rate": round(len(ok) / n, 4) if n else None,
        "rejection_rate": round(sum(r.status == "rejected" for r in records) / n, 4) if n else None,
        "ttfb_p50_ms": ms(percentile(ttfb, 0.5)),
        "ttfb_p95_ms": ms(percentile(ttfb, 0.95)),
        "ttfb_p99_ms": ms(percentile(ttfb, 0.99)),
        "rtf_mean": round(statistics.fmean(rtf), 4) if rtf else None,
        "rtf_p95": round(percentile(rtf, 0.95), 4) if rtf else None,
        "underrun_events": sum(c for c, _ in under),
        "underrun_streams": sum(c > 0 for c, _ in under),
        "stall_seconds": round(sum(s for _, s in under), 3),
        "realtime_streams": sum(r.realtime for r in ok),
        "started": len(started),
        # Of the streams that started (first audio), the share that played to the end without a gap.
        "realtime_of_started": round(sum(r.realtime for r in ok) / len(started), 4) if started else None,
        "concurrent_peak": peak,  # completed streams playing at once
        "concurrent_mean": round(mean, 1),
        "audio_seconds": round(audio, 3),
        "wall_seconds": round(wall_s, 3),
        "audio_seconds_per_second": round(audio / wall_s, 4) if wall_s > 0 else None,
    }
