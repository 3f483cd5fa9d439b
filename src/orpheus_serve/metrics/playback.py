"""How a stream would have played, judged at the server from when its audio left (ARCHITECTURE §8).

The benchmark client measures underruns from arrival times at the client
(client/records.py). A server cannot see its clients' speakers, but it knows
when it handed each chunk of audio to the client's connection; the same model
on those times says whether the server kept up with playback:

- playback starts when the first audio is handed over and consumes audio in
  real time (at the output's speed);
- a chunk handed over after the audio before it ran out is an underrun: the
  player stalled for the gap, then resumes with that chunk.

This is a lower bound on what a client hears (the network adds its own
jitter), and what the Prometheus metrics `orpheus:stream_underruns_total`,
`orpheus:streams_played_total{playback}` and `orpheus:underrunning_streams`
count. A gap that is the client's own doing is not an underrun: an
incremental-text request whose client had sent no more text by the time its
audio ran out resumes playback (`AudioChunk.resumes_playback`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Slack for timer resolution, as the benchmark client's model (client/records.py) allows.
UNDERRUN_TOLERANCE_S = 1e-4


@dataclass(slots=True)
class PlaybackClock:
    """One stream's playback model, fed the moment each chunk of audio is handed to the client."""

    buffered_until: float | None = None  # when the audio handed over so far runs out; None before the first
    underruns: int = 0
    stall_s: float = 0.0

    @property
    def started(self) -> bool:
        return self.buffered_until is not None

    def deliver(self, now: float, seconds: float, *, resume: bool = False) -> float:
        """`seconds` of audio handed over at `now`. Returns the stall it ends (0.0 when it came in time).
        `resume`: a gap before it is not the server's (the client had nothing more for it to say)."""
        stall = 0.0
        if self.buffered_until is None or resume:
            start = now if self.buffered_until is None else max(now, self.buffered_until)
        elif now > self.buffered_until + UNDERRUN_TOLERANCE_S:
            stall = now - self.buffered_until
            self.underruns += 1
            self.stall_s += stall
            start = now
        else:
            start = self.buffered_until
        self.buffered_until = start + seconds
        return stall
