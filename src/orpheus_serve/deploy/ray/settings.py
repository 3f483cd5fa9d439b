"""How many replicas, with what resources: the Ray side of a deployment, derived from the server's config.

`RaySettings` is what `build_app` takes as the `args` of a Serve config file (deploy/ray/*.yaml) or what
the command line builds. The per-replica figures come from the server config, so a replica's limits in
Serve match the limits the replica itself enforces:

- `max_ongoing_requests` = scheduler.max_concurrent_sessions + scheduler.max_queue: everything one
  replica can hold (slots running, the rest queued). Past it Serve routes elsewhere or queues the request
  at the proxy, where `max_queued_requests` bounds it (then 503).
- `target_ongoing_requests` for autoscaling = the replica's slots: a replica whose slots are all busy
  and that still has requests queued wants a neighbour.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ...config import Config, ConfigError, load_config

APP_NAME = "orpheus"
STATS_APP_NAME = "orpheus-stats"
REPLICA_DEPLOYMENT = "OrpheusReplica"
STATS_DEPLOYMENT = "StatsAggregator"
# Where the aggregate lives: a Serve application of its own at this prefix takes /v1/stats (and
# /v1/stats/metrics) before the replicas' app at / sees them (Serve routes by the longest prefix).
STATS_ROUTE_PREFIX = "/v1/stats"


@dataclass(frozen=True, slots=True)
class RaySettings:
    """The `args` of the Serve application (see the module docstring); every field optional."""

    config: str | None = None  # server config file (default config/model_config.yaml)
    profile: str | None = None
    set: list[str] = field(default_factory=list)  # `section.key=value` overrides, as production_server.py --set
    replicas: int | None = None  # a fixed number; None: autoscale between min_replicas and max_replicas
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float | None = None  # None: the replica's slots
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0
    num_cpus: float = 1.0  # per replica
    num_gpus: float | None = None  # per replica; None: 1 if the engine runs on CUDA, else 0
    max_queued_requests: int | None = None  # per proxy/handle; None: scheduler.max_queue
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float | None = None  # None: server.shutdown_grace_s + 5

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> RaySettings:
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(f"config error: Serve application args: unknown keys {unknown}; "
                              f"allowed: {sorted(known)}")
        if isinstance(args.get("set"), str):
            args["set"] = [args["set"]]
        settings = cls(**args)
        settings.check()
        return settings

    def check(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise ConfigError("config error: replicas must be at least 1")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(f"config error: need 0 <= min_replicas <= max_replicas and max_replicas >= 1 "
                              f"(got {self.min_replicas}, {self.max_replicas})")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ConfigError("config error: num_cpus and num_gpus must not be negative")

    def as_args(self) -> dict[str, Any]:
        return asdict(self)

    def server_config(self) -> Config:
        return load_config(self.config, profile=self.profile, overrides=list(self.set))


def engine_on_gpu(config: Config) -> bool:
    """Whether a replica's engine wants a GPU: explicitly CUDA, or `auto` with a real backend (the sim
    engine and the CPU device never do). Decided here, on the machine that builds the application, so
    `auto` asks for a GPU whenever this cluster has one."""
    if config.engine.backend == "sim":
        return False
    device = config.engine.device
    if device.startswith("cuda"):
        return True
    if device == "cpu":
        return False
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def replica_options(settings: RaySettings, config: Config) -> dict[str, Any]:
    """`serve.deployment` options of the replica deployment (see the module docstring)."""
    scheduler = config.scheduler
    capacity = scheduler.max_concurrent_sessions + scheduler.max_queue
    gpus = settings.num_gpus if settings.num_gpus is not None else (1.0 if engine_on_gpu(config) else 0.0)
    actor_options: dict[str, Any] = {"num_cpus": settings.num_cpus}
    if gpus:
        actor_options["num_gpus"] = gpus
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "ray_actor_options": actor_options,
        "max_ongoing_requests": capacity,
        "max_queued_requests": settings.max_queued_requests if settings.max_queued_requests is not None
        else max(1, scheduler.max_queue),
        "health_check_period_s": settings.health_check_period_s,
        "health_check_timeout_s": settings.health_check_timeout_s,
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_timeout_s
        if settings.graceful_shutdown_timeout_s is not None else config.server.shutdown_grace_s + 5.0,
        # The replica drains within server.shutdown_grace_s itself (TTSService.shutdown).
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if settings.replicas is not None:
        options["num_replicas"] = settings.replicas
    else:
        target = settings.target_ongoing_requests or float(scheduler.max_concurrent_sessions)
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = {
            "min_replicas": settings.min_replicas,
            "initial_replicas": max(1, settings.min_replicas),
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": target,
            "upscale_delay_s": settings.upscale_delay_s,
            "downscale_delay_s": settings.downscale_delay_s,
            "metrics_interval_s": settings.metrics_interval_s,
            "look_back_period_s": settings.look_back_period_s,
        }
    return options
