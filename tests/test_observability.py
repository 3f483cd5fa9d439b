"""The Grafana dashboard and the Prometheus alert rules (deploy/) against what a running server exports.

- every metric a dashboard panel or an alert rule names is in `/metrics` of a real server (uvicorn, the
  tiny torch model) after a few requests;
- the rules pass `promtool check rules` and their unit tests (`promtool test rules`);
- every dashboard query parses, and returns data when a real Prometheus scrapes a real server;
- playback judged at the server: a server slower than real time counts its stream as underran, and a
  context whose client let its audio run out before sending more text is not an underrun.

promtool and prometheus are Debian's `prometheus` package (scripts/test.sh installs it); the tests that
need them skip, saying so, only where it is absent.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client.protocols import stream_url
from orpheus_serve.metrics.playback import PlaybackClock
from tests.gateway_support import metric_values, settled_stats, sim_config, stats, tiny_config

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "orpheus-serve.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
METRIC_NAME = re.compile(r"orpheus:[a-zA-Z0-9_:]+")
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NO_PROMETHEUS = "Debian's `prometheus` package is not installed (scripts/test.sh installs it with apt-get)"


def dashboard_panels() -> list[dict[str, Any]]:
    return [panel for panel in json.loads(DASHBOARD.read_text())["panels"] if panel["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def concrete(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in as Grafana would."""
    return (expr.replace("$__rate_interval", "15s").replace("$__range", "5m")
            .replace('instance=~"$instance"', 'instance=~".*"'))


def scrape_names(text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[ServerThread]:
    srv = ServerThread(tiny_config(tiny_orpheus, tiny_snac)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def exposition(server: ServerThread) -> str:
    """/metrics after a completed REST request, a refused one and a WebSocket request."""
    base = server.base_url
    ok = httpx.post(f"{base}/v1/audio/speech", json={"model": "orpheus", "input": "Hello there.", "voice": "tara",
                                                      "response_format": "pcm", "seed": 1}, timeout=120)
    assert ok.status_code == 200 and ok.content
    bad = httpx.post(f"{base}/v1/audio/speech", json={"model": "orpheus", "input": "Hi.", "voice": "nobody"},
                     timeout=30)
    assert bad.status_code == 400

    async def over_websocket() -> None:
        async with connect(stream_url(base), max_size=None) as ws:
            await ws.send(json.dumps({"text": "Hi there.", "voice": "leo", "response_format": "pcm"}))
            while isinstance(message := await asyncio.wait_for(ws.recv(), 120), bytes):
                pass
            assert json.loads(message).get("done") is True, message

    asyncio.run(over_websocket())
    settled_stats(lambda: stats(server), outcomes=3)
    return httpx.get(f"{base}/metrics").text


def test_the_dashboard_and_the_rules_name_metrics_at_all() -> None:
    # The regex must find the names: an empty set would let the export check below pass vacuously.
    names = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert {"orpheus:time_to_first_byte_seconds_bucket", "orpheus:underrunning_streams",
            "orpheus:api_process_cpu_seconds_total", "orpheus:requests_total"} <= names, names
    rule_names = {name for rule in alert_rules() for name in METRIC_NAME.findall(rule["expr"])}
    assert {"orpheus:saturated", "orpheus:engine_alive", "orpheus:ttfb_target_seconds",
            "orpheus:streams_played_total", "orpheus:engine_core_restarts_total",
            "orpheus:api_process_restarts_total"} <= rule_names, rule_names


def test_every_metric_a_panel_or_a_rule_uses_is_exported(exposition: str) -> None:
    exported = scrape_names(exposition)
    for where, exprs in (("dashboard", dashboard_exprs()), ("alerts.yml", [r["expr"] for r in alert_rules()])):
        for expr in exprs:
            missing = set(METRIC_NAME.findall(expr)) - exported
            assert not missing, f"{where}: {expr!r} uses {sorted(missing)}, which /metrics does not export"


def test_the_new_figures_say_what_happened(exposition: str) -> None:
    assert metric_values(exposition, "orpheus:engine_alive") == {"": 1.0}
    assert metric_values(exposition, "orpheus:engine_core_restarts_total") == {"": 0.0}
    assert metric_values(exposition, "orpheus:api_process_restarts_total") == {"": 0.0}
    # The default (conversational) profile's target_ttfb_ms.
    assert metric_values(exposition, "orpheus:ttfb_target_seconds") == {"": 0.1}
    # Both streams had audio and are counted once each, real-time or not, under their protocol.
    played = metric_values(exposition, "orpheus:streams_played_total")
    assert sum(v for k, v in played.items() if 'protocol="rest"' in k) == 1.0, played
    assert sum(v for k, v in played.items() if 'protocol="ws"' in k) == 1.0, played
    # Every stream has closed: none is underrunning now.
    assert set(metric_values(exposition, "orpheus:underrunning_streams").values()) == {0.0}
    # One API process: one row, whose requests are every request the gateway counted.
    requests = metric_values(exposition, "orpheus:api_process_requests_total")
    assert requests == {'{api_process="0"}': sum(metric_values(exposition, "orpheus:requests_total").values())}
    assert requests['{api_process="0"}'] == 3.0
    assert metric_values(exposition, "orpheus:api_process_cpu_seconds_total")['{api_process="0"}'] > 0


def test_the_dashboard_is_importable_and_every_panel_uses_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard_panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    titles = " | ".join(panel["title"] for panel in dashboard_panels())
    for wanted in ("Time to first byte", "real-time vs underrunning", "Admitted vs capacity", "Queue",
                   "Codec backlog", "KV-cache slots", "Tokens per second", "Audio seconds per second",
                   "Errors by code", "per API process"):
        assert wanted.lower() in titles.lower(), (wanted, titles)


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMETHEUS)
def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout
    tested = subprocess.run([PROMTOOL, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True,
                            timeout=120, cwd=ALERT_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every rule has a unit test.
    tested_alerts = {case["alertname"] for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
                     for case in test.get("alert_rule_test", ())}
    assert tested_alerts == {rule["alert"] for rule in alert_rules()}


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMETHEUS)
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses rule expressions: the dashboard's queries as recording rules."""
    assert PROMTOOL is not None
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, expr in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_a_real_prometheus_scraping_the_server_answers_every_dashboard_query(
        server: ServerThread, exposition: str, tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    port = _free_port()
    target = server.base_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "orpheus-serve", "static_configs": [{"targets": [target]}]}]}))
    log = (tmp_path / "prometheus.log").open("w")
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        def query(expr: str) -> list[dict[str, Any]]:
            body = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        # Wait (bounded) until Prometheus has scraped the server often enough for rate() over 15 s.
        deadline = time.monotonic() + 90
        while True:
            try:
                if query('count_over_time(orpheus:engine_alive[15s]) >= 4'):
                    break
            except httpx.TransportError:
                pass  # not listening yet
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        # More traffic while it scrapes, so the rates have something to show.
        response = httpx.post(f"{server.base_url}/v1/audio/speech", json={
            "model": "orpheus", "input": "One more.", "voice": "tara", "response_format": "pcm"}, timeout=120)
        assert response.status_code == 200
        time.sleep(2.5)
        empty = [expr for expr in dashboard_exprs() if not query(concrete(expr))]
        assert not empty, f"dashboard queries with no data from a scraped server: {empty}"
        rules = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"]
        loaded = {rule["name"]: rule for group in rules for rule in group["rules"]}
        assert set(loaded) == {rule["alert"] for rule in alert_rules()}
        assert all(rule["health"] == "ok" for rule in loaded.values()), loaded
        # A healthy, idle server: nothing fires.
        assert not [rule for rule in loaded.values() if rule["state"] == "firing"], loaded
    finally:
        prometheus.terminate()
        prometheus.wait(30)
        log.close()


# ------------------------------------------------------------------ playback judged at the server


def test_playback_clock_counts_late_audio_as_underruns() -> None:
    clock = PlaybackClock()
    assert clock.deliver(10.0, 0.5) == 0.0  # playback starts: audio until 10.5
    assert clock.deliver(10.3, 0.5) == 0.0  # in time: until 11.0
    assert clock.deliver(11.2, 0.5) == pytest.approx(0.2)  # 0.2 s of silence, then until 11.7
    assert clock.deliver(11.7, 0.1) == 0.0  # exactly on time
    assert (clock.underruns, clock.stall_s) == (1, pytest.approx(0.2))
    # A gap that is not the server's (the client sent no text): playback resumes, nothing counted.
    assert clock.deliver(20.0, 0.5, resume=True) == 0.0
    assert clock.buffered_until == 20.5 and clock.underruns == 1


def test_a_server_slower_than_real_time_counts_its_streams_as_underran(tiny_orpheus: Path) -> None:
    # Steps of 30 ms: a frame (7 tokens, 85 ms of audio) takes 210 ms, so no stream can play real-time.
    config = sim_config(tiny_orpheus, **{"engine.sim.step_base_ms": 30.0, "engine.sim.end_after_frames": 12})
    srv = ServerThread(config).start()
    try:
        response = httpx.post(f"{srv.base_url}/v1/audio/speech", json={
            "model": "orpheus", "input": "Hello there.", "voice": "tara", "response_format": "pcm"}, timeout=120)
        assert response.status_code == 200 and response.content
        settled_stats(lambda: stats(srv), outcomes=1)
        text = httpx.get(f"{srv.base_url}/metrics").text
    finally:
        srv.stop()
    played = metric_values(text, "orpheus:streams_played_total")
    assert played['{playback="underran",protocol="rest"}'] == 1.0, played
    assert played['{playback="real_time",protocol="rest"}'] == 0.0, played
    assert metric_values(text, "orpheus:stream_underruns_total")['{protocol="rest"}'] >= 1
    # 12 frames (1.02 s of audio) produced at 85/210 of real time: playback stalls for about 1.5 s in all.
    assert metric_values(text, "orpheus:stream_underrun_seconds_total")['{protocol="rest"}'] > 0.3


def test_a_context_that_waits_for_its_clients_text_is_not_an_underrun(tiny_orpheus: Path) -> None:
    # A fast engine: the only long gap in the audio is the client's, which sends its second sentence
    # two seconds after the first one's audio has all arrived.
    config = sim_config(tiny_orpheus, **{"engine.sim.step_base_ms": 1.0, "engine.sim.end_after_frames": 6})
    srv = ServerThread(config).start()

    async def scenario() -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        async with connect(stream_url(srv.base_url), max_size=None) as ws:
            await ws.send(json.dumps({"context_id": "c", "text": "Hello there. ", "voice": "tara",
                                      "response_format": "pcm", "timestamps": True}))

            async def until(done: Any) -> None:
                while True:
                    message = await asyncio.wait_for(ws.recv(), 60)
                    if isinstance(message, str):
                        messages.append(json.loads(message))
                        if done(messages[-1]):
                            return

            await until(lambda m: "timestamps" in m or "error" in m)
            await asyncio.sleep(2.0)  # the first sentence's audio (0.5 s) has long played out
            await ws.send(json.dumps({"context_id": "c", "text": "How are you?", "end": True}))
            await until(lambda m: "done" in m or "error" in m)
        return messages

    try:
        messages = asyncio.run(scenario())
        settled_stats(lambda: stats(srv), outcomes=1)
        text = httpx.get(f"{srv.base_url}/metrics").text
    finally:
        srv.stop()
    assert messages[-1].get("done") is True, messages[-1]
    assert sum(m.get("timestamps") is not None for m in messages) == 2, messages
    # Counted as an underrun, the client's pause would be a stall of about 1.5 s.
    stall = metric_values(text, "orpheus:stream_underrun_seconds_total")['{protocol="ws"}']
    assert stall < 1.0, stall
    played = metric_values(text, "orpheus:streams_played_total")
    assert sum(v for k, v in played.items() if 'protocol="ws"' in k) == 1.0, played
