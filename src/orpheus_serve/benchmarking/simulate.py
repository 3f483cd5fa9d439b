"""Virtual-clock simulation of the scheduler on the sim engine: how many voices stay real-time.

The scheduler runs exactly as in the server, driven by `SimEngine(realtime=
False)`, whose cost model advances a virtual clock, so minutes of GPU time at
high concurrency simulate in seconds on a CPU and every run reproduces.

Sessions arrive at seeded random times. Each FramesReady becomes audio at the
client `codec_latency_s` later; the codec holds back its lookahead frames
until the final push, as the real streaming decoder does. Each client starts
playback at its first audio and plays continuously; whenever the next audio
arrives after the buffer ran dry it has an underrun (it stalls, then resumes).
A stream with no underrun is real-time (ARCHITECTURE §8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..config import SchedulerConfig, SimConfig
from ..engines.sim_engine import SimEngine
from ..scheduler.errors import SchedulerFullError
from ..scheduler.events import FramesReady, SchedulerEvent, SessionFinished
from ..scheduler.flush import FlushPolicy
from ..scheduler.scheduler import Scheduler
from ..scheduler.session import SessionRequest
from ..scheduler.step import SamplingParams
from ..token_format import FRAME_SECONDS, TEXT_VOCAB_SIZE, TOKENS_PER_FRAME

_EPS = 1e-9


class VirtualClock:
    """Seconds that pass only when told to."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self.now_s += seconds

    def advance_to(self, t_s: float) -> None:
        self.now_s = max(self.now_s, t_s)


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: int
    arrival_window_s: float  # arrivals uniformly at random in [0, window)
    prompt_tokens: tuple[int, int] = (30, 90)  # prompt length range (voice + one sentence)
    # Audio that max_tokens allows per session; the sim engine ends each utterance
    # between half and all of it.
    max_audio_s: tuple[float, float] = (4.0, 12.0)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class SimulationSetup:
    scheduler: SchedulerConfig
    num_slots: int
    cost: SimConfig
    lookahead_frames: int = 2
    codec_latency_s: float = 0.010  # FramesReady -> audio at the client
    max_seq_len: int = 4096


@dataclass(slots=True)
class StreamResult:
    request_id: str
    arrival_s: float
    finish_reason: str | None = None
    ttfb_s: float | None = None
    audio_s: float = 0.0
    underruns: int = 0
    stall_s: float = 0.0
    end_s: float | None = None  # time of the last audio
    _emitted_frames: int = 0
    _playback_end_s: float = 0.0  # when the client's buffer runs dry

    @property
    def real_time(self) -> bool:
        return self.finish_reason in ("stop", "length") and self.ttfb_s is not None and self.underruns == 0

    def receive(self, t_s: float, audible_frames: int) -> None:
        """The client now holds `audible_frames` frames of audio in total."""
        gained = (audible_frames - self._emitted_frames) * FRAME_SECONDS
        if gained <= 0:
            return
        self._emitted_frames = audible_frames
        if self.ttfb_s is None:
            self.ttfb_s = t_s - self.arrival_s
            self._playback_end_s = t_s
        elif t_s > self._playback_end_s + _EPS:
            self.underruns += 1
            self.stall_s += t_s - self._playback_end_s
            self._playback_end_s = t_s
        self._playback_end_s += gained
        self.audio_s += gained
        self.end_s = t_s


@dataclass(slots=True)
class SimulationResult:
    policy: str
    sessions: int
    arrival_window_s: float
    num_slots: int
    max_batch_size: int
    streams: list[StreamResult] = field(default_factory=list)
    rejected: int = 0
    simulated_s: float = 0.0
    steps: int = 0
    mean_batch_size: float = 0.0
    engine_busy_s: float = 0.0

    @property
    def completed(self) -> int:
        return sum(s.finish_reason in ("stop", "length") for s in self.streams)

    @property
    def real_time_streams(self) -> int:
        return sum(s.real_time for s in self.streams)

    @property
    def underrun_streams(self) -> int:
        return sum(s.underruns > 0 for s in self.streams)

    @property
    def underruns(self) -> int:
        return sum(s.underruns for s in self.streams)

    @property
    def stall_s(self) -> float:
        return sum(s.stall_s for s in self.streams)

    @property
    def timed_out(self) -> int:
        return sum(s.finish_reason == "timeout" for s in self.streams)

    def ttfb_percentile(self, q: float) -> float | None:
        values = [s.ttfb_s for s in self.streams if s.ttfb_s is not None]
        return float(np.percentile(values, q)) if values else None


def make_requests(workload: Workload) -> list[SessionRequest]:
    """The seeded sessions of a workload, in arrival order."""
    rng = np.random.default_rng(workload.seed)
    arrivals = np.sort(rng.uniform(0.0, workload.arrival_window_s, size=workload.sessions))
    lo, hi = workload.prompt_tokens
    audio_lo, audio_hi = workload.max_audio_s
    requests = []
    for i, arrival in enumerate(arrivals):
        prompt = rng.integers(0, TEXT_VOCAB_SIZE, size=int(rng.integers(lo, hi + 1)))
        frames = math.ceil(rng.uniform(audio_lo, audio_hi) / FRAME_SECONDS)
        sampling = SamplingParams(max_tokens=(frames + 1) * TOKENS_PER_FRAME, seed=workload.seed * 1_000_003 + i)
        requests.append(
            SessionRequest(
                request_id=f"sim-{i}",
                prompt_ids=tuple(int(t) for t in prompt),
                sampling=sampling,
                arrival_s=float(arrival),
            )
        )
    return requests


def simulate(setup: SimulationSetup, workload: Workload) -> SimulationResult:
    clock = VirtualClock()
    cost = setup.cost.model_copy(update={"realtime": False})
    engine = SimEngine(setup.num_slots, setup.max_seq_len, cost, clock_advance=clock.advance)
    scheduler = Scheduler(
        setup.scheduler,
        setup.num_slots,
        lookahead_frames=setup.lookahead_frames,
        clock=clock,
        max_seq_len=setup.max_seq_len,
    )
    flush_policy = FlushPolicy.from_config(setup.scheduler, setup.lookahead_frames)
    requests = make_requests(workload)
    result = SimulationResult(
        policy=setup.scheduler.policy,
        sessions=workload.sessions,
        arrival_window_s=workload.arrival_window_s,
        num_slots=setup.num_slots,
        max_batch_size=setup.scheduler.max_batch_size,
    )
    streams: dict[str, StreamResult] = {}
    flushed: dict[str, int] = {}

    def handle(events: list[SchedulerEvent]) -> None:
        t_audio = clock() + setup.codec_latency_s
        for event in events:
            if isinstance(event, FramesReady):
                flushed[event.request_id] = flushed.get(event.request_id, 0) + event.num_frames
                audible = flush_policy.audible_frames(flushed[event.request_id], event.final)
                streams[event.request_id].receive(t_audio, audible)
            elif isinstance(event, SessionFinished):
                streams[event.request_id].finish_reason = event.reason

    next_arrival = 0
    while next_arrival < len(requests) or scheduler.has_work:
        while next_arrival < len(requests) and requests[next_arrival].arrival_s <= clock():
            req = requests[next_arrival]
            next_arrival += 1
            try:
                scheduler.submit(req)
            except SchedulerFullError:
                result.rejected += 1
                continue
            streams[req.request_id] = StreamResult(req.request_id, req.arrival_s)
        plan = scheduler.schedule()
        if plan.empty:
            handle(scheduler.drain_events())
            if next_arrival < len(requests):
                clock.advance_to(requests[next_arrival].arrival_s)  # idle until the next request
                continue
            if scheduler.has_work:
                raise RuntimeError("the scheduler holds work but planned nothing")
            break
        output = engine.step(plan)
        handle(scheduler.update(plan, output))

    stats = scheduler.stats()
    result.streams = list(streams.values())
    result.simulated_s = clock()
    result.steps = stats.total_steps
    result.mean_batch_size = stats.mean_batch_size
    result.engine_busy_s = engine.busy_s
    engine.close()
    return result


def format_table(results: list[SimulationResult]) -> str:
    """One line per run: the numbers the policy comparison is about."""
    columns = (
        ("policy", "<9"),
        ("sessions", ">9"),
        ("window", ">7"),
        ("slots", ">6"),
        ("batch", ">6"),
        ("done", ">5"),
        ("rejected", ">9"),
        ("real-time", ">10"),
        ("underrun", ">9"),
        ("events", ">7"),
        ("stall s", ">8"),
        ("ttfb p50", ">9"),
        ("ttfb p95", ">9"),
        ("mean bs", ">8"),
        ("sim s", ">7"),
    )
    header = "".join(f"{name:{fmt}}" for name, fmt in columns)
    lines = [header, "-" * len(header)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}ms"

    for r in results:
        values = (
            r.policy,
            r.sessions,
            f"{r.arrival_window_s:g}s",
            r.num_slots,
            r.max_batch_size,
            r.completed,
            r.rejected,
            r.real_time_streams,
            r.underrun_streams,
            r.underruns,
            f"{r.stall_s:.1f}",
            ms(r.ttfb_percentile(50)),
            ms(r.ttfb_percentile(95)),
            f"{r.mean_batch_size:.1f}",
            f"{r.simulated_s:.1f}",
        )
        lines.append("".join(f"{v:{fmt}}" for v, (_, fmt) in zip(values, columns, strict=True)))
    return "\n".join(lines)


def compare_policies(
    setup: SimulationSetup, workload: Workload, policies: tuple[str, ...] = ("fair", "deadline")
) -> list[SimulationResult]:
    """The same workload under each policy, everything else equal."""
    return [
        simulate(
            SimulationSetup(
                scheduler=setup.scheduler.model_copy(update={"policy": policy}),
                num_slots=setup.num_slots,
                cost=setup.cost,
                lookahead_frames=setup.lookahead_frames,
                codec_latency_s=setup.codec_latency_s,
                max_seq_len=setup.max_seq_len,
            ),
            workload,
        )
        for policy in policies
    ]


def realtime_capacity(cost: SimConfig, batch: int, context_tokens: int) -> float:
    """Voices one engine keeps real-time when it decodes `batch` sessions (each holding
    `context_tokens` of context) every step: its tokens per second over 82."""
    step_s = (
        cost.step_base_ms + cost.step_per_seq_ms * batch + cost.step_per_ctx_token_ms * batch * context_tokens
    ) / 1000
    return batch / step_s * FRAME_SECONDS / TOKENS_PER_FRAME
