"""Streaming clients for the protocols, shared by client.py and the benchmarks.

Each `synthesize_*` coroutine sends one request and returns a `ClientResult`:
the audio bytes, the arrival time and size of every audio message (from which
TTFB, underruns and RTF follow, ARCHITECTURE §8), the server's final metrics where
the protocol carries them, and a status: `ok`, `rejected` (the server is
full, not ready or shutting down: retry later) or `error` (with a message
saying what went wrong, including "cannot connect"). They never raise for
server-side failures, so a benchmark can fire thousands and count outcomes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
import httpx
import websockets
from websockets.asyncio.client import connect as ws_connect

from ..audio.encoding import AUDIO_FORMATS, TELEPHONY_FORMATS, decode_audio, default_sample_rate, wav_header
from ..proto import AUDIO_FORMAT_NUMBERS
from ..proto import orpheus_pb2 as pb
from ..proto import orpheus_pb2_grpc as pb_grpc
from ..request.types import PROTOCOLS
from ..token_format import SAMPLE_RATE
from .records import StreamRecord

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_GRPC_ADDR = "127.0.0.1:50051"
STREAM_PATH = "/v1/audio/stream"
CARTESIA_PATH = "/tts/websocket"

_REJECTED_HTTP = {429, 503}
_REJECTED_CODES = {"server_busy", "too_many_connections", "unavailable"}
_REJECTED_GRPC = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "seed")


@dataclass(slots=True)
class ClientResult(StreamRecord):
    """One request as the client saw it. A `StreamRecord` (protocol, sent_s, chunks of (arrival
    perf_counter, bytes), status ok | rejected | error, error), so benchmark summaries take it as is."""

    format: str = "pcm"
    sample_rate: int = SAMPLE_RATE
    audio: bytearray = field(default_factory=bytearray)
    code: str | None = None  # HTTP status, gRPC status name, or the error code of a WebSocket error message
    metrics: dict[str, Any] | None = None
    request_id: str | None = None
    # Text streamed in (synthesize_ws_context): when the first word, the end of the first clause and the
    # last word were sent (perf_counter seconds).
    input_marks: dict[str, float] = field(default_factory=dict)

    def underruns(self) -> tuple[int, float]:
        """(count, stall seconds) for a player starting at the first byte; needs PCM at the model's rate."""
        if self.format != "pcm" or self.sample_rate != SAMPLE_RATE:
            raise ValueError("underruns are measured on 24 kHz pcm streams, where bytes give playback time")
        return StreamRecord.underruns(self)

    def samples(self) -> int:
        """Samples of audio received (decoding the bytes for encoded formats)."""
        if self.format == "pcm":
            return len(self.audio) // 2
        decoded, _ = decode_audio(bytes(self.audio), self.format, sample_rate=self.sample_rate)
        return len(decoded)

    @property
    def audio_seconds(self) -> float:
        if not self.audio:
            return 0.0
        if self.format == "pcm":
            return len(self.audio) / 2 / self.sample_rate
        decoded, rate = decode_audio(bytes(self.audio), self.format, sample_rate=self.sample_rate)
        return len(decoded) / rate

    def _receive(self, data: bytes) -> None:
        self.chunks.append((time.perf_counter(), len(data)))
        self.audio += data

    def _fail(self, status: str, message: str, code: str | None = None) -> ClientResult:
        self.status, self.error, self.code = status, message, code
        return self


def _sampling(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in _SAMPLING_FIELDS and v is not None}


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(body: bytes) -> tuple[str, str | None]:
    try:
        error = json.loads(body)["error"]
        return str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:300] or "(empty body)", None


def http_client(base_url: str, timeout_s: float = 300.0) -> httpx.AsyncClient:
    """An AsyncClient for `base_url`; share one across many requests (benchmarks).

    TLS settings are built only for https URLs: loading the CA bundle costs
    ~70 ms of CPU per client, which would otherwise land in the measured TTFB
    of whatever else runs on the loop. Redirects are not followed, so a plain
    http client never reaches a TLS endpoint.
    """
    return httpx.AsyncClient(timeout=timeout_s, verify=base_url.lower().startswith("https://"))


async def synthesize_rest(base_url: str, text: str, *, voice: str | None = None, fmt: str = "pcm",
                          speed: float = 1.0, api_key: str | None = None, client: httpx.AsyncClient | None = None,
                          timeout_s: float = 300.0, **sampling: Any) -> ClientResult:
    """POST /v1/audio/speech, streaming the body."""
    body: dict[str, Any] = {"model": "orpheus", "input": text, "response_format": fmt, "speed": speed,
                            **_sampling(sampling)}
    if voice is not None:
        body["voice"] = voice
    result = ClientResult("rest", time.perf_counter(), format=fmt, sample_rate=default_sample_rate(fmt),
                          text_chars=len(text))
    return await _post_streamed(result, base_url, f"{base_url.rstrip('/')}/v1/audio/speech", client=client,
                                timeout_s=timeout_s, json=body, headers=_auth_headers(api_key))


async def _post_streamed(result: ClientResult, base_url: str, url: str, *, client: httpx.AsyncClient | None,
                         timeout_s: float, error_message: Callable[[bytes], tuple[str, str | None]] | None = None,
                         **request: Any) -> ClientResult:
    """POST `url` and stream the audio body into `result`; an HTTP error or a transport failure becomes
    the result's status (`error_message` reads the protocol's error body)."""
    own_client = client is None
    http = client if client is not None else http_client(base_url, timeout_s)
    try:
        result.sent_s = time.perf_counter()
        async with http.stream("POST", url, **request) as response:
            result.request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                message, code = (error_message or _error_message)(await response.aread())
                status = "rejected" if response.status_code in _REJECTED_HTTP else "error"
                return result._fail(status, f"HTTP {response.status_code}: {message}", code or
                                    str(response.status_code))
            async for data in response.aiter_raw():
                if data:
                    result._receive(data)
    except httpx.ConnectError as exc:
        return result._fail("error", f"cannot connect to {base_url}: {exc} (is the server running?)", "connect")
    except httpx.HTTPError as exc:
        return result._fail("error", f"{type(exc).__name__} talking to {base_url}: {exc}", "transport")
    finally:
        if own_client:
            await http.aclose()
    return result


def stream_url(base_url: str, path: str = STREAM_PATH) -> str:
    """http://host:port -> ws://host:port/v1/audio/stream (https -> wss)."""
    parts = urlsplit(base_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


async def _read_until_done(ws: Any, result: ClientResult) -> ClientResult:
    """Binary audio into `result` until the `done` message (or an error message)."""
    async for frame in ws:
        if isinstance(frame, bytes):
            result._receive(frame)
            continue
        reply = json.loads(frame)
        result.request_id = reply.get("request_id", result.request_id)
        if reply.get("done"):
            result.metrics = reply.get("metrics")
            return result
        if "error" in reply:
            error = reply["error"]
            status = "rejected" if error.get("code") in _REJECTED_CODES else "error"
            return result._fail(status, str(error.get("message")), error.get("code"))
    return result._fail("error", "the server closed the WebSocket before the request finished", "closed")


async def _ws_exchange(exchange: Callable[[], Awaitable[ClientResult]], result: ClientResult, url: str,
                       timeout_s: float) -> ClientResult:
    """Run one WebSocket exchange; connection and protocol failures become the result's status."""
    try:
        return await asyncio.wait_for(exchange(), timeout_s)
    except websockets.InvalidStatus as exc:
        response = exc.response
        message_text, code = _error_message(response.body or b"")
        status = "rejected" if response.status_code in _REJECTED_HTTP else "error"
        return result._fail(status, f"HTTP {response.status_code}: {message_text}", code or str(response.status_code))
    except (OSError, websockets.InvalidHandshake) as exc:
        return result._fail("error", f"cannot connect to {url}: {exc} (is the server running?)", "connect")
    except websockets.ConnectionClosed as exc:
        return result._fail("error", f"WebSocket closed: {exc}", "closed")
    except asyncio.TimeoutError:
        return result._fail("error", f"no complete answer within {timeout_s:g}s", "timeout")


async def synthesize_ws(base_url: str, text: str, *, voice: str | None = None, fmt: str = "pcm",
                        speed: float = 1.0, sample_rate: int | None = None, api_key: str | None = None,
                        timeout_s: float = 300.0, **sampling: Any) -> ClientResult:
    """One request over a fresh WebSocket: binary audio messages until `done`. `sample_rate` None: the
    server's default for `fmt`."""
    sample_rate = default_sample_rate(fmt) if sample_rate is None else sample_rate
    message: dict[str, Any] = {"text": text, "response_format": fmt, "speed": speed, "sample_rate": sample_rate,
                               **_sampling(sampling)}
    if voice is not None:
        message["voice"] = voice
    result = ClientResult("ws", time.perf_counter(), format=fmt, sample_rate=sample_rate, text_chars=len(text))
    url = stream_url(base_url)

    async def exchange() -> ClientResult:
        async with ws_connect(url, additional_headers=_auth_headers(api_key), max_size=None, open_timeout=30) as ws:
            result.sent_s = time.perf_counter()
            await ws.send(json.dumps(message))
            return await _read_until_done(ws, result)

    return await _ws_exchange(exchange, result, url, timeout_s)


def llm_pieces(text: str) -> list[str]:
    """`text` as an LLM would stream it: one piece per word, each with the space before the next word."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


_CLAUSE_END = (",", ";", ":", ".", "!", "?")


async def synthesize_ws_context(base_url: str, text: str, *, tokens_per_s: float = 30.0, voice: str | None = None,
                                fmt: str = "pcm", api_key: str | None = None, timeout_s: float = 300.0,
                                **sampling: Any) -> ClientResult:
    """One context over a fresh WebSocket, its text sent word by word at `tokens_per_s` (an LLM writing the
    reply), then `end`. TTFB counts from the first word; `input_marks` says when the first clause ended."""
    pieces = llm_pieces(text)
    result = ClientResult("ws", time.perf_counter(), format=fmt, text_chars=len(text))
    url = stream_url(base_url)
    context = "bench"

    async def send_text(ws: Any) -> None:
        for k, piece in enumerate(pieces):
            if k:
                await asyncio.sleep(1.0 / tokens_per_s)
            message: dict[str, Any] = {"context_id": context, "text": piece}
            if k == 0:
                message.update(response_format=fmt, **_sampling(sampling), **({"voice": voice} if voice else {}))
            now = time.perf_counter()
            if k == 0:
                result.sent_s = now
                result.input_marks["first_word_s"] = now
            if "first_clause_s" not in result.input_marks and piece.rstrip().endswith(_CLAUSE_END):
                result.input_marks["first_clause_s"] = now
            await ws.send(json.dumps(message))
        result.input_marks["last_word_s"] = time.perf_counter()
        result.input_marks.setdefault("first_clause_s", result.input_marks["last_word_s"])
        await ws.send(json.dumps({"context_id": context, "end": True}))

    async def exchange() -> ClientResult:
        async with ws_connect(url, additional_headers=_auth_headers(api_key), max_size=None, open_timeout=30) as ws:
            sender = asyncio.create_task(send_text(ws))
            try:
                return await _read_until_done(ws, result)
            finally:
                sender.cancel()

    return await _ws_exchange(exchange, result, url, timeout_s)


async def synthesize_cartesia(base_url: str, text: str, *, voice: str | None = None, fmt: str = "pcm",
                              speed: float = 1.0, sample_rate: int | None = SAMPLE_RATE, api_key: str | None = None,
                              timeout_s: float = 300.0, **sampling: Any) -> ClientResult:
    """One context over a fresh Cartesia-compatible WebSocket (/tts/websocket), the whole text at once:
    `chunk` messages until `done`. Raw audio only (`pcm` as pcm_s16le, `mulaw`, `alaw`); the protocol
    carries no sampling options. `sample_rate` None: 24 kHz (8 kHz for G.711)."""
    rate = sample_rate or (8000 if fmt in ("mulaw", "alaw") else SAMPLE_RATE)
    result = ClientResult("cartesia", time.perf_counter(), format=fmt, sample_rate=rate, text_chars=len(text))
    encoding = {"pcm": "pcm_s16le", "mulaw": "pcm_mulaw", "alaw": "pcm_alaw"}.get(fmt)
    if encoding is None:
        return result._fail("error", "the Cartesia protocol streams raw audio: use pcm, mulaw or alaw", "format")
    message: dict[str, Any] = {
        "context_id": uuid.uuid4().hex, "transcript": text, "continue": False, "model_id": "orpheus",
        "voice": {"mode": "id", "id": voice}, "add_timestamps": False,
        "output_format": {"container": "raw", "encoding": encoding, "sample_rate": rate}}
    if speed != 1.0:
        message["generation_config"] = {"speed": speed}
    url = stream_url(base_url, CARTESIA_PATH)

    async def exchange() -> ClientResult:
        headers = {"X-API-Key": api_key} if api_key else {}
        async with ws_connect(url, additional_headers=headers, max_size=None, open_timeout=30) as ws:
            result.sent_s = time.perf_counter()
            await ws.send(json.dumps(message))
            async for frame in ws:
                reply = json.loads(frame)
                if reply.get("type") == "chunk":
                    result._receive(base64.b64decode(reply["data"]))
                elif reply.get("type") == "done":
                    return result
                elif reply.get("type") == "error":
                    code = reply.get("error_code")
                    status = "rejected" if code in _REJECTED_CODES else "error"
                    return result._fail(status, str(reply.get("error")), code)
            return result._fail("error", "the server closed the WebSocket before the context finished", "closed")

    return await _ws_exchange(exchange, result, url, timeout_s)


# Formats the ElevenLabs API names by output_format (the client's own format -> its rate and name).
_ELEVENLABS_FORMATS = {"pcm": "pcm_{rate}", "mulaw": "ulaw_8000", "alaw": "alaw_8000", "mp3": "mp3_44100_128",
                       "opus": "opus_48000_64"}


async def synthesize_elevenlabs(base_url: str, text: str, *, voice: str | None = None, fmt: str = "pcm",
                                speed: float = 1.0, sample_rate: int | None = SAMPLE_RATE, api_key: str | None = None,
                                client: httpx.AsyncClient | None = None, timeout_s: float = 300.0,
                                **sampling: Any) -> ClientResult:
    """POST /v1/text-to-speech/{voice}/stream (the ElevenLabs-compatible API), streaming the body. Sampling
    options travel as ElevenLabs carries them: `seed`, and the temperature as `voice_settings.stability`;
    the others (max_tokens, top_p, ...) have no ElevenLabs field and are not sent."""
    rate = {"mulaw": 8000, "alaw": 8000, "mp3": 44100, "opus": 48000}.get(fmt, sample_rate or SAMPLE_RATE)
    result = ClientResult("elevenlabs", time.perf_counter(), format=fmt, sample_rate=rate, text_chars=len(text))
    if fmt not in _ELEVENLABS_FORMATS:
        return result._fail("error", f"the ElevenLabs API has no {fmt} output", "format")
    settings: dict[str, Any] = {"speed": speed}
    if sampling.get("temperature") is not None:
        settings["stability"] = max(0.0, 1.0 - sampling["temperature"] / 1.2)
    body: dict[str, Any] = {"text": text, "model_id": "orpheus", "voice_settings": settings,
                            "seed": sampling.get("seed")}
    url = f"{base_url.rstrip('/')}/v1/text-to-speech/{voice or 'tara'}/stream"
    return await _post_streamed(result, base_url, url, client=client, timeout_s=timeout_s,
                                error_message=_elevenlabs_error_message, json=body,
                                params={"output_format": _ELEVENLABS_FORMATS[fmt].format(rate=rate)},
                                headers={"xi-api-key": api_key} if api_key else {})


def _elevenlabs_error_message(body: bytes) -> tuple[str, str | None]:
    try:
        detail = json.loads(body)["detail"]
        return str(detail["message"]), detail.get("status")
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:300], None


async def synthesize_grpc(address: str, text: str, *, voice: str | None = None, fmt: str = "pcm",
                          speed: float = 1.0, sample_rate: int | None = None, api_key: str | None = None,
                          channel: grpc.aio.Channel | None = None, timeout_s: float = 300.0,
                          **sampling: Any) -> ClientResult:
    """orpheus.v1.Synthesizer/Synthesize, server-streaming."""
    sample_rate = default_sample_rate(fmt) if sample_rate is None else sample_rate
    options = _sampling(sampling)
    request = pb.SynthesizeRequest(text=text, voice=voice or "", format=AUDIO_FORMAT_NUMBERS[fmt],
                                   sample_rate=sample_rate, speed=speed,
                                   sampling=pb.SamplingOptions(**options) if options else None)
    result = ClientResult("grpc", time.perf_counter(), format=fmt, sample_rate=sample_rate, text_chars=len(text))
    own_channel = channel is None
    chan = channel if channel is not None else grpc.aio.insecure_channel(address)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    try:
        stub = pb_grpc.SynthesizerStub(chan)
        result.sent_s = time.perf_counter()
        call = stub.Synthesize(request, metadata=metadata, timeout=timeout_s)
        async for response in call:
            if response.HasField("audio"):
                result._receive(response.audio.audio)
            else:
                m = response.metrics
                result.metrics = {"request_id": m.request_id, "ttfb_ms": m.ttfb_ms, "queue_ms": m.queue_ms,
                                  "wall_ms": m.wall_ms, "audio_seconds": m.audio_seconds, "rtf": m.rtf,
                                  "samples": m.samples, "tokens": m.tokens, "frames": m.frames,
                                  "text_chunks": m.text_chunks, "finish_reason": m.finish_reason}
                result.request_id = m.request_id
    except grpc.aio.AioRpcError as exc:
        return _grpc_failure(result, address, exc)
    finally:
        if own_channel:
            await chan.close()
    return result


def _grpc_failure(result: ClientResult, address: str, exc: grpc.aio.AioRpcError) -> ClientResult:
    """A failed call as the result's status: cannot connect, rejected (retry later) or an error."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE and not result.chunks and "connect" in (exc.details() or "").lower():
        return result._fail("error", f"cannot connect to {address}: {exc.details()} (is the server running?)",
                            "connect")
    status = "rejected" if code in _REJECTED_GRPC else "error"
    return result._fail(status, f"gRPC {code.name}: {exc.details()}", code.name)


# Riva's AudioEncoding values for the formats it carries (riva_audio.proto).
RIVA_ENCODINGS: dict[str, int] = {"pcm": 1, "flac": 2, "mulaw": 3, "opus": 4, "alaw": 20}


async def synthesize_riva(address: str, text: str, *, voice: str | None = None, fmt: str = "pcm",
                          speed: float = 1.0, sample_rate: int | None = None, api_key: str | None = None,
                          channel: grpc.aio.Channel | None = None, timeout_s: float = 300.0,
                          **sampling: Any) -> ClientResult:
    """nvidia.riva.tts.RivaSpeechSynthesis/SynthesizeOnline with one message (Riva's streaming call); the
    Orpheus sampling options and speed travel in `custom_configuration`. Riva has no final metrics message."""
    from riva.client.proto import riva_tts_pb2 as rtts
    from riva.client.proto import riva_tts_pb2_grpc as rtts_grpc

    result = ClientResult("riva", time.perf_counter(), format=fmt, text_chars=len(text))
    if fmt not in RIVA_ENCODINGS:
        return result._fail("error", f"Riva carries {', '.join(RIVA_ENCODINGS)}, not {fmt}", "format")
    sample_rate = default_sample_rate(fmt) if sample_rate is None else sample_rate
    result.sample_rate = sample_rate
    custom = {k: str(v) for k, v in _sampling(sampling).items()}
    if speed != 1.0:
        custom["speed"] = str(speed)
    request = rtts.SynthesizeSpeechRequest(text=text, language_code="en-US", encoding=RIVA_ENCODINGS[fmt],
                                           sample_rate_hz=sample_rate, voice_name=voice or "",
                                           custom_configuration=custom)
    own_channel = channel is None
    chan = channel if channel is not None else grpc.aio.insecure_channel(address)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    try:
        result.sent_s = time.perf_counter()
        call = rtts_grpc.RivaSpeechSynthesisStub(chan).SynthesizeOnline(iter([request]), metadata=metadata,
                                                                        timeout=timeout_s)
        async for response in call:
            if response.audio:
                result._receive(response.audio)
        for key, value in await call.initial_metadata():
            if key == "x-request-id":
                result.request_id = value
    except grpc.aio.AioRpcError as exc:
        return _grpc_failure(result, address, exc)
    finally:
        if own_channel:
            await chan.close()
    return result


async def synthesize(protocol: str, text: str, *, url: str = DEFAULT_URL, grpc_addr: str = DEFAULT_GRPC_ADDR,
                     **kwargs: Any) -> ClientResult:
    if protocol == "rest":
        kwargs.pop("sample_rate", None)
        return await synthesize_rest(url, text, **kwargs)
    if protocol == "ws":
        return await synthesize_ws(url, text, **kwargs)
    if protocol == "grpc":
        return await synthesize_grpc(grpc_addr, text, **kwargs)
    if protocol == "riva":
        return await synthesize_riva(grpc_addr, text, **kwargs)
    if protocol == "cartesia":
        kwargs.pop("client", None)
        return await synthesize_cartesia(url, text, **kwargs)
    if protocol == "elevenlabs":
        return await synthesize_elevenlabs(url, text, **kwargs)
    raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")


# ------------------------------------------------------------------------ CLI


def _format_for(output: str, fmt: str | None) -> str:
    if fmt is not None:
        return fmt
    ext = os.path.splitext(output)[1].lower().lstrip(".")
    # A .wav output is requested as raw PCM and written with an exact-length header.
    return {"wav": "pcm", "ogg": "opus"}.get(ext, ext if ext in AUDIO_FORMATS else "pcm")


def write_output(path: str, result: ClientResult) -> None:
    data = bytes(result.audio)
    if path.lower().endswith(".wav") and result.format in ("pcm", "wav", *TELEPHONY_FORMATS):
        if result.format in TELEPHONY_FORMATS:
            pcm = decode_audio(data, result.format, sample_rate=result.sample_rate)[0].astype("<i2").tobytes()
        else:
            pcm = data[44:] if result.format == "wav" else data
        data = wav_header(result.sample_rate, num_samples=len(pcm) // 2) + pcm
    with open(path, "wb") as f:
        f.write(data)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Synthesize speech with a running orpheus-serve server and "
                                                 "report TTFB, audio seconds and real-time factor.")
    parser.add_argument("--text", required=True)
    parser.add_argument("--voice", default=None, help="Orpheus voice or OpenAI alias (default: the server's)")
    parser.add_argument("--output", default="out.wav", help="file to write (.wav gets an exact-length header)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="rest")
    parser.add_argument("--format", choices=AUDIO_FORMATS, default=None,
                        help="audio format on the wire (default: from --output's extension, pcm for .wav)")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--sample-rate", type=int, default=None,
                        help="ws, grpc and riva only (default: 8000 for mulaw/alaw, else 24000)")
    parser.add_argument("--url", default=DEFAULT_URL, help="HTTP base URL (rest and ws)")
    parser.add_argument("--grpc-addr", default=DEFAULT_GRPC_ADDR, help="gRPC address (grpc and riva)")
    parser.add_argument("--api-key", default=os.environ.get("ORPHEUS_API_KEY"),
                        help="API key (default: $ORPHEUS_API_KEY)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt = _format_for(args.output, args.format)
    result = asyncio.run(synthesize(
        args.protocol, args.text, url=args.url, grpc_addr=args.grpc_addr, voice=args.voice, fmt=fmt,
        speed=args.speed, sample_rate=args.sample_rate, api_key=args.api_key, temperature=args.temperature,
        seed=args.seed, max_tokens=args.max_tokens))
    if not result.ok:
        hint = " (the server is busy or not ready; retry shortly)" if result.status == "rejected" else ""
        print(f"error: {result.error}{hint}", file=sys.stderr)
        return 2 if result.status == "rejected" else 1
    write_output(args.output, result)
    ttfb = result.ttfb_s
    seconds = result.audio_seconds
    print(f"protocol      {result.protocol} ({fmt})")
    print(f"request id    {result.request_id}")
    print(f"TTFB          {ttfb * 1000:.1f} ms" if ttfb is not None else "TTFB          (no audio)")
    print(f"audio         {seconds:.3f} s in {len(result.chunks)} chunks, {len(result.audio)} bytes")
    print(f"RTF           {result.rtf:.3f}" if result.rtf is not None else "RTF           n/a")
    print(f"wrote         {args.output}")
    return 0
