"""Every deployment serves the same routes: the Ray Serve replica's app is the server's app (create_app is
the one place routes are composed), the Cartesia WebSocket included."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.routing import Mount, Route, WebSocketRoute

from orpheus_serve.api.gateway import Gateway
from orpheus_serve.api.server import OrpheusServer
from orpheus_serve.service.build import build_service

pytest.importorskip("ray.serve")
from orpheus_serve.deploy.ray.app import OrpheusReplica
from tests.gateway_support import sim_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def route_table(app: object) -> set[tuple[str, str]]:
    table = set()
    for route in app.routes:  # type: ignore[attr-defined]
        if isinstance(route, WebSocketRoute):
            table.add(("WEBSOCKET", route.path))
        elif isinstance(route, Route):
            table.update((method, route.path) for method in route.methods or ())
        elif isinstance(route, Mount):
            table.add(("MOUNT", route.path))
        else:
            raise AssertionError(f"a route of an unknown kind: {route!r}")
    return table


def test_the_ray_replica_serves_exactly_the_servers_routes(tiny_orpheus: Path) -> None:
    config = sim_config(tiny_orpheus)
    service = build_service(config)
    server = OrpheusServer(config, service)
    # The replica's own app factory, on a stand-in for the replica (Serve builds the real one in a replica
    # process): the attributes it reads are the service, the config and the gateway.
    replica = SimpleNamespace(service=service, config=config, gateway=Gateway(service, config))
    replica_app = OrpheusReplica.__serve_build_asgi_app__(replica)
    served = route_table(server.app)
    assert ("WEBSOCKET", "/tts/websocket") in served and ("WEBSOCKET", "/v1/audio/stream") in served
    assert ("POST", "/v1/audio/speech") in served
    assert route_table(replica_app) == served
