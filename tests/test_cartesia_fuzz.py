"""Generated frames on the Cartesia-compatible WebSocket (sim engine and codec, no pacing): whatever a client
sends, every answer is a well-formed Cartesia message, never a server error, and the socket keeps serving."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from orpheus_serve.api.launch import ServerThread
from tests.cartesia_support import ws_url
from tests.gateway_support import settled_stats, sim_config, start_server, stats

EXAMPLES = 120
KINDS = {"chunk", "timestamps", "flush_done", "done", "error"}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path) -> Iterator[ServerThread]:
    srv = start_server(sim_config(tiny_orpheus, **{"engine.sim.realtime": False, "engine.sim.end_after_frames": 2,
                                                   "codec.sim.realtime": False}))
    yield srv
    srv.stop()


_FIELDS = ("context_id", "transcript", "continue", "flush", "model_id", "voice", "output_format", "add_timestamps",
           "max_buffer_delay_ms", "generation_config", "language", "cancel")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
valid = st.fixed_dictionaries(
    {"transcript": st.sampled_from(["Hello there.", "Hi <laugh> you!", "\U0001F600 Emoji go, words stay.", "42", ""]),
     "continue": st.just(False)},
    optional={"voice": st.sampled_from([{"mode": "id", "id": "tara"}, {"mode": "id", "id": "alloy"},
                                        {"mode": "id", "id": "a0e99841-438c-4a64-b679-ae501e7d6091"},
                                        {"mode": "embedding", "embedding": [0.1, 0.2]}]),
              "output_format": st.fixed_dictionaries({
                  "container": st.just("raw"), "encoding": st.sampled_from(["pcm_s16le", "pcm_f32le"]),
                  "sample_rate": st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000])}),
              "add_timestamps": st.booleans(), "flush": st.booleans(), "max_buffer_delay_ms": st.integers(0, 5000),
              "model_id": st.text(max_size=10), "language": st.sampled_from(["en", None]),
              "generation_config": st.fixed_dictionaries({"speed": st.floats(0.6, 1.5)})})
perturbed = st.tuples(valid, st.sampled_from(_FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
near = st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6)
bodies = valid | perturbed | near | json_values
counter = itertools.count()
replies: Counter[str] = Counter()


@pytest.fixture(scope="module")
def ws(server: ServerThread) -> Iterator[ClientConnection]:
    with ws_connect(ws_url(server), max_size=None) as connection:
        yield connection


def _with_fresh_id(body: Any) -> Any:
    """A context id no earlier example used, where the example has a string one (so contexts do not collide)."""
    if isinstance(body, dict) and isinstance(body.get("context_id"), str):
        return {**body, "context_id": f"{next(counter)}-{body['context_id']}"[:200]}
    if isinstance(body, dict) and "context_id" not in body and "transcript" in body:
        return {**body, "context_id": f"ctx-{next(counter)}"}
    return body


def _context_of(frame: str | bytes) -> str | None:
    try:
        body = json.loads(frame)
    except ValueError:
        return None
    context_id = body.get("context_id") if isinstance(body, dict) else None
    return context_id if isinstance(context_id, str) and 0 < len(context_id) <= 256 else None


@given(frame=bodies.map(_with_fresh_id).map(json.dumps) | st.text(max_size=60) | st.binary(max_size=60))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_any_frame_gets_well_formed_answers_and_the_socket_stays_open(ws: ClientConnection, frame: str | bytes) -> None:
    probe = f"probe-{next(counter)}"
    try:
        ws.send(frame)
        ws.send(json.dumps({"context_id": probe, "transcript": "Still here.", "continue": False}))
        while True:
            message = json.loads(ws.recv(timeout=30))
            assert message["type"] in KINDS and "context_id" in message, message
            if message["type"] == "error":
                assert message["status_code"] == 400 and message["done"] is True and message["error"], message
                replies["error"] += 1
            if message["context_id"] == probe and message["type"] in ("done", "error"):
                assert message["type"] == "done", message
                break
            if message["type"] == "done":
                replies["done"] += 1
        # A context the frame left open (continue: true) is cancelled, so they do not pile up to the limit.
        opened = _context_of(frame)
        if opened is not None:
            ws.send(json.dumps({"context_id": opened, "cancel": True}))
    except ConnectionClosed as exc:
        pytest.fail(f"the socket closed on {frame!r}: {exc}")


def test_the_fuzz_reached_both_paths_and_left_nothing_behind(server: ServerThread, ws: ClientConnection) -> None:
    assert replies["done"] >= 10 and replies["error"] >= 10, replies
    ws.close()  # contexts the fuzz left open (continue: true) end with the socket
    snapshot = settled_stats(lambda: stats(server))
    requests = snapshot["gateway"]["requests"]["cartesia"]
    assert not {"internal_error", "engine_error"} & set(requests), requests
    assert snapshot["gateway"]["active_streams"]["cartesia"] == 0 and snapshot["kv_cache"]["used_slots"] == 0
