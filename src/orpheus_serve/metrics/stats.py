"""What the service counts and reports: one tally of request outcomes, `/v1/stats`, and saturation.

`RequestTally` is a service observer like the Prometheus metrics: the service
notifies observers of every request's progress and outcome and counts nothing
itself. `service_stats` assembles the `/v1/stats` JSON from typed figures
(the engine core's `EngineCoreStats` and the tally); `saturation` is the one
reading of "the pipeline is behind" that `/ready`, the flow section and the
Prometheus gauge share.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..config import Config
from ..core.client import EngineCoreStats
from ..request.types import SynthesisMetrics

RequestOutcome = Literal["completed", "failed", "cancelled"]


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    """The engine core's figures and the service's reading of them, at one moment."""

    core: EngineCoreStats
    saturation: str | None


@dataclass(slots=True)
class RequestTally:
    """Request outcomes as the service saw them (a service observer)."""

    total: int = 0
    active: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    invalid: int = 0
    audio_seconds: float = 0.0
    tokens: int = 0

    def on_request_started(self, request_id: str) -> None:
        self.total += 1
        self.active += 1

    def on_request_invalid(self, reason: str) -> None:
        self.invalid += 1

    def on_request_queued(self, request_id: str) -> None:
        pass

    def on_first_audio(self, request_id: str, ttfb_s: float, queue_s: float) -> None:
        pass

    def on_request_rejected(self, reason: str) -> None:
        self.rejected += 1

    def on_request_finished(self, metrics: SynthesisMetrics, outcome: RequestOutcome) -> None:
        if outcome == "completed":
            self.completed += 1
            self.audio_seconds += metrics.audio_seconds
            self.tokens += metrics.tokens
        elif outcome == "failed":
            self.failed += 1
        else:
            self.cancelled += 1

    def on_request_ended(self, request_id: str) -> None:
        self.active -= 1

    def as_dict(self) -> dict[str, int]:
        return {"active": self.active, "requests_total": self.total, "requests_completed": self.completed,
                "requests_failed": self.failed, "requests_cancelled": self.cancelled,
                "requests_rejected": self.rejected, "requests_invalid": self.invalid}


def saturation(core: EngineCoreStats, config: Config) -> str | None:
    """Why the pipeline is behind (for /ready), or None: the codec's oldest undecoded frame is older
    than server.ready_max_backlog_s, an API process's event loop lags past scheduler.max_gateway_lag_ms,
    or admission is closed and no request could wait for it."""
    if core.codec_oldest_pending_s > config.server.ready_max_backlog_s:
        return f"codec backlog: oldest undecoded frame is {core.codec_oldest_pending_s:.1f} s old"
    flow = core.flow
    lag_limit_ms = config.scheduler.max_gateway_lag_ms
    if lag_limit_ms and flow.gateway_lag_ms > lag_limit_ms:
        return f"gateway behind: its event loop runs {flow.gateway_lag_ms:.0f} ms late"
    if not flow.admission_open:
        if config.scheduler.admission == "reject":
            return f"at capacity: {flow.demand_streams} of {flow.capacity_streams} real-time streams"
        waiting = core.scheduler.pending_sessions
        if waiting >= config.scheduler.max_queue:
            return f"at capacity with a full queue: {waiting} requests waiting"
    return None


def flow_stats(snapshot: ServiceSnapshot) -> dict[str, Any]:
    """Flow control: capacity against demand, backpressure, codec backlog, and whether we are behind."""
    flow = snapshot.core.flow.as_dict()
    flow["codec_backlog_frames"] = snapshot.core.codec_backlog_frames
    flow["codec_oldest_pending_s"] = round(snapshot.core.codec_oldest_pending_s, 4)
    flow["saturated"] = snapshot.saturation is not None
    flow["saturation"] = snapshot.saturation
    return flow


def service_stats(snapshot: ServiceSnapshot, tally: RequestTally, *, backend: str, uptime_s: float,
                  cpu_s: float) -> dict[str, Any]:
    """The service's part of GET /v1/stats (the gateway adds its own figures)."""
    core = snapshot.core
    s, mem = core.scheduler, core.memory
    uptime = max(uptime_s, 1e-9)
    return {
        "scheduler": {
            "total_sessions": s.total_sessions,
            "active_sessions": s.active_sessions,
            "pending_sessions": s.pending_sessions,
            "max_concurrent": s.max_concurrent,
            "policy": s.policy,
            "finished": s.finished,
            "cancelled": s.cancelled,
            "failed": s.failed,
            "timed_out": s.timed_out,
            "rejected": s.rejected,
            "mean_batch_size": round(s.mean_batch_size, 3),
            "total_steps": s.total_steps,
            "adapter_waits": s.adapter_waits,  # plans where a custom voice waited for an adapter-pool entry
            # tokens dropped: made for a session that had ended (a step in flight when it ended, or a cancel)
            "stray_tokens": s.stray_tokens,
        },
        "kv_cache": {
            "used_slots": s.used_slots,
            "free_slots": s.free_slots,
            "usage": round(s.used_slots / max(s.max_concurrent, 1), 4),
            "dtype": mem.kv_cache_dtype,
            "bytes_per_slot": mem.kv_bytes_per_slot,
            "total_bytes": mem.kv_cache_bytes,
            "max_seq_len": mem.max_seq_len,
        },
        "total_tokens": s.total_tokens,
        "total_batches": s.total_batches,
        "engine": {
            "backend": backend,
            "alive": core.engine_alive,
            "failure": core.engine_failure,
            "device": mem.device,
            "steps": core.steps,
            "step_errors": core.step_errors,
            "busy_s": round(core.busy_s, 3),
            "engine_elapsed_s": round(core.engine_elapsed_s, 3),
            "loop_s": round(core.loop_s, 3),
            # start-up: torch.compile of the decode pass (engine.compile) and the decode graphs' capture
            "compile_s": None if mem.compile_s is None else round(mem.compile_s, 3),
            "graph_capture_s": None if mem.graph_capture_s is None else round(mem.graph_capture_s, 3),
        },
        "codec": core.codec,
        "flow": flow_stats(snapshot),
        # Where the engine-core process's host time goes, per loop phase and thread (core/host_time.py).
        "core_host": core.core_host,
        "requests": tally.as_dict(),
        # All threads; with the engine core in its own process, `cpu_s` adds its CPU time to this process's.
        "process": {"cpu_s": round(cpu_s + core.core_cpu_s, 3), "engine_core_cpu_s": round(core.core_cpu_s, 3),
                    "engine_core_pid": core.core_pid, "engine_core_restarts": core.core_restarts},
        "throughput": {
            "uptime_s": round(uptime, 3),
            "audio_seconds_total": round(tally.audio_seconds, 3),
            "tokens_total": tally.tokens,
            "tokens_per_s": round(s.total_tokens / uptime, 2),
            "audio_seconds_per_s": round(tally.audio_seconds / uptime, 4),
        },
    }


def api_process_figures(tally: RequestTally, gateway: Mapping[str, Any], metrics: list[Any]) -> dict[str, Any]:
    """One API process's own counters, as it sends them to the engine core for the others' /v1/stats
    (and, `metrics`: its Prometheus counters and histograms, for their /metrics)."""
    return {"pid": os.getpid(), "cpu_s": round(time.process_time(), 3), "requests": tally.as_dict(),
            "audio_seconds": tally.audio_seconds, "tokens": tally.tokens,
            "gateway": {key: value for key, value in gateway.items() if key != "uptime_s"}, "metrics": metrics}


def _sum_into(total: dict[str, Any], part: Mapping[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, Mapping):
            _sum_into(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value


def merge_api_processes(snapshot: dict[str, Any], own_index: int, figures: Mapping[int, Mapping[str, Any]]) -> None:
    """Sum the request and gateway counters of every API process into one /v1/stats snapshot
    (server.api_processes > 1). `figures` holds each process's own counters (api_process_figures), this
    one's fresh, the others' as they last sent them to the engine core (up to a fraction of a second old).
    The engine part of the snapshot is the core's, the same for all, and stays as it is."""
    requests: dict[str, Any] = {}
    gateway: dict[str, Any] = {}
    audio_seconds = 0.0
    tokens = 0
    cpu_s = 0.0
    rows = []
    for index in sorted(figures):
        part = figures[index]
        _sum_into(requests, part["requests"])
        _sum_into(gateway, part["gateway"])
        audio_seconds += part["audio_seconds"]
        tokens += part["tokens"]
        cpu_s += part["cpu_s"]
        rows.append({"index": index, "pid": part["pid"], "cpu_s": part["cpu_s"], "requests": part["requests"],
                     "gateway": part["gateway"]})
    snapshot["requests"] = requests
    snapshot["gateway"] = {"uptime_s": snapshot["gateway"]["uptime_s"], **gateway}
    throughput = snapshot["throughput"]
    throughput["audio_seconds_total"] = round(audio_seconds, 3)
    throughput["tokens_total"] = tokens
    throughput["audio_seconds_per_s"] = round(audio_seconds / max(throughput["uptime_s"], 1e-9), 4)
    # CPU time of the whole server: every API process's (each as of its last report) and the core's.
    process = snapshot["process"]
    process["cpu_s"] = round(cpu_s + process["engine_core_cpu_s"], 3)
    snapshot["api_process_index"] = own_index
    snapshot["api_processes"] = rows
