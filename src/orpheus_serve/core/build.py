"""Core-side construction: the model paths resolved from config, and the engine and decoder built from them.

Runs where the engine core runs (the API process with an in-process core, or the engine-core process);
the API side (service.build) calls `resolve_models` too, for the tokenizer path and the model info.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..codec.base import StreamingDecoder
from ..config import Config
from ..engines.base import TokenEngine
from ..request.types import ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedModels:
    """The config with its model paths resolved (tiny fallback applied), and what is served."""

    config: Config
    info: ModelInfo
    tokenizer_path: str


def resolve_models(config: Config) -> ResolvedModels:
    """Engine mode applied, backend checked, model paths resolved (the tiny models if the real ones are
    missing, said loudly). Cheap: loads nothing."""
    from ..config import apply_engine_mode
    from ..engines.factory import check_backend
    from ..weights.paths import resolve_model_paths

    config = apply_engine_mode(config)
    check_backend(config)
    paths = resolve_model_paths(config)
    if paths.warning:
        log.warning("!" * 72)
        log.warning(paths.warning)
        log.warning("!" * 72)
    engine_cfg = config.engine.model_copy(update={"model_path": str(paths.model_path)})
    codec_cfg = config.codec.model_copy(update={"path": str(paths.codec_path)})
    config = config.model_copy(update={"engine": engine_cfg, "codec": codec_cfg})
    info = ModelInfo(
        id="orpheus-tiny" if paths.tiny else Path(paths.model_path).name,
        backend=config.engine.backend,
        model_path=str(paths.model_path),
        codec_path=str(paths.codec_path),
        tiny=paths.tiny,
        warning=paths.warning,
    )
    return ResolvedModels(config=config, info=info, tokenizer_path=str(paths.tokenizer_path))


def build_engine_and_decoder(config: Config) -> tuple[TokenEngine, StreamingDecoder, str]:
    """Engine, decoder and the codec's device from a config whose model paths are resolved
    (`resolve_models`). Runs where the engine core runs: this process, or the engine-core process."""
    from ..codec import build_decoder, load_snac
    from ..codec.sim import SimDecoder
    from ..config import resolve_device, resolve_dtype
    from ..engines.factory import create_engine

    card = None
    if config.engine.backend == "sim" and config.engine.sim.profile:
        from ..replay import ModelledCard, load_profile

        # One card for the engine and the codec: they share its device and this process's interpreter.
        card = ModelledCard(load_profile(config.engine.sim.profile, variant=config.engine.sim.profile_variant))
        log.info("replaying the card measured in %s (%s, %s steps)", config.engine.sim.profile,
                 card.profile.card, card.profile.variant)
    engine = create_engine(config, card=card)
    codec_device = resolve_device(config.codec.device)
    if config.codec.decoder == "sim":
        sim = config.codec.sim
        decoder: StreamingDecoder = SimDecoder(base_ms=sim.base_ms, per_frame_ms=sim.per_frame_ms,
                                               realtime=sim.realtime, card=card, max_batch=config.codec.max_batch,
                                               ragged=config.codec.ragged_steps is not False)
    else:
        snac = load_snac(
            config.codec.path,
            device=codec_device,
            dtype=resolve_dtype(config.codec.dtype, codec_device, cuda_default="fp16"),
            noise=config.codec.noise,
            seed=config.codec.seed,
            compile=config.codec.compile,
        )
        decoder = build_decoder(config.codec, snac)
    return engine, decoder, codec_device
