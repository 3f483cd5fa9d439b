"""The codec worker: one thread that batches every session's SNAC decoding.

Architecture
------------
    engine core thread ──submit(CodecPush)──▶ pending frames, one entry per session
                                                   │  (condition variable)
                                                   ▼
                     codec worker thread, one bounded pass at a time:
                        ├─ close the sessions cancelled since the last pass
                        ├─ pick at most max_frames_per_pass frames, round-robin
                        ├─ decoder.decode(pushes)  (max_batch pushes per call)
                        ├─ on_result(CodecResult) for each, on this thread
                        └─ on_pass(frames, seconds)

`submit` only appends to the pending entry of its session under a lock and
notifies; it never waits for decoding. Several pushes of one session that
arrive while the worker is busy are coalesced (frames concatenated in order,
`final` OR-ed), so a slow pass makes the next one a bigger batch instead of
many small decodes.

Passes are bounded (ARCHITECTURE §5a): a pass decodes at most `max_frames_per_pass`
frames in all, and fewer when the measured cost per frame says the pass would
take longer than `max_pass_s` (a CPU codec at ~20 ms a frame: a 64-frame pass
would keep every client waiting for a second); each session contributes at
most `max_frames_per_session` of its pending frames; the rest stays pending,
in order, for the next pass. Passes are even where the decoder has fixed step sizes (the stateful
decoder's 1, 2, 4 frames): a decoder advances every row of a forward step by the same number of frames, so
pushes of unequal lengths cost a step each (`codec.base.step_schedule`), and on a GPU a step is a few
hundred kernel launches whatever its batch. Every streaming session brings the pass's step (the largest
size at least half of them have pending); one short of it waits for more unless its client holds under
`URGENT_HELD_S`. First pushes come whole. A ragged decoder (`codec.ragged_steps`) takes unequal pushes in
one step up to its largest size, so a final push brings at most the frames that fit that step beside its
flush (`lookahead_frames`; one frame for 4-frame steps and a lookahead of 3): the frames before them go in
this pass as a streaming push, the last ones and the flush in the next. Otherwise final pushes come whole.
And a pass waits, up to `max_pass_wait_s`, for `min_pass_frames` to be pending, unless a session waits for
its first audio or a client holds under `URGENT_HELD_S`: back-to-back passes of a few frames cost a whole
launch each, and their launches hold the interpreter that the engine-core loop in the same process needs.
Sessions whose audio has not started go first (their client waits for its
first byte: they may bring their whole first push), then the sessions whose
clients hold the least audio (`held_audio_s`, the scheduler's playback model),
then arrival order. So under a backlog no pass decodes minutes of audio, a new
session's first push is in the next pass, and every session advances.
The worker sleeps on the condition variable when there is nothing to do.

On CUDA the thread runs every decode on a `torch.cuda.Stream` of its own, so
SNAC's kernels overlap with the LLM's steps on the default stream; the
decoder's host transfers (codec.transfer: pinned staging buffers, asynchronous
copies, an event wait that blocks only this thread) run on that stream too.

Failures stay local: if `decode` raises, each session of that call gets a
`CodecResult` with `error` set (empty pcm, final=True), its decoder state is
dropped, and the worker carries on with everybody else. An exception raised
by `on_result` is logged and counted; it does not stop the worker.

`close_session(key)` cancels a session: its pending frames are discarded at
once (before the next pass), its decoder state is dropped on the worker thread
before the next decode, results still in flight for it are not delivered, and
later pushes for the key are discarded (keys identify one stream and are not
reused after a close).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..token_format import join_frames
from .base import CodecPush, CodecResult, StreamingDecoder
from .loader import check_frames
from .pass_clock import PassClock, name_os_thread

log = logging.getLogger(__name__)

# Cancelled keys remembered to discard their late pushes; old entries are forgotten first.
CLOSED_KEYS_REMEMBERED = 65536
# A streaming session short of a pass's even step waits for more frames while its client holds this much.
URGENT_HELD_S = 0.25



@dataclass(slots=True)
class _Pending:
    frames: list[np.ndarray] = field(default_factory=list)  # each [n, 7] int64, in order
    arrived: list[float] = field(default_factory=list)  # when each of `frames` was submitted
    count: int = 0  # frames pending
    final: bool = False  # the session's final push has arrived
    pushes: int = 0  # pushes submitted into this entry (counters)

    def age_s(self, now: float) -> float:
        """Age of its oldest pending frame."""
        return now - self.arrived[0] if self.arrived else 0.0

    def take(self, key: Hashable, limit: int) -> CodecPush:
        """The first `limit` pending frames as one push; final only with the last frame taken."""
        taken: list[np.ndarray] = []
        need = limit
        while self.frames and need > 0:
            head = self.frames[0]
            if head.shape[0] <= need:
                taken.append(self.frames.pop(0))
                self.arrived.pop(0)
                need -= head.shape[0]
            else:
                taken.append(head[:need])
                self.frames[0] = head[need:]
                need = 0
        n = limit - need
        self.count -= n
        frames = join_frames(taken)
        return CodecPush(key, frames, self.final and self.count == 0)


@dataclass(slots=True)
class _Counters:
    passes: int = 0  # bounded passes run
    max_pass_frames: int = 0  # the most frames any pass held
    last_pass_frames: int = 0
    batches: int = 0  # decoder.decode calls
    pushes: int = 0  # pushes decoded (as submitted, before coalescing)
    coalesced_pushes: int = 0  # pushes handed to the decoder (after coalescing)
    frames: int = 0  # frames decoded
    decode_s: float = 0.0  # wall time inside decoder.decode
    errors: int = 0  # sessions failed by a decode exception
    dropped_pushes: int = 0  # pushes for closed sessions, or discarded by stop(drain=False)
    dropped_frames: int = 0  # their frames: work a departed client did not cost
    callback_errors: int = 0  # exceptions raised by on_result


class CodecWorker:
    """One thread that decodes every session's pushes in batches (see module doc)."""

    def __init__(
        self,
        decoder: StreamingDecoder,
        on_result: Callable[[CodecResult], None],
        *,
        max_batch: int = 64,
        max_frames_per_pass: int = 64,
        max_frames_per_session: int = 4,
        max_pass_s: float | None = None,
        min_pass_frames: int = 1,
        max_pass_wait_s: float = 0.0,
        held_audio_s: Callable[[list[Hashable]], list[float]] | None = None,
        on_pass: Callable[[int, float], None] | None = None,
        device: str | torch.device = "cpu",
        name: str = "codec-worker",
    ) -> None:
        """`held_audio_s(keys)`: audio each session's client holds (orders the sessions of a pass);
        `on_pass(frames, seconds)`: called after each pass (capacity measurement, wake-ups)."""
        if max_batch < 1 or max_frames_per_pass < 1 or max_frames_per_session < 1:
            raise ValueError("max_batch, max_frames_per_pass and max_frames_per_session must be >= 1")
        self.decoder = decoder
        self.on_result = on_result
        self.max_batch = max_batch
        self.max_frames_per_pass = max_frames_per_pass
        self.max_frames_per_session = max_frames_per_session
        self.max_pass_s = max_pass_s
        self.min_pass_frames = min_pass_frames
        self.max_pass_wait_s = max_pass_wait_s
        self._s_per_frame: float | None = None  # measured, smoothed over passes
        # A ragged decoder takes a pass's pushes of unequal lengths in one step of up to its largest size; a final
        # push brings at most this many frames, so that they and the flush fit one step (None: no such decoder).
        sizes = getattr(decoder, "step_frames", None)
        tail = max(sizes) - decoder.lookahead_frames if sizes and getattr(decoder, "ragged", False) else 0
        self._final_frames: int | None = tail if tail > 0 else None
        self.held_audio_s = held_audio_s
        self.on_pass = on_pass
        self.device = torch.device(device)
        self.name = name
        self._cond = threading.Condition()
        self._pending: dict[Hashable, _Pending] = {}  # insertion order = arrival order
        self._to_close: list[Hashable] = []
        self._closed: OrderedDict[Hashable, None] = OrderedDict()
        self._started: set[Hashable] = set()  # sessions whose audio has begun (worker thread only)
        self._stopping = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self._counters = _Counters()
        # Each pass's wall and thread-CPU time and frames (the engine core's `core_host.codec_pass`).
        self.pass_clock = PassClock()

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
        self.submit_many((push,))

    def submit_many(self, pushes: Sequence[CodecPush]) -> None:
        """Queue pushes in order, as `submit` does, under one lock and with one wake-up of the worker
        (the engine core hands over one step's pushes at once). A push that raises leaves the ones
        before it queued."""
        checked = [(push, check_frames(push.frames)) for push in pushes]
        now = time.monotonic()
        with self._cond:
            try:
                for push, frames in checked:
                    self._queue(push, frames, now)
            finally:
                self._cond.notify()

    def _queue(self, push: CodecPush, frames: np.ndarray, now: float) -> None:
        if self._stopping:
            raise RuntimeError("codec worker is stopping")
        if push.key in self._closed:
            self._counters.dropped_pushes += 1
            self._counters.dropped_frames += int(frames.shape[0])
            return
        entry = self._pending.get(push.key)
        if entry is None:
            entry = self._pending[push.key] = _Pending()
        elif entry.final:
            raise ValueError(f"push for session {push.key!r} after its final push")
        if frames.shape[0]:
            entry.frames.append(frames)
            entry.arrived.append(now)
            entry.count += int(frames.shape[0])
        entry.final = entry.final or push.final
        entry.pushes += 1

    def close_session(self, key: Hashable) -> None:
        """Cancel a session (see module doc). Safe from any thread, any number of times."""
        with self._cond:
            entry = self._pending.pop(key, None)
            if entry is not None:
                self._counters.dropped_pushes += entry.pushes
                self._counters.dropped_frames += entry.count
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

    def stats(self) -> dict[str, float | int | None]:
        with self._cond:
            c = self._counters
            now = time.monotonic()
            return {
                "passes": c.passes,
                "max_pass_frames": c.max_pass_frames,
                "last_pass_frames": c.last_pass_frames,
                "max_frames_per_pass": self.max_frames_per_pass,
                "backlog_frames": sum(e.count for e in self._pending.values()),
                "oldest_pending_s": round(max((e.age_s(now) for e in self._pending.values()), default=0.0), 4),
                "batches": c.batches,
                "pushes": c.pushes,
                "coalesced_pushes": c.coalesced_pushes,
                "frames_decoded": c.frames,
                "decode_s": c.decode_s,
                "errors": c.errors,
                "dropped_pushes": c.dropped_pushes,
                "dropped_frames": c.dropped_frames,
                "callback_errors": c.callback_errors,
                "queued_sessions": len(self._pending),
                # Per-session state that must be gone once a session ends (leak checks): the worker's own set of
                # sessions whose audio has begun, and the decoder's state (the stateful decoder's pool rows; None
                # if it keeps none).
                "started_sessions": len(self._started),
                "decoder_sessions": getattr(self.decoder, "active_sessions", None),
            }

    def backlog(self) -> tuple[int, float]:
        """(frames pending, age in seconds of the oldest pending frame): is the codec behind?"""
        with self._cond:
            now = time.monotonic()
            frames = sum(e.count for e in self._pending.values())
            oldest = max((e.age_s(now) for e in self._pending.values()), default=0.0)
            return frames, oldest

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
        stream = torch.cuda.Stream(self.device)
        # Decoders are built on the default stream before the worker starts; whatever they queued
        # there comes before this stream's first decode (they also finish it themselves: belt and braces).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def _run(self) -> None:
        name_os_thread(self.name)
        with self._stream_context():
            for closes, batch in self._passes():
                for key in closes:
                    self.decoder.close(key)
                    self._started.discard(key)
                if not batch:
                    continue
                started, cpu_started = time.perf_counter(), time.thread_time()
                for start in range(0, len(batch), self.max_batch):
                    self._decode_group(batch[start : start + self.max_batch])
                elapsed = time.perf_counter() - started
                frames = sum(int(push.frames.shape[0]) for push, _ in batch)
                if frames:
                    per_frame = elapsed / frames
                    self._s_per_frame = per_frame if self._s_per_frame is None \
                        else 0.8 * self._s_per_frame + 0.2 * per_frame
                with self._cond:
                    c = self._counters
                    c.passes += 1
                    c.last_pass_frames = frames
                    c.max_pass_frames = max(c.max_pass_frames, frames)
                self.pass_clock.record(elapsed, time.thread_time() - cpu_started, frames)
                if self.on_pass is not None:
                    self.on_pass(frames, elapsed)

    def _passes(self) -> Iterator[tuple[list[Hashable], list[tuple[CodecPush, int]]]]:
        """Each pass: the sessions to close and a bounded selection of pending frames (see module doc)."""
        while True:
            with self._cond:
                while not self._pending and not self._to_close and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._drain:
                    self._counters.dropped_pushes += sum(e.pushes for e in self._pending.values())
                    self._counters.dropped_frames += sum(e.count for e in self._pending.values())
                    self._pending.clear()
                closes, self._to_close = self._to_close, []
                if self._stopping and not self._pending and not closes:
                    return
                keys = [k for k in self._pending if k in self._started]
            # Asked outside the lock: the scheduler takes its own lock, and submit() must never wait on it.
            held = self.held_audio_s(keys) if self.held_audio_s is not None and keys else [0.0] * len(keys)
            with self._cond:
                wait = self._fuller_pass_wait(dict(zip(keys, held, strict=True)))
                if wait > 0:
                    if closes:
                        yield closes, []
                    self._cond.wait(wait)  # a push wakes it: the pass is judged again
                    continue
                batch = self._select(dict(zip(keys, held, strict=True)))
            yield closes, batch  # decoded outside the lock: submit() never waits for a pass

    def _select(self, held: dict[Hashable, float]) -> list[tuple[CodecPush, int]]:
        """Take at most max_frames_per_pass frames from the pending entries (caller holds the lock)."""
        arrival = {key: i for i, key in enumerate(self._pending)}

        def rank(key: Hashable) -> tuple[int, float, int]:
            if key not in self._started:
                return (0, 0.0, arrival[key])  # no audio yet: its client waits for the first byte
            return (1, held.get(key, 0.0), arrival[key])

        def share_of(key: Hashable, entry: _Pending) -> int:
            # A session before its first audio brings its whole first push (up to the hard bound).
            return min(entry.count, self.max_frames_per_pass if key not in self._started
                       else self.max_frames_per_session)

        even = self._even_frames({key: share_of(key, e) for key, e in self._pending.items()
                                  if key in self._started and not e.final})
        budget = self._pass_budget()
        batch: list[tuple[CodecPush, int]] = []
        for key in sorted(self._pending, key=rank):
            entry = self._pending[key]
            share = share_of(key, entry)
            if entry.final and self._final_frames is not None and entry.count > self._final_frames:
                # Its last frames and the flush come in the next pass, which they fit in one step; these now.
                share = min(share, entry.count - self._final_frames)
            if even is not None and key in self._started and not entry.final:
                if share >= even:
                    share = even
                elif held.get(key, 0.0) >= URGENT_HELD_S and batch:
                    continue  # short of the pass's step: it waits for more frames while its client holds plenty
            # The first session of a pass always brings its whole share: a pass makes progress.
            take = share if not batch else min(share, budget)
            if take == 0 and not (entry.final and entry.count == 0):
                if budget == 0:
                    break
                continue
            pushes = entry.pushes
            push = entry.take(key, take)
            entry.pushes = 0
            if entry.count == 0:
                del self._pending[key]
            batch.append((push, pushes))
            budget -= take
        return batch

    def _fuller_pass_wait(self, held: dict[Hashable, float]) -> float:
        """Seconds to wait for a fuller pass (caller holds the lock); 0: decode now. A pass goes at once when
        `min_pass_frames` are pending, when a session waits for its first audio, when a client holds under
        `URGENT_HELD_S`, when stopping, and when its oldest frame has waited `max_pass_wait_s`."""
        if self.max_pass_wait_s <= 0 or self._stopping:
            return 0.0
        if sum(e.count for e in self._pending.values()) >= self.min_pass_frames:
            return 0.0
        if any(key not in self._started for key in self._pending):
            return 0.0
        if any(held.get(key, 0.0) < URGENT_HELD_S for key in self._pending):
            return 0.0
        now = time.monotonic()
        oldest = max((e.age_s(now) for e in self._pending.values()), default=0.0)
        return max(0.0, self.max_pass_wait_s - oldest)

    def _even_frames(self, shares: dict[Hashable, int]) -> int | None:
        """Frames every streaming session brings to this pass: the largest of the decoder's step sizes that at
        least half of them have pending, so the pass is one forward step for most of its rows (a decoder
        advances all rows of a step by the same count; unequal pushes cost a step each: codec.base.step_schedule).
        None: the decoder has no fixed step sizes, or nothing is streaming."""
        sizes = getattr(self.decoder, "step_frames", None)
        if not sizes or not shares:
            return None
        counts = sorted(shares.values(), reverse=True)
        median = counts[(len(counts) - 1) // 2]  # at least half have this many
        return max((n for n in sizes if n <= median), default=min(sizes))

    def _pass_budget(self) -> int:
        """Frames this pass may take: max_frames_per_pass, or what fits in max_pass_s at the measured cost."""
        if self.max_pass_s is None or self._s_per_frame is None or self._s_per_frame <= 0:
            return self.max_frames_per_pass
        return max(1, min(self.max_frames_per_pass, int(self.max_pass_s / self._s_per_frame)))

    def _decode_group(self, group: list[tuple[CodecPush, int]]) -> None:
        pushes = [push for push, _ in group]
        started = time.perf_counter()
        try:
            results = [replace(r, frames=int(p.frames.shape[0]))
                       for r, p in zip(self.decoder.decode(pushes), pushes, strict=True)]
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
                        c.dropped_frames += late.count
            deliver = [r for r in results if r.key not in cancelled]
        for result in deliver:
            if result.pcm.size:
                self._started.add(result.key)
            if result.final:
                self._started.discard(result.key)
            try:
                self.on_result(result)
            except Exception:
                log.exception("codec on_result callback raised for session %r", result.key)
                with self._cond:
                    self._counters.callback_errors += 1
