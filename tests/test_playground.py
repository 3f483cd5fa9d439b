"""The playground's server side: the page and its files, `server.playground`, and the WebSocket's API key
as a subprotocol (browsers cannot set an Authorization header on a WebSocket).

Two real servers on loopback with the sim engine: one as configured by default (playground on, no
keys), one with API keys and the playground off. The page itself is driven in a real browser by
test_playground_browser.py.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.http import PLAYGROUND_DIR, WS_KEY_SUBPROTOCOL
from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from tests.gateway_support import check_openai_error, sim_config, start_server, stats, wait_for
from tests.pace import MachinePace

KEY = "pg-key/with+odd=chars"  # '/', '+' and '=' cannot appear in a subprotocol: base64url carries them
GOOD = {"Authorization": f"Bearer {KEY}"}
SHORT = {"text": "Hello.", "max_tokens": 28}


def key_subprotocol(key: str) -> str:
    return WS_KEY_SUBPROTOCOL + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


@pytest.fixture(scope="module")
def open_server(tiny_orpheus: Path):
    srv = start_server(sim_config(tiny_orpheus))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_orpheus: Path):
    srv = start_server(sim_config(tiny_orpheus, **{"server.api_keys": [KEY], "server.playground": False}))
    yield srv
    srv.stop()


def _assets(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(playground/static/[^"]+)"', html)


def _module_imports(js: str) -> list[str]:
    """Relative modules a script loads: static imports and the AudioWorklet module."""
    return re.findall(r'from "(\./[^"]+)"', js) + re.findall(r'new URL\("(\./[^"]+)", import\.meta\.url\)', js)


def test_page_is_served_at_root_and_at_playground_with_every_file_it_loads(open_server: ServerThread) -> None:
    base = open_server.base_url
    root = httpx.get(f"{base}/")
    assert root.status_code == 200
    assert root.headers["content-type"].startswith("text/html")
    assert root.headers["cache-control"] == "no-cache"
    assert httpx.get(f"{base}/playground").text == root.text
    # The page's policy allows nothing but this server; the browser tests run under it.
    policy = re.search(r'http-equiv="Content-Security-Policy"\s+content="([^"]+)"', root.text)
    assert policy is not None and "default-src 'self'" in policy.group(1)
    assert "unsafe-inline" not in policy.group(1) and "unsafe-eval" not in policy.group(1)

    assets = _assets(root.text)
    assert {"playground/static/playground.css", "playground/static/js/main.js",
            "playground/static/favicon.svg"} <= set(assets)
    scripts = ["playground/static/js/main.js"]
    seen: set[str] = set()
    while scripts:  # follow the module graph from main.js
        path = scripts.pop()
        if path in seen:
            continue
        seen.add(path)
        response = httpx.get(f"{base}/{path}")
        assert response.status_code == 200, path
        assert "javascript" in response.headers["content-type"], (path, response.headers["content-type"])
        folder = path.rsplit("/", 1)[0]
        scripts += [f"{folder}/{name.removeprefix('./')}" for name in _module_imports(response.text)]
    assert "playground/static/js/pcm-worklet.js" in seen
    assert {f"playground/static/js/{p.name}" for p in (PLAYGROUND_DIR / "js").glob("*.js")} == seen
    assert httpx.get(f"{base}/playground/static/playground.css").headers["content-type"].startswith("text/css")
    assert httpx.get(f"{base}/playground/static/favicon.svg").headers["content-type"] == "image/svg+xml"
    check_openai_error(httpx.get(f"{base}/playground/static/nothing-here.js"), 404, "not_found")


def test_static_files_reference_nothing_outside_the_server() -> None:
    files = [p for p in PLAYGROUND_DIR.rglob("*") if p.is_file()]
    assert files
    for path in files:
        text = path.read_text()
        # The one absolute URL allowed is the SVG namespace, a name rather than something fetched.
        external = [u for u in re.findall(r"(?:https?:)?//[A-Za-z0-9-]+\.[A-Za-z0-9.-]+", text)
                    if u != "http://www.w3.org"]
        assert not external, (path.name, external)


def test_playground_off_answers_404(keyed_server: ServerThread) -> None:
    base = keyed_server.base_url
    for path in ("/", "/playground", "/playground/static/js/main.js"):
        check_openai_error(httpx.get(f"{base}{path}"), 404, "not_found")
    assert httpx.get(f"{base}/v1/audio/voices", headers=GOOD).status_code == 200


def _ws_outcomes(server: ServerThread) -> dict[str, int]:
    return stats(server)["gateway"]["requests"]["ws"]


def _speak(ws) -> dict:
    ws.send(json.dumps(SHORT))
    audio = 0
    while isinstance(message := ws.recv(timeout=30), bytes):
        audio += len(message)
    reply = json.loads(message)
    assert reply["done"] is True and audio > 0, reply
    return reply


def test_websocket_takes_the_api_key_as_a_subprotocol(keyed_server: ServerThread, pace: MachinePace) -> None:
    url = api_client.stream_url(keyed_server.base_url)
    refused_before = _ws_outcomes(keyed_server).get("invalid_api_key", 0)
    sessions_before = stats(keyed_server)["scheduler"]["total_sessions"]

    # As the page does: the key beside a plain subprotocol, which is the one the server selects,
    # so the key is not echoed back in the response headers.
    with ws_connect(url, subprotocols=["orpheus.v1", key_subprotocol(KEY)]) as ws:
        assert ws.subprotocol == "orpheus.v1"
        _speak(ws)
    # Offered alone, the key's entry is the only one the server can select.
    with ws_connect(url, subprotocols=[key_subprotocol(KEY)]) as ws:
        assert ws.subprotocol == key_subprotocol(KEY)
        _speak(ws)
    # The header still works, and wins over a subprotocol.
    with ws_connect(url, additional_headers=GOOD, subprotocols=["orpheus.v1", key_subprotocol("wrong")]) as ws:
        _speak(ws)

    for offered in ([key_subprotocol("wrong")], ["orpheus.v1", WS_KEY_SUBPROTOCOL + "!not-base64!"],
                    ["orpheus.v1"]):
        with pytest.raises(websockets.InvalidStatus) as info:
            ws_connect(url, subprotocols=offered)
        assert info.value.response.status_code == 401
        assert json.loads(info.value.response.body)["error"]["code"] == "invalid_api_key"

    wait_for(lambda: _ws_outcomes(keyed_server).get("invalid_api_key", 0) == refused_before + 3, pace.window(2.0),
             "three refusals counted")
    assert stats(keyed_server)["scheduler"]["total_sessions"] == sessions_before + 3  # only the good ones ran


def test_key_subprotocol_is_accepted_where_no_key_is_needed(open_server: ServerThread) -> None:
    """A page that still holds a key from another server must not fail its handshake."""
    with ws_connect(api_client.stream_url(open_server.base_url),
                    subprotocols=["orpheus.v1", key_subprotocol("any")]) as ws:
        assert ws.subprotocol == "orpheus.v1"
        _speak(ws)
