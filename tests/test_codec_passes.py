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
        assert len(step_schedule(list(even.values()), decoder.step_frames, 64)) == 1
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
