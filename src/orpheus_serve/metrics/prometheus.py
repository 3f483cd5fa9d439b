"""Prometheus metrics with vLLM-style names (`orpheus:...`), one registry per app.

Two sources feed it:

- a collector that reads `TTSService.snapshot()` (typed) at scrape time (running and
  waiting requests, KV-cache usage, tokens and engine steps), so the gauges
  are never stale and nothing polls in the background;
- an observer registered with the service (`on_first_audio`,
  `on_request_finished`, ...) for the per-request histograms, plus the
  gateway's own figures (requests by protocol and status, time to first byte
  written, open streams).

Nothing registers into prometheus_client's global registry, so several apps
(tests, benchmarks) can live in one process.

Playback as the server judged it (playback.py): every underrun as it happens
(`stream_underruns`, `stream_underrun_seconds`), the open streams that have had
one (`underrunning_streams`), and every stream that had audio once it closes,
by whether it played real-time (`streams_played{playback}`).

With more than one API process (server.api_processes) each process's own
counters and histograms (`samples()`) travel with its other counters through
the engine core (api/process_group.py); `render()` then adds the other
processes' samples to this one's (`peer_samples`), so a scrape of any process
sees the whole server. The engine gauges are the core's, the same everywhere. The `api_process_*`
families are the one place with a row per API process (label `api_process`,
"0" alone with one process), for telling an overloaded process from the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..request.types import PROTOCOLS, SynthesisMetrics
from ..scheduler import FlowStats
from .stats import ServiceSnapshot

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets tuned for TTFB targets around 100 ms, with room for CPU runs.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


class _ServiceStatsCollector(Collector):
    """Gauges and counters read from the service's typed snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], ServiceSnapshot], gateway_figures: Callable[[], Mapping[str, Any]]):
        self._snapshot = snapshot
        self._gateway_figures = gateway_figures
        # API process index -> its figures (stats.api_process_figures: "cpu_s", "gateway"); with one API
        # process, this one's alone. ServingMetrics.api_process_figures replaces it for more.
        self.api_process_figures: Callable[[], Mapping[int, Mapping[str, Any]]] = lambda: {
            0: {"cpu_s": time.process_time(), "gateway": gateway_figures()}}

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        scheduler, flow = snapshot.core.scheduler, snapshot.core.flow
        yield GaugeMetricFamily("orpheus:num_requests_running", "Sessions holding a KV-cache slot.",
                                value=scheduler.active_sessions)
        yield GaugeMetricFamily("orpheus:num_requests_waiting", "Sessions waiting for a KV-cache slot.",
                                value=scheduler.pending_sessions)
        yield GaugeMetricFamily("orpheus:max_concurrent_sessions", "KV-cache slots pre-allocated at start-up.",
                                value=scheduler.max_concurrent)
        slots = scheduler.used_slots + scheduler.free_slots
        yield GaugeMetricFamily("orpheus:kv_cache_usage_perc", "Fraction of KV-cache slots in use (1 = full).",
                                value=scheduler.used_slots / slots if slots else 0.0)
        yield CounterMetricFamily("orpheus:generation_tokens", "Audio tokens generated.",
                                  value=scheduler.total_tokens)
        yield CounterMetricFamily("orpheus:engine_steps", "Engine steps (micro-batches) run.",
                                  value=scheduler.total_batches)
        yield GaugeMetricFamily("orpheus:codec_backlog_frames", "Frames waiting for the codec worker.",
                                value=snapshot.core.codec_backlog_frames)
        yield GaugeMetricFamily("orpheus:codec_oldest_pending_seconds",
                                "Age of the oldest frame waiting for the codec worker.",
                                value=snapshot.core.codec_oldest_pending_s)
        yield GaugeMetricFamily("orpheus:undecoded_frames_max",
                                "The most frames any session has generated but not decoded.",
                                value=flow.max_undecoded_frames)
        capacity = flow.capacity_streams
        yield GaugeMetricFamily("orpheus:capacity_realtime_streams",
                                "Real-time streams the measured pipeline sustains (NaN until measured).",
                                value=float("nan") if capacity is None else capacity)
        yield GaugeMetricFamily("orpheus:admitted_streams",
                                "Admitted streams that need real-time production (compare with capacity).",
                                value=flow.demand_streams)
        yield from _admission_inputs(flow)
        paused = GaugeMetricFamily("orpheus:sessions_held_back", "Sessions skipped by backpressure, by cause.",
                                   labels=["cause"])
        for cause, count in (("codec", flow.paused_codec), ("client_buffer", flow.paused_client_buffer),
                             ("server_buffer", flow.paused_server_buffer)):
            paused.add_metric([cause], count)
        yield paused
        yield GaugeMetricFamily("orpheus:gateway_lag_seconds",
                                "How late the most lagging API process's event loop runs (smoothed).",
                                value=flow.gateway_lag_ms / 1000)
        yield GaugeMetricFamily("orpheus:saturated", "1 while the pipeline is behind or full (/ready is 503).",
                                value=1.0 if snapshot.saturation is not None else 0.0)
        yield GaugeMetricFamily("orpheus:engine_alive",
                                "0 once the engine is declared dead (every retry of a step failed) or its "
                                "core process is down; 1 otherwise.", value=1.0 if snapshot.core.engine_alive else 0.0)
        yield CounterMetricFamily("orpheus:engine_core_restarts",
                                  "Times the engine-core process was started again after it died "
                                  "(server.engine_process).", value=snapshot.core.core_restarts)
        gateway = self._gateway_figures()
        streams = GaugeMetricFamily("orpheus:active_streams", "Audio streams open at the gateway.",
                                    labels=["protocol"])
        for protocol, count in gateway["active_streams"].items():
            streams.add_metric([protocol], count)
        yield streams
        underrunning = GaugeMetricFamily(
            "orpheus:underrunning_streams", "Open streams that have had an underrun, judged at the server "
            "(the rest of orpheus:active_streams played real-time so far).", labels=["protocol"])
        for protocol, count in gateway["underrunning_streams"].items():
            underrunning.add_metric([protocol], count)
        yield underrunning
        yield GaugeMetricFamily("orpheus:open_connections",
                                "Streams counted against server.max_connections (HTTP streams, WebSockets, gRPC calls).",
                                value=gateway["open_connections"])
        yield from _per_api_process(self.api_process_figures())


def _admission_inputs(flow: FlowStats) -> Iterator[Metric]:
    """What admission decided on (ARCHITECTURE §5a): why the limit is where it is, the playing streams' readings,
    the cost model's bounds and margins, the loop and codec percentiles. NaN where nothing is measured yet."""

    def value(x: float | None) -> float:
        return float("nan") if x is None else float(x)

    reason = GaugeMetricFamily("orpheus:admission_limited_by", "1 for what bounds admission now: lead (the playing "
                               "streams' readings), codec (its busy share held or backed it off), model (the cost model, before any "
                               "reading), gateway, slots.",
                               labels=["reason"])
    for name in ("lead", "codec", "model", "gateway", "slots"):
        reason.add_metric([name], 1.0 if flow.limit_reason == name else 0.0)
    yield reason
    playing = GaugeMetricFamily("orpheus:playing_streams", "Playing streams read by admission, by whether they keep "
                                "real time (produced faster than real time by the margin, never dry) or fall.",
                                labels=["state"])
    playing.add_metric(["keeping"], value(flow.keeping_streams))
    playing.add_metric(["falling"], value(flow.falling_streams))
    yield playing
    yield GaugeMetricFamily("orpheus:stream_lead_p5_seconds", "5th percentile of the playing streams' leads (audio "
                            "their clients hold unplayed).", value=value(flow.lead_p5_s))
    yield GaugeMetricFamily("orpheus:codec_busy_ratio", "Share of the last second the codec spent in passes.",
                            value=value(flow.codec_busy))
    bounds = GaugeMetricFamily("orpheus:model_bound_streams", "The cost model's real-time bound, by part.",
                               labels=["part"])
    margins = GaugeMetricFamily("orpheus:model_margin", "The cost model's margin over real time, by part.",
                                labels=["part"])
    for part, bound, margin in (("engine", flow.engine_capacity_streams, flow.engine_margin),
                                ("codec", flow.codec_capacity_streams, flow.codec_margin)):
        bounds.add_metric([part], value(bound))
        margins.add_metric([part], value(margin))
    yield bounds
    yield margins
    loop = GaugeMetricFamily("orpheus:loop_period_seconds", "Engine-core loop period over recent steps.",
                             labels=["quantile"])
    codec = GaugeMetricFamily("orpheus:codec_pass_seconds", "Codec pass time over recent passes.",
                              labels=["quantile"])
    for quantile, loop_ms, pass_ms in (("0.5", flow.loop_period_ms_p50, flow.codec_pass_ms_p50),
                                       ("0.99", flow.loop_period_ms_p99, flow.codec_pass_ms_p99)):
        loop.add_metric([quantile], value(None if loop_ms is None else loop_ms / 1000))
        codec.add_metric([quantile], value(None if pass_ms is None else pass_ms / 1000))
    yield loop
    yield codec
    yield GaugeMetricFamily("orpheus:codec_frames_per_pass", "Frames per codec pass over recent passes.",
                            value=value(flow.codec_frames_per_pass))


def _per_api_process(figures: Mapping[int, Mapping[str, Any]]) -> Iterator[Metric]:
    """One row per API process (never summed): its CPU time, streams, connections and requests."""
    cpu = CounterMetricFamily("orpheus:api_process_cpu_seconds", "CPU seconds of one API process (all threads).",
                              labels=["api_process"])
    streams = GaugeMetricFamily("orpheus:api_process_active_streams", "Audio streams open in one API process.",
                                labels=["api_process"])
    connections = GaugeMetricFamily("orpheus:api_process_open_connections",
                                    "Streams one API process counts against server.max_connections.",
                                    labels=["api_process"])
    requests = CounterMetricFamily("orpheus:api_process_requests", "Requests one API process has seen, any outcome.",
                                   labels=["api_process"])
    for index, part in sorted(figures.items()):
        label = [str(index)]
        gateway = part["gateway"]
        cpu.add_metric(label, part["cpu_s"])
        streams.add_metric(label, sum(gateway["active_streams"].values()))
        connections.add_metric(label, gateway["open_connections"])
        requests.add_metric(label, sum(count for by_status in gateway["requests"].values()
                                       for count in by_status.values()))
    yield from (cpu, streams, connections, requests)


class ServingMetrics:
    """The app's registry, the service observer, and the gateway's counters."""

    def __init__(self, snapshot: Callable[[], ServiceSnapshot],
                 gateway_figures: Callable[[], Mapping[str, Any]], *, ttfb_target_s: float) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The profile's target (profiles.<name>.target_ttfb_ms), for alerts that compare TTFB with it.
        self.ttfb_target = Gauge("orpheus:ttfb_target_seconds", "The active profile's time-to-first-byte target.",
                                 registry=r)
        self.ttfb_target.set(ttfb_target_s)
        self.time_to_first_audio = Histogram(
            "orpheus:time_to_first_audio_seconds", "Request admitted by the service -> first audio chunk ready.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.time_to_first_byte = Histogram(
            "orpheus:time_to_first_byte_seconds", "Request received by the gateway -> first audio byte written.",
            ["protocol"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "orpheus:request_queue_time_seconds", "Time spent waiting for a KV-cache slot.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "orpheus:e2e_request_latency_seconds", "Request received -> last audio chunk.",
            buckets=_E2E_BUCKETS, registry=r)
        self.real_time_factor = Histogram(
            "orpheus:request_real_time_factor", "Generation wall time / audio duration per request (< 1 is faster "
            "than real time).", buckets=_RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("orpheus:audio_seconds", "Seconds of audio generated.", registry=r)
        self.requests_queued = Counter("orpheus:requests_queued", "Requests admitted to the service queue.",
                                       registry=r)
        # No reason label: the service reports a free-text message, which would make unbounded label values.
        self.requests_rejected = Counter("orpheus:requests_rejected", "Requests the service refused (queue full).",
                                         registry=r)
        self.finished = Counter("orpheus:requests_finished", "Requests the service finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.requests = Counter("orpheus:requests", "Requests seen by the gateway, by protocol and outcome.",
                                ["protocol", "status"], registry=r)
        self.stream_underruns = Counter(
            "orpheus:stream_underruns", "Underruns judged at the server: audio handed to a client after the audio "
            "before it would have finished playing.", ["protocol"], registry=r)
        self.stream_underrun_seconds = Counter(
            "orpheus:stream_underrun_seconds", "Seconds a client's playback would have stalled, judged at the server.",
            ["protocol"], registry=r)
        self.streams_played = Counter(
            "orpheus:streams_played", "Streams that had audio, counted when they close, by how they played: "
            "real_time (no underrun) or underran.", ["protocol", "playback"], registry=r)
        self.api_process_restarts = Counter(
            "orpheus:api_process_restarts", "API processes 1..N-1 started again after they died "
            "(server.api_processes).", registry=r)
        for protocol in PROTOCOLS:  # every series exists from the start, so rate() and alerts see the first one
            self.stream_underruns.labels(protocol)
            self.stream_underrun_seconds.labels(protocol)
            for playback in ("real_time", "underran"):
                self.streams_played.labels(protocol, playback)
        self._own: list[Counter | Histogram] = [
            self.time_to_first_audio, self.time_to_first_byte, self.queue_time, self.e2e_latency,
            self.real_time_factor, self.audio_seconds, self.requests_queued, self.requests_rejected, self.finished,
            self.requests, self.stream_underruns, self.stream_underrun_seconds, self.streams_played,
            self.api_process_restarts]
        self._service_collector = _ServiceStatsCollector(snapshot, gateway_figures)
        r.register(self._service_collector)
        # Set with more than one API process: the other processes' counters as they last sent them
        # (stats.api_process_figures: their `samples()` under "metrics", their gateway figures under "gateway").
        self.peer_figures: Callable[[], list[Mapping[str, Any]]] | None = None

    # ------------------------------------------------ service observer interface

    def on_request_started(self, request_id: str) -> None:
        pass

    def on_request_invalid(self, reason: str) -> None:
        pass

    def on_request_queued(self, request_id: str) -> None:
        self.requests_queued.inc()

    def on_first_audio(self, request_id: str, ttfb_s: float, queue_s: float) -> None:
        self.time_to_first_audio.observe(ttfb_s)
        self.queue_time.observe(queue_s)

    def on_request_finished(self, metrics: SynthesisMetrics, outcome: str) -> None:
        if outcome == "cancelled":  # cancelled requests are the gateway's `requests{status="cancelled"}`
            return
        self.finished.labels(metrics.finish_reason).inc()
        self.e2e_latency.observe(metrics.wall_s)
        if metrics.audio_seconds > 0:
            self.audio_seconds.inc(metrics.audio_seconds)
            self.real_time_factor.observe(metrics.rtf)

    def on_request_rejected(self, reason: str) -> None:
        self.requests_rejected.inc()

    def on_request_ended(self, request_id: str) -> None:
        pass

    # ---------------------------------------------------------- gateway figures

    def request_done(self, protocol: str, status: str) -> None:
        self.requests.labels(protocol, status).inc()

    def first_byte(self, protocol: str, seconds: float) -> None:
        self.time_to_first_byte.labels(protocol).observe(seconds)

    def underrun(self, protocol: str, stall_s: float) -> None:
        self.stream_underruns.labels(protocol).inc()
        self.stream_underrun_seconds.labels(protocol).inc(stall_s)

    def stream_played(self, protocol: str, *, underran: bool) -> None:
        self.streams_played.labels(protocol, "underran" if underran else "real_time").inc()

    @property
    def api_process_figures(self) -> Callable[[], Mapping[int, Mapping[str, Any]]]:
        """Every API process's figures by index, for the per-process families (set with more than one)."""
        return self._service_collector.api_process_figures

    @api_process_figures.setter
    def api_process_figures(self, figures: Callable[[], Mapping[int, Mapping[str, Any]]]) -> None:
        self._service_collector.api_process_figures = figures

    def samples(self) -> list[list[Any]]:
        """This process's own counters and histograms: [[family, [[sample, labels, value], ...]], ...]
        (plain values, for msgpack); `_created` timestamps are left out (they do not add up)."""
        return [[family.name, [[sample.name, sample.labels, sample.value] for sample in family.samples
                               if not sample.name.endswith("_created")]]
                for metric in self._own for family in metric.collect()]

    def render(self) -> bytes:
        if self.peer_figures is None:
            return generate_latest(self.registry)
        return generate_latest(_MergedRegistry(self, self.peer_figures()))


class _MergedRegistry:
    """What `generate_latest` needs of a registry: this process's families with the other API processes'
    samples added, the gateway's gauges summed, and the engine gauges (the core's) once."""

    def __init__(self, metrics: ServingMetrics, peers: list[Mapping[str, Any]]) -> None:
        self._metrics = metrics
        self._peers: dict[str, list[list[Any]]] = {}
        for figures in peers:
            for name, family_samples in figures["metrics"]:
                self._peers.setdefault(name, []).extend(family_samples)
            gateway = figures["gateway"]
            self._peers.setdefault("orpheus:open_connections", []).append(
                ["orpheus:open_connections", {}, gateway["open_connections"]])
            for name in ("active_streams", "underrunning_streams"):
                for protocol, count in gateway[name].items():
                    self._peers.setdefault(f"orpheus:{name}", []).append(
                        [f"orpheus:{name}", {"protocol": protocol}, count])

    def collect(self) -> Iterator[Metric]:
        for family in self._metrics._service_collector.collect():
            yield self._merged(family) if family.name in self._peers else family
        for metric in self._metrics._own:
            for family in metric.collect():
                yield self._merged(family)
        yield from self._metrics.ttfb_target.collect()  # the same in every process: not summed

    def _merged(self, family: Metric) -> Metric:
        totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample in family.samples:
            totals[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        for name, labels, value in self._peers.get(family.name, ()):
            key = (name, tuple(sorted(labels.items())))
            totals[key] = totals.get(key, 0.0) + value
        merged = Metric(family.name, family.documentation, family.type, family.unit)
        for (name, labels), value in totals.items():
            merged.add_sample(name, dict(labels), value)
        return merged
