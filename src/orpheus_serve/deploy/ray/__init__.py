"""Replicas of the server under Ray Serve: one engine per replica, Serve's load-aware routing,
autoscaling on ongoing requests, an aggregate /v1/stats. Needs the `[ray]` extra.

    python -m orpheus_serve.deploy.ray --replicas 2 --port 8000 [--config FILE] [--set key=value ...]
    serve run deploy/ray/serve_config.yaml          # or `serve deploy` to a running cluster

See app.py for the applications, settings.py for how their sizes follow the server config, and
docs/SCALING.md for when to use this rather than one process.
"""

from .app import (
    GRPC_SERVICER_FUNCTION,
    OrpheusReplica,
    StatsAggregator,
    build_app,
    build_apps,
    build_stats_app,
    grpc_options,
    list_replicas,
    run_apps,
)
from .settings import APP_NAME, STATS_APP_NAME, STATS_ROUTE_PREFIX, RaySettings, replica_options

__all__ = [
    "APP_NAME",
    "GRPC_SERVICER_FUNCTION",
    "STATS_APP_NAME",
    "STATS_ROUTE_PREFIX",
    "OrpheusReplica",
    "RaySettings",
    "StatsAggregator",
    "build_app",
    "build_apps",
    "build_stats_app",
    "grpc_options",
    "list_replicas",
    "replica_options",
    "run_apps",
]
