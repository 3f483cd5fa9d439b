"""The messages between API processes and the engine-core process: msgpack, plain values only.

Nothing is pickled: a request is its fields, audio is its PCM bytes (msgpack
`bin`, copied once into the message), a stats snapshot is its dataclasses'
fields. Each message is one msgpack array whose first item names its kind.

API process -> engine core (a DEALER per API process -> the core's ROUTER):

    [CALL_SUBMIT, seq, api, request...]    answered: [seq, OK] or [seq, FULL|INVALID|UNAVAILABLE, message, extra]
    [CALL_STATS, seq, with_host?]          answered: [seq, OK, stats..., [[api, figures], ...]]; the stats carry the
                                           core_host record (core/host_time.py) when with_host is true
    [CALL_SHUTDOWN, seq]                   answered: [seq, OK]; the core then stops
    [CALL_ADAPTERS, seq, op, name]         answered: [seq, OK, [status, ...]] or [seq, INVALID, reason]
    [CALL_TOKEN_LOG, seq, [session_id, ...]]
                                           answered: [seq, OK, [[session_id, frames, finish_reason, ended_at,
                                           ended_step], ...]] (core.frame_log.FrameEntry's fields)
                                           (a core started with record_tokens; otherwise an empty list)
    [NOTES, api, [[session_id, samples], ...], [cancelled session_id, ...], [released session_id, ...]]
                                           not answered, batched per loop pass; they apply to the
                                           sender's sessions only (a session id another API process
                                           submitted since is not its to note)
    [FIGURES, api, {request and gateway counters}]   not answered: an API process's own counters, for the
                                           others' /v1/stats (server.api_processes > 1), sent when they change
    [API_GONE, api]                        not answered: API process `api` died; its sessions are cancelled
    [LOOP_LAG, api, seconds]               not answered: how late API process `api`'s event loop runs (every 50 ms)

engine core -> API process `api` (a PUSH per API process -> its PULL):

    [[session_id, PCM bytes] | [session_id, outcome, tokens, frames, queue_s, error] | [ENGINE_DEAD, error], ...]
                                           a batch of outputs; ENGINE_DEAD (once, to every API process): the
                                           engine died, whoever's sessions failed
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import msgpack

from ..engines.base import MemoryReport
from ..request.errors import ServiceUnavailableError
from ..scheduler import FlowStats, InvalidSessionError, SchedulerFullError, SchedulerStats, SessionRequest
from ..scheduler.step import SamplingParams
from .client import EngineCoreStats, Outcome, SessionDone, SessionOutput

CALL_SUBMIT = 1
CALL_STATS = 2
NOTES = 3
CALL_SHUTDOWN = 4
FIGURES = 5
API_GONE = 6
LOOP_LAG = 7
ENGINE_DEAD = 8  # an output entry no session owns (session ids are strings)
CALL_ADAPTERS = 9  # [kind, seq, op, name] -> [seq, OK, [status, ...]] | [seq, INVALID | FULL, reason]
CALL_TOKEN_LOG = 10
CALL_PREFETCH = 11  # [kind, seq, adapter] -> [seq, OK, None] | [seq, INVALID | FULL, reason]: before a submit
FILE_CALLS = (CALL_ADAPTERS, CALL_PREFETCH)  # answered from the core's file thread, in order, not at once

OK = 0
FULL = 1  # SchedulerFullError: extra is retry_after_s
INVALID = 2  # InvalidSessionError: extra is the parameter at fault
UNAVAILABLE = 3  # the engine is dead: ServiceUnavailableError


def refusal_error(status: int, message: str, extra: Any = None) -> Exception:
    """The exception a refused CALL_SUBMIT stands for (the statuses above)."""
    if status == FULL:
        return SchedulerFullError(message, retry_after_s=extra)
    if status == INVALID:
        return InvalidSessionError(message, param=extra)
    return ServiceUnavailableError(message)

# Bounded queues on every socket (messages, not bytes): a batch of outputs is one message.
SOCKET_HWM = 1000


@dataclass(frozen=True, slots=True)
class CoreAddresses:
    """ZeroMQ endpoints: the core binds `input`; API process i binds `outputs[i]`."""

    input: str
    outputs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the core tells its API processes once its engine is built."""

    max_seq_len: int
    num_slots: int
    pid: int


@dataclass(frozen=True, slots=True)
class EngineDead:
    """The core's engine died (ENGINE_DEAD): every API process learns it at once, for its /ready and submits."""

    error: str


# Both ends run this same module: the positional encodings below (astuple, then the constructor) need no
# field names on the wire.


def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)


def encode_request(req: SessionRequest) -> list[Any]:
    return [req.request_id, list(req.prompt_ids), list(astuple(req.sampling)), req.arrival_s,
            req.playback_start_s, req.audio_before_s, req.adapter]


def decode_request(fields_: list[Any]) -> SessionRequest:
    request_id, prompt_ids, sampling, arrival_s, playback_start_s, audio_before_s, adapter = fields_
    return SessionRequest(request_id=request_id, prompt_ids=tuple(prompt_ids), sampling=SamplingParams(*sampling),
                          arrival_s=arrival_s, playback_start_s=playback_start_s, audio_before_s=audio_before_s,
                          adapter=adapter)


def encode_output(session_id: str, item: SessionOutput) -> list[Any]:
    if isinstance(item, bytes):
        return [session_id, item]
    return [session_id, item.outcome.value, item.tokens, item.frames, item.queue_s, item.error]


def encode_engine_dead(error: str | None) -> list[Any]:
    return [ENGINE_DEAD, error]


def decode_output(entry: list[Any]) -> tuple[str, SessionOutput] | EngineDead:
    if entry[0] == ENGINE_DEAD:
        return EngineDead(entry[1] or "the engine failed")
    if len(entry) == 2:
        return entry[0], entry[1]
    session_id, outcome, tokens, frames, queue_s, error = entry
    return session_id, SessionDone(Outcome(outcome), tokens=tokens, frames=frames, queue_s=queue_s, error=error)


def encode_stats(stats: EngineCoreStats) -> list[Any]:
    return [list(astuple(stats.scheduler)), list(astuple(stats.flow)), stats.codec, stats.codec_backlog_frames,
            stats.codec_oldest_pending_s, list(astuple(stats.memory)), stats.engine_alive, stats.engine_failure,
            stats.steps, stats.step_errors, stats.busy_s, stats.engine_elapsed_s, stats.loop_s, stats.core_cpu_s,
            stats.core_host]


def decode_stats(values: list[Any]) -> EngineCoreStats:
    (scheduler, flow, codec, backlog, oldest, memory, alive, failure, steps, step_errors, busy_s, elapsed_s, loop_s,
     cpu_s, core_host) = values
    return EngineCoreStats(
        scheduler=SchedulerStats(*scheduler), flow=FlowStats(*flow), codec=codec, codec_backlog_frames=backlog,
        codec_oldest_pending_s=oldest, memory=MemoryReport(*memory), engine_alive=alive, engine_failure=failure,
        steps=steps, step_errors=step_errors, busy_s=busy_s, engine_elapsed_s=elapsed_s, loop_s=loop_s,
        core_cpu_s=cpu_s, core_host=core_host)

