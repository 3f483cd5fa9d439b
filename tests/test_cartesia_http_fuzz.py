"""Generated bodies on Cartesia's HTTP endpoints (`POST /tts/bytes`, `POST /tts/sse`; sim engine and codec, no
pacing): whatever a client sends, the answer is audio or a Cartesia-shaped 4xx, never a server error, and the
server keeps serving."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orpheus_serve.api.launch import ServerThread
from tests.gateway_support import settled_stats, sim_config, start_server, stats

EXAMPLES = 120
ERROR_FIELDS = {"error_code", "title", "message", "request_id"}
SSE_KINDS = {"chunk", "timestamps", "done"}


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path) -> Iterator[ServerThread]:
    srv = start_server(sim_config(tiny_orpheus, **{"engine.sim.realtime": False, "engine.sim.end_after_frames": 2,
                                                   "codec.sim.realtime": False}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


_FIELDS = ("model_id", "transcript", "voice", "output_format", "generation_config", "language", "locale", "speed",
           "save", "context_id", "add_timestamps", "add_phoneme_timestamps", "duration", "unknown")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
formats = st.one_of(
    st.fixed_dictionaries({"container": st.sampled_from(["raw", "wav"]),
                           "encoding": st.sampled_from(["pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw"]),
                           "sample_rate": st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000])}),
    st.fixed_dictionaries({"container": st.just("mp3"), "sample_rate": st.sampled_from([8000, 24000, 48000])},
                          optional={"bit_rate": st.sampled_from([32000, 128000])}),
)
valid = st.fixed_dictionaries(
    {"transcript": st.sampled_from(["Hello there.", "Hi <laugh> you!", "\U0001F600 Emoji go, words stay.", "42"]),
     "voice": st.sampled_from(["tara", {"mode": "id", "id": "alloy"}, {"id": "a0e99841-438c-4a64-b679-ae501e7d6091"}]),
     "output_format": formats},
    optional={"model_id": st.text(max_size=10), "language": st.sampled_from(["en", None]),
              "generation_config": st.fixed_dictionaries({"speed": st.floats(0.6, 1.5)},
                                                         optional={"volume": st.floats(0.5, 2.0)})})
perturbed = st.tuples(valid, st.sampled_from(_FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
near = st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6)
bodies = valid | perturbed | near | json_values
answers: Counter[str] = Counter()


@given(path=st.sampled_from(["/tts/bytes", "/tts/sse"]),
       body=bodies.map(lambda b: json.dumps(b).encode()) | st.binary(max_size=60))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_any_body_gets_audio_or_a_cartesia_error(client: httpx.Client, path: str, body: bytes) -> None:
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    if response.status_code == 200:
        assert response.content, body
        if path == "/tts/sse":
            events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
                      if line.startswith("data: ")]
            assert {e["type"] for e in events} <= SSE_KINDS and events[-1]["type"] == "done", events[-3:]
        answers["audio"] += 1
        return
    assert response.status_code == 400, (response.status_code, response.text, body)
    error = response.json()
    assert set(error) == ERROR_FIELDS and error["error_code"] == "invalid_request" and error["message"], error
    answers["refused"] += 1


def test_the_fuzz_reached_both_paths_and_left_nothing_behind(server: ServerThread, client: httpx.Client) -> None:
    assert answers["audio"] >= 10 and answers["refused"] >= 10, answers
    good: dict[str, Any] = {"transcript": "Still here.", "voice": "tara",
                            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    assert client.post("/tts/bytes", json=good).status_code == 200
    snapshot = settled_stats(lambda: stats(server))
    requests = snapshot["gateway"]["requests"]["cartesia"]
    assert not {"internal_error", "engine_error"} & set(requests), requests
    assert snapshot["gateway"]["active_streams"]["cartesia"] == 0 and snapshot["kv_cache"]["used_slots"] == 0
