"""The container files, checked without building an image (scripts/test_container.sh builds and runs one).

- Dockerfile: base image as a build arg, torch pinned as scripts/setup.sh pins it, a non-root USER, EXPOSE of
  the configured ports, a HEALTHCHECK on /ready, production_server.py as the entry point, every COPY source
  present and inside the build context that .dockerignore leaves.
- docker/healthcheck.py against a real server: healthy when ready, unhealthy while draining or when nothing listens.
- deploy/compose.yaml against the Compose Specification's JSON schema (vendored by check-jsonschema, a dev
  extra), and what the services need from each other (ports, aliases, mounted files).
- deploy/prometheus/prometheus.yml through `promtool check config` where promtool is installed.
- The image names of compose, the KubeRay manifest and the README agree with the package's version.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from orpheus_serve.config import load_config
from tests.pace import MachinePace

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
HEALTHCHECK_SCRIPT = ROOT / "docker" / "healthcheck.py"
COMPOSE = ROOT / "deploy" / "compose.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
KUBERAY = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


# --- Dockerfile ------------------------------------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, backslash continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def args_of(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for key, args in instructions if key == keyword]


def build_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for arg in args_of(instructions, "ARG"):
        name, _, default = arg.partition("=")
        out[name] = default
    return out


def setup_sh_torch_pin() -> str:
    match = re.search(r'"torch==([0-9.]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    assert match, "scripts/setup.sh pins no torch"
    return match.group(1)


def pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pinned(requirements: list[str], name: str) -> str:
    for requirement in requirements:
        match = re.match(rf"{re.escape(name)}(\[[^\]]*\])?==([0-9][0-9.]*)", requirement)
        if match:
            return match.group(2)
    raise AssertionError(f"{name} is not pinned in {requirements}")


def test_the_base_image_is_a_build_arg_and_the_gpu_default_is_a_pytorch_cuda_runtime(
        instructions: list[tuple[str, str]]) -> None:
    first_from = next(i for i, (key, _) in enumerate(instructions) if key == "FROM")
    before = dict(arg.partition("=")[::2] for key, arg in instructions[:first_from] if key == "ARG")
    assert "BASE_IMAGE" in before, "ARG BASE_IMAGE must come before FROM to be usable in it"
    assert instructions[first_from][1] == "${BASE_IMAGE}"
    assert re.fullmatch(r"pytorch/pytorch:[0-9.]+-cuda[0-9.]+-cudnn[0-9]+-runtime", before["BASE_IMAGE"])
    assert len(args_of(instructions, "FROM")) == 1


def test_torch_is_pinned_as_scripts_setup_sh_pins_it(instructions: list[tuple[str, str]]) -> None:
    pin = setup_sh_torch_pin()
    assert build_args(instructions)["TORCH_VERSION"] == pin
    # The GPU default base carries the same release, so the GPU build keeps the base's CUDA torch.
    base = dict(arg.partition("=")[::2] for arg in args_of(instructions, "ARG"))["BASE_IMAGE"]
    assert base.startswith(f"pytorch/pytorch:{pin}-")
    # docker/wheels/README.md tells how to fetch the same release.
    assert f"torch=={pin}" in (ROOT / "docker" / "wheels" / "README.md").read_text()


def test_the_package_is_installed_as_scripts_setup_sh_installs_it(instructions: list[tuple[str, str]]) -> None:
    """Editable from /app, torch first through docker/install_torch.sh; nothing pinned differently."""
    runs = " ".join(args_of(instructions, "RUN"))
    assert "install_torch.sh" in runs and runs.index("install_torch.sh") < runs.index("pip install")
    assert re.search(r'pip install .*-e "/app\$\{EXTRAS:\+\[\$EXTRAS\]\}"', runs)
    # Pins anywhere in the Dockerfile (the variants in its comments included) match pyproject's and setup.sh's.
    text = DOCKERFILE.read_text()
    project = pyproject()
    extras = project["project"]["optional-dependencies"]
    ray_pin = pinned(extras["ray"], "ray")
    for version in re.findall(r"rayproject/ray:([0-9.]+)-", text):
        assert version == ray_pin, f"rayproject/ray:{version} but pyproject pins ray=={ray_pin}"
    for extra in re.findall(r"EXTRAS=([a-z,]+)", text):
        assert set(extra.split(",")) <= set(extras), f"EXTRAS={extra} names an extra pyproject does not have"
    # The TensorRT-LLM variant's torch is the one docs/TENSORRT.md installs for TensorRT-LLM 1.2.
    trt_torch = re.search(r"TORCH_VERSION=([0-9.]+)", text)
    assert trt_torch and f"torch=={trt_torch.group(1)}" in (ROOT / "docs" / "TENSORRT.md").read_text()


def test_it_runs_as_a_non_root_user(instructions: list[tuple[str, str]]) -> None:
    users = args_of(instructions, "USER")
    assert users, "no USER: the server would run as root"
    last = users[-1]
    assert last == "10001:10001"
    # Nothing runs as root after it.
    after = instructions[max(i for i, (key, _) in enumerate(instructions) if key == "USER") + 1:]
    assert not [args for key, args in after if key == "RUN"]


def test_it_exposes_the_configured_ports_and_sets_them(instructions: list[tuple[str, str]]) -> None:
    config = load_config(env={})
    exposed = {int(port.split("/")[0]) for arg in args_of(instructions, "EXPOSE") for port in arg.split()}
    assert exposed == {config.server.http_port, config.server.grpc_port}
    env = " ".join(args_of(instructions, "ENV"))
    assert f"ORPHEUS_SERVE__SERVER__HTTP_PORT={config.server.http_port}" in env
    assert f"ORPHEUS_SERVE__SERVER__GRPC_PORT={config.server.grpc_port}" in env
    # Models come from /models; the overrides name real config keys (an unknown key would stop start-up).
    overrides = dict(re.findall(r"(ORPHEUS_SERVE__[A-Z_]+)=(\S+)", env))
    assert overrides["ORPHEUS_SERVE__ENGINE__MODEL_PATH"].startswith("/models/")
    assert overrides["ORPHEUS_SERVE__CODEC__PATH"].startswith("/models/")
    loaded = load_config(env=overrides)
    assert loaded.engine.model_path == "/models/orpheus" and loaded.codec.path == "/models/snac_24khz"


def test_the_healthcheck_runs_the_script_that_asks_ready(instructions: list[tuple[str, str]]) -> None:
    (healthcheck,) = args_of(instructions, "HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD ")
    assert "--start-period=" in options and "--interval=" in options
    argv = json.loads(command)  # exec form: no shell needed in the image
    assert argv == ["python3", "/app/docker/healthcheck.py"]
    copied = {args.split()[-1]: args.split()[-2] for args in args_of(instructions, "COPY")}
    assert copied["docker/healthcheck.py"] == "docker/healthcheck.py"  # WORKDIR /app
    healthcheck_module = _healthcheck_module()
    assert healthcheck_module.ready_url({}) == "http://127.0.0.1:8000/ready"
    assert healthcheck_module.ready_url({"ORPHEUS_SERVE__SERVER__HTTP_PORT": "9001"}) == "http://127.0.0.1:9001/ready"


def test_the_entry_point_is_production_server_and_sigterm_stops_it(instructions: list[tuple[str, str]]) -> None:
    (entrypoint,) = args_of(instructions, "ENTRYPOINT")
    argv = json.loads(entrypoint)  # exec form: the server is PID 1's child of no shell, and gets SIGTERM itself
    assert argv == ["python3", "/app/production_server.py"]
    assert (ROOT / "production_server.py").is_file()
    assert args_of(instructions, "WORKDIR") == ["/app"]
    assert args_of(instructions, "STOPSIGNAL") == ["SIGTERM"]
    copied_files = " ".join(args_of(instructions, "COPY"))
    assert "production_server.py" in copied_files


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return out


def ignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also excludes what lies under a match."""
    result = False
    parts = path.split("/")
    for negated, pattern in dockerignore_patterns():
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if fnmatch.fnmatch(prefix, pattern) or (pattern.startswith("**/")
                                                   and fnmatch.fnmatch(parts[depth - 1], pattern[3:])):
                result = not negated
                break
    return result


def test_dockerignore_keeps_environments_history_results_and_weights_out() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "results/x.json", "results-gpu/x.json", "models/orpheus/config.json",
                 "engines/orpheus-fp8/rank0.engine", "src/orpheus_serve/__pycache__/config.cpython-311.pyc",
                 "tests/test_config.py"):
        assert ignored(path), f"{path} would be sent to the builder"


def test_every_copy_source_exists_and_is_in_the_context(instructions: list[tuple[str, str]]) -> None:
    sources: list[str] = []
    for args in args_of(instructions, "COPY"):
        words = [word for word in shlex.split(args) if not word.startswith("--")]
        sources += words[:-1]
    for mount in re.findall(r"--mount=type=bind,source=([^,\s]+)", " ".join(args_of(instructions, "RUN"))):
        sources.append(mount)
    assert "docker/wheels" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source.rstrip("/")), f"COPY {source}: excluded by .dockerignore"
    # What the package build reads, and the tiny models' writer.
    for needed in ("pyproject.toml", "README.md", "src/", "config/", "scripts/"):
        assert needed in sources
    assert not ignored("docker/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")


def install_torch(tmp_path: Path, torch_version: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "TORCH_VERSION": torch_version,
           "WHEEL_DIR": str(tmp_path)}
    return subprocess.run(["sh", str(ROOT / "docker" / "install_torch.sh")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_install_torch_keeps_the_pinned_torch_and_refuses_a_wheel_of_another_release(tmp_path: Path) -> None:
    """docker/install_torch.sh, run against this environment (where torch is installed): the pinned release
    already there is kept, an empty pin keeps whatever is there, and a wheel of another release in the
    wheel folder is refused before pip sees it."""
    import torch

    have = torch.__version__
    kept = install_torch(tmp_path, have.split("+")[0])
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.splitlines() == [f"the base image already has torch {have}", f"torch {have}"]
    base = install_torch(tmp_path, "")
    assert base.returncode == 0 and base.stdout.strip() == f"keeping the base image's torch {have}"
    (tmp_path / "torch-1.0.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    refused = install_torch(tmp_path, have.split("+")[0])
    assert refused.returncode == 1
    assert "is not torch" in refused.stderr and "scripts/setup.sh's pin" in refused.stderr


# --- docker/healthcheck.py against a real server ---------------------------------------------------------------

def _healthcheck_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("orpheus_container_healthcheck", HEALTHCHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "ORPHEUS_SERVE__SERVER__HTTP_PORT": str(port)}
    return subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)


def test_healthcheck_against_a_real_server(tiny_orpheus: Path, pace: MachinePace) -> None:
    """Healthy once ready; unhealthy while it drains a stream after a stop (as SIGTERM starts one), and once
    nothing listens."""
    from gateway_support import sim_config, start_server

    from orpheus_serve.client import protocols as api_client

    server = start_server(sim_config(tiny_orpheus, **{"scheduler.admission": "slots"}))
    port = server.http_port
    try:
        ready = run_healthcheck(port)
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert ready.stdout.strip() == f"http://127.0.0.1:{port}/ready: ready"

        # A stream of ~8 s of audio, paced by flow control: the drain lasts seconds.
        streaming = threading.Thread(target=lambda: results.append(asyncio.run(api_client.synthesize_ws(
            server.base_url, "Keep going while the server stops.", max_tokens=700, seed=1))))
        results: list[api_client.ClientResult] = []
        streaming.start()
        server.call(_wait_until(lambda: server.server.gateway.stats()["scheduler"]["active_sessions"] == 1))
        # A drain window of 30 s on the reference machine, stretched to this one (tests/pace.py).
        stopping = asyncio.run_coroutine_threadsafe(server.server.shutdown(pace.window(30.0)), server.loop)
        server.call(_wait_until(lambda: server.server.gateway.readiness() == "shutting_down"))
        draining = run_healthcheck(port)
        assert draining.returncode == 1 and draining.stdout.strip().endswith(": shutting_down"), draining.stdout
        assert not stopping.done()  # still draining the stream
        stopping.result(timeout=pace.window(60.0))
        streaming.join(pace.window(60.0))
        assert results and results[0].ok and results[0].metrics["finish_reason"] in ("stop", "length")
    finally:
        server.stop(0)
    gone = run_healthcheck(port)
    assert gone.returncode == 1 and "Connection refused" in gone.stdout


async def _wait_until(condition: Any, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


class _CannedReady(BaseHTTPRequestHandler):
    """Answers /ready with a fixed status and body: the states a real server cannot be put in on demand."""

    code = 503
    body = b""

    def do_GET(self) -> None:
        self.send_response(self.code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(("code", "body", "healthy"), [
    (503, b'{"status": "saturated"}', True),      # a load signal: replacing the container would cut its streams
    (503, b'{"status": "engine_failed"}', False),
    (503, b'{"status": "warming_up"}', False),
    (200, b"<html>not the server</html>", False),  # something else on the port
])
def test_healthcheck_reads_the_readiness_state(code: int, body: bytes, healthy: bool) -> None:
    handler = type("Handler", (_CannedReady,), {"code": code, "body": body})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        done = run_healthcheck(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (done.returncode == 0) is healthy, done.stdout


def test_the_settings_the_container_test_changes_are_real_keys() -> None:
    """scripts/test_container.sh picks free ports and admits by slots through these keys (an unknown key
    would stop the server's start)."""
    script = (ROOT / "scripts" / "test_container.sh").read_text()
    keys = dict(re.findall(r'"(ORPHEUS_SERVE__[A-Z_]+)=([^"$]*)', script))
    assert set(keys) == {"ORPHEUS_SERVE__SERVER__HTTP_PORT", "ORPHEUS_SERVE__SERVER__GRPC_PORT",
                         "ORPHEUS_SERVE__SCHEDULER__ADMISSION"}
    loaded = load_config(env={"ORPHEUS_SERVE__SERVER__HTTP_PORT": "1", "ORPHEUS_SERVE__SERVER__GRPC_PORT": "2",
                              "ORPHEUS_SERVE__SCHEDULER__ADMISSION": keys["ORPHEUS_SERVE__SCHEDULER__ADMISSION"]})
    assert loaded.scheduler.admission == "slots"


# --- compose, Prometheus, Grafana -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_matches_the_compose_specification_schema(compose: dict[str, Any]) -> None:
    pytest.importorskip("check_jsonschema", reason="check-jsonschema (dev extra) vendors the Compose schema")
    import jsonschema

    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_class(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    # The schema is strict: a misspelt key fails it.
    broken = json.loads(json.dumps(compose))
    broken["services"]["orpheus-cpu"]["stop_grace_periodd"] = "30s"
    assert list(validator_class(schema).iter_errors(broken))


def test_compose_runs_the_server_with_a_gpu_or_on_cpu(compose: dict[str, Any]) -> None:
    config = load_config(env={})
    services = compose["services"]
    gpu, cpu = services["orpheus-gpu"], services["orpheus-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "deploy" not in cpu
    for service in (gpu, cpu):
        assert service["build"]["context"] == ".." and (COMPOSE.parent / ".." / "Dockerfile").exists()
        targets = {int(port.rsplit(":", 1)[1]) for port in service["ports"]}
        assert targets == {config.server.http_port, config.server.grpc_port}
        assert "${ORPHEUS_MODELS:-../models}:/models:ro" in service["volumes"]  # read-only; the tiny models are in the image
        # Compose gives a container stop_grace_period before SIGKILL: more than the server's drain.
        assert int(service["stop_grace_period"].rstrip("s")) > config.server.shutdown_grace_s
        assert service["init"] is True
        assert "orpheus-serve" in service["networks"]["default"]["aliases"]
        load_config(env={key: str(value) for key, value in service["environment"].items()})  # real keys
    assert cpu["build"]["args"]["BASE_IMAGE"].startswith("python:3.11")  # the CPU wheel's cp311


def test_prometheus_scrapes_the_server_and_loads_the_alert_rules(compose: dict[str, Any]) -> None:
    config = load_config(env={})
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "orpheus-serve"]
    assert job["metrics_path"] == "/metrics"
    (target,) = job["static_configs"][0]["targets"]
    assert target == f"orpheus-serve:{config.server.http_port}"
    assert prometheus["rule_files"] == ["alerts.yml"]
    service = compose["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in service["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in service["command"]


def test_grafana_is_provisioned_with_the_prometheus_data_source_and_the_dashboards_folder(
        compose: dict[str, Any]) -> None:
    service = compose["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "orpheus-serve.yaml").read_text())
    (provider,) = providers["providers"]
    assert mounts[provider["options"]["path"]] == "./grafana"  # the dashboards' JSON lives in deploy/grafana/


def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    config_path = PROMETHEUS
    if not (PROMETHEUS.parent / "alerts.yml").exists():
        # The rules are written elsewhere; check the config here with an empty rule file beside it.
        shutil.copy(PROMETHEUS, tmp_path / "prometheus.yml")
        (tmp_path / "alerts.yml").write_text("groups: []\n")
        config_path = tmp_path / "prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(config_path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# --- image names --------------------------------------------------------------------------------------------------

def test_image_names_agree_with_the_readme_and_the_package_version(compose: dict[str, Any]) -> None:
    version = pyproject()["project"]["version"]
    ray = pinned(pyproject()["project"]["optional-dependencies"]["ray"], "ray")
    readme = (ROOT / "README.md").read_text()
    kuberay_image = f"ghcr.io/orpheus-serve/orpheus-serve:{version}-ray{ray}-gpu"
    manifest = yaml.safe_load(KUBERAY.read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    images = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]]
    images += [group["template"]["spec"]["containers"][0]["image"] for group in cluster["workerGroupSpecs"]]
    assert set(images) == {kuberay_image}
    assert kuberay_image in readme
    for service, flavour in (("orpheus-gpu", "gpu"), ("orpheus-cpu", "cpu")):
        default = re.search(r":-([^}]+)}", compose["services"][service]["image"])
        assert default and default.group(1) == f"ghcr.io/orpheus-serve/orpheus-serve:{version}-{flavour}"
        assert default.group(1) in readme
    # The manifest's Serve config reads the config where the image puts it.
    assert "config: /app/config/model_config.yaml" in manifest["spec"]["serveConfigV2"]
