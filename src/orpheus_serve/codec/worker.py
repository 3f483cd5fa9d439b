"""The codec worker: one thread that batches every session's SNAC decoding.

Architecture
------------
    engine core thread ──submit(CodecPush)──▶ pending pushes, one entry per session
                                                   │  (condition variable)
                                                   ▼
                     codec worker thread: take everything pending, across sessions
                        ├─ close the sessions cancelled since the last round
                        ├─ decoder.decode(pushes)  (max_batch pushes per call)
                        └─ on_result(CodecResult) for each, on this thread

`submit` only appends to the pending entry of its session under a lock and
notifies; it never waits for decoding. Several pushes of one session that
arrive while the worker is busy are coalesced into one (frames concatenated in
order, `final` OR-ed), so a slow round makes the next one larger instead of
queueing many small decodes: the codec degrades into bigger batches under load.
The worker sleeps on the condition variable when there is nothing to do.

On CUDA the thread runs every decode on a `torch.cuda.Stream` of its own, so
SNAC's kernels overlap with the LLM's steps on the default stream; the
decoder's host transfers (codec.transfer: pinned staging buffers, asynchronous
copies, an event wait that blocks only this thread) run on that stream too.

Failures stay local: if `decode` raises, each session of that call gets a
`CodecResult` with `error` set (empty pcm, final=True), its decoder state is
dropped, and the worker carries on with everybody else. An exception raised
by `on_result` is logged and counted; it does not stop the worker.

`close_session(key)` cancels a session: its pending pushes are discarded, its
decoder state is dropped on the worker thread before the next decode, results
still in flight for it are not delivered, and later pushes for the key are
discarded (keys identify one stream and are not reused after a close).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..protocol import TOKENS_PER_FRAME
from .base import CodecPush, CodecResult, StreamingDecoder
from .loader import check_frames

log = logging.getLogger(__name__)

# Cancelled keys remembered to discard their late pushes; old entries are forgotten first.
CLOSED_KEYS_REMEMBERED = 65536


@dataclass(slots=True)
class _Pending:
    frames: list[np.ndarray] = field(default_factory=list)  # each [n, 7] int64
    final: bool = False
    pushes: int = 0

    def to_push(self, key: Hashable) -> CodecPush:
        if not self.frames:
            frames = np.zeros((0, TOKENS_PER_FRAME), dtype=np.int64)
        elif len(self.frames) == 1:
            frames = self.frames[0]
        else:
            frames = np.concatenate(self.frames, axis=0)
        return CodecPush(key, frames, self.final)


@dataclass(slots=True)
class _Counters:
    batches: int = 0  # decoder.decode calls
    pushes: int = 0  # pushes decoded (as submitted, before coalescing)
    coalesced_pushes: int = 0  # pushes handed to the decoder (after coalescing)
    frames: int = 0  # frames decoded
    decode_s: float = 0.0  # wall time inside decoder.decode
    errors: int = 0  # sessions failed by a decode exception
    dropped_pushes: int = 0  # pushes for closed sessions, or discarded by stop(drain=False)
    callback_errors: int = 0  # exceptions raised by on_result


class CodecWorker:
    """One thread that decodes every session's pushes in batches (see module doc)."""

    def __init__(
        self,
        decoder: StreamingDecoder,
        on_result: Callable[[CodecResult], None],
        *,
        max_batch: int = 64,
        device: str | torch.device = "cpu",
        name: str = "codec-worker",
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.decoder = decoder
        self.on_result = on_result
        self.max_batch = max_batch
        self.device = torch.device(device)
        self.name = name
        self._cond = threading.Condition()
        self._pending: dict[Hashable, _Pending] = {}  # insertion order = arrival order
        self._to_close: list[Hashable] = []
        self._closed: OrderedDict[Hashable, None] = OrderedDict()
        self._stopping = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self._counters = _Counters()

    # ------------------------------------------------------------ caller side

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("codec worker already started")
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, push: CodecPush) -> None:
        """Queue a push; returns at once (pushes queued before `start` wait for it).
        Raises ValueError for malformed frames, RuntimeError once the worker is stopping."""
        frames = check_frames(push.frames)
        with self._cond:
            if self._stopping:
                raise RuntimeError("codec worker is stopping")
            if push.key in self._closed:
                self._counters.dropped_pushes += 1
                return
            entry = self._pending.get(push.key)
            if entry is None:
                entry = self._pending[push.key] = _Pending()
            elif entry.final:
                raise ValueError(f"push for session {push.key!r} after its final push")
            if frames.shape[0]:
                entry.frames.append(frames)
            entry.final = entry.final or push.final
            entry.pushes += 1
            self._cond.notify()

    def close_session(self, key: Hashable) -> None:
        """Cancel a session (see module doc). Safe from any thread, any number of times."""
        with self._cond:
            entry = self._pending.pop(key, None)
            if entry is not None:
                self._counters.dropped_pushes += entry.pushes
            self._remember_closed(key)
            self._to_close.append(key)
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0, *, drain: bool = True) -> bool:
        """Stop the thread, after decoding what is queued if `drain`. True once it has exited."""
        with self._cond:
            self._stopping = True
            self._drain = self._drain and drain
            self._cond.notify()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def stats(self) -> dict[str, float | int]:
        with self._cond:
            c = self._counters
            return {
                "batches": c.batches,
                "pushes": c.pushes,
                "coalesced_pushes": c.coalesced_pushes,
                "frames_decoded": c.frames,
                "decode_s": c.decode_s,
                "errors": c.errors,
                "dropped_pushes": c.dropped_pushes,
                "callback_errors": c.callback_errors,
                "queued_sessions": len(self._pending),
            }

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ worker side

    def _remember_closed(self, key: Hashable) -> None:
        self._closed[key] = None
        self._closed.move_to_end(key)
        while len(self._closed) > CLOSED_KEYS_REMEMBERED:
            self._closed.popitem(last=False)

    def _stream_context(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self.device.index is not None:
            torch.cuda.set_device(self.device)
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def _run(self) -> None:
        with self._stream_context():
            for closes, batch in self._rounds():
                for key in closes:
                    self.decoder.close(key)
                for start in range(0, len(batch), self.max_batch):
                    self._decode_group(batch[start : start + self.max_batch])

    def _rounds(self) -> Iterator[tuple[list[Hashable], list[tuple[CodecPush, int]]]]:
        """Each round: the sessions to close and every pending push, taken atomically."""
        while True:
            with self._cond:
                while not self._pending and not self._to_close and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._drain:
                    self._counters.dropped_pushes += sum(e.pushes for e in self._pending.values())
                    self._pending.clear()
                closes, self._to_close = self._to_close, []
                pending, self._pending = self._pending, {}
                if self._stopping and not pending and not closes:
                    return
                batch = [(entry.to_push(key), entry.pushes) for key, entry in pending.items()]
            yield closes, batch

    def _decode_group(self, group: list[tuple[CodecPush, int]]) -> None:
        pushes = [push for push, _ in group]
        started = time.perf_counter()
        try:
            results = self.decoder.decode(pushes)
            failure: BaseException | None = None
        except Exception as exc:
            failure = exc
        elapsed = time.perf_counter() - started
        if failure is not None:
            log.error("codec decode failed for %d session(s)", len(pushes), exc_info=failure)
            message = f"codec decode failed: {type(failure).__name__}: {failure}"
            for push in pushes:
                self.decoder.close(push.key)  # its state may be half-updated; the stream ends here
            results = [CodecResult(p.key, np.zeros(0, dtype=np.float32), True, error=message) for p in pushes]
        with self._cond:
            c = self._counters
            c.batches += 1
            c.pushes += sum(n for _, n in group)
            c.coalesced_pushes += len(pushes)
            c.frames += sum(int(p.frames.shape[0]) for p in pushes)
            c.decode_s += elapsed
            cancelled = {p.key for p in pushes if p.key in self._closed}  # closed while decoding
            if failure is not None:
                c.errors += len(pushes)
                for push in pushes:  # the stream has ended: later pushes for it are discarded
                    self._remember_closed(push.key)
                    late = self._pending.pop(push.key, None)
                    if late is not None:
                        c.dropped_pushes += late.pushes
            deliver = [r for r in results if r.key not in cancelled]
        for result in deliver:
            try:
                self.on_result(result)
            except Exception:
                log.exception("codec on_result callback raised for session %r", result.key)
                with self._cond:
                    self._counters.callback_errors += 1
