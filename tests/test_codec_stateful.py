"""StatefulDecoder against snac's own one-shot decode (noise off, real snac_24khz architecture, random weights)."""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterator

import numpy as np
import pytest
import snac
import torch
from snac.layers import NoiseBlock, ResidualUnit, WNConv1d, WNConvTranspose1d
from torch.utils._python_dispatch import TorchDispatchMode

from orpheus_serve.codec.base import CodecPush, StreamingDecoder
from orpheus_serve.codec.loader import decode_offline, full_fp32_convolutions
from orpheus_serve.codec.stateful import StatefulDecoder, _Builder, _StepContext
from orpheus_serve.token_format import frames_to_snac_codes

SPF = 2048  # samples per frame


def _bypass_noise(model: snac.SNAC) -> snac.SNAC:
    for module in model.modules():
        if isinstance(module, NoiseBlock):
            module.forward = lambda x: x  # the one-shot reference without its random NoiseBlocks
    return model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_snac) -> snac.SNAC:
    return _bypass_noise(snac.SNAC.from_pretrained(str(tiny_snac)).eval())


def random_frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7), dtype=np.int64)  # [n, 7]


def one_shot(model: snac.SNAC, frames: np.ndarray) -> np.ndarray:
    codes = [torch.from_numpy(c)[None].to(next(model.parameters()).device) for c in frames_to_snac_codes(frames)]
    with torch.inference_mode():
        return model.decode(codes)[0, 0].double().cpu().numpy()  # [2048 n]


_references: dict[tuple[int, int], np.ndarray] = {}


def reference(model: snac.SNAC, n: int, seed: int) -> np.ndarray:
    if (n, seed) not in _references:
        _references[(n, seed)] = one_shot(model, random_frames(n, seed))
    return _references[(n, seed)]


def snr_db(reference: np.ndarray, audio: np.ndarray) -> float:
    assert audio.shape == reference.shape
    error = float(np.sum((reference - audio.astype(np.float64)) ** 2))
    return float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference**2)) / error)


def chunks(frames: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, bool]]:
    for start in range(0, len(frames), size):
        yield frames[start : start + size], start + size >= len(frames)


def stream_alone(decoder: StatefulDecoder, frames: np.ndarray, chunk: int, key: Hashable = "alone") -> list[np.ndarray]:
    return [decoder.decode([CodecPush(key, part, final)])[0].pcm for part, final in chunks(frames, chunk)]


# -- each streaming layer equals its one-shot layer -----------------------------------------------------


def _stream_layer(module: torch.nn.Module, channels: int, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Run `module` in streaming form on x [B, C, T] in chunks of `sizes`, then zeros to flush; crop the delay."""
    builder = _Builder()
    ops, delay, upsample, _ = builder.build(module, 0, 1, channels)
    batch = x.shape[0]
    states = [torch.zeros(batch, c, t, dtype=x.dtype) for c, t in builder.state_shapes]
    flush = -(-delay // upsample)
    pieces, start = [], 0
    for size in [*sizes, flush]:
        part = x[..., start : start + size] if start < x.shape[-1] else torch.zeros(batch, channels, size)
        start += size
        y = part
        for op in ops:
            y = op.step(y, _StepContext(states, None, noise=False))
        pieces.append(y)
    return torch.cat(pieces, dim=-1)[..., delay : delay + x.shape[-1] * upsample]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: WNConv1d(8, 8, kernel_size=7, dilation=3, padding=9, groups=8), id="depthwise-dilated-conv"
        ),
        pytest.param(lambda: WNConv1d(8, 5, kernel_size=7, padding=3), id="dense-conv"),
        pytest.param(lambda: WNConvTranspose1d(8, 6, kernel_size=8, stride=4, padding=2), id="conv-transpose-s4"),
        pytest.param(
            lambda: WNConvTranspose1d(8, 6, kernel_size=6, stride=3, padding=2, output_padding=1),
            id="conv-transpose-s3",
        ),
        pytest.param(lambda: ResidualUnit(8, dilation=9, groups=8), id="residual-unit-d9"),
    ],
)
def test_each_streaming_layer_equals_its_one_shot_layer(make) -> None:
    torch.manual_seed(0)
    module = make().eval()
    with torch.no_grad():
        for p in module.parameters():  # move off the init values so every weight and bias matters
            p.add_(0.3 * torch.randn_like(p))
        x = torch.randn(2, 8, 23)  # [B, C, T]
        expected = module(x)
        for sizes in ([23], [1] * 23, [5, 1, 7, 2, 8]):
            streamed = _stream_layer(module, 8, x, sizes)
            assert streamed.shape == expected.shape
            torch.testing.assert_close(streamed, expected, rtol=1e-5, atol=1e-5)


# -- lookahead ----------------------------------------------------------------------------------------


def test_lookahead_is_derived_and_matches_the_one_shot_receptive_field(model) -> None:
    decoder = StatefulDecoder(model)
    # 3·512 + (4+39)·64 + (4+39)·8 + (2+39)·2 + (1+39) + 3, from the layer walk.
    assert decoder.lookahead_samples == 4757
    assert decoder.lookahead_frames == 3
    assert decoder.first_audio_tokens == 21  # no more than a windowed decoder with 2 frames of lookahead
    # In the one-shot decode (float64: the far edge of the receptive field is below float32 resolution),
    # changing frame 3 changes the audio from exactly sample 2048·3 - lookahead on.
    model64 = copy.deepcopy(model).double()
    frames = random_frames(4, seed=11)
    changed = frames.copy()
    changed[3] = random_frames(1, seed=12)[0]
    first_diff = int(np.flatnonzero(one_shot(model64, changed) != one_shot(model64, frames))[0])
    assert first_diff == SPF * 3 - decoder.lookahead_samples


def test_each_push_returns_all_the_audio_that_is_final(model) -> None:
    decoder = StatefulDecoder(model)
    frames = random_frames(6, seed=3)
    emitted = 0
    for k in range(1, 6):
        emitted += len(decoder.decode([CodecPush("s", frames[k - 1 : k])])[0].pcm)
        assert emitted == max(0, SPF * k - decoder.lookahead_samples)
    result = decoder.decode([CodecPush("s", frames[5:], final=True)])[0]
    assert result.final and emitted + len(result.pcm) == 6 * SPF


# -- streamed audio equals the one-shot decode ----------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("n_frames", [1, 2, 7, 40])
def test_streamed_audio_equals_one_shot_decode(model, n_frames: int, chunk: int) -> None:
    decoder = StatefulDecoder(model)
    frames = random_frames(n_frames, seed=n_frames)
    audio = np.concatenate(stream_alone(decoder, frames, chunk))
    assert audio.dtype == np.float32
    assert audio.shape == (SPF * n_frames,)
    assert snr_db(reference(model, n_frames, n_frames), audio) >= 100
    assert decoder.active_sessions == 0


def test_sessions_joining_and_leaving_mid_utterance_keep_their_audio(model) -> None:
    # max_batch=2 with up to 4 live sessions: several forward groups per step, a grown state pool,
    # and (once "b" leaves) non-contiguous rows, gathered and scattered.
    plan = {  # key: (frames, first call, frames per push)
        "a": (random_frames(10, seed=21), 0, 2),
        "b": (random_frames(4, seed=22), 1, 1),
        "c": (random_frames(7, seed=23), 3, 2),
        "d": (random_frames(1, seed=24), 4, 1),
        "e": (random_frames(3, seed=25), 5, 1),
    }
    decoder = StatefulDecoder(model, max_batch=2)
    pushes_left = {key: list(chunks(frames, size)) for key, (frames, _, size) in plan.items()}
    audio: dict[str, list[np.ndarray]] = {key: [] for key in plan}
    call = 0
    while any(pushes_left.values()):
        # Sessions skip some calls (call % 3 == 2 for "a") as a worker would when a session has no new frames.
        keys = [
            k
            for k, (_, first, _) in plan.items()
            if call >= first and pushes_left[k] and not (k == "a" and call % 3 == 2)
        ]
        pushes = [CodecPush(k, *pushes_left[k].pop(0)) for k in keys]
        results = decoder.decode(pushes)
        assert [r.key for r in results] == keys
        for r in results:
            audio[r.key].append(r.pcm)
        call += 1

    alone = StatefulDecoder(model)
    for key, (frames, _, size) in plan.items():
        together = np.concatenate(audio[key])
        by_itself = np.concatenate(stream_alone(alone, frames, size))
        assert together.shape == (SPF * len(frames),)
        assert snr_db(by_itself.astype(np.float64), together) >= 100, key
        assert snr_db(one_shot(model, frames), together) >= 100, key
    assert decoder.active_sessions == 0


def test_close_mid_utterance_leaves_other_sessions_intact(model) -> None:
    decoder = StatefulDecoder(model)
    frames = {key: random_frames(6, seed=30 + i) for i, key in enumerate("xyz")}
    audio: dict[str, list[np.ndarray]] = {key: [] for key in frames}
    for start in range(0, 6, 2):
        keys = [k for k in frames if not (k == "y" and start >= 4)]
        results = decoder.decode([CodecPush(k, frames[k][start : start + 2], start + 2 >= 6) for k in keys])
        for r in results:
            audio[r.key].append(r.pcm)
        if start == 2:
            decoder.close("y")  # cancelled after 4 frames
            decoder.close("y")  # a second cancel is harmless
            assert decoder.active_sessions == 2
    for key in "xz":
        assert snr_db(one_shot(model, frames[key]), np.concatenate(audio[key])) >= 100
    # The key is free again: a new session under it starts from a clean state.
    fresh = random_frames(3, seed=39)
    assert snr_db(one_shot(model, fresh), np.concatenate(stream_alone(decoder, fresh, 2, key="y"))) >= 100


# -- protocol edges, dtypes, noise, validation --------------------------------------------------------


def test_protocol_and_edge_pushes(model) -> None:
    decoder = StatefulDecoder(model)
    assert isinstance(decoder, StreamingDecoder)
    assert decoder.decode([]) == []
    assert decoder.sample_rate == 24000 and decoder.samples_per_frame == SPF
    frames = random_frames(4, seed=41)
    empty = np.zeros((0, 7), dtype=np.int64)
    results = decoder.decode(
        [
            CodecPush("flush-only", frames),
            CodecPush("nothing", empty, final=True),  # an utterance with no frames at all
            CodecPush("idle", empty),  # an empty push on a live session
        ]
    )
    assert [len(r.pcm) for r in results] == [4 * SPF - decoder.lookahead_samples, 0, 0]
    assert results[1].final and not results[0].final
    tail = decoder.decode([CodecPush("flush-only", empty, final=True), CodecPush("idle", frames[:1], final=True)])
    assert len(tail[0].pcm) == decoder.lookahead_samples
    whole = np.concatenate([results[0].pcm, tail[0].pcm])
    assert snr_db(one_shot(model, frames), whole) >= 100
    assert snr_db(one_shot(model, frames[:1]), tail[1].pcm) >= 100
    assert decoder.active_sessions == 0


def test_float64_model_streams_to_float64_precision(model) -> None:
    model64 = copy.deepcopy(model).double()
    decoder = StatefulDecoder(model64)
    frames = random_frames(3, seed=51)
    audio = np.concatenate(stream_alone(decoder, frames, 1))
    # Returned as float32 by contract; the error is that rounding alone (~150 dB), far below float32 decoding.
    assert snr_db(one_shot(model64, frames), audio) >= 140


def test_noise_blocks_are_applied_when_enabled(model) -> None:
    frames = random_frames(4, seed=61)
    torch.manual_seed(0)
    noisy = np.concatenate(stream_alone(StatefulDecoder(model, noise=True), frames, 2))
    assert noisy.shape == (4 * SPF,) and np.all(np.isfinite(noisy))
    # Skipped noise would match the noise-free decode to >= 100 dB.
    assert snr_db(one_shot(model, frames), noisy) < 60


def test_invalid_pushes_are_rejected_without_touching_any_session(model) -> None:
    decoder = StatefulDecoder(model)
    frames = random_frames(3, seed=71)
    first = decoder.decode([CodecPush("ok", frames[:1])])[0].pcm
    bad_pushes = [
        [CodecPush("ok", frames[1:2]), CodecPush("ok", frames[2:])],  # two pushes for one key
        [CodecPush("ok", frames[1:2]), CodecPush("bad", frames[:, :6])],  # not [n, 7]
        [CodecPush("ok", frames[1:2]), CodecPush("bad", np.full((1, 7), 4096))],  # code out of range
        [CodecPush("ok", frames[1:2]), CodecPush("bad", np.full((1, 7), -1))],
        [CodecPush("ok", frames[1:2]), CodecPush("bad", frames.astype(np.float32))],
    ]
    for pushes in bad_pushes:
        with pytest.raises(ValueError):
            decoder.decode(pushes)
    assert decoder.active_sessions == 1
    rest = decoder.decode([CodecPush("ok", frames[1:], final=True)])[0].pcm
    assert snr_db(one_shot(model, frames), np.concatenate([first, rest])) >= 100


def test_rejects_models_it_cannot_stream() -> None:
    small = {"encoder_dim": 8, "encoder_rates": [2, 2], "decoder_dim": 16, "decoder_rates": [2, 2]}
    with pytest.raises(NotImplementedError):  # windowed attention (snac_32khz / snac_44khz)
        StatefulDecoder(snac.SNAC(**small, attn_window_size=4, vq_strides=[4, 2, 1]))
    with pytest.raises(ValueError):  # codebooks that do not match the 7-token Orpheus frame
        StatefulDecoder(snac.SNAC(**small, attn_window_size=None, vq_strides=[8, 4, 2, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "min_snr"), [(torch.float32, 90), (torch.float16, 30)])
def test_cuda_streaming_matches_cuda_one_shot(model, dtype: torch.dtype, min_snr: float) -> None:
    """FP32: both sides in IEEE FP32 (the codec's promise, loader.full_fp32_convolutions), so only the order of
    sums differs. The one-shot side is the project's reference decode, which keeps the same promise."""
    gpu_model = copy.deepcopy(model).to(device="cuda", dtype=dtype)
    decoder = StatefulDecoder(gpu_model)
    frames = random_frames(12, seed=81)
    audio = np.concatenate(stream_alone(decoder, frames, 2))
    assert audio.shape == (12 * SPF,)
    assert snr_db(decode_offline(gpu_model, frames).astype(np.float64), audio) >= min_snr


class _ConvolutionPrecision(TorchDispatchMode):
    """Records cuDNN's TF32 switch at every convolution dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.tf32_allowed: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.convolution, torch.ops.aten.conv1d):
            self.tf32_allowed.append(torch.backends.cudnn.allow_tf32)
        return func(*args, **(kwargs or {}))


def test_an_fp32_codec_convolves_in_full_fp32_and_leaves_the_switch_as_it_was(model) -> None:
    """On CUDA, cuDNN runs FP32 convolutions in TF32 unless told not to (64 dB streamed against one-shot on an
    H200). Every convolution of an FP32 decode, streamed or one-shot, runs with TF32 off; the process's own
    setting is back once the decode returns. On a CPU the switch has no effect, but it is set the same."""
    frames = random_frames(6, seed=83)
    assert torch.backends.cudnn.allow_tf32  # PyTorch's default
    with _ConvolutionPrecision() as seen:
        decoder = StatefulDecoder(model)  # its latent tables are convolutions too
        stream_alone(decoder, frames, 2)
        decode_offline(model, frames)
    assert len(seen.tf32_allowed) > 20 and not any(seen.tf32_allowed)
    assert torch.backends.cudnn.allow_tf32
    with full_fp32_convolutions(torch.float16):  # a half-precision codec keeps the process's setting
        assert torch.backends.cudnn.allow_tf32


def test_seeded_noise_is_reproducible_and_the_seed_matters(model) -> None:
    frames = random_frames(6, seed=62)

    def noisy(seed: int | None) -> np.ndarray:
        return np.concatenate(stream_alone(StatefulDecoder(model, noise=True, seed=seed), frames, 2))

    first, again, other = noisy(7), noisy(7), noisy(8)
    assert np.array_equal(first, again)  # codec.seed: the same pushes give the same audio, run after run
    assert not np.array_equal(first, other)
    assert snr_db(one_shot(model, frames), first) < 60  # and it is noise, not a no-op


def _busy_default_stream() -> torch.Tensor:
    """Queue a few hundred ms of work on the default stream and return without waiting for it."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):
        x = torch.tanh(x @ x) * 0.01
    return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp16_decoder_against_fp32_on_the_same_codes(model, device: str) -> None:
    """FP16 SNAC (the CUDA default) against FP32 on the same codes: what the half-precision codec costs."""
    frames = random_frames(16, seed=82)
    reference = np.concatenate(stream_alone(StatefulDecoder(copy.deepcopy(model).to(device)), frames, 2))
    half = np.concatenate(stream_alone(StatefulDecoder(copy.deepcopy(model).to(device, torch.float16)), frames, 2))
    snr = snr_db(reference.astype(np.float64), half)
    print(f"\nstateful SNAC on {device}: FP16 vs FP32 on the same codes, SNR {snr:.1f} dB")
    assert snr >= 40


@pytest.mark.gpu
def test_decoder_built_on_a_busy_default_stream_decodes_on_another(model) -> None:
    """Everything the constructor queued (latent tables, state pool) is done before another stream reads it."""
    frames = random_frames(8, seed=83)
    expected = np.concatenate(stream_alone(StatefulDecoder(model), frames, 2))
    gpu_model = copy.deepcopy(model).to("cuda")
    _busy_default_stream()
    decoder = StatefulDecoder(gpu_model)
    with torch.cuda.stream(torch.cuda.Stream()):
        audio = np.concatenate(stream_alone(decoder, frames, 2))
    assert snr_db(expected.astype(np.float64), audio) >= 40  # TF32 convolutions at most
