"""Generated frames on the ElevenLabs multi-stream-input WebSocket (sim engine and codec, no pacing): whatever
a client sends, every answer is a well-formed ElevenLabs message, never a server error, and the socket keeps
serving its other contexts."""

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
from tests.gateway_support import settled_stats, sim_config, start_server, stats

EXAMPLES = 120


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path) -> Iterator[ServerThread]:
    srv = start_server(sim_config(tiny_orpheus, **{"engine.sim.realtime": False, "engine.sim.end_after_frames": 2,
                                                   "codec.sim.realtime": False}))
    yield srv
    srv.stop()


# close_socket is left out: it ends the socket on purpose (tests/test_elevenlabs_hostile.py covers it).
_FIELDS = ("text", "context_id", "voice_settings", "flush", "try_trigger_generation", "close_context",
           "generation_config", "model_id", "xi_api_key")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
valid = st.fixed_dictionaries(
    {"text": st.sampled_from([" ", "Hello there. ", "Hi <laugh> you! ", "\U0001F600 Emoji go, words stay. ", "42",
                              ""])},
    optional={"voice_settings": st.fixed_dictionaries(
                  {}, optional={"stability": st.floats(0, 1), "similarity_boost": st.floats(0, 1),
                                "speed": st.floats(0.7, 1.2), "use_speaker_boost": st.booleans()}),
              "flush": st.booleans(), "try_trigger_generation": st.booleans(), "close_context": st.booleans(),
              "generation_config": st.fixed_dictionaries({"chunk_length_schedule": st.lists(st.integers(50, 500))})})
perturbed = st.tuples(valid, st.sampled_from(_FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
near = st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6)
bodies = valid | perturbed | near | json_values
counter = itertools.count()
replies: Counter[str] = Counter()


@pytest.fixture(scope="module")
def ws(server: ServerThread) -> Iterator[ClientConnection]:
    url = f"ws://127.0.0.1:{server.http_port}/v1/text-to-speech/tara/multi-stream-input?output_format=pcm_16000"
    with ws_connect(url, max_size=None) as connection:
        yield connection


def _with_fresh_id(body: Any) -> Any:
    """A context id no earlier example used (finished ids are not reopened), where the example has one."""
    if isinstance(body, dict) and isinstance(body.get("context_id"), str) and body["context_id"]:
        return {**body, "context_id": f"{next(counter)}-{body['context_id']}"[:200]}
    if isinstance(body, dict) and "context_id" not in body and "text" in body:
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
        for body in ({"text": "Still here. ", "context_id": probe}, {"context_id": probe, "flush": True},
                     {"context_id": probe, "close_context": True}):
            ws.send(json.dumps(body))
        while True:
            message = json.loads(ws.recv(timeout=30))
            assert isinstance(message, dict) and "contextId" in message, message
            if "error" in message:
                assert message["code"] == 400 and message["message"] and message["error"], message
                assert message["contextId"] != probe, message
                replies["error"] += 1
                continue
            assert set(message) <= {"audio", "isFinal", "alignment", "normalizedAlignment", "contextId"}, message
            if message["isFinal"] and message["contextId"] == probe:
                break
            if message.get("audio"):
                replies["audio"] += 1
        # A context the frame left open is closed (a barge-in), so they do not pile up to the limit.
        opened = _context_of(frame)
        if opened is not None:
            ws.send(json.dumps({"context_id": opened, "close_context": True}))
    except ConnectionClosed as exc:
        pytest.fail(f"the socket closed on {frame!r}: {exc}")


def test_the_fuzz_reached_both_paths_and_left_nothing_behind(server: ServerThread, ws: ClientConnection) -> None:
    assert replies["audio"] >= 10 and replies["error"] >= 10, replies
    ws.close()
    snapshot = settled_stats(lambda: stats(server))
    requests = snapshot["gateway"]["requests"]["elevenlabs"]
    assert not {"internal_error", "engine_error"} & set(requests), requests
    assert snapshot["gateway"]["active_streams"]["elevenlabs"] == 0 and snapshot["kv_cache"]["used_slots"] == 0
