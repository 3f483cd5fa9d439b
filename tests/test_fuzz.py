"""Generated input against a real server (sim engine and codec, no pacing): the HTTP API against its own
OpenAPI document with the schemathesis CLI (`--checks all`, every phase that applies, with and without the API
key), and the WebSocket with random JSON from hypothesis.

No input may produce a 5xx, a response the document does not describe, or an abnormal close.
Example counts are CI-sized (the whole module runs in well under a minute on two cores).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import schemathesis
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.cli import schemathesis as schemathesis_cli
from schemathesis.specs.openapi.checks import positive_data_acceptance
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from orpheus_serve.request.errors import InvalidRequestError
from orpheus_serve.request.types import SynthesisRequest
from orpheus_serve.request.validation import documented_ranges
from orpheus_serve.service.service import TTSService
from tests.gateway_support import auth_header, sim_config, start_server, stats

API_EXAMPLES = 40  # per operation in the fuzzing phase; /v1/audio/speech is the one with a body
WS_EXAMPLES = 120
RANGES = documented_ranges()
API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path):
    # No pacing and short utterances: a fuzzed request costs milliseconds whatever its max_tokens. With an API
    # key, so that the document declares it and the auth check can confirm /v1/ refuses requests without it.
    srv = start_server(sim_config(tiny_orpheus, **{"engine.sim.realtime": False, "engine.sim.end_after_frames": 2,
                                                   "codec.sim.realtime": False, "server.api_keys": [API_KEY]}))
    yield srv
    srv.stop()


def unspeakable(service: TTSService, case: Any) -> list[InvalidRequestError]:
    """What a JSON Schema cannot say, the service decides: whether a text has something to speak within the
    profile's limits once normalised, and whether a voice name is known (README, "Input validation and text
    hygiene"). The service's reasons to refuse a body that fits the document; [] if it has none."""
    body = case.body if isinstance(case.body, dict) else None
    if body is None:
        return []
    reasons = []
    for name in ("top_k", "seed", "max_tokens"):
        # The generator and the checker work with doubles past 2**53: they take 2**64 + 383 (or the float
        # 1.8446744073709552e19) for a seed under `maximum: 2**64 - 1`. Valid means valid in exact arithmetic.
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and value not in RANGES[name]:
            reasons.append(InvalidRequestError(f"{name} is out of range", param=name))
    text = body.get("input") if body.get("input") is not None else body.get("text")
    if body.get("input") is not None and body.get("text") is not None and body["input"] != body["text"]:
        reasons.append(InvalidRequestError("two different texts", param="text"))
    try:
        service.validate(SynthesisRequest(text=text, voice=body.get("voice")))
    except InvalidRequestError as exc:
        reasons.append(exc)
    return reasons


@schemathesis.check
def service_decided_acceptance(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis's `positive_data_acceptance` (a body that fits the document is accepted), except for the
    bodies the service refuses for what a schema cannot say (`unspeakable`): those must get a 400 naming one of
    the parameters at fault."""
    service = _services.get(urlsplit(response.request.url).port)
    meta = case.meta
    if service is None or meta is None or not meta.generation.mode.is_positive or response.status_code == 401:
        return positive_data_acceptance(ctx, response, case)
    reasons = unspeakable(service, case)
    if not reasons:
        return positive_data_acceptance(ctx, response, case)
    error = json.loads(response.content)["error"] if response.status_code == 400 else {}
    if error.get("param") not in {reason.param for reason in reasons}:
        raise AssertionError(f"{case.body!r}: expected 400 naming one of {[str(r) for r in reasons]}; got "
                             f"{response.status_code} {response.content[:300]!r}")
    return None


_services: dict[int, TTSService] = {}  # the servers service_decided_acceptance judges for, by port


def test_http_api_conforms_to_its_openapi_document(server: ServerThread, tmp_path: Path) -> None:
    """The schemathesis CLI against the live server with `--checks all`: every phase that applies (the
    document's examples, coverage of its boundaries and of undocumented methods, fuzzing), data that fits the
    document and data that does not, and every check: 5xx, status codes, content types, headers and bodies as
    documented, bad input refused, good input accepted (refined by `service_decided_acceptance`), undocumented
    methods answered 405 with `Allow`, /v1/ refusing a missing or wrong key (the document declares the bearer
    key; `ignored_auth` probes without it)."""
    # Crash records (for `st replay`) go to the test's temporary folder, not the working tree.
    config = tmp_path / "schemathesis.toml"
    config.write_text(f'[cache]\ndirectory = "{tmp_path / "cache"}"\n')
    _services[server.http_port] = server.server.service
    try:
        result = CliRunner().invoke(schemathesis_cli, [
            "--config-file", str(config), "run", f"{server.base_url}/openapi.json", "--checks", "all",
            "--exclude-checks", "positive_data_acceptance", "--max-examples", str(API_EXAMPLES),
            "--header", f"Authorization: Bearer {API_KEY}", "--workers", "1", "--generation-database", "none",
            "--continue-on-failure", "--no-color"], catch_exceptions=False)
    finally:
        del _services[server.http_port]
    assert result.exit_code == 0, result.output[-20_000:]
    # Every operation was exercised, with and without a body fitting the document.
    assert "7 selected / 7 total" in result.output and "Tested: 7" in result.output, result.output
    assert "Coverage" in result.output and "Fuzzing" in result.output, result.output


def test_every_check_is_included() -> None:
    load_all_checks()
    assert set(CHECKS.get_all_names()) >= {
        "not_a_server_error", "status_code_conformance", "content_type_conformance", "response_headers_conformance",
        "response_schema_conformance", "negative_data_rejection", "positive_data_acceptance",
        "missing_required_header", "unsupported_method", "allow_header_conformance", "ignored_auth",
        "service_decided_acceptance"}


def test_no_fuzzed_request_was_a_server_error(server: ServerThread) -> None:
    requests = stats(server)["gateway"]["requests"]["rest"]
    assert requests.get("ok", 0) >= 10 and requests.get("invalid_request", 0) >= 10, requests
    assert requests.get("invalid_api_key", 0) >= 1, requests  # the auth check probed without the key
    assert not {"internal_error", "engine_error"} & set(requests), requests


# ------------------------------------------------------------------ WebSocket

_FIELDS = ("text", "input", "voice", "response_format", "sample_rate", "speed", "temperature", "top_p", "top_k",
           "repetition_penalty", "seed", "max_tokens", "request_id", "cancel")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Valid requests, valid requests with one field replaced by anything, requests made of known fields with any
# values, arbitrary JSON, arbitrary text and binary frames.
valid_requests = st.fixed_dictionaries(
    {"text": st.sampled_from(["Hello there.", "Hi <laugh> you!", "\U0001F600 Emoji go, words stay.", "42"])},
    optional={"voice": st.sampled_from(["tara", "alloy", " LEO "]), "response_format": st.sampled_from(["pcm", "wav"]),
              "sample_rate": st.sampled_from([8000, 16000, 24000]), "speed": st.floats(0.25, 4.0),
              "temperature": st.floats(0, 5), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 156940),
              "seed": st.integers(0, 2**64 - 1), "max_tokens": st.integers(7, 10**30),
              "request_id": st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=128)})
perturbed = st.tuples(valid_requests, st.sampled_from(_FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
near_requests = st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6)
messages = ((valid_requests | perturbed | near_requests | json_values).map(json.dumps) | st.text(max_size=60)
            | st.binary(max_size=60))
replies: Counter[str] = Counter()


@pytest.fixture(scope="module")
def ws(server: ServerThread):
    with ws_connect(api_client.stream_url(server.base_url), max_size=None,
                    additional_headers=auth_header(server)) as connection:
        yield connection


def _reply(ws: ClientConnection) -> dict[str, Any]:
    """The JSON message that ends this exchange (audio before it is skipped)."""
    while isinstance(message := ws.recv(timeout=30), bytes):
        pass
    return json.loads(message)


@given(message=messages)
@settings(max_examples=WS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_websocket_answers_any_message_and_stays_open(ws: ClientConnection, message: str | bytes) -> None:
    try:
        ws.send(message)
        reply = _reply(ws)
    except ConnectionClosed as exc:  # an abnormal close is the failure this test looks for
        pytest.fail(f"the socket closed on {message!r}: {exc}")
    if "error" in reply:
        assert reply["error"]["type"] == "invalid_request_error", reply  # never a server error
        assert reply["error"]["code"] == "invalid_request" and reply["error"]["message"], reply
        replies["error"] += 1
    elif reply.get("done") is True:
        assert reply["metrics"]["finish_reason"] in ("stop", "length"), reply
        replies["done"] += 1
    else:
        assert "cancelled" in reply, reply


def test_websocket_still_serves_after_the_fuzz(ws: ClientConnection) -> None:
    assert replies["done"] >= 10 and replies["error"] >= 10, replies  # the fuzz exercised both paths
    ws.send(json.dumps({"text": "Still here.", "request_id": "after-fuzz"}))
    reply = _reply(ws)
    assert reply["done"] is True and reply["request_id"] == "after-fuzz", reply
