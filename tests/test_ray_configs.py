"""The committed deployment files, checked without a cluster: Serve configs (deploy/ray/) against Serve's
own schema, and the KubeRay RayService (deploy/kuberay/) against the RayService CRD's openAPIV3Schema
(vendored in tests/data/kuberay, see its $comment), strictly: a field the CRD does not define fails,
as `kubectl apply --validate=strict` would fail it."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orpheus_serve.config import ConfigError

pytest.importorskip("ray.serve")
jsonschema = pytest.importorskip("jsonschema")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from orpheus_serve.deploy.ray import (  # noqa: E402
    GRPC_SERVICER_FUNCTION,
    RaySettings,
    build_app,
    build_stats_app,
    replica_options,
)

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIGS = sorted((ROOT / "deploy" / "ray").glob("*.yaml"))
RAYSERVICE = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
CRD_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.v1.schema.json"


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the fields (Kubernetes would prune them
    silently; strict validation reports them), except where the CRD keeps unknown fields on purpose."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@pytest.fixture(scope="module")
def validator() -> Any:
    schema = strict(json.loads(CRD_SCHEMA.read_text()))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def rayservice() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE.read_text())


def check_serve_config(config: dict[str, Any]) -> list[RaySettings]:
    schema = ServeDeploySchema.model_validate(config)
    apps = {app.name: app for app in schema.applications}
    assert apps["orpheus"].route_prefix == "/" and apps["orpheus-stats"].route_prefix == "/v1/stats"
    assert apps["orpheus"].import_path == "orpheus_serve.deploy.ray:build_app"
    assert apps["orpheus-stats"].import_path == "orpheus_serve.deploy.ray:build_stats_app"
    assert apps["orpheus"].args == apps["orpheus-stats"].args  # one set of args for both
    # Serve's gRPC proxy serves orpheus.v1.Synthesizer, registered by the stubs' own function.
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER_FUNCTION]
    module, _, function = GRPC_SERVICER_FUNCTION.rpartition(".")
    assert callable(getattr(importlib.import_module(module), function))
    return [RaySettings.from_args(app.args) for app in schema.applications]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_are_valid_and_build(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    settings = check_serve_config(config)[0]
    args = next(app["args"] for app in config["applications"] if app["name"] == "orpheus")
    # Serve's builders accept the args: the applications are built (server config loaded and checked).
    assert build_app(args) is not None and build_stats_app(args) is not None
    server = settings.server_config()
    options = replica_options(settings, server)
    assert options["max_ongoing_requests"] == (server.scheduler.max_concurrent_sessions + server.scheduler.max_queue)


def test_gpu_serve_config_autoscales_one_gpu_per_replica() -> None:
    settings = check_serve_config(yaml.safe_load((ROOT / "deploy" / "ray" / "serve_config.yaml").read_text()))[0]
    options = replica_options(settings, settings.server_config())
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert options["num_replicas"] == "auto"
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 4)
    assert scaling["target_ongoing_requests"] == settings.server_config().scheduler.max_concurrent_sessions


def test_rayservice_matches_the_crd_schema(validator: Any) -> None:
    manifest = rayservice()
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.path))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")


def test_rayservice_asks_for_gpus_and_its_serve_config_is_valid() -> None:
    manifest = rayservice()
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    workers = cluster["workerGroupSpecs"]
    gpu_containers = [c for group in workers for c in group["template"]["spec"]["containers"]
                      if "nvidia.com/gpu" in c["resources"].get("limits", {})]
    assert gpu_containers and all(c["resources"]["requests"]["nvidia.com/gpu"] == "1" for c in gpu_containers)
    settings = check_serve_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]))[0]
    assert settings.num_gpus == 1
    assert settings.max_replicas <= sum(group["maxReplicas"] for group in workers)


@pytest.mark.parametrize(("where", "change", "complaint"), [
    (("spec", "rayClusterConfig", "headGroupSpec"), {"rayStartParam": {}}, "Additional properties"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0), {"maxReplicas": "four"}, "is not of type 'integer'"),
    (("spec",), {"serveConfigV2": ["not", "a", "string"]}, "is not of type 'string'"),
])
def test_the_crd_check_can_fail(validator: Any, where: tuple[Any, ...], change: dict[str, Any],
                                complaint: str) -> None:
    manifest = copy.deepcopy(rayservice())
    node = manifest
    for key in where:
        node = node[key]
    node.update(change)
    messages = [error.message for error in validator.iter_errors(manifest)]
    assert any(complaint in message for message in messages), messages


def test_unknown_application_args_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        RaySettings.from_args({"replica": 2})
    with pytest.raises(ConfigError, match="min_replicas"):
        RaySettings.from_args({"min_replicas": 3, "max_replicas": 2})
