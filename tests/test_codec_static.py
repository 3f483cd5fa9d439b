"""The stateful decoder's static step path (padded batch buckets, fixed buffers, CUDA graphs on CUDA)
against its dynamic path: the same audio, bit for bit on a CPU (noise off, one torch thread)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import snac
import torch
from snac.layers import NoiseBlock

from orpheus_serve.codec import build_decoder
from orpheus_serve.codec.base import CodecPush, step_schedule
from orpheus_serve.codec.stateful import StatefulDecoder
from orpheus_serve.config import CodecConfig
from orpheus_serve.engines import vram_budget
from orpheus_serve.token_format import frames_to_snac_codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_snac) -> snac.SNAC:
    model = snac.SNAC.from_pretrained(str(tiny_snac)).eval()
    for module in model.modules():
        if isinstance(module, NoiseBlock):
            module.forward = lambda x: x  # the one-shot reference without its random NoiseBlocks
    return model


def random_frames(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 4096, size=(n, 7), dtype=np.int64)  # [n, 7]


def one_shot(model: snac.SNAC, frames: np.ndarray) -> np.ndarray:
    codes = [torch.from_numpy(c)[None].to(next(model.parameters()).device) for c in frames_to_snac_codes(frames)]
    with torch.inference_mode():
        return model.decode(codes)[0, 0].double().cpu().numpy()  # [2048 n]


def snr_db(reference: np.ndarray, audio: np.ndarray) -> float:
    assert audio.shape == reference.shape
    error = float(np.sum((reference - audio.astype(np.float64)) ** 2))
    return float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference**2)) / error)


def mixed_schedule(seed: int, calls: int = 9) -> Iterator[tuple[list[str], list[CodecPush]]]:
    """(keys to close, then the pushes of one decode call), as a codec worker makes them: sessions start and end
    at different calls, bring 0 to 4 frames (and the final flush) per call, skip calls, or are cancelled; new
    keys keep arriving, so ended sessions' pool rows are reused. Batches of 1 to 6 rows: buckets with padding."""
    rng = np.random.default_rng(seed)
    live: dict[str, int] = {}  # key -> frames pushed so far
    next_key = 0
    for call in range(calls):
        for _ in range(int(rng.integers(1, 3)) if call < calls - 3 else 0):
            live[f"s{next_key}"] = 0
            next_key += 1
        closes: list[str] = []
        pushes: list[CodecPush] = []
        for key in list(live):
            roll = rng.random() if call < calls - 1 else 1.0  # the last call ends every session
            if roll < 0.1 and live[key] > 0:
                closes.append(key)
                del live[key]
                continue
            if roll < 0.25:
                continue  # no new frames for this session in this call
            n = int(rng.integers(0 if live[key] else 1, 5))
            final = call == calls - 1 or (live[key] + n >= 3 and rng.random() < 0.25)
            pushes.append(CodecPush(key, random_frames(n, rng), final))
            live[key] += n
            if final:
                del live[key]
        yield closes, pushes


def run_schedule(decoder: StatefulDecoder, seed: int) -> tuple[dict[str, list[np.ndarray]], dict[str, np.ndarray]]:
    """Each key's audio, push by push, and the frames it pushed ([n, 7]) for the keys that finished."""
    audio: dict[str, list[np.ndarray]] = {}
    frames: dict[str, list[np.ndarray]] = {}
    finished: dict[str, np.ndarray] = {}
    for closes, pushes in mixed_schedule(seed):
        for key in closes:
            decoder.close(key)
        for push, result in zip(pushes, decoder.decode(pushes), strict=True):
            assert result.key == push.key and result.final == push.final
            audio.setdefault(push.key, []).append(result.pcm)
            frames.setdefault(push.key, []).append(push.frames)
            if push.final:
                finished[push.key] = np.concatenate(frames[push.key])
    return audio, finished


def assert_one_shot_audio(model: snac.SNAC, audio: dict[str, list[np.ndarray]], finished: dict[str, np.ndarray]) -> None:
    """Every finished session's audio, its pushes joined, is the one-shot decode of its frames (at least four
    sessions with frames)."""
    assert len([frames for frames in finished.values() if len(frames)]) >= 4
    for key, frames in finished.items():
        whole = np.concatenate(audio[key])
        assert whole.shape == (2048 * len(frames),)
        if len(frames):
            assert snr_db(one_shot(model, frames), whole) >= 100, key


@pytest.mark.parametrize("seed", [1, 2])
def test_static_path_equals_dynamic_path_bit_for_bit(model, seed: int) -> None:
    # max_batch 4: groups of several forward steps per call, buckets 1, 2 and 4 with padding, and a pool that grows.
    dynamic = StatefulDecoder(model, max_batch=4)
    static = StatefulDecoder(model, max_batch=4, static=True)
    (expected, _), (got, _) = run_schedule(dynamic, seed), run_schedule(static, seed)
    assert got.keys() == expected.keys() and len(got) >= 8
    for key in expected:
        assert len(got[key]) == len(expected[key])
        for mine, theirs in zip(got[key], expected[key], strict=True):
            assert mine.dtype == np.float32 and np.array_equal(mine, theirs), key
    assert static.active_sessions == dynamic.active_sessions == 0
    assert len(got) > static._pool.shape[0] - 1  # more sessions than session rows: ended sessions' rows were reused
    # Every bucket, and steps of every frame count, with and without edge masks, ran on fixed buffers.
    shapes = set(static._shapes)
    assert {bucket for bucket, _, _ in shapes} == {1, 2, 4}
    assert {frames for _, frames, _ in shapes} == {1, 2, 4}
    assert {edges for _, _, edges in shapes} == {False, True}


def test_static_path_matches_the_one_shot_decode_and_leaves_padding_rows_alone(model) -> None:
    decoder = StatefulDecoder(model, max_batch=8, static=True)
    assert_one_shot_audio(model, *run_schedule(decoder, seed=3))
    # Padding rows read the zero row and are never scattered back: it is still all zeros.
    assert decoder._zero_row == 8 and not decoder._pool[decoder._zero_row].any()


def test_static_steps_pad_to_buckets_and_reuse_their_buffers(model) -> None:
    decoder = StatefulDecoder(model, max_batch=8, static=True)
    assert decoder.batch_buckets == [1, 2, 4, 8] and decoder.graph_count == 0  # eager on a CPU
    rng = np.random.default_rng(5)
    for batch in (3, 5):
        decoder.decode([CodecPush((batch, b), random_frames(4, rng)) for b in range(batch)])
    assert set(decoder._shapes) == {(4, 4, True), (8, 4, True)}  # 3 rows ran as 4, 5 as 8
    buffers = {key: shape.state.data_ptr() for key, shape in decoder._shapes.items()}
    decoder.decode([CodecPush((5, b), random_frames(4, rng)) for b in range(5)])  # past the start edge now
    decoder.decode([CodecPush((5, b), random_frames(4, rng)) for b in range(5)])
    assert set(decoder._shapes) == {(4, 4, True), (8, 4, True), (8, 4, False)}
    assert all(decoder._shapes[key].state.data_ptr() == ptr for key, ptr in buffers.items())
    assert decoder._shapes[(8, 4, False)].state.data_ptr() == decoder._static_state.data_ptr()


def test_server_selects_graphs_on_cuda_only(model) -> None:
    cfg = CodecConfig(decoder="stateful", cuda_graphs=True, noise=False)
    on_cpu = build_decoder(cfg, model)
    assert isinstance(on_cpu, StatefulDecoder) and not on_cpu.static and not on_cpu.cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs"):
        StatefulDecoder(model, cuda_graphs=True)


def test_memory_model_knows_the_state_size(model) -> None:
    # The graph pool estimate (engines/vram_budget.py) counts the fixed state buffer by this size.
    assert StatefulDecoder(model).state_size == vram_budget.SNAC_STATE_PER_SESSION
    assert vram_budget.snac_graph_pool_bytes(64) > 64 * vram_budget.SNAC_STATE_PER_SESSION * 2


# -- CUDA: graph replay against the same static steps run eagerly ------------------------------------------


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """Full FP32 convolutions and matmuls for the whole test, capture included (CUDA defaults to TF32 convs)."""
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_graph_replay_equals_eager(model, dtype: torch.dtype, ragged: bool) -> None:
    gpu_model = copy.deepcopy(model).to(device="cuda", dtype=dtype)
    graphs = StatefulDecoder(gpu_model, max_batch=4, cuda_graphs=True, ragged=ragged)
    assert graphs.graph_count == 3 * 3 * 2  # buckets 1, 2, 4 x frames 1, 2, 4 x edge masks or not
    eager = StatefulDecoder(gpu_model, max_batch=4, static=True, ragged=ragged)
    dynamic = StatefulDecoder(gpu_model, max_batch=4, ragged=ragged)
    with torch.cuda.stream(torch.cuda.Stream()):  # replayed on another stream than the capture's, as the worker does
        replayed, _ = run_schedule(graphs, seed=1)
    (eager_audio, _), (dynamic_audio, _) = run_schedule(eager, seed=1), run_schedule(dynamic, seed=1)
    for key, pieces in replayed.items():
        got, same_shapes, unpadded = (np.concatenate(a[key]) for a in (replayed, eager_audio, dynamic_audio))
        assert len(pieces) == len(eager_audio[key])
        assert np.array_equal(got, same_shapes), key  # the same kernels on the same shapes
        # Unpadded batches may pick other kernels: close, not equal.
        assert snr_db(unpadded.astype(np.float64), got) >= (100 if dtype == torch.float32 else 40), key


@pytest.mark.gpu
def test_cuda_graphs_with_seeded_noise_repeat_and_differ_by_seed(model) -> None:
    gpu_model = copy.deepcopy(model).to(device="cuda", dtype=torch.float16)
    frames = random_frames(6, np.random.default_rng(9))

    def noisy(seed: int) -> np.ndarray:
        decoder = StatefulDecoder(gpu_model, max_batch=2, noise=True, seed=seed, cuda_graphs=True)
        return np.concatenate([decoder.decode([CodecPush("n", frames[i : i + 2], i + 2 >= 6)])[0].pcm
                               for i in range(0, 6, 2)])

    first, again, other = noisy(7), noisy(7), noisy(8)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert np.all(np.isfinite(first))


@pytest.mark.parametrize("static", [False, True])
def test_ragged_steps_match_the_one_shot_decode_in_one_step_per_call(model, static: bool) -> None:
    """A ragged decoder takes a call's pushes of unequal lengths (first, streaming and final pushes, and the
    final flush) in one step where they fit the largest step size, and every session's audio is still the
    one-shot decode's: a row's padding reaches neither its audio nor its state."""
    decoder = StatefulDecoder(model, max_batch=8, static=static, ragged=True)
    even = StatefulDecoder(model, max_batch=8, static=static)
    steps: list[int] = []
    forward = decoder._forward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        steps.append(args[3])
        return forward(*args, **kwargs)

    decoder._forward = counted  # type: ignore[method-assign]
    audio, finished = run_schedule(decoder, seed=3)
    (even_audio, _) = run_schedule(even, seed=3)
    assert_one_shot_audio(model, audio, finished)
    for key in finished:
        # Push by push, the same audio as even steps give (each push's final samples, nothing early or late).
        assert [len(piece) for piece in audio[key]] == [len(piece) for piece in even_audio[key]], key
    # Pushes of 0-4 frames, finals of n + 3: the schedule's steps, and fewer than even steps take (19 here).
    counts = [[len(p.frames) + (decoder.lookahead_frames if p.final else 0) for p in pushes]
              for _, pushes in mixed_schedule(3)]
    assert len(steps) == sum(len(step_schedule(c, decoder.step_frames, 8, ragged=True)) for c in counts) == 12
    assert sum(len(step_schedule(c, decoder.step_frames, 8)) for c in counts) == 19
    assert decoder.active_sessions == 0
    if static:
        assert not decoder._pool[decoder._zero_row].any()


def test_ragged_steps_setting_reads_as_yaml_writes_it_and_auto_is_off_on_a_cpu(model) -> None:
    """`codec.ragged_steps`: auto (ragged where a step is launch-bound, CUDA), or forced either way, with the
    words a YAML file or `--set` uses (on/off parse as booleans there)."""
    from orpheus_serve.config import load_config

    for text, expected in (("auto", "auto"), ("on", True), ("off", False), ("true", True), ("false", False)):
        assert load_config(overrides=[f"codec.ragged_steps={text}"], env={}).codec.ragged_steps == expected, text
    assert load_config(env={}).codec.ragged_steps == "auto"
    assert not build_decoder(CodecConfig(decoder="stateful", noise=False), model).ragged  # auto, on a CPU
    assert build_decoder(CodecConfig(decoder="stateful", noise=False, ragged_steps=True), model).ragged
