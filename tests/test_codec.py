"""SNAC codec: loading, windowed streaming decode, batching, the worker and the decode CLI.

Everything runs the real snac_24khz architecture (seeded random weights) with the
noise injection off, and compares against snac's own one-shot decode. SNAC costs
~20-40 ms of CPU per decoded frame here, so utterances stay short.
"""

from __future__ import annotations

import json
import threading
import wave
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from orpheus_serve import token_format as P
from orpheus_serve.codec import CodecPush, CodecResult, CodecWorker, WindowedDecoder, build_decoder
from orpheus_serve.codec.loader import DisabledNoiseBlock, decode_offline, load_snac
from orpheus_serve.codec.windowed import Window, WindowBatcher
from orpheus_serve.config import CodecConfig, load_config

FRAMES = 24
DEFAULTS = load_config().codec
SCHED = load_config().scheduler


def snr_db(test: np.ndarray, ref: np.ndarray) -> float:
    err = float(np.sum((test.astype(np.float64) - ref) ** 2))
    return float("inf") if err == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / err)


def random_frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, P.CODEBOOK_SIZE, (n, P.TOKENS_PER_FRAME), dtype=np.int64)


def stream(decoder: WindowedDecoder, frames: np.ndarray, push_frames: int, key: str = "s") -> list[np.ndarray]:
    """Feed one utterance in pushes of `push_frames`, the last one final; the pcm of each push."""
    n = frames.shape[0]
    return [
        decoder.decode([CodecPush(key, frames[s : s + push_frames], final=s + push_frames >= n)])[0].pcm
        for s in range(0, n, push_frames)
    ]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def snac(tiny_snac: Path):
    return load_snac(tiny_snac, noise=False)


@pytest.fixture(scope="module")
def utterance(snac) -> tuple[np.ndarray, np.ndarray]:
    frames = random_frames(FRAMES, seed=1)
    return frames, decode_offline(snac, frames)


# ------------------------------------------------------------------ loading


def test_loader_folds_weight_norm_and_matches_snac_itself(tiny_snac: Path, snac) -> None:
    from snac import SNAC
    from snac.layers import NoiseBlock

    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in snac.modules())
    noise_blocks = [m for m in snac.modules() if isinstance(m, NoiseBlock)]
    assert len(noise_blocks) == 4 and all(isinstance(m, DisabledNoiseBlock) for m in noise_blocks)
    assert not snac.training and next(snac.parameters()).dtype == torch.float32

    reference = SNAC.from_pretrained(str(tiny_snac))  # snac's own loader, weight norm live
    for parent in list(reference.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NoiseBlock):
                setattr(parent, name, torch.nn.Identity())
    frames = random_frames(3, seed=2)
    codes = [torch.from_numpy(c)[None] for c in P.frames_to_snac_codes(frames)]
    with torch.inference_mode():
        expected = reference.decode(codes)[0, 0].numpy()
    got = decode_offline(snac, frames)
    assert got.dtype == np.float32 and got.shape == (3 * P.SAMPLES_PER_FRAME,)
    assert snr_db(got, expected) >= 100


def test_noise_switch_seeded_and_off(tiny_snac: Path, snac) -> None:
    frames = random_frames(2, seed=3)
    a = decode_offline(load_snac(tiny_snac, seed=7), frames)
    b = decode_offline(load_snac(tiny_snac, seed=7), frames)
    c = decode_offline(load_snac(tiny_snac, seed=8), frames)
    off = decode_offline(snac, frames)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert snr_db(a, off) < 60  # the noise is really injected when on


def test_loader_rejects_what_it_cannot_load(tmp_path: Path, tiny_snac: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_snac(tmp_path)  # empty folder
    cfg = json.loads((tiny_snac / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vq_strides": [8, 4, 2, 1]}))
    (tmp_path / "pytorch_model.bin").write_bytes((tiny_snac / "pytorch_model.bin").read_bytes())
    with pytest.raises(ValueError, match="24 kHz layout"):
        load_snac(tmp_path)
    assert decode_offline(load_snac(tiny_snac, noise=False), np.zeros((0, 7), np.int64)).shape == (0,)


# ------------------------------------------------------------------ streaming


def test_default_windows_stream_every_frame_at_60db(snac, utterance) -> None:
    frames, offline = utterance
    decoder = build_decoder(DEFAULTS.model_copy(update={"decoder": "windowed"}), snac)
    assert isinstance(decoder, WindowedDecoder)
    assert decoder.lookahead_frames == DEFAULTS.lookahead_frames
    chunks = stream(decoder, frames, push_frames=SCHED.flush_every_n_tokens // P.TOKENS_PER_FRAME)
    audio = np.concatenate(chunks)
    assert audio.shape == (FRAMES * P.SAMPLES_PER_FRAME,)
    assert all(c.shape[0] % P.SAMPLES_PER_FRAME == 0 for c in chunks)
    assert snr_db(audio, offline) >= 60
    first, last = slice(0, P.SAMPLES_PER_FRAME), slice(-P.SAMPLES_PER_FRAME, None)
    assert np.abs(offline[first]).max() > 1e-3 and np.abs(offline[last]).max() > 1e-3
    assert snr_db(audio[first], offline[first]) >= 60  # first frame present (and in place)
    assert snr_db(audio[last], offline[last]) >= 60  # last frame present
    assert decoder.active_sessions == 0


def test_three_frames_of_context_each_way_is_exact(snac, utterance) -> None:
    frames, offline = utterance
    decoder = WindowedDecoder(snac, left_context_frames=3, lookahead_frames=3)
    audio = np.concatenate(stream(decoder, frames, push_frames=4))
    assert audio.shape == offline.shape
    assert snr_db(audio, offline) >= 100


def test_push_size_does_not_change_the_audio(snac) -> None:
    frames = random_frames(9, seed=4)
    offline = decode_offline(snac, frames)
    outputs = {}
    for push in (1, 2, 3):
        decoder = WindowedDecoder(snac, left_context_frames=3, lookahead_frames=3)
        chunks = stream(decoder, frames, push)
        # A frame comes out once 3 frames follow it; the final push flushes the rest.
        pushed = [min(9, (j + 1) * push) for j in range(len(chunks))]
        emitted = [9 if n == 9 else max(0, n - 3) for n in pushed]
        assert [c.shape[0] // P.SAMPLES_PER_FRAME for c in chunks] == list(np.diff([0, *emitted]))
        outputs[push] = np.concatenate(chunks)
        assert outputs[push].shape == offline.shape
    assert snr_db(outputs[1], outputs[2]) >= 100 and snr_db(outputs[1], outputs[3]) >= 100
    assert snr_db(outputs[2], offline) >= 100


def test_rejects_bad_pushes_without_losing_state(snac) -> None:
    frames = random_frames(4, seed=5)
    decoder = WindowedDecoder(snac, left_context_frames=3, lookahead_frames=3)
    first = decoder.decode([CodecPush("a", frames[:2])])[0].pcm
    with pytest.raises(ValueError, match="more than one push"):
        decoder.decode([CodecPush("a", frames[2:3]), CodecPush("a", frames[3:])])
    with pytest.raises(ValueError, match=r"0\.\.4095"):
        decoder.decode([CodecPush("a", np.full((1, 7), 4096))])
    rest = decoder.decode([CodecPush("a", frames[2:], final=True)])[0].pcm
    assert snr_db(np.concatenate([first, rest]), decode_offline(snac, frames)) >= 100


# ------------------------------------------------------------------ batching


def test_eight_sessions_in_one_batch_equal_each_alone(snac) -> None:
    utterances = [random_frames(4, seed=10 + i) for i in range(8)]
    batched = WindowedDecoder(snac, left_context_frames=1, lookahead_frames=1)
    together: dict[int, list[np.ndarray]] = defaultdict(list)
    for start in (0, 2):
        results = batched.decode([CodecPush(i, u[start : start + 2], final=start == 2) for i, u in enumerate(utterances)])
        assert [r.key for r in results] == list(range(8))
        for r in results:
            together[r.key].append(r.pcm)
    assert batched.batcher.passes_run == 2  # one forward pass per round for all eight
    for i, u in enumerate(utterances):
        alone = np.concatenate(stream(WindowedDecoder(snac, left_context_frames=1, lookahead_frames=1), u, 2))
        joint = np.concatenate(together[i])
        assert joint.shape == (4 * P.SAMPLES_PER_FRAME,)
        assert snr_db(joint, alone) >= 100


def _window(length: int, *, at_end: bool = False, history: int = 0) -> Window:
    return Window(np.zeros((length, 7), np.int64), 0, length, np.zeros((history, 7), np.int64), at_end)


def test_pass_planning_pads_only_where_it_pays(snac) -> None:
    windows = [_window(5), _window(6), _window(6), _window(3, at_end=True), _window(4, at_end=True, history=2)]
    compute_bound = WindowBatcher(snac, pass_overhead_frames=0.0, max_pass_frames=None)
    assert sorted((p.length, p.members) for p in compute_bound.plan(windows)) == [
        (3, (3,)), (4, (4,)), (5, (0,)), (6, (1, 2))]  # whole windows kept: padding never pays
    launch_bound = WindowBatcher(snac, pass_overhead_frames=100.0, max_pass_frames=None)
    plan = sorted((p.length, sorted(p.members)) for p in launch_bound.plan(windows))
    # All but the window that ends its utterance with no history to pad with share one pass.
    assert plan == [(3, [3]), (6, [0, 1, 2, 4])]
    capped = WindowBatcher(snac, pass_overhead_frames=0.0, max_pass_frames=12, max_batch=64)
    assert [len(p.members) for p in capped.plan([_window(6)] * 5)] == [2, 2, 1]
    assert [len(p.members) for p in WindowBatcher(snac, max_batch=2, max_pass_frames=None).plan([_window(6)] * 3)] \
        == [2, 1]


def test_cropped_decode_equals_whole_window_decode(snac) -> None:
    """Computing only the kept frames (+ receptive field) gives the samples the whole window gives."""
    windows = [
        Window(random_frames(8, seed=70), 2, 4, np.zeros((0, 7), np.int64), at_end=False),
        Window(random_frames(8, seed=71), 3, 6, np.zeros((0, 7), np.int64), at_end=False),  # keeps more
        Window(random_frames(8, seed=72), 0, 1, np.zeros((0, 7), np.int64), at_end=False),  # crop clamps at 0
        Window(random_frames(8, seed=73), 6, 8, np.zeros((0, 7), np.int64), at_end=True),  # and at the end
    ]
    cropped = WindowBatcher(snac, pass_overhead_frames=1e6)  # all four in one pass, rows cropped differently
    whole = WindowBatcher(snac, crop=False, pass_overhead_frames=1e6)
    got, expected = cropped.run(windows), whole.run(windows)
    assert cropped.passes_run == whole.passes_run == 1
    for g, e, w in zip(got, expected, windows, strict=True):
        assert g.shape == e.shape == ((w.keep_end - w.keep_start) * P.SAMPLES_PER_FRAME,)
        assert snr_db(g, e) >= 100
    # The cropped pass computed a fraction of the whole windows (3 of the 4 keep little).
    assert cropped.frame_cost < 0.7 * whole.frame_cost


def test_padded_passes_keep_fidelity(snac) -> None:
    """Sessions pushing different amounts share passes when padding is forced; audio stays within the windows' fidelity."""
    a, b = random_frames(8, seed=20), random_frames(7, seed=21)
    decoder = WindowedDecoder(snac, left_context_frames=2, lookahead_frames=2, pass_overhead_frames=1e6)
    out: dict[str, list[np.ndarray]] = defaultdict(list)
    plan = [((0, 3), (0, 4)), ((3, 5), (4, 7)), ((5, 8), None)]
    for push_a, push_b in plan:
        pushes = [CodecPush("a", a[slice(*push_a)], final=push_a[1] == 8)]
        if push_b is not None:
            pushes.append(CodecPush("b", b[slice(*push_b)], final=push_b[1] == 7))
        for r in decoder.decode(pushes):
            out[r.key].append(r.pcm)
    assert decoder.batcher.passes_run == 3  # each round's two windows in one padded pass
    for key, frames in (("a", a), ("b", b)):
        audio = np.concatenate(out[key])
        assert audio.shape == (frames.shape[0] * P.SAMPLES_PER_FRAME,)
        assert snr_db(audio, decode_offline(snac, frames)) >= 60


# ------------------------------------------------------------------ worker


class Collector:
    """on_result target: results per session, and an event once `expected` sessions ended."""

    def __init__(self, expected: int) -> None:
        self.results: dict[object, list[CodecResult]] = defaultdict(list)
        self.threads: set[str] = set()
        self.ended = 0
        self.expected = expected
        self.done = threading.Event()

    def __call__(self, result: CodecResult) -> None:
        self.threads.add(threading.current_thread().name)
        self.results[result.key].append(result)
        if result.final:
            self.ended += 1
            if self.ended == self.expected:
                self.done.set()


def test_worker_delivers_every_session_in_order_from_many_threads(snac) -> None:
    utterances = {f"s{i}": random_frames(5, seed=30 + i) for i in range(4)}
    collector = Collector(expected=len(utterances))
    worker = CodecWorker(WindowedDecoder(snac, left_context_frames=3, lookahead_frames=3), collector, max_batch=64)
    worker.start()
    barrier = threading.Barrier(len(utterances))

    def produce(key: str, frames: np.ndarray) -> None:
        barrier.wait()
        for i in range(frames.shape[0]):
            worker.submit(CodecPush(key, frames[i : i + 1], final=i == frames.shape[0] - 1))

    producers = [threading.Thread(target=produce, args=item) for item in utterances.items()]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    assert collector.done.wait(timeout=120)
    assert worker.stop(timeout_s=30)
    assert collector.threads == {"codec-worker"}
    for key, frames in utterances.items():
        results = collector.results[key]
        assert [r.final for r in results] == [False] * (len(results) - 1) + [True]
        assert all(r.error is None for r in results)
        audio = np.concatenate([r.pcm for r in results])
        assert snr_db(audio, decode_offline(snac, frames)) >= 100  # in order, nothing lost or repeated
    stats = worker.stats()
    assert stats["pushes"] == 20 and stats["frames_decoded"] == 20 and stats["errors"] == 0
    assert 1 <= stats["batches"] <= stats["coalesced_pushes"] <= 20 and stats["decode_s"] > 0


class FailsForKey(WindowedDecoder):
    """Fault injection: a real decoder that raises when one given session is in the batch."""

    def __init__(self, *args, bad_key: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad_key = bad_key

    def decode(self, pushes):
        if any(p.key == self.bad_key for p in pushes):
            raise RuntimeError("injected decode failure")
        return super().decode(pushes)


def test_worker_decode_error_fails_only_its_batch(snac) -> None:
    frames = {k: random_frames(3, seed=40 + i) for i, k in enumerate("abcd")}
    decoder = FailsForKey(snac, left_context_frames=0, lookahead_frames=0, bad_key="b")
    collector = Collector(expected=4)
    worker = CodecWorker(decoder, collector, max_batch=2)
    for key in "abcd":  # queued before start: the first round takes all four, as groups [a, b] and [c, d]
        worker.submit(CodecPush(key, frames[key][:2]))
    worker.start()
    worker.submit(CodecPush("c", frames["c"][2:], final=True))
    worker.submit(CodecPush("d", frames["d"][2:], final=True))
    assert collector.done.wait(timeout=60)
    worker.submit(CodecPush("a", frames["a"][2:], final=True))  # its stream already ended with the error
    assert worker.stop(timeout_s=30)
    for key in "ab":
        (only,) = collector.results[key]
        assert only.final and only.pcm.size == 0 and "injected decode failure" in (only.error or "")
    for key in "cd":
        results = collector.results[key]
        assert all(r.error is None for r in results) and results[-1].final
        audio = np.concatenate([r.pcm for r in results])
        assert audio.shape == (3 * P.SAMPLES_PER_FRAME,)
    assert worker.stats()["errors"] == 2 and worker.stats()["dropped_pushes"] == 1
    assert decoder.active_sessions == 0


def test_worker_coalesces_and_cancels(snac) -> None:
    frames = random_frames(3, seed=50)
    collector = Collector(expected=1)
    decoder = WindowedDecoder(snac, left_context_frames=0, lookahead_frames=0)
    worker = CodecWorker(decoder, collector)
    for i in range(3):
        worker.submit(CodecPush("kept", frames[i : i + 1], final=i == 2))
    worker.submit(CodecPush("cancelled", frames[:1]))
    worker.close_session("cancelled")
    worker.submit(CodecPush("cancelled", frames[1:2]))  # late push after the cancel: discarded
    with pytest.raises(ValueError):
        worker.submit(CodecPush("kept", frames[:1]))  # after its final push
    with pytest.raises(ValueError):
        worker.submit(CodecPush("x", np.zeros((1, 6), np.int64)))
    worker.start()
    assert collector.done.wait(timeout=60)
    assert worker.stop(timeout_s=30)
    (result,) = collector.results["kept"]  # three pushes, one decode
    assert result.final and result.pcm.shape == (3 * P.SAMPLES_PER_FRAME,)
    assert snr_db(result.pcm, decode_offline(snac, frames)) >= 100  # one window: the whole utterance
    assert "cancelled" not in collector.results
    stats = worker.stats()
    assert stats["batches"] == 1 and stats["pushes"] == 3 and stats["coalesced_pushes"] == 1
    assert stats["dropped_pushes"] == 2
    with pytest.raises(RuntimeError):
        worker.submit(CodecPush("late", frames[:1]))


def test_build_decoder_stateful_when_present(snac) -> None:
    stateful = pytest.importorskip("orpheus_serve.codec.stateful")
    decoder = build_decoder(DEFAULTS.model_copy(update={"decoder": "stateful"}), snac)
    assert isinstance(decoder, stateful.StatefulDecoder)


# ------------------------------------------------------------------ CLI


def test_decode_cli_round_trip(tmp_path: Path, tiny_snac: Path, snac) -> None:
    from orpheus_serve.__main__ import main

    frames = random_frames(6, seed=60)
    tokens = tmp_path / "ids.json"
    tokens.write_text(json.dumps(P.frames_to_token_ids(frames, end=True)))
    common = ["decode", "--snac", str(tiny_snac), "--tokens", str(tokens), "--noise", "off", "--device", "cpu"]
    streamed, offline = tmp_path / "streamed.wav", tmp_path / "offline.wav"
    assert main([*common, "--out", str(streamed), "--decoder", "windowed", "--push-frames", "2"]) == 0
    assert main([*common, "--out", str(offline), "--offline"]) == 0
    pcm = {}
    for path in (streamed, offline):
        with wave.open(str(path), "rb") as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
            assert wav.getnframes() == 6 * P.SAMPLES_PER_FRAME
            pcm[path] = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float64)
    reference = np.clip(decode_offline(snac, frames), -1, 1) * 32767
    assert np.max(np.abs(pcm[offline] - reference)) <= 1.0  # only 16-bit rounding
    assert snr_db(pcm[streamed], reference) >= 50  # window fidelity, then 16-bit rounding

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([P.END_OF_TEXT]))
    assert main([*common, "--out", str(tmp_path / "x.wav"), "--offline", "--tokens", str(bad)]) == 1


# ------------------------------------------------------------------ CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", ["windowed", "stateful"])
@pytest.mark.parametrize(("dtype", "min_db"), [("fp32", 40.0), ("fp16", 25.0)])
def test_worker_on_cuda_matches_cpu_offline(tiny_snac: Path, snac, dtype: str, min_db: float, decoder: str) -> None:
    """The worker's own stream, pinned staging and async copies give the CPU one-shot audio
    (within TF32 / FP16 rounding), with the decoder built while the default stream is still busy."""
    model = load_snac(tiny_snac, device="cuda", dtype=dtype, noise=False)
    utterances = {f"s{i}": random_frames(7, seed=80 + i) for i in range(3)}
    collector = Collector(expected=len(utterances))
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):  # a few hundred ms queued on the default stream, not waited for
        busy = torch.tanh(busy @ busy) * 0.01
    codec_cfg = CodecConfig(decoder=decoder, noise=False, device="cuda", dtype=dtype)
    worker = CodecWorker(build_decoder(codec_cfg, model), collector, device="cuda")
    worker.start()
    for start in range(0, 7, 2):
        for key, frames in utterances.items():
            worker.submit(CodecPush(key, frames[start : start + 2], final=start + 2 >= 7))
    assert collector.done.wait(timeout=120)
    assert worker.stop(timeout_s=30)
    for key, frames in utterances.items():
        audio = np.concatenate([r.pcm for r in collector.results[key]])
        assert audio.dtype == np.float32 and audio.shape == (7 * P.SAMPLES_PER_FRAME,)
        assert snr_db(audio, decode_offline(snac, frames)) >= min_db
