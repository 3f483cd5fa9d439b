"""Loading SNAC for decoding, and the one-shot reference decode.

`load_snac` returns a `snac.SNAC` ready for inference:

- weights from a local folder (`config.json` + `pytorch_model.bin`) or, with
  internet access, a Hugging Face hub id;
- eval mode, with every weight-norm parametrization folded into a plain weight
  once (identical output, ~8% less decode time: the parametrization would
  otherwise recompute each conv's weight on every call, ARCHITECTURE §4);
- FP16 on CUDA and FP32 on CPU unless a dtype is given;
- SNAC's noise injection either switched off (`noise=False`: every `NoiseBlock`
  returns its input, so decoding is a pure function of the codes) or driven
  by a generator of its own (`seed=...`: reproducible from run to run);
- optionally the decoder wrapped in `torch.compile` (CUDA only).

An FP32 codec computes in full FP32 on CUDA too: every decode here runs inside
`full_fp32_convolutions`, which keeps cuDNN from running FP32 convolutions in
TF32 (PyTorch's default on Ampere and later: 10 mantissa bits, ~60 dB against
IEEE FP32) for the length of the decode only. FP16 / BF16 codecs are untouched.

`decode_frames` is the batched primitive every decoder here builds on:
[B, n, 7] frame codes to [B, n * 2048] samples. `decode_offline` is the
one-shot decode of a whole utterance, the reference streamed audio is
measured against.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from snac.layers import NoiseBlock

from ..config import resolve_device, resolve_dtype
from ..token_format import CODEBOOK_SIZE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "pytorch_model.bin"

# Positions of the codes inside a 7-code frame for each SNAC codebook (ARCHITECTURE §3):
# c0[i] = t0; c1[2i], c1[2i+1] = t1, t4; c2[4i..4i+3] = t2, t3, t5, t6.
_C1_SLOTS = (1, 4)
_C2_SLOTS = (2, 3, 5, 6)


class DisabledNoiseBlock(NoiseBlock):
    """SNAC's NoiseBlock switched off: returns its input. Keeps `linear`, so the module tree and
    state dict are those of the original and code that walks the decoder still finds a NoiseBlock."""

    def __init__(self, linear: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)  # not NoiseBlock.__init__: reuse the loaded projection
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return x


class SeededNoiseBlock(NoiseBlock):
    """SNAC's NoiseBlock drawing from a generator of its own, so noisy decodes repeat run to run.

    Same computation as `snac.layers.NoiseBlock`: x + randn[B, 1, T] * linear(x).
    """

    def __init__(self, linear: torch.nn.Module, generator: torch.Generator) -> None:
        torch.nn.Module.__init__(self)
        self.linear = linear
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        batch, _, steps = x.shape
        noise = torch.randn((batch, 1, steps), generator=self.generator, device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)


def _read_local(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"SNAC folder {folder} lacks {', '.join(missing)} (needs {CONFIG_FILE} + {WEIGHTS_FILE})")
    config = json.loads((folder / CONFIG_FILE).read_text())
    state = torch.load(folder / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    return config, state


def _read_hub(repo_id: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from huggingface_hub import hf_hub_download

    config = json.loads(Path(hf_hub_download(repo_id=repo_id, filename=CONFIG_FILE)).read_text())
    state = torch.load(hf_hub_download(repo_id=repo_id, filename=WEIGHTS_FILE), map_location="cpu", weights_only=True)
    return config, state


def fold_weight_norm(model: torch.nn.Module) -> int:
    """Replace every parametrized weight by its current value; returns how many were folded."""
    folded = 0
    for module in model.modules():
        if torch.nn.utils.parametrize.is_parametrized(module):
            for name in list(module.parametrizations.keys()):
                torch.nn.utils.parametrize.remove_parametrizations(module, name, leave_parametrized=True)
                folded += 1
    return folded


def replace_noise(module: torch.nn.Module, generator: torch.Generator | None) -> int:
    """Switch every NoiseBlock off (generator None) or to a seeded copy; returns how many."""
    replaced = 0
    for name, child in module.named_children():
        if isinstance(child, NoiseBlock):
            new = DisabledNoiseBlock(child.linear) if generator is None else SeededNoiseBlock(child.linear, generator)
            setattr(module, name, new)
            replaced += 1
        else:
            replaced += replace_noise(child, generator)
    return replaced


def check_frame_layout(config: dict) -> None:
    """The Orpheus frame format (7 codes = 2048 samples) exists only for SNAC's 24 kHz layout."""
    hop = int(np.prod(config.get("decoder_rates", [])))
    strides = list(config.get("vq_strides", []))
    if strides != [4, 2, 1] or hop * strides[0] != SAMPLES_PER_FRAME or config.get("attn_window_size") is not None:
        raise ValueError(
            "SNAC config does not match the 24 kHz layout Orpheus uses "
            f"(vq_strides [4, 2, 1], decoder hop 512, no attention); got vq_strides {strides}, hop {hop}"
        )


def load_snac(
    path_or_hub_id: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    noise: bool = True,
    seed: int | None = None,
    compile: bool = False,
) -> SNAC:
    """SNAC in eval mode on `device`, weight norm folded, noise as asked (see module doc).

    `device` and `dtype` accept "auto" (CUDA when visible; FP16 on CUDA, FP32 on CPU).
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device, cuda_default="fp16")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    folder = Path(path_or_hub_id)
    if folder.is_dir():
        config, state = _read_local(folder)
    elif folder.exists() or str(path_or_hub_id).count("/") != 1:
        raise FileNotFoundError(f"{path_or_hub_id} is neither a SNAC folder nor a hub id (owner/name)")
    else:
        config, state = _read_hub(str(path_or_hub_id))

    check_frame_layout(config)
    model = SNAC(**config)
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    fold_weight_norm(model)
    if not noise:
        replace_noise(model, None)
    elif seed is not None:
        replace_noise(model, torch.Generator(device=device).manual_seed(seed))
    model.to(device=device, dtype=TORCH_DTYPES[dtype])
    if compile:
        if device.startswith("cuda"):
            # Layer by layer, so that decoders which run the layers themselves (cropped windows)
            # get the compiled code too; shapes vary with batch and window, hence dynamic.
            layers = model.decoder.model
            for index, layer in enumerate(layers):
                layers[index] = torch.compile(layer, dynamic=True)
        else:
            log.warning("codec.compile applies to CUDA only; decoding uncompiled on %s", device)
    if device.startswith("cuda"):
        # The weights were copied on the default stream; the codec worker decodes on a stream of
        # its own, which does not wait for the default one.
        torch.cuda.synchronize(device)
    return model


@contextmanager
def full_fp32_convolutions(dtype: torch.dtype) -> Iterator[None]:
    """Inside, an FP32 model's convolutions run in IEEE FP32 on CUDA, not TF32; other dtypes: nothing changes.

    cuDNN's TF32 switch is process-wide in PyTorch (2.11 and 2.13 alike: `torch.backends.cudnn.allow_tf32`,
    or the newer `torch.backends.cudnn.conv.fp32_precision`); there is no per-module or per-thread one. It is
    set for the decode only and put back after, so the process's own setting holds everywhere else. The
    engine runs no convolutions (matmuls have a switch of their own), so its steps are unaffected even while
    a pass runs on another thread. The legacy switch is used: it sets conv and RNN alike, which keeps readers
    of either API working (reading it with the two set apart raises). On a CPU the switch changes nothing."""
    if dtype != torch.float32:
        yield
        return
    cudnn = torch.backends.cudnn
    before = cudnn.allow_tf32
    cudnn.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32 = before


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def frames_to_codes(frames: torch.Tensor) -> list[torch.Tensor]:
    """[B, n, 7] int64 frame codes -> SNAC's [c0 [B, n], c1 [B, 2n], c2 [B, 4n]]."""
    batch, n, _ = frames.shape
    c0 = frames[:, :, 0]
    c1 = frames[:, :, _C1_SLOTS].reshape(batch, 2 * n)
    c2 = frames[:, :, _C2_SLOTS].reshape(batch, 4 * n)
    return [c0, c1, c2]


@torch.inference_mode()
def decode_frames(model: SNAC, frames: torch.Tensor) -> torch.Tensor:
    """[B, n, 7] int64 codes (on the model's device) -> [B, n * 2048] samples, model dtype, same device."""
    with full_fp32_convolutions(next(model.parameters()).dtype):
        audio = model.decode(frames_to_codes(frames))  # [B, 1, n * 2048]
    return audio[:, 0, :]


def check_frames(frames: np.ndarray) -> np.ndarray:
    """Validate [n, 7] codes in 0..4095; returns them as int64."""
    arr = np.asarray(frames)
    if arr.ndim != 2 or arr.shape[1] != TOKENS_PER_FRAME:
        raise ValueError(f"frames must have shape [n, {TOKENS_PER_FRAME}], got {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"frames must be integer codes, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= CODEBOOK_SIZE):
        raise ValueError(f"frame codes must be in 0..{CODEBOOK_SIZE - 1}")
    return arr.astype(np.int64, copy=False)


def decode_offline(model: SNAC, frames: np.ndarray) -> np.ndarray:
    """One-shot decode of a whole utterance: [n, 7] codes -> [n * 2048] float32 samples."""
    codes = check_frames(frames)
    if codes.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    batch = torch.from_numpy(codes).to(model_device(model))[None]  # [1, n, 7]
    return decode_frames(model, batch)[0].float().cpu().numpy()
