"""Even codec passes (codec/worker.py, ARCHITECTURE §4-§5a): the worker gives the stateful decoder pushes of one
length, so a pass is one forward step for its streaming rows instead of one per distinct length (on a GPU each
step is a few hundred kernel launches, whatever its batch). Real tiny SNAC, real decoder, real worker thread."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np
import pytest

from orpheus_serve import token_format as P
from orpheus_serve.codec import CodecPush, CodecResult, CodecWorker
from orpheus_serve.codec.base import step_schedule
from orpheus_serve.codec.loader import decode_offline, load_snac
from orpheus_serve.codec.stateful import StatefulDecoder


class RecordingDecoder(StatefulDecoder):
    """The real stateful decoder, noting the frames of each push of each decode call."""

    calls: list[dict[Hashable, int]]

    def decode(self, pushes: Sequence[CodecPush]) -> list[CodecResult]:
        self.calls.append({p.key: len(p.frames) + (self.lookahead_frames if p.final else 0) for p in pushes})
        return super().decode(pushes)


@pytest.fixture(scope="module")
def snac(tiny_snac: Path):
    return load_snac(tiny_snac, noise=False)


def test_streaming_sessions_bring_one_step_each_and_every_frame_is_decoded_once(snac) -> None:
    rng = np.random.default_rng(7)
    keys = [f"s{i}" for i in range(6)]
    frames = {k: rng.integers(0, P.CODEBOOK_SIZE, size=(9, 7), dtype=np.int64) for k in keys}
    audio: dict[str, list[np.ndarray]] = defaultdict(list)
    finals = threading.Event()
    done: set[str] = set()
    lock = threading.Lock()

    def on_result(result: CodecResult) -> None:
        with lock:
            audio[result.key].append(result.pcm)
            if result.final:
                done.add(result.key)
                if len(done) == len(keys):
                    finals.set()

    decoder = RecordingDecoder(snac, max_batch=64, noise=False)
    decoder.calls = []
    # Every client holds plenty (1 s): nobody short of the step is urgent.
    worker = CodecWorker(decoder, on_result, held_audio_s=lambda ks: [1.0] * len(ks))
    for k in keys:  # first pushes: 3 frames each, before the worker starts (one pass)
        worker.submit(CodecPush(k, frames[k][:3]))
    worker.start()
    try:
        while len(audio) < len(keys):
            threading.Event().wait(0.01)
        assert decoder.calls == [dict.fromkeys(keys, 3)]
        # Streaming pushes of unequal lengths, queued at once: 2, 2, 2, 2, then 1 and 4.
        sizes = dict(zip(keys, (2, 2, 2, 2, 1, 4), strict=True))
        worker.submit_many([CodecPush(k, frames[k][3 : 3 + n]) for k, n in sizes.items()])
        while len(decoder.calls) < 2:
            threading.Event().wait(0.01)
        even = decoder.calls[1]
        # One step of two frames for the five sessions with two or more; the one with a single frame waits.
        assert even == {"s0": 2, "s1": 2, "s2": 2, "s3": 2, "s5": 2}, even
        assert len(step_schedule(list(even.values()), decoder.step_frames, 64)) == 1  # even steps: one
        # The rest, and the final pushes: every frame decoded once, in order, equal to the one-shot decode.
        worker.submit_many([CodecPush(k, frames[k][3 + n :], final=True) for k, n in sizes.items()])
        assert finals.wait(timeout=60)
    finally:
        assert worker.stop(timeout_s=30)
    for k in keys:
        streamed = np.concatenate(audio[k])
        reference = decode_offline(snac, frames[k])
        assert streamed.shape == reference.shape
        np.testing.assert_allclose(streamed, reference, atol=1e-4)


def test_a_pass_waits_for_a_fuller_batch_unless_a_client_runs_short(snac) -> None:
    rng = np.random.default_rng(8)
    keys = [f"w{i}" for i in range(17)]
    frames = {k: rng.integers(0, P.CODEBOOK_SIZE, size=(8, 7), dtype=np.int64) for k in keys}
    held = dict.fromkeys(keys, 1.0)
    results = threading.Semaphore(0)
    decoder = RecordingDecoder(snac, max_batch=64, noise=False)
    decoder.calls = []
    # A wait far longer than the test: only a full batch or a short client makes a pass.
    worker = CodecWorker(decoder, lambda r: results.release(), held_audio_s=lambda ks: [held[k] for k in ks],
                         min_pass_frames=32, max_pass_wait_s=600.0)
    worker.submit_many([CodecPush(k, frames[k][:3]) for k in keys])  # first pushes go at once (first audio)
    worker.start()
    try:
        for _ in keys:
            assert results.acquire(timeout=60)
        assert len(decoder.calls) == 1
        # 15 sessions x 2 frames = 30 pending, under 32, every client holding a second: no pass.
        worker.submit_many([CodecPush(k, frames[k][3:5]) for k in keys[:15]])
        assert not results.acquire(timeout=0.5)
        assert len(decoder.calls) == 1
        # Two more make 34: one pass of all 17.
        worker.submit_many([CodecPush(k, frames[k][3:5]) for k in keys[15:]])
        for _ in keys:
            assert results.acquire(timeout=60)
        assert len(decoder.calls) == 2 and len(decoder.calls[1]) == 17
        # One client short of audio: its push goes at once, alone.
        held["w0"] = 0.1
        worker.submit(CodecPush("w0", frames["w0"][5:7]))
        assert results.acquire(timeout=60)
        assert decoder.calls[2] == {"w0": 2}
    finally:
        worker.stop(timeout_s=30, drain=False)


def test_a_ragged_decoders_final_push_brings_what_fits_one_step_with_its_flush(snac) -> None:
    """Ragged steps (codec.ragged_steps): first pushes of 3 frames, streaming ones of 2 and final flushes share
    one step of 4; a final push of 3 frames would be 3 + 3 (two steps), so its first 2 frames go as a streaming
    push and the last one with the flush in the next pass. Every frame once, equal to the one-shot decode."""
    rng = np.random.default_rng(9)
    keys = ["a", "b", "c"]
    frames = {k: rng.integers(0, P.CODEBOOK_SIZE, size=(8, 7), dtype=np.int64) for k in keys}
    audio: dict[str, list[np.ndarray]] = defaultdict(list)
    results = threading.Semaphore(0)
    decoder = RecordingDecoder(snac, max_batch=64, noise=False, ragged=True)
    decoder.calls = []
    worker = CodecWorker(decoder, lambda r: audio[r.key].append(r.pcm) or results.release(),
                         held_audio_s=lambda ks: [1.0] * len(ks))
    worker.submit_many([CodecPush(k, frames[k][:3]) for k in keys])
    worker.start()
    try:
        for _ in keys:
            assert results.acquire(timeout=60)
        # a: a final push of 3 frames; b and c stream 2 each.
        worker.submit_many([CodecPush("a", frames["a"][3:6], final=True),
                            *(CodecPush(k, frames[k][3:5]) for k in ("b", "c"))])
        for _ in keys:
            assert results.acquire(timeout=60)
        assert decoder.calls[1] == {"a": 2, "b": 2, "c": 2}  # a's last frame waits with its flush
        assert results.acquire(timeout=60)
        assert decoder.calls[2] == {"a": 1 + decoder.lookahead_frames}
        worker.submit_many([CodecPush(k, frames[k][5:8], final=True) for k in ("b", "c")])
        for _ in range(4):
            assert results.acquire(timeout=60)
    finally:
        assert worker.stop(timeout_s=30)
    # Every call is one ragged step of at most 4 frames.
    assert all(len(step_schedule(list(c.values()), decoder.step_frames, 64, ragged=True)) == 1
               for c in decoder.calls), decoder.calls
    for k, whole in (("a", frames["a"][:6]), ("b", frames["b"]), ("c", frames["c"])):
        np.testing.assert_allclose(np.concatenate(audio[k]), decode_offline(snac, whole), atol=1e-4)
