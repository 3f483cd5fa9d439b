"""The Ray Serve application: replicas of the server behind one endpoint, and an aggregate of their stats.

Two Serve applications, built by `build_apps` (or `build_app` from a Serve config file):

- `orpheus` at `/`: the `OrpheusReplica` deployment. Each replica owns one engine (one GPU, or
  `num_cpus` on a CPU) and serves the same FastAPI app as production_server.py, built by the same
  factory (`create_app` over a `TTSService` and a `Gateway`): OpenAI speech streaming, SSE, the
  WebSocket (Serve's FastAPI ingress carries WebSockets), /ready, per-replica /v1/stats and /metrics.
  Serve's proxy routes each request with its default load-aware router (power of two choices over
  the replicas' ongoing requests); `max_ongoing_requests` and autoscaling come from settings.py.
- `orpheus-stats` at `/v1/stats`: the `StatsAggregator`. `GET /v1/stats` asks every running replica
  for its own stats at that moment and answers them as rows of `replicas`, with totals;
  `GET /v1/stats/metrics` is every replica's Prometheus exposition with a `replica` label added.

How the aggregator reaches each replica: the controller lists the replicas (id, state, actor name)
and each replica actor answers `record_routing_stats`, the per-replica hook Serve itself calls on
replicas. A handle would not do: the router picks the replica, and a row per replica needs each one.
Serve's controller also calls the hook on its own, every request_routing_stats_period_s (10 s), and
passes the result to the routers; the default router does not use it, so that costs one snapshot per
replica per period.

gRPC: `orpheus.v1.Synthesizer` through Serve's gRPC proxy (`serve.start(grpc_options=...)` with
`GRPC_SERVICER_FUNCTION`): the replica's `Synthesize` / `ListVoices` run the server's own servicer
(api/grpc_server.py) over an adapter of Serve's gRPC context. With two applications on one proxy, a
call names its application in the metadata `application: orpheus`.

What differs from one process: a client that stops reading is cut off with a graceful close only
(the replica does not own the socket to reset it; Serve's proxy does); gRPC errors carry their status
code and message but not the trailing metadata (error-code, retry-after-s), which Serve drops on error;
a request Serve's proxy cannot decode is its INTERNAL error, not this server's INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...api.errors import openai_error_body
from ...api.gateway import Gateway
from ...api.grpc_server import SynthesizerService
from ...api.http import create_app
from ...config import Config
from ...metrics.prometheus import PROMETHEUS_CONTENT_TYPE
from .settings import (
    APP_NAME,
    REPLICA_DEPLOYMENT,
    STATS_APP_NAME,
    STATS_DEPLOYMENT,
    STATS_ROUTE_PREFIX,
    RaySettings,
    replica_options,
)

log = logging.getLogger(__name__)

# Serve's gRPC proxy registers the service with this (the stubs' own registration function).
GRPC_SERVICER_FUNCTION = "orpheus_serve.proto.orpheus_pb2_grpc.add_SynthesizerServicer_to_server"
# How long the aggregate waits for one replica's answer before its row says it did not answer.
REPLICA_STATS_TIMEOUT_S = 5.0


@serve.ingress()
class OrpheusReplica:
    """One engine and the server's whole HTTP/WebSocket app, as one Serve replica."""

    async def __init__(self, config_data: dict[str, Any]) -> None:
        from ...service.build import build_service

        config = Config.model_validate(config_data)
        # The replica's process is its own: the same interpreter-lock hand-off as run_server sets.
        sys.setswitchinterval(config.server.switch_interval_ms / 1000.0)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.config = config
        self.service = build_service(config)
        self.gateway = Gateway(self.service, config)
        self.grpc = SynthesizerService(self.gateway)
        # Warm-up inside the constructor: Serve routes nothing to a replica until it returns, so a new
        # replica (scale-up, restart) takes traffic only once its first audio has been produced.
        await self.service.start()
        log.info("replica %s ready (model %s, backend %s, pid %d)", self.replica_id, self.service.model_info.id,
                 self.service.model_info.backend, os.getpid())

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.service, self.config, gateway=self.gateway)
        app.add_middleware(ProxyGoneIsDisconnect)
        return app

    async def Synthesize(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        """`orpheus.v1.Synthesizer/Synthesize` through Serve's gRPC proxy: the server's own servicer."""
        async for message in self.grpc.Synthesize(request, ServeGrpcContext(grpc_context)):
            yield message

    async def ListVoices(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.ListVoices(request, ServeGrpcContext(grpc_context))

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is replaced (its streams already failed)."""
        if not self.service.engine_alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine is dead")

    async def record_routing_stats(self) -> dict[str, Any]:
        """This replica's /v1/stats and Prometheus exposition, for the aggregator (see the module docstring)."""
        stats = self.gateway.stats()
        stats["replica"] = {"replica_id": self.replica_id, "pid": os.getpid()}
        return {"replica_id": self.replica_id, "stats": stats, "metrics": self.gateway.metrics.render().decode()}

    async def __del__(self) -> None:
        # Serve stops routing here first; in-flight streams get server.shutdown_grace_s to finish.
        self.gateway.shutting_down = True
        await self.service.shutdown(self.config.server.shutdown_grace_s)
        await self.gateway.wait_idle(2.0)
        self.gateway.close()


class GrpcAborted(Exception):
    """Raised by `ServeGrpcContext.abort`: Serve answers the status code set on the context."""


class ServeGrpcContext:
    """The part of `grpc.aio.ServicerContext` the servicer uses, over Serve's `RayServegRPCContext`.

    `abort` sets the code and message and raises, which is how a Serve deployment fails a call with a
    status of its own; initial metadata is the proxy's to send (it sends the request id)."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._context.set_trailing_metadata(list(metadata))

    async def send_initial_metadata(self, metadata: Any) -> None:
        return None

    async def abort(self, code: Any, details: str) -> NoReturn:
        self._context.set_code(code)
        self._context.set_details(details)
        raise GrpcAborted(details)


class ProxyGoneIsDisconnect:
    """A `receive()` that fails because Serve's proxy ended the request is the client's disconnect.

    A replica reads the client's messages by calling back into the proxy. When the proxy drops the
    request (the client went away, or stopped reading: the proxy then treats it as gone), that call
    is cancelled and `receive()` raises a Ray error instead of returning a disconnect message; the
    app would count a cancelled stream as an internal error. Serve itself turns the proxy's "no such
    request" into a disconnect; this does the same for the cancelled call."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        gone: Message = {"type": "http.disconnect"} if scope["type"] == "http" else {
            "type": "websocket.disconnect", "code": 1006}

        async def receive_or_gone() -> Message:
            try:
                return await receive()
            except ray.exceptions.TaskCancelledError:
                log.info("the proxy ended %s %s: treated as a client disconnect", scope["type"], scope["path"])
                return gone

        await self.app(scope, receive_or_gone, send)


class _Relabelled(Collector):
    """Every family of several replicas' expositions, each sample labelled with its replica."""

    def __init__(self, expositions: dict[str, str]) -> None:
        self._expositions = expositions

    def collect(self) -> Any:
        families: dict[str, Metric] = {}
        for replica_id, text in sorted(self._expositions.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica_id}, sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from families.values()


def relabel_expositions(expositions: dict[str, str]) -> bytes:
    """One Prometheus exposition out of `{replica_id: exposition}`, a `replica` label on every sample."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Relabelled(expositions))
    return generate_latest(registry)


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over the replicas that answered: what one server's stats would say for the whole endpoint."""
    totals: dict[str, Any] = {"active_sessions": 0, "pending_sessions": 0, "max_concurrent_sessions": 0,
                              "requests": {}}
    for row in rows:
        stats = row.get("stats")
        if stats is None:
            continue
        scheduler = stats.get("scheduler", {})
        totals["active_sessions"] += scheduler.get("active_sessions", 0)
        totals["pending_sessions"] += scheduler.get("pending_sessions", 0)
        totals["max_concurrent_sessions"] += scheduler.get("max_concurrent", 0)
        for protocol, by_status in stats.get("gateway", {}).get("requests", {}).items():
            into = totals["requests"].setdefault(protocol, {})
            for status, count in by_status.items():
                into[status] = into.get(status, 0) + count
    return totals


@serve.ingress()
class StatsAggregator:
    """`GET /v1/stats` and `GET /v1/stats/metrics` over every replica of the `OrpheusReplica` deployment."""

    def __init__(self, api_keys: list[str], app_name: str = APP_NAME,
                 deployment_name: str = REPLICA_DEPLOYMENT) -> None:
        self._api_keys = [key.encode() for key in api_keys]
        self.app_name = app_name
        self.deployment_name = deployment_name

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="orpheus-serve replica stats", openapi_url=None, docs_url=None, redoc_url=None)

        # Serve strips the route prefix: /v1/stats arrives as "" and /v1/stats/ as "/"; both answer.
        @app.get("", include_in_schema=False)
        @app.get("/")
        async def stats(request: Request) -> Response:
            if (denied := self._denied(request)) is not None:
                return denied
            return JSONResponse(await self.aggregate())

        @app.get("/metrics")
        async def metrics() -> Response:
            rows = await self._collect()
            expositions = {row["replica_id"]: row["metrics"] for row in rows if row.get("metrics")}
            return Response(relabel_expositions(expositions), media_type=PROMETHEUS_CONTENT_TYPE)

        return app

    def _denied(self, request: Request) -> Response | None:
        """/v1/ is behind the API key on a single server; the aggregate is too."""
        if not self._api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        matched = False
        for key in self._api_keys:
            matched |= hmac.compare_digest(token.strip().encode(), key)
        if scheme.lower() == "bearer" and matched:
            return None
        body = openai_error_body("missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})

    async def aggregate(self) -> dict[str, Any]:
        rows = await self._collect()
        public = [{key: value for key, value in row.items() if key != "metrics"} for row in rows]
        return {"object": "replica_stats", "app": self.app_name, "deployment": self.deployment_name,
                "time": time.time(), "num_replicas": len(public),
                "running_replicas": sum(1 for row in public if row["state"] == "RUNNING"),
                "totals": _totals(public), "replicas": public}

    async def _collect(self) -> list[dict[str, Any]]:
        replicas = await list_replicas(self.app_name, self.deployment_name)
        return list(await asyncio.gather(*(self._row(replica) for replica in replicas)))

    @staticmethod
    async def _row(replica: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {key: replica.get(key) for key in ("replica_id", "state", "node_ip", "pid",
                                                                 "actor_name", "start_time_s")}
        if replica.get("state") != "RUNNING" or not replica.get("actor_name"):
            return row
        try:
            actor = ray.get_actor(replica["actor_name"], namespace=SERVE_NAMESPACE)
            answer = await asyncio.wait_for(actor.record_routing_stats.remote(), REPLICA_STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, ValueError, ray.exceptions.RayError) as exc:
            # Dying or just died: the row says so, the other replicas' rows still come.
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            return row
        row["stats"] = answer["stats"]
        row["metrics"] = answer["metrics"]
        return row


# Serve keeps its controller and replicas in this Ray namespace.
SERVE_NAMESPACE = "serve"


async def list_replicas(app_name: str = APP_NAME, deployment_name: str = REPLICA_DEPLOYMENT) -> list[dict[str, Any]]:
    """The controller's view of one deployment's replicas: replica_id, state, actor_name, node_ip, pid, ...

    The same data `serve status` and the dashboard show (ServeInstanceDetails), asked of the controller
    actor directly so it works without the dashboard."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = await controller.get_serve_instance_details.remote()
    app = details.get("applications", {}).get(app_name) or {}
    deployment = app.get("deployments", {}).get(deployment_name) or {}
    return [dict(replica) for replica in deployment.get("replicas", [])]


def build_apps(settings: RaySettings, config: Config | None = None) -> dict[str, Any]:
    """`{app name: bound application}`: the replicas (route prefix /) and the aggregator (/v1/stats)."""
    config = config if config is not None else settings.server_config()
    replica = serve.deployment(OrpheusReplica).options(**replica_options(settings, config))
    aggregator = serve.deployment(StatsAggregator).options(
        name=STATS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=16, max_queued_requests=64)
    return {APP_NAME: replica.bind(config.model_dump(mode="json")),
            STATS_APP_NAME: aggregator.bind(list(config.server.api_keys))}


def build_app(args: dict[str, Any]) -> Any:
    """Application builder of the replicas' app for Serve config files (`import_path: ...:build_app`)."""
    settings = RaySettings.from_args(args)
    return build_apps(settings)[APP_NAME]


def build_stats_app(args: dict[str, Any]) -> Any:
    """Application builder of the aggregator's app (`import_path: ...:build_stats_app`, prefix /v1/stats)."""
    settings = RaySettings.from_args(args)
    return build_apps(settings)[STATS_APP_NAME]


def grpc_options(port: int) -> dict[str, Any]:
    """`serve.start(grpc_options=...)` serving `orpheus.v1.Synthesizer` on `port`."""
    return {"port": port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]}


def run_apps(settings: RaySettings, config: Config, *, blocking: bool = False) -> DeploymentHandle:
    """`serve.run` both applications on the connected cluster (Serve already started); the replicas' handle."""
    apps = build_apps(settings, config)
    serve.run(apps[STATS_APP_NAME], name=STATS_APP_NAME, route_prefix=STATS_ROUTE_PREFIX)
    return serve.run(apps[APP_NAME], name=APP_NAME, route_prefix="/", blocking=blocking)
