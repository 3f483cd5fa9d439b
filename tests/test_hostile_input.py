"""A hostile client against a real server (tiny Llama + tiny SNAC on CPU) on REST, WebSocket and gRPC.

Every case gets its interface's error, exactly: a 4xx with the OpenAI error body (code and
parameter), a WebSocket JSON error message on a socket that stays open, INVALID_ARGUMENT with
the parameter in the trailing metadata. The few hostile requests that are valid (a huge
max_tokens, text padded with emoji) are served normally. All of it runs while a greedy stream
shares the engine's steps; that stream's tokens are bit-identical to the same request run alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosedError
from websockets.frames import Frame, Opcode

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from orpheus_serve.proto import orpheus_pb2 as pb
from orpheus_serve.service.build import build_service
from orpheus_serve.token_format import SAMPLES_PER_FRAME, VOCAB_SIZE
from tests.gateway_support import tiny_config

MAX_SEQ_LEN = 320
GOOD = {"text": "The good stream keeps going.", "temperature": 0.0, "max_tokens": 10**12}
INVALID = "invalid_request"
LONE_SURROGATE = '"\\ud800"'  # JSON text for a lone surrogate (json.dumps would escape the backslash)


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None):
    config = tiny_config(tiny_orpheus, tiny_snac, **{"engine.max_seq_len": MAX_SEQ_LEN})
    srv = ServerThread(config, build_service(config, record_tokens=True)).start()
    yield srv
    srv.stop()


# ---------------------------------------------------------------- the cases

def _rest_cases() -> list[tuple[str, dict[str, Any], int, str, str | None]]:
    """(name, request, HTTP status, error code, error param)."""
    def post(**body: Any) -> dict[str, Any]:
        return {"json": {"input": "Hello there.", **body}}

    def raw(content: bytes | str) -> dict[str, Any]:
        data = content.encode() if isinstance(content, str) else content
        return {"content": data, "headers": {"Content-Type": "application/json"}}

    return [
        ("top_k of 2**63", post(top_k=2**63), 400, INVALID, "top_k"),
        ("top_k past the vocabulary", post(top_k=VOCAB_SIZE + 1), 400, INVALID, "top_k"),
        ("negative top_k", post(top_k=-1), 400, INVALID, "top_k"),
        ("seed -1", post(seed=-1), 400, INVALID, "seed"),
        ("seed 2**64", post(seed=2**64), 400, INVALID, "seed"),
        ("seed of 5000 digits", raw('{"input": "hi", "seed": ' + "7" * 5000 + "}"), 400, INVALID, None),
        ("temperature overflows to inf", raw('{"input": "hi", "temperature": 1e999}'), 400, INVALID, "temperature"),
        ("max_tokens under one frame", post(max_tokens=6), 400, INVALID, "max_tokens"),
        ("lone surrogate in input", raw('{"input": ' + LONE_SURROGATE + "}"), 400, INVALID, "input"),
        ("lone surrogate in voice", raw('{"input": "hi", "voice": ' + LONE_SURROGATE + "}"), 400, INVALID, "voice"),
        ("JSON nested 60000 deep", raw("[" * 60_000), 400, INVALID, None),
        ("body not UTF-8", raw(b'{"input": "caf\xe9"}'), 400, INVALID, None),
        ("only an emotion tag", post(input="<laugh>"), 400, INVALID, "input"),
        ("only unknown tags", post(input="<foo></foo><bar/>"), 400, INVALID, "input"),
        ("only emoji", post(input="\U0001F600" * 50), 400, INVALID, "input"),
        ("only punctuation", post(input="?! ... --"), 400, INVALID, "input"),
        ("too long once NFKC expands it", post(input="\ufdfa" * 20), 400, INVALID, "input"),
        ("too many tokens for its characters", post(input="\U00020000" * 200), 400, INVALID, "input"),
        ("request_id is not a REST field", post(request_id="x" * 10_000), 400, INVALID, "request_id"),
    ]


def _ws_cases() -> list[tuple[str, str | bytes, str | None]]:
    """(name, message, error param); every reply's code is invalid_request."""
    def msg(**body: Any) -> str:
        return json.dumps({"text": "Hello there.", **body})

    return [
        ("JSON nested 60000 deep", "[" * 60_000, None),
        ("integer of 5000 digits", '{"text": "hi", "seed": ' + "7" * 5000 + "}", None),
        ("top_k of 2**63", msg(top_k=2**63), "top_k"),
        ("seed -1", msg(seed=-1), "seed"),
        ("lone surrogate in text", '{"text": ' + LONE_SURROGATE + "}", "input"),
        ("only an emotion tag", msg(text="<sigh>"), "input"),
        ("only emoji", msg(text="\U0001F389" * 20), "input"),
        ("request_id of 129 characters", msg(request_id="r" * 129), "request_id"),
        ("request_id with a newline", msg(request_id="a\nb"), "request_id"),
        ("max_tokens of zero", msg(max_tokens=0), "max_tokens"),
        ("binary frame", b"\x00\xff" * 100, None),
        ("not an object", "[1, 2, 3]", None),
    ]


def _grpc_cases() -> list[tuple[str, str, bytes, str | None]]:
    """(name, method, serialized request, error param); every status is INVALID_ARGUMENT."""
    def req(**kwargs: Any) -> bytes:
        return pb.SynthesizeRequest(**{"text": "Hello there.", **kwargs}).SerializeToString()

    synthesize = "/orpheus.v1.Synthesizer/Synthesize"
    return [
        ("text not UTF-8", synthesize, b"\x0a\x04caf\xe9", None),
        ("voice not UTF-8", synthesize, req() + b"\x12\x02\xc3\x28", None),
        ("corrupt wire format", synthesize, b"\x0a\x40abc", None),
        ("top_k past the vocabulary", synthesize, req(sampling=pb.SamplingOptions(top_k=2**31 - 1)), "top_k"),
        ("seed -1", synthesize, req(sampling=pb.SamplingOptions(seed=-1)), "seed"),
        ("request_id of 129 characters", synthesize, req(request_id="r" * 129), "request_id"),
        ("request_id of 10000 characters", synthesize, req(request_id="r" * 10_000), "request_id"),
        ("only an emotion tag", synthesize, req(text="<laugh>"), "input"),
        ("only emoji", synthesize, req(text="\U0001F600\u2764\ufe0f"), "input"),
        ("ListVoices that does not decode", "/orpheus.v1.Synthesizer/ListVoices", b"\xff\xff\xff", None),
    ]


# ---------------------------------------------------------------- the suites

async def _rest_suite(base: str) -> list[str]:
    problems = []
    async with httpx.AsyncClient(timeout=60) as http:
        for name, spec, status, code, param in _rest_cases():
            response = await http.post(f"{base}/v1/audio/speech", **spec)
            error = response.json().get("error", {}) if response.headers.get("content-type") == "application/json" \
                else {}
            got = (response.status_code, error.get("code"), error.get("param"))
            if got != (status, code, param) or set(error) != {"message", "type", "param", "code"} \
                    or not error["message"]:
                problems.append(f"REST {name}: {got} {response.text[:300]}")
        # Valid, if hostile: 300 emoji around two words (dropped), and a huge max_tokens (clamped to the context).
        response = await http.post(f"{base}/v1/audio/speech", json={"input": "Hi " + "\U0001F600" * 300,
                                                                   "response_format": "pcm", "max_tokens": 70})
        if response.status_code != 200 or not response.content or len(response.content) % (2 * SAMPLES_PER_FRAME):
            problems.append(f"REST emoji-padded text: {response.status_code} {response.text[:200]}")
    return problems


async def _ws_suite(base: str) -> list[str]:
    problems = []
    async with ws_connect(api_client.stream_url(base), max_size=None) as ws:
        for name, message, param in _ws_cases():
            await ws.send(message)
            reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
            error = reply.get("error", {})
            if (error.get("code"), error.get("param")) != (INVALID, param) or not error.get("message"):
                problems.append(f"WS {name}: {reply}")
        # Still open, and serves a request whose max_tokens is far past the context: a normal "length" finish.
        await ws.send(json.dumps({"text": "Still here, and long.", "max_tokens": 10**15, "request_id": "after"}))
        audio = 0
        while isinstance(message := await asyncio.wait_for(ws.recv(), 120), bytes):
            audio += len(message)
        reply = json.loads(message)
        metrics = reply.get("metrics", {})
        if not (reply.get("done") and reply["request_id"] == "after" and metrics["finish_reason"] == "length"
                and audio == 2 * metrics["samples"] > 0 and metrics["tokens"] <= MAX_SEQ_LEN):
            problems.append(f"WS after the bad messages: {reply}, {audio} bytes")
    return problems


async def _grpc_suite(address: str) -> list[str]:
    problems = []
    async with grpc.aio.insecure_channel(address) as channel:
        for name, method, payload, param in _grpc_cases():
            # Raw bytes in, so requests no stub would build (bad UTF-8, corrupt wire format) go as sent.
            call = channel.unary_stream(method) if method.endswith("Synthesize") else channel.unary_unary(method)
            try:
                if method.endswith("Synthesize"):
                    async for _ in call(payload, timeout=60):
                        pass
                else:
                    await call(payload, timeout=60)
                problems.append(f"gRPC {name}: succeeded")
            except grpc.aio.AioRpcError as exc:
                trailing = dict(exc.trailing_metadata() or ())
                got = (exc.code(), trailing.get("error-code"), trailing.get("error-param"))
                if got != (grpc.StatusCode.INVALID_ARGUMENT, INVALID, param) or not exc.details():
                    problems.append(f"gRPC {name}: {got} {exc.details()}")
        # Valid: a max_tokens of 2**31 - 1 ends at the context with "length".
        stub = channel.unary_stream("/orpheus.v1.Synthesizer/Synthesize",
                                    response_deserializer=pb.SynthesizeResponse.FromString)
        replies = [reply async for reply in stub(pb.SynthesizeRequest(text="Long enough.", sampling=pb.SamplingOptions(
            max_tokens=2**31 - 1)).SerializeToString(), timeout=120)]
        if not replies or replies[-1].metrics.finish_reason != "length":
            problems.append(f"gRPC huge max_tokens: {replies[-1:]}")
    return problems


async def _greedy_stream(base: str, started: asyncio.Event | None = None) -> tuple[bytes, dict[str, Any], float]:
    """The good request over a WebSocket: (PCM, final metrics, when its final message came)."""
    audio = bytearray()
    async with ws_connect(api_client.stream_url(base)) as ws:
        await ws.send(json.dumps({**GOOD, "response_format": "pcm"}))
        while isinstance(message := await asyncio.wait_for(ws.recv(), 120), bytes):
            audio += message
            if started is not None:
                started.set()
        reply = json.loads(message)
    assert reply.get("done"), reply
    return bytes(audio), reply["metrics"], time.perf_counter()


def test_hostile_input_on_every_interface_while_a_greedy_stream_stays_bit_identical(server: ServerThread) -> None:
    base = server.base_url
    token_log = server.server.service.token_log
    assert token_log is not None

    alone_pcm, alone_metrics, _ = asyncio.run(_greedy_stream(base))

    async def under_attack() -> tuple[tuple[bytes, dict[str, Any], float], float, list[str]]:
        started = asyncio.Event()
        good = asyncio.create_task(_greedy_stream(base, started))
        await asyncio.wait_for(started.wait(), 60)  # the good stream is running: attack now
        attack_started = time.perf_counter()
        suites = await asyncio.gather(_rest_suite(base), _ws_suite(base), _grpc_suite(server.grpc_address))
        return await good, attack_started, [p for suite in suites for p in suite]

    (pcm, metrics, good_ended), attack_started, problems = asyncio.run(under_attack())
    assert not problems, "\n".join(problems)
    assert good_ended > attack_started  # it was still streaming when the attack began

    # The engine's output for the good stream is bit-identical to the run alone...
    assert token_log[f"{metrics['request_id']}-0"]["frames"] == token_log[f"{alone_metrics['request_id']}-0"]["frames"]
    assert metrics["finish_reason"] == alone_metrics["finish_reason"] == "length"  # its max_tokens is 10**12
    assert (metrics["tokens"], metrics["samples"]) == (alone_metrics["tokens"], alone_metrics["samples"])
    assert len(pcm) == len(alone_pcm) == 2 * metrics["samples"]
    # ...and so is its audio, but for the codec's batched float arithmetic (it shared SNAC batches with
    # the valid hostile requests), which moves a sample by a unit or two at most.
    diff = np.abs(np.frombuffer(pcm, "<i2").astype(np.int32) - np.frombuffer(alone_pcm, "<i2").astype(np.int32))
    assert diff.max() <= 2, diff.max()

    # Nothing became a 500, and no step failed.
    snapshot = httpx.get(f"{base}/v1/stats").json()
    assert not any(status in ("internal_error", "engine_error")
                   for counts in snapshot["gateway"]["requests"].values() for status in counts)
    assert snapshot["engine"]["step_errors"] == 0 and snapshot["engine"]["alive"] is True


def test_a_text_message_that_is_not_utf8_gets_an_error_message_before_the_rfc_close(server: ServerThread) -> None:
    async def scenario() -> tuple[dict[str, Any], int | None, str | None]:
        async with ws_connect(api_client.stream_url(server.base_url)) as ws:
            # A client library refuses to send this; write the frame by hand.
            ws.protocol.send_frame(Frame(Opcode.TEXT, b'{"text": "caf\xe9"}'))
            ws.send_data()
            reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(ConnectionClosedError) as closed:
                await asyncio.wait_for(ws.recv(), 30)
            rcvd = closed.value.rcvd
            return reply, rcvd.code if rcvd else None, rcvd.reason if rcvd else None

    reply, code, reason = asyncio.run(scenario())
    assert reply["error"]["code"] == INVALID and "not valid UTF-8" in reply["error"]["message"]
    assert (code, reason) == (1007, "text message is not valid UTF-8")
    # The server is fine, and so is a new connection.
    result = asyncio.run(api_client.synthesize_ws(server.base_url, "Hello again.", max_tokens=28))
    assert result.ok, result.error
