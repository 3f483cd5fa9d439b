"""SNAC codec: loading, streaming decoders and the batching worker.

    load_snac / decode_offline   codec.loader    the model, and the one-shot reference decode
    WindowedDecoder              codec.windowed  [L | new | R] windows, batched by length
    StatefulDecoder              codec.stateful  per-layer streaming state, each frame decoded once
    CodecWorker                  codec.worker    the thread that batches all sessions' decoding
    build_decoder                here            the decoder that `codec.decoder` in the config names

`codec.base` (the StreamingDecoder protocol and its push/result types) does
not need torch, so the names above are imported on first use: importing
`orpheus_serve.codec.base` stays cheap for code that only passes results on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import CodecPush, CodecResult, StreamingDecoder

if TYPE_CHECKING:
    from snac import SNAC

    from ..config import CodecConfig
    from .loader import decode_offline, load_snac
    from .windowed import WindowedDecoder
    from .worker import CodecWorker

_LAZY = {
    "load_snac": ".loader",
    "decode_offline": ".loader",
    "WindowedDecoder": ".windowed",
    "CodecWorker": ".worker",
}

__all__ = [
    "CodecPush",
    "CodecResult",
    "CodecWorker",
    "StreamingDecoder",
    "WindowedDecoder",
    "build_decoder",
    "decode_offline",
    "load_snac",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_decoder(codec_cfg: CodecConfig, model: SNAC) -> StreamingDecoder:
    """The streaming decoder `codec_cfg.decoder` selects, over a loaded SNAC."""
    if codec_cfg.decoder == "windowed":
        from .windowed import WindowedDecoder

        return WindowedDecoder(
            model,
            left_context_frames=codec_cfg.left_context_frames,
            lookahead_frames=codec_cfg.lookahead_frames,
            max_batch=codec_cfg.max_batch,
        )
    if codec_cfg.decoder == "stateful":
        from .stateful import StatefulDecoder

        # Graphs (and the static steps they replay) on CUDA only: on a CPU, padding a step to its bucket
        # would only add compute, and there is no launch cost to save.
        on_cuda = next(model.parameters()).device.type == "cuda"
        graphs = codec_cfg.cuda_graphs and on_cuda
        ragged = on_cuda if codec_cfg.ragged_steps == "auto" else codec_cfg.ragged_steps
        return StatefulDecoder(model, max_batch=codec_cfg.max_batch, noise=codec_cfg.noise, seed=codec_cfg.seed,
                               cuda_graphs=graphs, ragged=ragged)
    if codec_cfg.decoder == "reference":
        from .reference import ReferenceWindowDecoder

        return ReferenceWindowDecoder(model, max_batch=codec_cfg.max_batch)
    raise ValueError(f"codec decoder {codec_cfg.decoder!r} needs no SNAC model or is unknown "
                     "(windowed | stateful | reference)")
